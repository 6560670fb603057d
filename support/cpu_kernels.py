"""The CPU backend (docs/performance.md): kernels of our own (cpu_kernels.cpp) for a round's few rows. `install`
puts fitting `nn.Linear`s on `dspark::panel_linear` (each weight streamed once for all rows) and attention on
`dspark::cached_attention`; one thread computes each output in one order, so its bits depend on neither the other
rows nor the thread count. Built on first use (cached); `unavailable()` says why not (DSPARK_CPU_KERNELS=0: off)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import shutil
import tempfile
import types
import warnings
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import model
from support.cli import UserError

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.cpp")
PANEL = 16  # output columns per panel: a layer fits when its out_features is a multiple
# query tokens up to which `attend` takes the kernel (beyond, SDPA: as fast)
ATTENTION_MAX_TOKENS = 16
_why: Optional[str] = ""    # why the kernels are unavailable; "" until the build was tried


def _cpu_flags() -> set:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


# DSPARK_CPU_KERNELS: on (the default), off, or the AVX2 path on a CPU with AVX-512 (cpu_kernels.cpp reads it)
SETTINGS = {"on": ("1", "on", "true", "yes"), "off": ("0", "off", "false", "no"), "avx2": ("avx2",)}


def _build() -> Optional[str]:
    given = os.environ.get("DSPARK_CPU_KERNELS", "1")
    setting = given.strip().lower()
    known = [value for values in SETTINGS.values() for value in values]
    if setting not in known:
        raise UserError(f"DSPARK_CPU_KERNELS={given!r}: one of {', '.join(known)} (unset: on)")
    if setting in SETTINGS["off"]:
        return "turned off by DSPARK_CPU_KERNELS"
    if setting in SETTINGS["avx2"]:
        os.environ["DSPARK_CPU_KERNELS"] = "avx2"  # as the C++ side compares it: " AVX2 " picked AVX-512 there
    system = platform.system()
    machine = platform.machine()
    if system != "Linux" or machine not in ("x86_64", "AMD64"):
        return f"they are for x86-64 Linux (this is {system} {machine})"
    if not {"avx2", "fma"} <= _cpu_flags():
        return "this CPU lacks AVX2 or FMA"
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return f"no C++ compiler {cxx!r} on PATH (set CXX)"
    if not os.path.isfile(SOURCE):
        return f"their source {SOURCE} is missing"
    from torch.utils import cpp_extension
    # -mavx2 -mfma: a build any AVX2 machine sharing the cache can run (the AVX-512 code is chosen at
    # run time); -fopenmp: at::parallel_for is OpenMP in torch's CPU builds, one pool with torch's.
    flags = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-w"]
    with open(SOURCE, "rb") as f:
        code = f.read()
    build_line = " ".join(flags + [torch.__version__])
    key = hashlib.sha256(code + build_line.encode()).hexdigest()[:16]
    # One build folder per source and flags, compiling a copy kept there: every checkout of the same
    # source shares the build (ninja would rebuild for a source at another path).
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    folder = os.path.join(root, f"dspark_cpu_kernels_{key}")
    try:
        os.makedirs(folder, exist_ok=True)
        copy = os.path.join(folder, "cpu_kernels.cpp")
        if not os.path.isfile(copy):
            with tempfile.NamedTemporaryFile("wb", dir=folder, delete=False) as f:
                f.write(code)
            os.replace(f.name, copy)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cpp_extension.load(
                "dspark_cpu_kernels", [copy], extra_cflags=flags, extra_ldflags=["-fopenmp"],
                build_directory=folder, is_python_module=False, verbose=False)
    except Exception as e:  # a failed build, a broken toolchain: one line of why
        lines = str(e).strip().splitlines() or [type(e).__name__]
        why = lines[0]  # the first line that reports an error, else the first line
        for line in lines:
            if "error:" in line:
                why = line.strip()
                break
        return f"building {SOURCE} failed: " + why[:300]

    @torch.library.register_fake("dspark::panel_linear")
    def _(x, panels, bias):
        out_features = panels.shape[0] * panels.shape[2]
        return x.new_empty(*x.shape[:-1], out_features)

    @torch.library.register_fake("dspark::cached_attention")
    def _(q, k, v, bias):
        width = q.shape[2] * q.shape[3]  # heads x head_dim
        return q.new_empty(q.shape[0], q.shape[1], width)
    return None


def unavailable() -> Optional[str]:
    """None when the kernels are built (on the first call: seconds, or a cache hit) and loaded, else why not."""
    global _why
    if _why == "":
        _why = _build()
    return _why


class PanelLinear(nn.Linear):
    """nn.Linear on the panel kernel (the same Parameters); autograd, autocast, other dtypes or devices: F.linear."""
    panels: torch.Tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        b = self.bias
        if _on_kernel(x, w, b):
            return torch.ops.dspark.panel_linear(x, self.panels, b)
        return F.linear(x, w, b)


def _on_kernel(x, w, b) -> bool:
    if x.dtype is not torch.float32 or w.dtype is not torch.float32:
        return False
    if not x.is_cpu or not w.is_cpu or torch.is_autocast_enabled("cpu"):
        return False
    needs_grad = x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)
    return not (torch.is_grad_enabled() and needs_grad)


def project(attn, x):
    """`Attention.project` in one panel GEMM: q_proj's and kv_proj's panels stacked (a call costs a
    fixed overhead that a few rows do not hide). A q_proj or kv_proj replaced since: the modules there now."""
    q = attn.q_proj
    kv = attn.kv_proj
    installed = attn.qkv_modules[0] is q and attn.qkv_modules[1] is kv
    if not (installed and _on_kernel(x, q.weight, q.bias) and _on_kernel(x, kv.weight, kv.bias)):
        return q(x), kv(x)
    qkv = torch.ops.dspark.panel_linear(x, attn.qkv_panels, attn.qkv_bias)
    return qkv.split([q.out_features, kv.out_features], -1)


def _panels_of(w: torch.Tensor, copied: list) -> torch.Tensor:
    """w's panel copy. `copied` holds the (weight, panels) made so far on w's storage: a weight shared by
    layers (tied) is copied once, and rows 16i.. of a weight copied already are a view of its copy."""
    K = w.shape[1]
    for base, panels in copied:
        offset = w.storage_offset() - base.storage_offset()
        rows = offset // K
        if base is w:
            return panels
        # w is whole rows rows..rows+len(w) of base, starting on a panel
        row_major = w.stride() == base.stride() == (K, 1) and base.shape[1] == K
        on_panel = rows % PANEL == 0 and 0 <= rows * K == offset
        inside = rows + w.shape[0] <= base.shape[0]
        if row_major and on_panel and inside:
            return panels[rows // PANEL:(rows + w.shape[0]) // PANEL]
    copied.append((w, torch.ops.dspark.panels(w.detach())))
    return copied[-1][1]


def attend(q, k, v, bias):
    """`model.attend_cached` on the kernel where it applies (CPU float32, no autograd, few tokens), else itself."""
    if _attention_fits(q, k, v, bias):
        return torch.ops.dspark.cached_attention(q, k, v, bias)
    return model.attend_cached(q, k, v, bias)


def _attention_fits(q, k, v, bias) -> bool:
    """CPU float32, few query tokens with a bias row each (GQA unfolded), head_dim a multiple of PANEL, no autograd."""
    if not q.is_cpu:
        return False
    if not q.dtype == k.dtype == v.dtype == bias.dtype == torch.float32:
        return False
    T = q.shape[1]
    if T > ATTENTION_MAX_TOKENS or q.shape[3] % PANEL != 0 or bias.shape[2] != T:
        return False
    needs_grad = q.requires_grad or k.requires_grad or v.requires_grad
    return not (torch.is_grad_enabled() and needs_grad)


def _cpu_float32(m: nn.Module) -> bool:
    p = next(m.parameters(), None)
    if p is None:
        return False
    return p.device.type == "cpu" and p.dtype == torch.float32


def install(m: nn.Module) -> bool:
    """A CPU float32 model's fitting nn.Linear layers and attention on the kernels (True), else nothing (False).
    Parameters and tied weights stay; the panels are a copy made now (`refresh`, which every
    `Engine.generate` calls, copies them again after an edit)."""
    if not _cpu_float32(m) or unavailable() is not None:
        return False
    attentions = [a for a in m.modules() if isinstance(a, model.Attention)]
    fused = []  # attentions whose q_proj and kv_proj run as one GEMM
    for a in attentions:
        if not (_linear_fits(a.q_proj) and _linear_fits(a.kv_proj)):
            continue
        if (a.q_proj.bias is None) == (a.kv_proj.bias is None):
            fused.append(a)
    paired = {id(lin) for a in fused for lin in (a.q_proj, a.kv_proj)}  # their panels: views of the pair's
    alone = [x for x in m.modules() if _linear_fits(x) and id(x) not in paired]
    copied: dict = {}  # storage -> the (weight, panels) made on it by this call
    # tallest first: a whole weight is copied before the rows of it that other layers hold
    for lin in sorted(alone, key=lambda x: -x.weight.shape[0]):
        if getattr(lin, "stamp", None) != _stamp(lin.weight):
            storage = lin.weight.untyped_storage().data_ptr()
            lin.panels = _panels_of(lin.weight, copied.setdefault(storage, []))
            lin.stamp = _stamp(lin.weight)
        lin.__class__ = PanelLinear
    for a in fused:
        q = a.q_proj
        kv = a.kv_proj
        stamps = (getattr(q, "stamp", None), getattr(kv, "stamp", None))
        if stamps != (_fused_stamp(q), _fused_stamp(kv)):
            weight = torch.cat([q.weight, kv.weight]).detach()
            a.qkv_panels = torch.ops.dspark.panels(weight)
            a.qkv_bias = None
            if q.bias is not None:
                a.qkv_bias = torch.cat([q.bias, kv.bias]).detach()
            panel_counts = [q.out_features // PANEL, kv.out_features // PANEL]
            q.panels, kv.panels = a.qkv_panels.split(panel_counts)
            q.stamp = _fused_stamp(q)
            kv.stamp = _fused_stamp(kv)
        q.__class__ = PanelLinear
        kv.__class__ = PanelLinear
        a.qkv_modules = (q, kv)  # the modules the panels were made of
        a.project = types.MethodType(project, a)
    for a in attentions:
        a.cache_attention = attend
    return True


def refresh(m: nn.Module):
    """`install` again where a weight was edited since it was installed (an ablation, load_state_dict), or a
    fitting layer put in place of one: its panels are copied anew, so an eager run decodes with the weights
    as they are now; unedited, nothing changes (not even the bound methods a compiled graph traced)."""
    if not any(type(x) is PanelLinear for x in m.modules()):
        return  # not installed
    for x in m.modules():
        edited = isinstance(x, PanelLinear) and x.stamp not in (_stamp(x.weight), _fused_stamp(x))
        replaced = type(x) is nn.Linear and _linear_fits(x)
        if edited or replaced:
            install(m)
            return


def copies(device, dtype: torch.dtype) -> bool:
    """Whether `install` copies weights on `device` in `dtype`: on a CPU in float32, the kernels available."""
    on_cpu = torch.device(device).type == "cpu"
    return on_cpu and dtype == torch.float32 and unavailable() is None


def copied_bytes(m: nn.Module, device, dtype: torch.dtype) -> int:
    """What `install` would copy of `m` (built on any device, meta included) once it is on `device` in
    `dtype`: its fitting linear layers' weights on a CPU in float32 with the kernels available, else 0."""
    if not copies(device, dtype):
        return 0
    fitting = [x.weight for x in m.modules() if type(x) is nn.Linear and _panel_shaped(x.weight)]
    return sum(w.numel() for w in fitting) * dtype.itemsize


def _linear_fits(x: nn.Module) -> bool:
    """An nn.Linear (or one installed already) whose weight fits the panel kernel."""
    if type(x) not in (nn.Linear, PanelLinear):
        return False
    w = x.weight
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return False
    return _panel_shaped(w)


def _panel_shaped(w: torch.Tensor) -> bool:
    """A matrix whose rows fill whole panels."""
    return w.dim() == 2 and w.shape[0] % PANEL == 0 and w.shape[1] > 0


def _stamp(w: torch.Tensor) -> tuple:
    """What tells a weight's panels are still its own: its data's address, shape and version."""
    version = None  # inference tensors keep no version counter
    if not w.is_inference():
        version = w._version
    return w.data_ptr(), w.shape, version


def _fused_stamp(lin: nn.Module) -> tuple:
    """A fused projection's weight and bias stamps: the fused bias is a copy too."""
    bias = None
    if lin.bias is not None:
        bias = _stamp(lin.bias)
    return _stamp(lin.weight), bias


def gemm_path(m: nn.Module) -> Optional[str]:
    """The GEMMs a CPU float32 run of `m` uses, as an SPS table records them: "mkl" (no kernels), "avx2" or
    "avx512" (None off a CPU in float32)."""
    if not _cpu_float32(m):
        return None
    installed = any(type(x) is PanelLinear for x in m.modules())  # first: `unavailable` builds them
    if not installed or unavailable() is not None:
        return "mkl"
    asked_avx2 = os.environ.get("DSPARK_CPU_KERNELS", "").strip().lower() == "avx2"
    if asked_avx2 or "avx512f" not in _cpu_flags():  # as cpu_kernels.cpp chooses
        return "avx2"
    return "avx512"


def describe(m: nn.Module, compiled: bool = False) -> Optional[str]:
    """Which GEMMs a CPU float32 run of `m` uses, in one line for a program's start (None otherwise)."""
    if not _cpu_float32(m):
        return None
    why = unavailable()
    if why is not None:
        return f"GEMMs: MKL (the CPU kernels are unavailable: {why})"
    if not any(type(x) is PanelLinear for x in m.modules()):
        return "GEMMs: MKL (the CPU kernels are not installed)"
    line = "GEMMs: the few-row kernel (cpu_kernels.cpp; few-token attention too)"
    if compiled:
        line += ", one op each in the compiled graphs"
    return line
