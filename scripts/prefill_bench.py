"""Prefill: eager, or compiled over a few prompt-length buckets? Measures both, in one process.

    python scripts/prefill_bench.py --threads 1 --lengths 64,128,256 --batch-sizes 1,4

For each prompt length L (each one a bucket: a compiled prefill pads prompts up to it) and batch
size it times the prefill forward (target with capture + the drafter's context write) eager and
compiled (`compiling.compiled`: the project's recipe for the device), as the median of
`--reps` calls after one untimed, and the compile seconds each bucket costs. A compiled prefill
pays when (eager - compiled) x prefills exceeds the compile seconds of the buckets it needs.
Model: bench.py's constructed ~35M pair on CPU, or `--model qwen3-8b` (random weights) on cuda.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import bigram_pair  # noqa: E402
from common import (UserError, check_ranges, cli_main, device_name, parse_ints, resolve_device,  # noqa: E402
                    resolve_dtype, sync)
from drafter import random_drafter  # noqa: E402
from model import PRESETS, random_target  # noqa: E402
from compiling import compiled  # noqa: E402


@dataclass
class PrefillArgs:
    """Eager vs bucket-compiled prefill, side by side."""

    model: str = "bigram-35m"
    """bigram-35m (the constructed CPU pair) or a random-weight preset: qwen3-4b, qwen3-8b, qwen3-14b."""
    device: Literal["cpu", "cuda"] = "cpu"
    """Where to run."""
    lengths: str = "64,128,256"
    """Comma-separated prompt lengths (the buckets)."""
    batch_sizes: str = "1,4"
    """Comma-separated batch sizes."""
    reps: int = 5
    """Timed calls per measurement (the median is reported)."""
    threads: Optional[int] = None
    """torch threads on cpu (default: torch's own)."""


def prefill_forward(target, drafter, tokens, positions, last):
    """What `speculate.prefill` runs on the device: the target with capture, the context write."""
    logits, features = target(tokens, positions, capture=drafter.cfg.target_layer_ids, logits_index=last)
    drafter.commit_context(features, positions)
    return logits


def median_seconds(fn, device, reps: int) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def run(args: PrefillArgs):
    lengths = parse_ints(args.lengths, "--lengths", positive=True, distinct=True)
    batches = parse_ints(args.batch_sizes, "--batch-sizes", positive=True, distinct=True)
    check_ranges(args, reps="[1, inf)", threads="[1, inf)")
    if args.model != "bigram-35m" and args.model not in PRESETS:
        raise UserError(f"--model {args.model!r}: unknown (bigram-35m, {', '.join(PRESETS)})")
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)
    dtype = resolve_dtype(None, dev)
    if args.model == "bigram-35m":
        target, drafter = bigram_pair(dev, dtype)
    else:
        target = random_target(args.model, dev, dtype)
        drafter = random_drafter(target)
    print(f"# {args.model}, {dtype}, {device_name(dev)}, torch {torch.__version__}")
    print("| batch | prompt tokens | eager ms | compiled ms | compiled / eager | compile s |")
    print("|---|---|---|---|---|---|")
    for B in batches:
        target.setup_caches(B, max(lengths) + 16)
        drafter.setup_caches(B, max(lengths) + 16)
        fast = compiled(prefill_forward, dev)
        for L in lengths:
            tokens = torch.randint(0, target.args.vocab_size, (B, L), device=dev)
            positions = torch.arange(L, device=dev).expand(B, L)
            last = torch.full((B,), L - 1, device=dev)
            eager_s = median_seconds(lambda: prefill_forward(target, drafter, tokens, positions, last), dev, args.reps)
            t0 = time.perf_counter()
            fast(target, drafter, tokens, positions, last)
            sync(dev)
            compile_s = time.perf_counter() - t0
            compiled_s = median_seconds(lambda: fast(target, drafter, tokens, positions, last), dev, args.reps)
            print(f"| {B} | {L} | {1e3 * eager_s:.2f} | {1e3 * compiled_s:.2f} | {compiled_s / eager_s:.2f} | "
                  f"{compile_s:.1f} |", flush=True)


def main(argv=None) -> int:
    return cli_main(PrefillArgs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
