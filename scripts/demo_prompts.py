"""Held-out prompts for the demo pair's figures: JSON lines of {"prompt_ids": [...]}, cut from the
standard-library files listed in demo/heldout.txt (never trained on) with the demo tokenizer.

    python scripts/demo_prompts.py --out heldout.jsonl          # 20 prompts of 64 tokens
    python speculate.py --prompts-file heldout.jsonl --max-new-tokens 128 > out.txt   # demo pair, both ways

Prompt i comes from file i mod F (F held-out files, in heldout.txt order), starting at token
(i // F + 1) / (ceil(N / F) + 1) of the file — deterministic, spread over each file.
"""

import argparse
import json
import math
import os
import sys
import sysconfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from text import Tokenizer  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def heldout_prompts(num_prompts: int = 20, prompt_tokens: int = 64, demo: str = os.path.join(ROOT, "demo")):
    """The prompts as lists of token ids (read here, and by scripts/bench_concurrency.py). Raises OSError
    when a held-out file is missing (another Python version's standard library)."""
    tok = Tokenizer(os.path.join(demo, "target"))
    names = open(os.path.join(demo, "heldout.txt")).read().split()
    stdlib = sysconfig.get_paths()["stdlib"]
    ids = [tok.encode(open(os.path.join(stdlib, n), encoding="utf-8").read()) for n in names]
    per_file = math.ceil(num_prompts / len(names))
    prompts = []
    for i in range(num_prompts):
        doc = ids[i % len(names)]
        start = (i // len(names) + 1) * len(doc) // (per_file + 1)
        start = max(0, min(start, len(doc) - prompt_tokens))
        prompts.append(doc[start:start + prompt_tokens])
    return prompts


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--demo", default=os.path.join(ROOT, "demo"))
    a = ap.parse_args()
    prompts = heldout_prompts(a.num_prompts, a.prompt_tokens, a.demo)
    with open(a.out, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
    names = open(os.path.join(a.demo, "heldout.txt")).read().split()
    print(f"wrote {a.num_prompts} prompts of {a.prompt_tokens} tokens from {len(names)} held-out files to {a.out}")

if __name__ == "__main__":
    main()
