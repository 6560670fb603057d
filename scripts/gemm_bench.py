"""The CPU GEMMs of a round two ways, in one process: MKL (`F.linear` on the weight as nn.Linear stores
it) and the CPU backend's few-row kernel on the weight's panels (`torch.ops.dspark.panel_linear`,
cpu_kernels.cpp); and with --attention, the attention over the KV cache two ways: SDPA
(`model.attend_cached`) and the backend's kernel (`torch.ops.dspark.cached_attention`).

    python scripts/gemm_bench.py --threads 1
    python scripts/gemm_bench.py --threads 1 --shapes 3072x512,512x1536 --rows 1,6,8,64
    python scripts/gemm_bench.py --threads 1 --shapes none --attention 8x204,64x512

For each weight shape OUTxIN (a layer's [out, in]) and row count it prints the median microseconds per
product of `--reps` calls (after `--warmup`), the two interleaved, each call on the next of `--copies`
copies of the weight (a model's weights do not stay in cache between two uses; 1: the same weight every
call); MKL's time over the kernel's; the largest difference between their results (they round
differently: ~1e-5); and what `cpu_kernels.install` runs there (the kernel where out is a multiple of
16 and the kernels could be built). The last line gives the process's CPU time beside its wall time: on
a shared machine, CPU well under wall means the figures waited for the CPU.
Default shapes: the demo pair's (hidden 256: q, [k; v] and o 256x256, gate-up 1536x256, down and the
drafter's fc 256x768, the lm_head 4096x256, the Markov head's 4096x64) and bigram-35m's (hidden 512:
512x512, gate-up 3072x512, down 512x1536, the drafter's fc 512x1024, the lm_head 8192x512, Markov
8192x64).

`--attention TOKENSxKEYS,...` times TOKENS query tokens at the end of a cache of KEYS filled positions
(each token reads its prefix) at `--heads` (bigram-35m's by default), and names what `install` runs (the
kernel up to `cpu_kernels.ATTENTION_MAX_TOKENS` tokens, else SDPA).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support import cpu_kernels  # noqa: E402
from support.cli import (  # noqa: E402
    SEED_RANGE,
    UserError,
    check_ranges,
    cli_main,
    device_name,
    free_memory,
    parse_ints,
)


@dataclass
class GemmArgs:
    """MKL and the CPU backend's few-row kernel: float32 GEMMs (and attention) at the shapes of a round, on this CPU."""

    shapes: str = ("256x256,1536x256,256x768,4096x256,4096x64,"
                   "512x512,3072x512,512x1536,512x1024,8192x512,8192x64")
    """Comma-separated weight shapes OUTxIN ("none": no GEMM table)."""
    rows: str = "1,6,7,8,64"
    """Comma-separated row counts of the input (a verification of a block of K drafts has K+1 rows per request)."""
    attention: str = ""
    """Comma-separated TOKENSxKEYS: also time attention of TOKENS query tokens over KEYS cache positions
    (e.g. 8x204,64x512; empty: none)."""
    heads: str = "8,4,64"
    """For --attention: query heads, K/V heads, head dim (default bigram-35m's)."""
    threads: int = 1
    """torch threads."""
    reps: int = 200
    """Timed calls per (shape, rows, way), interleaved between the two ways."""
    copies: int = 16
    """Copies of each weight (or cache), used in turn (1: the same every call, always in cache)."""
    warmup: int = 20
    """Untimed calls first."""
    seed: int = 0
    """Seed of the random weights and inputs."""


def parse_shapes(text: str, flag: str = "--shapes", example: str = "3072x512") -> list[tuple[int, int]]:
    """AxB,... -> pairs; "none" or "" -> none. `example`: a good one, for the error."""
    if text.strip().lower() in ("", "none"):
        return []
    shapes = []
    for part in text.split(","):
        spec = part.strip().lower()
        try:
            a, b = [int(x) for x in spec.split("x")]
        except ValueError:
            raise UserError(f"{flag}: {part.strip()!r} is not two numbers AxB (e.g. {example})") from None
        if not (1 <= a <= 1 << 20 and 1 <= b <= 1 << 20):
            raise UserError(f"{flag}: {part.strip()!r} is outside 1..1048576")
        shapes.append((a, b))
    return shapes


def interleaved_us(ways: dict, args: GemmArgs) -> dict:
    """Median µs per call of each of `ways` (each takes the copy to use): `args.warmup` untimed rounds,
    then `args.reps` timed ones, the ways interleaved, each call on the next copy, each way in turn on
    all the copies."""
    # Where the number of ways and --copies share a factor, taking the next copy each call would give
    # each way only some of the copies (with 2 ways and 2 copies, one each, always in cache): each
    # time the calls come back to the copy and way they began with, they step one copy further.
    period = math.lcm(len(ways), args.copies)
    calls = 0
    for _ in range(args.warmup):
        for f in ways.values():
            f((calls + calls // period) % args.copies)
            calls += 1
    times = {k: [] for k in ways}
    for _ in range(args.reps):
        for k, f in ways.items():
            i = (calls + calls // period) % args.copies
            calls += 1
            t0 = time.perf_counter()
            f(i)
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(t) * 1e6 for k, t in times.items()}


def cell(times: dict, way: str, width: int) -> str:
    if way not in times:
        return f"{'n/a':>{width}}"
    return f"{times[way]:>{width}.1f}"


def comparison(times: dict, ways: dict, base: str, width: int) -> tuple[str, str]:
    """(base µs ÷ kernel µs, right-aligned in `width`; the largest |kernel - base| of one call, in 11), both
    "n/a" without the kernel: no figure where nothing was compared."""
    if "kernel" not in ways:
        return f"{'n/a':>{width}}", f"{'n/a':>11}"
    speed_up = times[base] / times["kernel"]
    ratio = f"{speed_up:>{width - 1}.2f}x"
    difference = ways["kernel"](0) - ways[base](0)
    return ratio, f"{difference.abs().max().item():>11.2e}"


def gemm_table(shapes: list[tuple[int, int]], rows: list[int], args: GemmArgs, g: torch.Generator):
    kernels = cpu_kernels.unavailable() is None
    print(f"{'weight':>11} {'rows':>5} {'MKL µs':>9} {'kernel µs':>10} {'MKL/kernel':>10} "
          f"{'max |diff|':>11}  install uses")
    for out, inp in shapes:
        ws = []  # the copies of the weight, scaled as a layer's
        for _ in range(args.copies):
            ws.append(torch.randn(out, inp, generator=g) / inp ** 0.5)
        fits = kernels and out % cpu_kernels.PANEL == 0
        panels = []
        uses = "MKL"
        if fits:
            panels = [torch.ops.dspark.panels(w) for w in ws]
            uses = "kernel"
        for r in rows:
            x = torch.randn(r, inp, generator=g)
            ways = {"mkl": lambda i: F.linear(x, ws[i])}
            if fits:
                ways["kernel"] = lambda i: torch.ops.dspark.panel_linear(x, panels[i], None)
            times = interleaved_us(ways, args)
            ratio, diff = comparison(times, ways, "mkl", 10)
            mkl = cell(times, "mkl", 9)
            kernel = cell(times, "kernel", 10)
            print(f"{out:>5}x{inp:<5} {r:>5} {mkl} {kernel} {ratio} {diff}  {uses}", flush=True)


def attention_table(sizes: list[tuple[int, int]], H: int, Hkv: int, hd: int, args: GemmArgs,
                    g: torch.Generator):
    """SDPA and the few-token kernel per TOKENSxKEYS."""
    from model import attend_cached, cache_bias
    kernels = cpu_kernels.unavailable() is None
    print(f"attention, {H} query heads, {Hkv} K/V heads, head dim {hd}")
    print(f"{'tokens':>7} {'keys':>6} {'SDPA µs':>9} {'kernel µs':>10} {'SDPA/kernel':>11} "
          f"{'max |diff|':>11}  install uses")
    for T, S in sizes:
        qs = []
        kv = []  # each copy's cache row of [k; v] heads, as k and v views
        for _ in range(args.copies):
            qs.append(torch.randn(1, T, H, hd, generator=g))
            cache = torch.randn(1, S, 2 * Hkv, hd, generator=g)
            kv.append((cache[:, :, :Hkv], cache[:, :, Hkv:]))
        positions = torch.arange(S - T, S)  # the tokens are the cache's last T positions
        allowed = positions[:, None] >= torch.arange(S)
        bias = cache_bias(allowed[None], 1, torch.float32)
        ways = {"sdpa": lambda i: attend_cached(qs[i], *kv[i], bias)}
        if kernels:
            ways["kernel"] = lambda i: torch.ops.dspark.cached_attention(qs[i], *kv[i], bias)
        times = interleaved_us(ways, args)
        ratio, diff = comparison(times, ways, "sdpa", 11)
        uses = "SDPA"
        if kernels and T <= cpu_kernels.ATTENTION_MAX_TOKENS:
            uses = "kernel"
        sdpa = cell(times, "sdpa", 9)
        kernel = cell(times, "kernel", 10)
        print(f"{T:>7} {S:>6} {sdpa} {kernel} {ratio} {diff}  {uses}", flush=True)


def check_memory(args: GemmArgs, shapes: list, rows: list[int], attention: list, heads: list[int], free: int):
    """Refuse a table row whose tensors do not fit in `free` bytes (0: unknown), before any is built."""
    if not free:
        return
    H, Hkv, hd = heads
    need = {}  # the flag's value: the float32 bytes its row holds at once
    for out, inp in shapes:
        weights = 2 * args.copies * out * inp  # the copies, and as many in panels
        need[f"--shapes {out}x{inp}"] = 4 * (weights + max(rows) * (inp + out))
    for T, S in attention:
        need[f"--attention {T}x{S}"] = 4 * args.copies * (T * H + S * 2 * Hkv) * hd
    for what, nbytes in need.items():
        if nbytes > free:
            raise UserError(f"{what}: needs {nbytes / 2**30:.1f} GiB at --copies {args.copies}; "
                            f"{free / 2**30:.1f} GiB are free (fewer --copies, or a smaller shape)")


def run(args: GemmArgs) -> int:
    check_ranges(args, threads="[1, 1024]", reps="[1, 100000]", warmup="[0, 100000]", seed=SEED_RANGE,
                 copies="[1, 1024]")
    shapes = parse_shapes(args.shapes)
    attention = parse_shapes(args.attention, "--attention", "8x204")
    heads = parse_ints(args.heads, "--heads")
    if len(heads) != 3 or min(heads) < 1 or heads[0] % heads[1] or heads[2] % cpu_kernels.PANEL:
        raise UserError(f"--heads {args.heads}: must be H,HKV,HD with H a multiple of HKV and HD of "
                        f"{cpu_kernels.PANEL}")
    if any(t > s for t, s in attention):
        raise UserError(f"--attention {args.attention}: TOKENS must not exceed KEYS (the tokens are cache positions)")
    rows = parse_ints(args.rows, "--rows")
    if any(r < 1 or r > 65536 for r in rows):
        raise UserError(f"--rows {args.rows}: each must be in 1..65536")
    check_memory(args, shapes, rows, attention, heads, free_memory("cpu"))
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(args.seed)
    why = cpu_kernels.unavailable()
    wall = time.perf_counter()
    cpu = time.process_time()
    header = (f"{device_name('cpu')}, torch {torch.__version__}, float32; median µs of {args.reps} interleaved "
              f"calls, each on the next of {args.copies} copies")
    if why:
        header += f"; the CPU kernels are unavailable: {why}"
    print(header)
    if shapes:
        gemm_table(shapes, rows, args, g)
    if attention:
        attention_table(attention, *heads, args, g)
    print(f"process: {time.process_time() - cpu:.1f} s CPU, {time.perf_counter() - wall:.1f} s wall")
    return 0


def main(argv=None) -> int:
    return cli_main(GemmArgs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
