"""The demo pair's held-out prompts (committed as demo/heldout.jsonl), cut from the standard-library
files it never trained on: prompt i is T tokens of held-out file i mod F, at (i // F + 1) / (ceil(N / F)
+ 1) of it, moved back to end by the file's end (a file shorter than T: all of it, a shorter prompt).
T stays below the target's context (max_position_embeddings), leaving a token to decode. A library whose
held-out files differ from demo/corpus.json's is refused.

    python scripts/demo_prompts.py --out my_heldout.jsonl
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from support.cli import UserError, check_ranges, cli_main
from support.configs import target_args  # noqa: E402
from support.files import atomic_write, check_outputs, read_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(ROOT, "demo")


@dataclass
class PromptArgs:
    """Cut the demo pair's held-out prompts from the standard-library files in demo/heldout.txt."""

    out: str
    """Where to write the prompts (JSON lines)."""
    num_prompts: int = 20
    """How many prompts."""
    prompt_tokens: int = 64
    """Tokens per prompt (demo tokenizer; fewer from a shorter file), below the target's context."""
    demo: str = DEMO
    """The demo pair's directory (target/, heldout.txt, corpus.json)."""
    stdlib: Optional[str] = None
    """The standard library to read (default: the running Python's)."""


def files_digest(paths: list[str]) -> str:
    """sha256 over each file's name, length and bytes, in order."""
    h = hashlib.sha256()
    for p in paths:
        with open(p, "rb") as f:
            data = f.read()
        name = os.path.basename(p).encode()
        length = str(len(data)).encode()
        h.update(name + b"\0" + length + b"\0" + data)
    return h.hexdigest()


def heldout_files(demo: str = DEMO, stdlib: Optional[str] = None) -> list[str]:
    """The held-out files in `stdlib`, checked."""
    stdlib = stdlib or sysconfig.get_paths()["stdlib"]
    listing = os.path.join(demo, "heldout.txt")
    if not os.path.isfile(listing):
        raise UserError(f"{listing}: not found (the list of held-out files that scripts/train_demo.sh writes)")
    with open(listing, encoding="utf-8") as f:
        names = f.read().split()
    if not names:
        raise UserError(f"{listing}: lists no files")
    corpus = os.path.join(demo, "corpus.json")
    built = {}  # the pair's corpus record, if any
    if os.path.isfile(corpus):
        built = read_json(corpus)
    which = "the one the pair was built from"
    if built.get("python"):
        which = f"Python {built['python']}'s"
    paths = [os.path.join(stdlib, n) for n in names]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise UserError(f"{missing[0]}: held-out file not in this standard library ({len(missing)} of "
                        f"{len(names)} missing; the demo was cut from {which}); give --stdlib, or use the "
                        f"committed demo/heldout.jsonl")
    if "heldout_sha256" in built and files_digest(paths) != built["heldout_sha256"]:
        raise UserError(f"{stdlib}: its held-out files differ from {which} ({corpus}: heldout_sha256); "
                        f"give --stdlib, or use the committed demo/heldout.jsonl")
    return paths


def heldout_prompts(num_prompts: int = 20, prompt_tokens: int = 64, demo: str = DEMO,
                    stdlib: Optional[str] = None) -> list[dict]:
    """Records {"prompt_ids", "source", "start"}."""
    from support.text import Tokenizer

    paths = heldout_files(demo, stdlib)
    tok = Tokenizer(os.path.join(demo, "target"))
    ids = []
    for p in paths:
        try:
            with open(p, encoding="utf-8") as f:
                ids.append(tok.encode(f.read()))
        except (OSError, UnicodeDecodeError) as e:
            why = getattr(e, "strerror", None) or e.reason
            raise UserError(f"{p}: cannot read it as UTF-8 text ({why})") from None
    per_file = math.ceil(num_prompts / len(paths))
    prompts = []
    for i in range(num_prompts):
        doc = ids[i % len(paths)]
        start = (i // len(paths) + 1) * len(doc) // (per_file + 1)
        start = max(0, min(start, len(doc) - prompt_tokens))
        source = os.path.basename(paths[i % len(paths)])
        prompts.append({"prompt_ids": doc[start:start + prompt_tokens], "source": source, "start": start})
    return prompts


def run(a: PromptArgs):
    check_ranges(a, num_prompts="[1, 100000]", prompt_tokens="[1, 100000]")
    if a.stdlib is not None and not a.stdlib.strip():
        raise UserError("--stdlib: empty; give a standard library's folder, or leave the flag out")
    inputs = [os.path.join(a.demo, name) for name in ("heldout.txt", "corpus.json", "target")]
    inputs += heldout_files(a.demo, a.stdlib)
    config = os.path.join(a.demo, "target", "config.json")
    context = target_args(read_json(config), config).max_position_embeddings
    if a.prompt_tokens >= context:
        raise UserError(f"--prompt-tokens {a.prompt_tokens}: at most {context - 1}, leaving a token to decode in "
                        f"the target's context of {context} ({config}: max_position_embeddings)")
    check_outputs({"--out": a.out}, inputs=inputs)
    prompts = heldout_prompts(a.num_prompts, a.prompt_tokens, a.demo, a.stdlib)
    lines = [json.dumps(p) + "\n" for p in prompts]
    atomic_write(a.out, "".join(lines))
    files = len({p["source"] for p in prompts})
    print(f"wrote {a.num_prompts} prompts of up to {a.prompt_tokens} tokens from {files} held-out files "
          f"to {a.out}")


def main(argv: Optional[list[str]] = None) -> int:
    return cli_main(PromptArgs, run, argv, inference=False)


if __name__ == "__main__":
    sys.exit(main())
