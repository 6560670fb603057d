"""How the round is compiled: the project's torch.compile recipe per device, where its on-disk caches
live, and the flags that choose them (--compile's default, --compile-mode, --compile-cache, --verbose).

The recipe (`compiled`): one graph, static shapes — on CUDA `reduce-overhead` (CUDA graphs), on CPU
max-autotune with the weights frozen into the graph and a C++ graph wrapper. README, "Compiling", has what a cold
and a warm start cost.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Literal, Optional

import torch

import cpu_kernels
from common import UserError, user_cache_dir

#: torch.compile's modes, for --compile-mode (without it: the recipe of `compiled`).
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_MODES = CompileMode.__args__


def auto_compile(compile: Optional[bool], device: str) -> bool:
    """--compile's default: on for cuda, off for cpu."""
    return compile if compile is not None else device.startswith("cuda")


def check_compile_flags(compile: bool, compile_cache: Optional[str], verbose: bool, mode: Optional[str] = None):
    """--compile-mode, --compile-cache and --verbose only change a compiled run."""
    for flag, given in ((f"--compile-mode {mode}", mode is not None), ("--compile-cache", compile_cache is not None),
                        ("--verbose", verbose)):
        if given and not compile:
            raise UserError(f"{flag}: only used with --compile (the run is eager)")


def compile_cache_dir(path: Optional[str] = None) -> str:
    """Where torch.compile keeps what a later run can reuse: `path`, else $TORCHINDUCTOR_CACHE_DIR, else
    ~/.cache/dspark-fast/inductor ($XDG_CACHE_HOME/dspark-fast/inductor when that is set) — a per-user
    directory that, unlike Inductor's own default under /tmp, survives a reboot."""
    if path is None:
        path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if path is None:
        path = user_cache_dir("inductor")
    return os.path.abspath(os.path.expanduser(path))


def use_compile_cache(path: Optional[str] = None, flag: str = "--compile-cache") -> str:
    """Point Inductor's on-disk caches at `compile_cache_dir(path)` (created if missing) and return it;
    before anything compiles, since Inductor reads TORCHINDUCTOR_CACHE_DIR when it opens a cache. What a
    warm start reuses depends on the recipe (see `compiled` and the README's "Compiling")."""
    where = compile_cache_dir(path)
    if os.path.exists(where) and not os.path.isdir(where):
        raise UserError(f"{flag} {where}: not a directory")
    try:
        os.makedirs(where, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag} {where}: cannot create the directory ({e.strerror})") from None
    if not os.access(where, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {where}: the directory is not writable")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = where
    return where


#: Inductor settings of every compile here: no "Autotune Choices Stats" JSON blob per autotuned op on
#: stderr. A setting, so part of the cache key: the same whether or not `verbose`.
_QUIET_OPTIONS = {"max_autotune_report_choices_stats": False}


def _inductor_options(options: dict) -> dict:
    config = torch._inductor.config
    return {**options, **{k: v for k, v in _QUIET_OPTIONS.items() if hasattr(config, k)}}  # torch 2.11 may lack one


def compiled(fn, device, mode: Optional[str] = None, verbose: bool = False):
    """`fn` under torch.compile with the project's recipe: one graph, static shapes; on CPU max-autotune
    with frozen weights, on CUDA `reduce-overhead` (CUDA graphs, no GEMM autotuning); or `mode` when given.

    On CUDA the default is `reduce-overhead` because it was measured and max-autotune was not: on an
    H200 with a Qwen3-8B-shaped pair it compiled in 42 s and 55 s per engine and ran rounds within
    1.5-1.55x of their memory-bandwidth floor (BENCHMARKS.md), while max-autotune times every GEMM
    shape of the 36-layer target before the first token. `--compile-mode max-autotune` asks for it.

    On CPU the default also freezes the weights into the graph (Inductor's `freezing`): they become
    constants, packed once, and max-autotune can then pick Inductor's C++ GEMM micro-kernels, which
    beat MKL 1.4-3.5x at the few-row matmuls of a round on this project's CPU (BENCHMARKS.md) —
    where the project's CPU kernels are unavailable: else the model's GEMMs and its few-token
    attention stay with them, called as one opaque op each (`cpu_kernels.dense`, dspark::panel_linear;
    `model.attend_cached`, dspark::cached_attention), faster still, and Inductor fuses what lies
    between them. The
    weights must not change in place afterwards (a new model recompiles; an edited one would not be
    seen), and the packed copies cost a second copy of the weights' memory. The graph's wrapper is
    generated as C++ rather than Python (`cpp_wrapper`): a round calls a few hundred kernels, and
    the profiler put ~2.6 ms of a ~26 ms round in the Python graph call itself, outside them. Both settings
    are read when a graph compiles, which is the first call of each shape, so every call runs with
    them switched on (and without autograd, which freezing needs). Frozen graphs are not kept by
    Inductor's FX-graph and AOTAutograd caches (torch 2.13 refuses graphs with frozen, oneDNN-packed
    weights), so a second process re-lowers them; it reuses the autotuning results and the compiled
    kernels from the cache directory (README, "Compiling").

    Compiling under max-autotune prints a table per autotuned GEMM (`AUTOTUNE ...`) to stderr;
    `verbose` shows them, else they are off (Inductor's module switch, not a setting: the cache key
    is the same either way), as is a deprecation warning Inductor's autotuner raises."""
    import torch._inductor.select_algorithm as select_algorithm

    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(f"compile mode {mode!r}: not one of {', '.join(COMPILE_MODES)}")
    if not verbose:
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated", category=UserWarning,
                                module=r"torch\._inductor")
    cpu_recipe = not str(device).startswith("cuda") and mode is None
    if cpu_recipe:  # max-autotune's options without its CUDA graphs (which the C++ wrapper would warn it skips)
        options = {"max_autotune": True}
    else:  # the mode as its options (what torch.compile does with a mode), so that ours can join them
        options = torch._inductor.list_mode_options(mode or "reduce-overhead")
    if not str(device).startswith("cuda"):  # (a CUDA run does not build the CPU kernels)
        cpu_kernels.prepare_graphs()  # CPU: GEMMs and few-token attention on our kernels, one op each
    graph = torch.compile(fn, fullgraph=True, dynamic=False, options=_inductor_options(options))
    switch = hasattr(select_algorithm, "PRINT_AUTOTUNE")

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if switch:
            shown, select_algorithm.PRINT_AUTOTUNE = select_algorithm.PRINT_AUTOTUNE, verbose
        try:
            if not cpu_recipe:
                return graph(*args, **kwargs)
            with torch.no_grad(), torch._inductor.config.patch(freezing=True, cpp_wrapper=True):
                return graph(*args, **kwargs)
        finally:
            if switch:
                select_algorithm.PRINT_AUTOTUNE = shown
    return call
