"""The demo drafter's data: the demo target's greedy continuations (its own dialect, what the drafter
must guess) of prompts cut from training file i mod F at seeded offsets, for `train.py --data-ids`.

    python scripts/demo_selfdata.py --target DIR/target --corpus CORPUS --out selfdata.jsonl
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import dataclass

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from support.cli import SEED_RANGE, UserError, check_ranges, cli_main
from support.files import atomic_write, check_outputs, directory_problem  # noqa: E402


@dataclass
class SelfDataArgs:
    """The demo target's greedy continuations of corpus prompts."""
    target: str
    """The demo target's directory (with tokenizer.json)."""
    corpus: str
    """The training corpus directory: its *.py files."""
    out: str
    """Where to write the records."""
    num_prompts: int = 2048
    """How many prompts (one record each)."""
    prompt_tokens: int = 64
    """Tokens per prompt."""
    new_tokens: int = 192
    """Greedy tokens the target writes after each prompt."""
    batch_size: int = 32
    """Prompts decoded together."""
    seed: int = 0
    """Seed of the prompts' offsets."""
    threads: int = 0
    """torch threads (0: torch's default)."""


def corpus_prompts(corpus: str, files: list[str], tokenizer, num: int, length: int, seed: int
                   ) -> list[list[int]]:
    """`num` windows of `length` tokens from the files of --corpus `corpus`, file i mod F for prompt i."""
    rng = random.Random(seed)
    docs = []
    longest = 0  # tokens of the longest file, for the error
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                ids = tokenizer.encode(f.read())
        except UnicodeDecodeError:
            raise UserError(f"{path}: not UTF-8 text") from None
        longest = max(longest, len(ids))
        if len(ids) >= length:
            docs.append(ids)
    if not docs:
        raise UserError(f"--corpus {corpus}: no *.py file has --prompt-tokens {length} tokens "
                        f"(the longest has {longest})")
    prompts = []
    for i in range(num):
        doc = docs[i % len(docs)]
        start = rng.randrange(0, len(doc) - length + 1)
        prompts.append(doc[start:start + length])
    return prompts


def run(args: SelfDataArgs) -> int:
    check_ranges(args, num_prompts="[1, 1000000]", prompt_tokens="[1, 4096]", new_tokens="[1, 4096]",
                 batch_size="[1, 1024]", seed=SEED_RANGE, threads="[0, 1024]")
    problem = directory_problem(args.corpus)
    if problem:
        raise UserError(f"--corpus {args.corpus}: {problem}")
    files = sorted(os.path.join(args.corpus, n) for n in os.listdir(args.corpus)
                   if n.endswith(".py") and os.path.isfile(os.path.join(args.corpus, n)))
    if not files:
        raise UserError(f"--corpus {args.corpus}: no *.py files")
    check_outputs({"--out": args.out}, inputs=[args.target, args.corpus])

    import torch

    from speculate import load, make_engine, requests_for
    from support import flags
    from support.flags import Settings
    if args.threads:
        torch.set_num_threads(args.threads)
    m = load(args.target)
    if m.tokenizer is None:
        raise UserError(f"--target {args.target}: no tokenizer.json")
    prompts = corpus_prompts(args.corpus, files, m.tokenizer, args.num_prompts, args.prompt_tokens, args.seed)
    context = args.prompt_tokens + args.new_tokens
    if context > m.target.args.max_position_embeddings:
        raise UserError(f"--prompt-tokens + --new-tokens = {context}: more than the target's context "
                        f"({m.target.args.max_position_embeddings})")
    s = Settings(max_new_tokens=args.new_tokens, temperature=0.0, ignore_eos=True, batch_size=args.batch_size)
    s = flags.check_settings(s, "cpu")
    engine = make_engine(m, None, prompts, s, verbose=False)
    requests = requests_for(prompts, 1)
    t0, done = time.perf_counter(), [0]

    def on_finish(req):
        done[0] += 1
        if done[0] % max(1, len(requests) // 20) == 0 or done[0] == len(requests):
            print(f"  {done[0]}/{len(requests)} continuations, {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    engine.generate(requests, args.new_tokens, on_finish=on_finish)
    lines = "".join(json.dumps({"prompt_ids": r.prompt_ids + r.output_ids}) + "\n" for r in requests)
    atomic_write(args.out, lines)
    tokens = sum(len(r.prompt_ids) + len(r.output_ids) for r in requests)
    print(f"self-distillation data: {len(requests)} records, {tokens:,} tokens, in {time.perf_counter() - t0:.0f} s "
          f"-> {args.out}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    return cli_main(SelfDataArgs, run, argv)


if __name__ == "__main__":
    sys.exit(main())
