"""CPU: kernels of our own for a round's few rows (cpu_kernels.cpp), built, loaded and called from here;
F.linear and SDPA are their references (tests/test_cpu_kernels.py).

On CPU in float32, a verify multiplies K+1 rows by each weight, a drafter's block K, an
autoregressive step one; and each attends with those few query tokens over the KV cache. The libraries
tune for more rows; at these few they ran well below the core's peak on this project's machine. The
kernels split their work over torch's threads (`torch.set_num_threads`), each output computed by one
thread as with one: the same bits at any thread count.

- `panel_linear`, the GEMM: streams each weight once per six rows from a panel layout
  (`panel_weight`) with the rows' outputs in registers: at six rows 1.61-1.75x faster than the best of
  MKL and packed oneDNN on weights of 2^18 elements or more, at 64 rows 1.13-1.23x, at one row
  1.02-1.42x (on smaller weights 0.95-1.55x, 1.01-1.12x, 0.57-1.2x; `python scripts/gemm_bench.py`,
  BENCHMARKS.md "CPU, a few-row GEMM kernel"; `dense` says which products take it), all with one
  thread; with two, 1.2-2.4x faster than the best of them at one to six rows.
- `cached_attention`: per K/V head, the query rows of its GQA group against the keys and the values
  as two of those GEMMs, reading only the keys some query may see (a static cache costs what is
  filled); model.attend_cached says when it is used.
- The panels live on transparent huge pages (`weight_memory`, the operator dspark::huge_buffer):
  streamed through 4 KiB pages, the target's GEMMs at six rows took a third longer.

And which product runs where (`dense`, the `Dense` layer, `pack_weight`, `column_major`): the model's
weights get their inference copies here (panels, oneDNN's packed layout, column-major storage) and each
GEMM goes to the fastest kernel measured for its rows and thread count; `gemm_note` says which in words.

They are built on first use with the system's C++ compiler (CXX, default g++) against torch's own
headers (about 10 s, once per torch version) into a cache folder, and loaded as the operators
dspark::panel_linear and dspark::cached_attention, which eager code and compiled graphs call alike
(`prepare_graphs` lets graphs traced afterwards use them). Where they cannot be (not x86-64 Linux with
AVX2 and FMA, no compiler, DSPARK_CPU_KERNELS=0), `unavailable` says why and the model keeps F.linear /
oneDNN and SDPA.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from typing import NamedTuple, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from common import user_cache_dir

PANEL = 16  # output columns per panel (cpu_kernels.cpp)
KERNELS_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_kernels.cpp")
# -fopenmp: at::parallel_for is OpenMP in torch's CPU builds (the libgomp.so.1 torch loaded serves the
# library too: one thread pool); -w: torch's headers warn
KERNELS_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w")
_loaded = False       # the operators are defined (this process loaded the library)
_kernels_why = None   # why they are unavailable, once known


def kernel_cache_dir() -> str:
    """Where the built kernels are kept: $DSPARK_CACHE_DIR, else $XDG_CACHE_HOME/dspark-fast, else
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


def _torch_flags() -> list[str]:
    """What an operator library needs of this torch: its headers, its C++ ABI, its libraries."""
    root = os.path.dirname(os.path.abspath(torch.__file__))
    return [f"-I{os.path.join(root, 'include')}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            f"-L{os.path.join(root, 'lib')}", "-lc10", "-ltorch_cpu"]


def _first_error(output: str) -> str:
    lines = output.strip().splitlines() or ["(no output)"]
    return next((line for line in lines if "error" in line), lines[0])


def _build_kernels() -> tuple[Optional[str], Optional[str]]:
    """Build cpu_kernels.cpp (or find it built) -> (the library's path, None), or (None, why not)."""
    if os.environ.get("DSPARK_CPU_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return None, "turned off by DSPARK_CPU_KERNELS"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"they are for x86-64 Linux (this is {platform.system()} {platform.machine()})"
    if not {"avx2", "fma"} <= _cpu_flags():
        return None, "this CPU lacks AVX2 or FMA"
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        return None, f"no C++ compiler {cxx!r} on PATH (set CXX)"
    flags = [*KERNELS_FLAGS, *_torch_flags()]
    try:
        with open(KERNELS_SOURCE, "rb") as f:
            source = f.read()
        version = subprocess.run([cxx, "--version"], capture_output=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"cannot read {KERNELS_SOURCE} or run {cxx}: {e}"
    # A library is built against one torch: its version and place are part of the key.
    key = hashlib.sha256(b"\0".join([source, version, " ".join(flags).encode(), torch.__version__.encode()]))
    folder = kernel_cache_dir()
    path = os.path.join(folder, f"cpu_kernels-{key.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        try:
            os.makedirs(folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=folder)
            os.close(fd)
        except OSError as e:
            return None, f"cannot write to the cache folder {folder}: {e} (set DSPARK_CACHE_DIR)"
        try:
            done = subprocess.run([cxx, KERNELS_SOURCE, "-o", tmp, *flags], capture_output=True, text=True,
                                  timeout=600)
            if done.returncode != 0:
                return None, f"{cxx} failed on {KERNELS_SOURCE}: {_first_error(done.stderr or done.stdout)}"
            os.replace(tmp, path)  # whole or absent: another process may be building the same file
        except (OSError, subprocess.SubprocessError) as e:
            return None, f"{cxx} failed on {KERNELS_SOURCE}: {e}"
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        _prune_builds(folder)
    else:
        try:
            os.utime(path)  # in use: what _prune_builds goes by
        except OSError:
            pass
    return path, None


STALE_DAYS = 30  # a build not used for this long is removed when another is made


def _prune_builds(folder: str):
    """Remove from the cache folder the builds of cpu_kernels.cpp that no process used for STALE_DAYS
    (each source edit, compiler or torch version makes one, ~200 KB; a use touches its file) and the
    temporary files of builds that died more than a day ago. Best effort: a file that cannot be removed
    stays."""
    now = time.time()
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        stale = (STALE_DAYS * 86400 if name.startswith("cpu_kernels-") else 86400 if name.startswith("tmp") else None)
        if stale is None or not name.endswith(".so"):
            continue
        try:
            if now - os.path.getmtime(os.path.join(folder, name)) > stale:
                os.unlink(os.path.join(folder, name))
        except OSError:
            pass


def unavailable() -> Optional[str]:
    """None when the CPU kernels are built and loaded (building them on the first call, about 10 s,
    once per torch version), else why not, in words."""
    global _loaded, _kernels_why
    if not _loaded and _kernels_why is None:
        path, why = _build_kernels()
        if why is None:
            try:
                torch.ops.load_library(path)
            except (OSError, RuntimeError) as e:
                why = f"cannot load {path}: {str(e).splitlines()[0] if str(e) else e}"
        if why is not None:
            _kernels_why = why
        else:
            _register_fakes()
            _loaded = True
    return _kernels_why


def _register_fakes():
    """The operators' output shapes, for torch.compile's tracing (the kernels run only on real tensors)."""
    @torch.library.register_fake("dspark::panel_linear")
    def _(x, panels, bias):
        return x.new_empty(*x.shape[:-1], panels.shape[0] * panels.shape[2])

    @torch.library.register_fake("dspark::cached_attention")
    def _(q, k, v, bias):
        return q.new_empty(q.shape[0], q.shape[1], q.shape[2] * q.shape[3])


def panel_weight(weight: torch.Tensor) -> Optional[torch.Tensor]:
    """`weight` [N, K] (float32, CPU) as panels [N/16, K, 16] for `panel_linear` (a copy, on huge pages:
    `weight_memory`), or None where the kernel does not apply: another dtype or device, N not a
    multiple of 16, or the kernels unavailable (`unavailable`)."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
            or weight.shape[0] % PANEL or weight.shape[1] == 0 or unavailable() is not None):
        return None
    N, K = weight.shape
    panels = weight_memory(N * K * 4).view(torch.float32).view(N // PANEL, K, PANEL)
    return panels.copy_(weight.detach().reshape(N // PANEL, PANEL, K).transpose(1, 2))


ARENA_BYTES = 64 << 20  # the huge-page blocks `weight_memory` carves the panels from
_arena: Optional[torch.Tensor] = None  # the current block (uint8) ...
_arena_used = 0                        # ... and how much of it is handed out


def weight_memory(nbytes: int) -> torch.Tensor:
    """nbytes of uninitialised memory (uint8, 64-byte aligned) for a weight copy the kernels stream, cut
    from blocks of ARENA_BYTES on transparent huge pages (the operator dspark::huge_buffer): streamed
    through 4 KiB pages, a weight costs a TLB walk per page and the prefetchers stop at each page's end
    (the target's GEMMs at six rows: 6.2 ms a pass on huge pages, 8.2 ms on 4 KiB; BENCHMARKS.md). The
    block lives as long as any weight cut from it."""
    global _arena, _arena_used
    need = -(-nbytes // 64) * 64
    if _arena is None or _arena_used + need > _arena.numel():
        _arena, _arena_used = torch.ops.dspark.huge_buffer.default(max(ARENA_BYTES, need)), 0
    out = _arena[_arena_used:_arena_used + nbytes]
    _arena_used += need
    return out


def panel_linear(x: torch.Tensor, panels: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [..., K] @ Wᵀ (+ bias) -> [..., N] for panels = `panel_weight(W)`: the operator
    dspark::panel_linear (cpu_kernels.cpp; torch's threads split the panels; no autograd). Agrees with
    F.linear(x, W, bias) to rounding; each row's result is the same whatever rows share the call and
    however many threads run it (the sum over k runs in one order). Refuses (RuntimeError) an x that
    does not fit and panels not in panel_weight's layout."""
    return torch.ops.dspark.panel_linear.default(x, panels, bias)


#: The most query tokens `model.attend_cached` hands `cached_attention`: a verify's K+1, a drafter's
#: block, one step, a short prompt. On this project's CPU the kernel took 0.55-0.58x SDPA's time at 1-6
#: tokens, 0.79-0.91x at 16-128, and was level at 256 (a K/V head's scores, [tokens x group, keys]
#: floats, outgrow the caches): `python scripts/gemm_bench.py --attention ...`, BENCHMARKS.md.
ATTENTION_MAX_TOKENS = 128


def attention_applies(q: torch.Tensor, bias: torch.Tensor) -> bool:
    """Whether `model.attend_cached` may hand q [B, T, H, hd] and its bias [B, 1, T, S] to
    `cached_attention`: CPU float32 without autograd, T <= ATTENTION_MAX_TOKENS, hd a multiple of 16, the
    bias one row per token (GQA not folded into it), and the kernels available."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and bias.dtype == torch.float32
            and not (torch.is_grad_enabled() and q.requires_grad) and q.shape[1] <= ATTENTION_MAX_TOKENS
            and q.shape[3] % PANEL == 0 and bias.shape[2] == q.shape[1] and unavailable() is None)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, T, H, hd] over k, v [B, S, Hkv, hd] under the additive bias [B, 1, T, S] (0 /
    -inf, `model.cache_bias` with group 1) -> [B, T, H*hd], query head h reading K/V head h // (H/Hkv),
    scale 1/sqrt(hd): the operator dspark::cached_attention (cpu_kernels.cpp; torch's threads split the
    (batch row, K/V head) pairs; no autograd), SDPA's result (`model.attend_cached`'s reference) to
    rounding. A query row's result is the same bits whatever other tokens share the call, however many
    keys past its last visible one the cache holds (given finite K/V) and however many threads run it;
    a row that may see no key gives zeros, as SDPA's CPU kernel does. Any strides; refuses
    (RuntimeError) shapes that do not fit."""
    return torch.ops.dspark.cached_attention.default(q, k, v, bias)


# ----------------------------------------------------------------------------------------
# Which product runs where: the model's GEMMs (`dense`, `Dense`) and the weight copies they use

class Packed(NamedTuple):
    """A weight's inference copies for `dense` (`pack_weight`; either may be None): `panels`, the
    layout of the few-row CPU kernel (`panel_weight`), and `onednn`, oneDNN's blocked layout."""
    panels: Optional[torch.Tensor]
    onednn: Optional[torch.Tensor]


def dense(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
          packed: Optional[Packed] = None) -> torch.Tensor:
    """x @ weightᵀ + bias, as F.linear (the reference: tests/test_model.py), on the fastest kernel
    `packed` (`pack_weight(weight)`) offers for it, on CPU in float32:

    - where the panels were made (the kernels available): the few-row kernel on them (`panel_linear`,
      the operator dspark::panel_linear of cpu_kernels.cpp; compiled, one opaque op in graphs traced
      after `prepare_graphs()`, which compiling.compiled calls), from two rows on, and for one row on
      weights of PACK_MIN_ELEMENTS or more (eager with more than one thread, on every weight:
      `one_row_on_panels`). On this project's machine, with one thread, it ran six
      rows 1.61-1.75x faster than the best of MKL and packed oneDNN on the larger weights (0.95-1.55x
      on smaller ones), 64 rows 1.01-1.23x, and one row 1.02-1.42x on the larger weights, where the
      smaller ones lost to MKL; with two threads (splitting the panels) 1.2-2.4x at one to six rows
      (BENCHMARKS.md, "CPU, a few-row GEMM kernel" and session 10); each row's result is the same
      however many rows share the product and however many threads compute it;
    - else, from two rows: oneDNN on its packed copy — MKL multiplies a handful of rows at a
      fraction of the core's peak (1.5-1.7x slower at 6 rows on weights of 0.8M+ elements);
    - else F.linear (MKL; one row on the column-major weight where out >= in: `column_major`).

    They agree to rounding, not bitwise (other summation orders). Autograd always takes F.linear (the
    fast kernels have no backward: a drafter in training reads the lm_head), and so does a call under
    autocast (training's --dtype bfloat16 on CPU: the kernels take float32 alone; autocast casts
    F.linear's operands). (Each check costs ~0.1 µs of a call's few.)"""
    if (packed is None or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
            or torch.is_autocast_enabled("cpu")):  # packed: a CPU weight
        return F.linear(x, weight, bias)
    if packed.panels is not None and (x.numel() > x.shape[-1] or weight.numel() >= PACK_MIN_ELEMENTS
                                      or one_row_on_panels()):
        if kernels_on():  # compiled: one opaque kernel of the graph
            return panel_linear(x, packed.panels, bias)
    if packed.onednn is None or x.numel() <= x.shape[-1]:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x if x.is_contiguous() else x.contiguous(), packed.onednn, bias,
                                              "none", [], "")


def one_row_on_panels() -> bool:
    """Whether `dense` gives one row of a weight under PACK_MIN_ELEMENTS the kernel too: eager with more
    than one thread. With one, MKL (column-major) was faster there on this project's CPU (the kernel
    0.57-1.2x its speed); with two the kernel was 1.2-2.8x faster than MKL's best (BENCHMARKS.md,
    session 10). Compiled graphs keep Inductor's GEMM there, at any thread count."""
    return not torch.compiler.is_compiling() and torch.get_num_threads() > 1


def pack_weight(weight: torch.Tensor, min_elements: Optional[int] = None) -> Optional[Packed]:
    """`weight` [out, in]'s copies for `dense` (each the weight's memory again), or None when it gets
    neither: the panels of the few-row CPU kernel where that applies (`panel_weight`), and
    oneDNN's blocked layout when the weight has `min_elements` elements or more (default
    PACK_MIN_ELEMENTS; 0 packs any weight) and oneDNN is built in."""
    panels = panel_weight(weight)
    onednn = None
    if (weight.numel() >= (PACK_MIN_ELEMENTS if min_elements is None else min_elements)
            and torch.backends.mkldnn.is_available()):
        onednn = _onednn_layout(weight)
    return None if panels is None and onednn is None else Packed(panels, onednn)


def _onednn_layout(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_ROWS)


def packed_rows(packed: Optional[Packed], weight: torch.Tensor, rows: int) -> Optional[Packed]:
    """The copies for `dense` of weight[:rows] (a fused weight's leading rows): its panels a view of
    the whole's leading panels (where `rows` is a whole number of panels), oneDNN's packed anew."""
    if packed is None:
        return None
    panels = packed.panels[:rows // PANEL] if packed.panels is not None and rows % PANEL == 0 \
        else None  # (panel_weight gives none either: no kernel, or not a whole number of panels)
    onednn = _onednn_layout(weight[:rows]) if packed.onednn is not None else None
    return None if panels is None and onednn is None else Packed(panels, onednn)


PACK_ROWS = 64  # the row count oneDNN chooses its layout for (packed for 1 instead, 6-row products were slower)
# Weights smaller than this get no oneDNN copy: oneDNN's fixed cost per product outweighs its better
# kernel there. On this project's machine (BENCHMARKS.md, "CPU, weight layouts") oneDNN at 6 rows ran
# at 0.59-0.97x the speed of MKL's best layout on weights of 65-197K elements (the demo pair's), and
# at 1.06-1.64x on weights of 262K (2^18) to 4.2M elements. (The panels are made at any size.)
PACK_MIN_ELEMENTS = 1 << 18


def gemm_note(model: nn.Module, compiled: bool = False) -> Optional[str]:
    """Which GEMMs a CPU float32 run of `model` (`compiled` or eager) uses, in words (printed at start;
    None off CPU float32). Where the few-row GEMM runs, so does the few-token attention (same library;
    `attend_cached`)."""
    w = next(model.parameters())
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return None
    others = "Inductor's" if compiled else "MKL/oneDNN"
    why = unavailable()
    if why is not None:
        return f"GEMMs: {others} (the few-row kernel is unavailable: {why})"
    if not any(isinstance(m, Dense) and m.packed is not None for m in model.modules()):
        return f"GEMMs: {others} (no packed copies: fuse_ was not run, or they would not fit in memory)"
    return ("GEMMs: the few-row kernel (cpu_kernels.cpp; few-token attention too)"
            + (", one op each in the compiled graphs" if compiled else ""))


def packs_pay(model: nn.Module) -> bool:
    """Whether `fuse_` packs `model`'s weights for `dense` (`pack_weight`): on CPU, in float32, and when
    the two copies it may make (panels, oneDNN's) take at most a third of the machine's memory."""
    w = next(model.parameters())
    if w.device.type != "cpu" or w.dtype != torch.float32:
        return False
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # no sysconf: do not risk the memory
        return False
    return 6 * weights <= memory


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [out, in] as the transpose of a contiguous [in, out] copy, where that layout pays
    (`column_major_pays`), else `weight` itself. F.linear then multiplies x by the stored [in, out]
    matrix as it lies (BLAS's "NN" product). On this project's CPU (MKL, AMD EPYC, float32, 1 thread;
    `scripts/gemm_bench.py`, BENCHMARKS.md "CPU, weight layouts") a one-row product — an autoregressive
    step, a Markov step — was 1.1-2.0x faster that way on every weight with out >= in (an 8192x512
    lm_head 1218 -> 657 µs, 1536x512 240 -> 162 µs) and slower on in > out (512x1536 176 -> 237 µs),
    and a few rows on the small weights that stay with MKL gained as much (768x256 at 6 rows: 171 ->
    109 µs). Same shape and values; another summation order, so agreement to rounding."""
    if not column_major_pays(weight):
        return weight
    return weight.detach().t().contiguous().t()


def column_major_pays(weight: torch.Tensor) -> bool:
    """Whether `column_major` stores `weight` transposed: on CPU, in float32, out >= in, row-major now,
    and the whole of its storage (not rows of a fused weight, which `fuse_` lays out as one)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.shape[0] >= weight.shape[1] and weight.is_contiguous()
            and weight.untyped_storage().nbytes() == weight.numel() * weight.element_size())


def column_major_(module: nn.Module):
    """Every nn.Linear weight of `module` that pays for it stored column-major in place (`column_major`):
    the Parameter objects are kept (a weight tied to an embedding stays tied), their data re-laid. Run
    after fusing: the fused weights are laid out whole, and their rows are views that stay views."""
    for lin in module.modules():
        if isinstance(lin, nn.Linear) and column_major_pays(lin.weight):
            lin.weight.data = column_major(lin.weight)


class Dense(nn.Linear):
    """nn.Linear through `dense`: with `packed` set (`fuse_` on CPU), its GEMMs run on the CPU kernel's
    panels or oneDNN's packed weight. `packed` is a plain attribute: not in state_dict, not moved by
    `.to()` (pack again after a move), and never read while torch.compile traces (Inductor packs its own)."""
    packed: Optional[Packed] = None

    def pack_(self):
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias, packed_of(self, "packed"))


def packed_of(module: nn.Module, name: str) -> Optional[Packed]:
    """module.<name>, a weight's packed copies or None. While torch.compile traces, only the panels:
    Inductor packs its own oneDNN weights (compiling.compiled), so a graph never reads those, and it
    calls the few-row kernel as one opaque op (`dense`)."""
    packed = getattr(module, name)
    if packed is None or not torch.compiler.is_compiling():
        return packed
    return Packed(packed.panels, None) if packed.panels is not None else None


_graphs_prepared = False  # prepare_graphs() was called: graphs traced from now on call the kernels


def prepare_graphs():
    """Let graphs traced from now on call the kernels (`kernels_on`): built (or refused) now, not while a
    graph is traced. A graph keeps what it was traced with."""
    global _graphs_prepared
    _graphs_prepared = unavailable() is None


def kernels_on() -> bool:
    """Whether `dense` and `model.attend_cached` may call the kernels, given that they apply (panels
    made, `attention_applies`): eager, always; while torch.compile traces, in graphs traced after
    `prepare_graphs` (before it, Inductor's own GEMMs and SDPA). At any thread count: the kernels split
    their work over torch's threads, with the same bits at every count."""
    return not torch.compiler.is_compiling() or _graphs_prepared
