"""CPU: a GEMM for a round's few rows (cpu_gemm.cpp), built, loaded and called from here; F.linear
is its reference (tests/test_cpu_gemm.py).

On CPU in float32, one thread, a verify multiplies K+1 rows by each weight, a drafter's block K, an
autoregressive step one. MKL and oneDNN tune for many rows; at these few they ran well below the
core's peak on this project's machine. cpu_gemm.cpp streams each weight once per six rows from a
panel layout (`panel_weight`) with the rows' outputs in registers: at six rows 1.61-1.75x faster than
the best of MKL and packed oneDNN on weights of 2^18 elements or more, at 64 rows 1.13-1.23x, at one
row 1.02-1.42x (on smaller weights 0.95-1.55x, 1.01-1.12x, 0.57-1.2x; `python scripts/gemm_bench.py`,
BENCHMARKS.md "CPU, a few-row GEMM kernel"; model.dense says which products take it). It is built on
first use with the system's C++ compiler (CXX, default g++) into a cache folder and loaded with
ctypes; where it cannot be (not x86-64 Linux with AVX2 and FMA, no compiler, DSPARK_CPU_GEMM=0),
`cpu_gemm_unavailable` says why and the model keeps F.linear / oneDNN (model.dense). Compiled
graphs call it as the operator dspark::panel_linear (`panel_linear_op`, `prepare_graphs`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Optional

import torch

from common import user_cache_dir

PANEL = 16  # output columns per panel (cpu_gemm.cpp)
CPU_GEMM_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_gemm.cpp")
CPU_GEMM_FLAGS = ("-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-std=c++17")
_cpu_gemm = None      # the loaded library's panel_linear, once built
_cpu_gemm_why = None  # why it is unavailable, once known


def cpu_gemm_cache_dir() -> str:
    """Where the built kernel is kept: $DSPARK_CACHE_DIR, else $XDG_CACHE_HOME/dspark-fast, else
    ~/.cache/dspark-fast."""
    return os.environ.get("DSPARK_CACHE_DIR") or user_cache_dir()


def _cpu_flags() -> set:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _build_cpu_gemm():
    """Build (or find built) and load cpu_gemm.cpp; returns its panel_linear or a reason string."""
    if os.environ.get("DSPARK_CPU_GEMM", "1").strip().lower() in ("0", "off", "false", "no"):
        return "turned off by DSPARK_CPU_GEMM"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"it is for x86-64 Linux (this is {platform.system()} {platform.machine()})"
    if not {"avx2", "fma"} <= _cpu_flags():
        return "this CPU lacks AVX2 or FMA"
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler {cxx!r} on PATH (set CXX)"
    try:
        with open(CPU_GEMM_SOURCE, "rb") as f:
            source = f.read()
        version = subprocess.run([cxx, "--version"], capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"cannot read {CPU_GEMM_SOURCE} or run {cxx}: {e}"
    key = hashlib.sha256(source + version + " ".join(CPU_GEMM_FLAGS).encode()).hexdigest()[:16]
    folder = cpu_gemm_cache_dir()
    path = os.path.join(folder, f"cpu_gemm-{key}.so")
    if not os.path.exists(path):
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError as e:
            return f"cannot write to the cache folder {folder}: {e} (set DSPARK_CACHE_DIR)"
        try:
            done = subprocess.run([cxx, *CPU_GEMM_FLAGS, CPU_GEMM_SOURCE, "-o", tmp], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                lines = (done.stderr or done.stdout).strip().splitlines() or ["(no output)"]
                return f"{cxx} failed on {CPU_GEMM_SOURCE}: {lines[0]}"
            os.replace(tmp, path)  # whole or absent: another process may be building the same file
        except (OSError, subprocess.SubprocessError) as e:
            return f"{cxx} failed on {CPU_GEMM_SOURCE}: {e}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        fn = ctypes.CDLL(path).panel_linear
    except (OSError, AttributeError) as e:
        return f"cannot load {path}: {e}"
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    fn.restype = None
    return fn


def cpu_gemm_unavailable() -> Optional[str]:
    """None when the CPU kernel is built and loaded (building it on first call, about a second),
    else why not, in words."""
    global _cpu_gemm, _cpu_gemm_why
    if _cpu_gemm is None and _cpu_gemm_why is None:
        built = _build_cpu_gemm()
        if isinstance(built, str):
            _cpu_gemm_why = built
        else:
            _cpu_gemm = built
    return _cpu_gemm_why


def panel_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """`weight` [N, K] (float32, CPU) as panels [N/16, K, 16] for `panel_linear` (a copy), or None
    where the kernel does not apply: another dtype or device, N not a multiple of 16, or the kernel
    unavailable (`cpu_gemm_unavailable`)."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
            or weight.shape[0] % PANEL or weight.shape[1] == 0 or cpu_gemm_unavailable() is not None):
        return None
    N, K = weight.shape
    return weight.detach().reshape(N // PANEL, PANEL, K).transpose(1, 2).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ Wᵀ (+ bias) -> [..., N] for panels = `panel_weight(W)`, on cpu_gemm.cpp's kernel
    (one thread; the caller holds no autograd: it has no backward). Agrees with F.linear(x, W, bias)
    to rounding; each row's result is the same whatever rows share the call (the sum over k runs in
    one order)."""
    if (panels.dim() != 3 or panels.shape[2] != PANEL or panels.dtype != torch.float32
            or panels.device.type != "cpu" or not panels.is_contiguous()):
        raise ValueError(f"panel_linear: panels {tuple(panels.shape)} {panels.dtype} on {panels.device} are not "
                         "a contiguous float32 CPU tensor [N/16, K, 16] (panel_weight's)")
    n_panels, K, _ = panels.shape
    N = n_panels * PANEL
    if x.shape[-1] != K or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"panel_linear: x {tuple(x.shape)} {x.dtype} on {x.device} does not fit a "
                         f"float32 CPU weight of {N}x{K}")
    x = x.contiguous()
    y = torch.empty(*x.shape[:-1], N, dtype=torch.float32, device="cpu")
    if x.numel():
        _cpu_gemm(x.data_ptr(), panels.data_ptr(), y.data_ptr(), x.numel() // K, K, N)
    return y.add_(bias) if bias is not None else y


_LIBRARY = None  # the torch.library registration of dspark::panel_linear (kept alive: dropping it unregisters)


def _register_panel_linear_op():
    """panel_linear as the operator dspark::panel_linear, for compiled graphs: torch.compile calls it
    as one opaque kernel (eager code calls panel_linear directly, without the dispatcher). Defined
    with torch.library.Library and a CPU kernel (no autograd: `model.dense` never calls it with
    grad), whose call costs about a third of torch.library.custom_op's wrapper (measured: 10-14 µs
    against ~33 µs over the direct call, ~50 calls a round). Registered when this module is imported
    (before anything traces), once per process."""
    global _LIBRARY
    if not hasattr(torch.ops.dspark, "panel_linear"):
        _LIBRARY = torch.library.Library("dspark", "DEF")
        _LIBRARY.define("panel_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor")
        _LIBRARY.impl("panel_linear", panel_linear, "CPU")

        @torch.library.register_fake("dspark::panel_linear", lib=_LIBRARY)
        def _(x, panels, bias):
            return x.new_empty(*x.shape[:-1], panels.shape[0] * panels.shape[2])
    return torch.ops.dspark.panel_linear


panel_linear_op = _register_panel_linear_op()


_graph_one_thread = None  # prepare_graphs(): torch.get_num_threads() == 1, as a constant for dynamo


def prepare_graphs():
    """Let graphs traced from now on call the few-row kernel (`panels_in_graph`). Not done at import:
    it imports torch's compiler stack (about 1.5 s, and it sets TORCHINDUCTOR_CACHE_DIR, which
    compiling.use_compile_cache must see unset to choose its own folder)."""
    global _graph_one_thread
    if _graph_one_thread is None:
        _graph_one_thread = torch.compiler.assume_constant_result(_one_thread)


def _one_thread() -> bool:
    return torch.get_num_threads() == 1


def panels_in_graph() -> bool:
    """While torch.compile traces: whether the graph calls the few-row kernel — torch ran one thread
    when it was traced, after `prepare_graphs` (a graph keeps what it was traced with; before
    prepare_graphs, or with more threads, Inductor's own GEMMs)."""
    return _graph_one_thread is not None and _graph_one_thread()
