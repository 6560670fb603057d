"""CPU GEMMs of a round, four ways, in one process, and its attention two ways: MKL on the weight as stored [out, in] (`F.linear`),
MKL on it stored column-major (`cpu_kernels.column_major`), oneDNN on a packed copy, and this project's
few-row kernel on the weight's panels (`cpu_kernels.panel_linear`, cpu_kernels.cpp) — the four `cpu_kernels.dense`
chooses from.

    python scripts/gemm_bench.py --threads 1
    python scripts/gemm_bench.py --threads 1 --shapes 3072x512,512x1536 --rows 1,6,64
    python scripts/gemm_bench.py --threads 1 --shapes none --attention 6x204,64x512

Why it exists: the eager engine lays out and packs float32 weights by what measured fastest on this
project's CPU — on the few-row kernel's panels (where the weight's out is a multiple of 16 and the
kernel could be built; at any thread count, the kernel splitting the panels over them; one row with
one thread only on weights of `cpu_kernels.PACK_MIN_ELEMENTS` elements or more, smaller ones on MKL as
below); else one
row (an autoregressive step, a Markov step) on MKL, column-major where out >= in, and more rows (a
verification's K+1 tokens, the drafter's block) on oneDNN's packed weight where the weight has
`cpu_kernels.PACK_MIN_ELEMENTS` elements or more, else on MKL. Whether that holds is a property of the CPU
and the BLAS build: run this on yours. For each weight shape OUTxIN (a layer's [out, in]) and
row count it prints the median microseconds per product of `--reps` calls (after `--warmup`) for the
four, interleaved, each call on the next of `--copies` copies of the weight (a model's weights do not
all stay in cache between two uses; 1: the same weight every call), and the largest difference between
the results (they round differently; they must agree to ~1e-5). The last column is what the engine
uses for that shape and row count.
Default shapes: a layer's GEMMs ([v; k; q], o_proj, gate or up, down_proj, a 4096-token lm_head) at
hidden 256 (the demo pair's), the Markov head's output at rank 64, and bigram-35m's (hidden 512,
[v; k; q] 1024, gate or up 1536, fused gate-up 3072, an 8192-token lm_head).

`--attention TOKENSxKEYS,...` then times `model.attend_cached`'s two ways, SDPA and this project's
few-token kernel (`cpu_kernels.cached_attention`), for TOKENS query tokens at the end of a cache of
KEYS filled positions (each token reads its prefix) at `--heads` (bigram-35m's by default), and names
the one the engine uses (the kernel up to `cpu_kernels.ATTENTION_MAX_TOKENS` tokens).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import UserError, check_ranges, cli_main, device_name, parse_ints  # noqa: E402
import cpu_kernels  # noqa: E402
from cpu_kernels import PACK_MIN_ELEMENTS, column_major_pays, pack_weight  # noqa: E402


@dataclass
class GemmArgs:
    """MKL (row- and column-major weights), packed oneDNN and the few-row kernel: float32 GEMMs at the shapes of a round, on this CPU."""

    shapes: str = ("512x256,256x256,768x256,256x768,4096x256,4096x64,"
                   "1024x512,512x512,1536x512,3072x512,512x1536,8192x512")
    """Comma-separated weight shapes OUTxIN."""
    rows: str = "1,2,6,12,64"
    """Comma-separated row counts of the input (a verification of a block of K drafts has K+1 rows per request)."""
    attention: str = ""
    """Comma-separated TOKENSxKEYS: also time attention of TOKENS query tokens over KEYS cache positions (e.g. 6x204,64x512; empty: none)."""
    heads: str = "8,4,64"
    """For --attention: query heads, K/V heads, head dim (default bigram-35m's)."""
    threads: int = 1
    """torch threads."""
    reps: int = 200
    """Timed products per (shape, rows, kernel), interleaved between the kernels."""
    copies: int = 16
    """Copies of each weight, used in turn (1: the same weight every call, always in cache)."""
    warmup: int = 20
    """Untimed products first."""
    seed: int = 0
    """Seed of the random weights and inputs."""


def parse_shapes(text: str, flag: str = "--shapes") -> list[tuple[int, int]]:
    """OUTxIN,... (or TOKENSxKEYS,...) -> pairs; "none" or "" -> none."""
    shapes = []
    if text.strip().lower() in ("", "none"):
        return shapes
    for part in text.split(","):
        try:
            out, inp = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise UserError(f"{flag}: {part.strip()!r} is not two numbers AxB (e.g. 3072x512)") from None
        if not (1 <= out <= 1 << 20 and 1 <= inp <= 1 << 20):
            raise UserError(f"{flag}: {part.strip()!r} is outside 1..1048576")
        shapes.append((out, inp))
    return shapes


def engine_choice(w: torch.Tensor, rows: int) -> str:
    """Which of the four the eager engine runs for this weight and row count at torch's current thread
    count (`cpu_kernels.dense`, `fuse_`)."""
    if (w.shape[0] % cpu_kernels.PANEL == 0 and cpu_kernels.unavailable() is None
            and (rows > 1 or w.numel() >= PACK_MIN_ELEMENTS or cpu_kernels.one_row_on_panels())):
        return "panels"
    if rows > 1 and w.numel() >= PACK_MIN_ELEMENTS:  # packed by fuse_ (pack_weight), used from 2 rows
        return "oneDNN"
    return "MKL col" if column_major_pays(w) else "MKL"


def run(args: GemmArgs) -> int:
    check_ranges(args, threads="[1, 1024]", reps="[1, 100000]", warmup="[0, 100000]", seed=f"[0, {2**62}]",
                 copies="[1, 1024]")
    shapes = parse_shapes(args.shapes)
    attention = parse_shapes(args.attention, "--attention")
    heads = parse_ints(args.heads, "--heads")
    if len(heads) != 3 or min(heads) < 1 or heads[0] % heads[1] or heads[2] % cpu_kernels.PANEL:
        raise UserError(f"--heads {args.heads}: must be H,HKV,HD with H a multiple of HKV and HD of {cpu_kernels.PANEL}")
    if any(t > s for t, s in attention):
        raise UserError(f"--attention {args.attention}: TOKENS must not exceed KEYS (the tokens are cache positions)")
    rows = parse_ints(args.rows, "--rows")
    if any(r < 1 or r > 65536 for r in rows):
        raise UserError(f"--rows {args.rows}: each must be in 1..65536")
    if not torch.backends.mkldnn.is_available():
        raise UserError("this torch was built without oneDNN (torch.backends.mkldnn): nothing to compare")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    why = cpu_kernels.unavailable()
    print(f"{device_name('cpu')}, torch {torch.__version__}, {args.threads} thread(s), float32; "
          f"median µs of {args.reps} interleaved products, each on the next of {args.copies} copies of the weight"
          + (f"; the few-row kernel is unavailable: {why}" if why else ""))
    if shapes:
        print(f"{'weight':>11} {'rows':>5} {'MKL µs':>9} {'MKL col µs':>11} {'oneDNN µs':>10} {'panels µs':>10} "
              f"{'max |diff|':>11}  engine uses")
    for out, inp in shapes:
        ws = [torch.randn(out, inp, generator=g) / inp ** 0.5 for _ in range(args.copies)]
        cols = [w.t().contiguous().t() for w in ws]  # column-major, as cpu_kernels.column_major lays out (any shape here)
        packs = [pack_weight(w, min_elements=0).onednn for w in ws]
        panels = [cpu_kernels.panel_weight(w) for w in ws]  # None where it does not apply
        for r in rows:
            x = torch.randn(r, inp, generator=g)
            kernels = {  # each takes the copy to use
                "mkl": lambda i: torch.nn.functional.linear(x, ws[i]),
                "col": lambda i: torch.nn.functional.linear(x, cols[i]),
                "onednn": lambda i: torch.ops.mkldnn._linear_pointwise(x, packs[i], None, "none", [], "")}
            if panels[0] is not None:
                kernels["panels"] = lambda i: cpu_kernels.panel_linear(x, panels[i])
            times = interleaved_us(kernels, args)
            mkl, col, onednn = (times[k] for k in ("mkl", "col", "onednn"))
            ours = f"{times['panels']:>10.1f}" if "panels" in times else f"{'n/a':>10}"
            results = [f(0) for f in kernels.values()]
            diff = max((results[0] - y).abs().max().item() for y in results[1:])
            print(f"{out:>5}x{inp:<5} {r:>5} {mkl:>9.1f} {col:>11.1f} {onednn:>10.1f} {ours} {diff:>11.2e}  "
                  f"{engine_choice(ws[0], r)}", flush=True)
    if attention:
        attention_table(attention, *heads, args, g)
    return 0


def interleaved_us(ways: dict, args: GemmArgs) -> dict:
    """Median µs per call of each of `ways` (each takes the copy to use): `args.warmup` untimed rounds,
    then `args.reps` timed ones, the ways interleaved, call n on copy n % `args.copies`."""
    for n in range(args.warmup):
        for f in ways.values():
            f(n % args.copies)
    times = {k: [] for k in ways}
    for n in range(args.reps):
        for k, f in ways.items():
            t0 = time.perf_counter()
            f(n % args.copies)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(t) * 1e6 for k, t in times.items()}


def attention_table(sizes: list[tuple[int, int]], H: int, Hkv: int, hd: int, args: GemmArgs, g: torch.Generator):
    """`model.attend_cached` both ways per TOKENSxKEYS: SDPA, and the few-token kernel where it applies."""
    from model import cache_bias
    print(f"attention, {H} query heads, {Hkv} K/V heads, head dim {hd}; median µs of {args.reps} interleaved calls, "
          f"each on the next of {args.copies} caches")
    print(f"{'tokens':>7} {'keys':>6} {'SDPA µs':>9} {'kernel µs':>10} {'max |diff|':>11}  engine uses")
    for T, S in sizes:
        qs = [torch.randn(1, T, H, hd, generator=g) for _ in range(args.copies)]
        caches = [torch.randn(1, S, 2 * Hkv, hd, generator=g) for _ in range(args.copies)]  # [v; k] heads, as a cache row
        bias = cache_bias((torch.arange(S - T, S)[:, None] >= torch.arange(S))[None], 1, torch.float32)

        def sdpa(i):
            q, k, v = qs[i].transpose(1, 2), caches[i][:, :, Hkv:].transpose(1, 2), caches[i][:, :, :Hkv].transpose(1, 2)
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=Hkv != H)\
                .transpose(1, 2).reshape(1, T, H * hd)

        ways = {"sdpa": sdpa}
        if cpu_kernels.unavailable() is None:
            ways["kernel"] = lambda i: cpu_kernels.cached_attention(qs[i], caches[i][:, :, Hkv:], caches[i][:, :, :Hkv], bias)
        times = interleaved_us(ways, args)
        ours = f"{times['kernel']:>10.1f}" if "kernel" in times else f"{'n/a':>10}"
        diff = (ways["kernel"](0) - sdpa(0)).abs().max().item() if "kernel" in ways else 0.0
        uses = "kernel" if ("kernel" in ways and T <= cpu_kernels.ATTENTION_MAX_TOKENS) else "SDPA"
        print(f"{T:>7} {S:>6} {times['sdpa']:>9.1f} {ours} {diff:>11.2e}  {uses}", flush=True)


def main(argv=None) -> int:
    return cli_main(GemmArgs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
