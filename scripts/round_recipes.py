"""The speculative round eager, compiled the old way, and compiled with the project's recipe.

    python scripts/round_recipes.py --threads 1 --repeats 5

One process, bench.py's constructed ~35M pair, one engine per way of running the round (all the
same size, so they share the target's cache buffers): eager (`--no-compile`), Inductor's default
mode without frozen weights (`--compile-mode default`, the CPU recipe before session 3), and the
default recipe (`compiling.compiled`: max-autotune, on CPU with the weights frozen into the
graph). Each engine is compiled and settled first; then --repeats timed runs in rotating order.
Prints, per engine, the median round time (decode seconds / rounds) with every run, and the
per-repeat ratios of each engine's round to the recipe's. Every engine must emit the same tokens.
"""

from __future__ import annotations

import os
import statistics
import sys
from dataclasses import dataclass
from typing import Literal, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import bigram_pair, side_engine, timed_generate  # noqa: E402
from common import check_ranges, cli_main, device_name, resolve_device, resolve_dtype  # noqa: E402

WAYS = {"eager": (False, None), "inductor-default": (True, "default"), "recipe": (True, None)}


@dataclass
class RecipeArgs:
    """Eager vs Inductor's default mode vs the project's compile recipe, for one speculative round."""

    device: Literal["cpu", "cuda"] = "cpu"
    """Where to run."""
    batch_size: int = 1
    """Rows decoded together."""
    prompt_len: int = 64
    """Tokens per (random) prompt."""
    max_new_tokens: int = 128
    """Tokens generated per request."""
    repeats: int = 5
    """Timed runs per engine, in rotating order; medians are reported."""
    threads: Optional[int] = None
    """torch threads on cpu (default: torch's own)."""
    seed: int = 0
    """Seed of the weights and prompts."""


def run(args: RecipeArgs):
    check_ranges(args, batch_size="[1, inf)", prompt_len="[1, inf)", max_new_tokens="[1, inf)", repeats="[1, inf)",
                 threads="[1, inf)")
    if args.threads:
        torch.set_num_threads(args.threads)
    dev = resolve_device(args.device)
    dtype = resolve_dtype(None, dev)
    target, drafter = bigram_pair(dev, dtype, args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(0, target.args.vocab_size - 1, (args.batch_size, args.prompt_len), generator=g).tolist()
    width = max(drafter.cfg.num_slots, drafter.cfg.num_drafts + 1)
    max_seq = args.prompt_len + args.max_new_tokens + 2 * width
    print(f"# bigram-35m, {dtype}, {device_name(dev)}, torch {torch.__version__}, batch {args.batch_size}, "
          f"{args.max_new_tokens} new tokens, {args.repeats} repeats", flush=True)
    engines = {}
    for way, (compile, mode) in WAYS.items():
        engines[way] = side_engine(target, drafter, args.batch_size, max_seq, dev, compile, mode)
        print(f"{way}: ready (compile {engines[way].compile_seconds:.1f} s)", flush=True)
    runs = {way: [] for way in WAYS}
    ways = list(WAYS)
    for rep in range(args.repeats):
        k = rep % len(ways)
        for way in ways[k:] + ways[:k]:
            runs[way].append(timed_generate(engines[way], prompts, args.max_new_tokens))
    for way in ways:
        if any(r["outputs"] != runs["recipe"][0]["outputs"] for r in runs[way]):
            raise AssertionError(f"{way} emitted different tokens than the recipe's round")
    round_ms = {way: [1e3 * r["decode_seconds"] / r["steps"] for r in runs[way]] for way in ways}
    print("| round | ms (median) | runs | ÷ recipe (median, range) | compile s |")
    print("|---|---|---|---|---|")
    for way in ways:
        ratios = [a / b for a, b in zip(round_ms[way], round_ms["recipe"])]
        print(f"| {way} | {statistics.median(round_ms[way]):.2f} | {', '.join(f'{x:.1f}' for x in round_ms[way])} | "
              f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f}) | "
              f"{engines[way].compile_seconds:.1f} |")


def main(argv=None) -> int:
    return cli_main(RecipeArgs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
