"""The demo pair's text: the running Python's standard library, top-level *.py files, 5% held out.

    python scripts/demo_corpus.py --corpus /tmp/corpus --out /tmp/pair   # what scripts/train_demo.sh runs first

The files are `sorted(stdlib/*.py)`; file i is held out (never trained on) when i % 20 == 0. The
training files are copied into --corpus; --out receives heldout.txt (the held-out names) and
corpus.json, which says which corpus this was: the Python version, the file counts, and sha256
digests of the training and the held-out files. Another Python version has other files, so it builds
another pair; the digests tell them apart (scripts/demo_prompts.py refuses a standard library whose
held-out files differ from the pair's). One line on stdout says which corpus was used.
"""

from __future__ import annotations

import glob
import os
import platform
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import UserError, atomic_write, check_outputs, cli_main, read_json, write_json  # noqa: E402
from demo_prompts import files_digest  # noqa: E402

HOLD_OUT_EVERY = 20


@dataclass
class CorpusArgs:
    """Split the running Python's standard library into the demo pair's training and held-out files."""

    corpus: str
    """A new (or empty) directory to copy the training files into."""
    out: str
    """The pair's directory: heldout.txt and corpus.json are written here (made if missing)."""
    stdlib: Optional[str] = None
    """The standard library to read (default: the running Python's)."""
    same_as: Optional[str] = None
    """A corpus.json the new corpus must equal (training and held-out digests): for rebuilding only the
    drafter of an existing pair, whose target saw that corpus."""


def split(stdlib: str) -> tuple[list[str], list[str]]:
    """(training files, held-out files): paths, sorted."""
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if len(files) < HOLD_OUT_EVERY:
        raise UserError(f"{stdlib}: {len(files)} top-level *.py files; not a standard library (give --stdlib)")
    held = [f for i, f in enumerate(files) if i % HOLD_OUT_EVERY == 0]
    return [f for f in files if f not in held], held


def run(a: CorpusArgs):
    stdlib = a.stdlib or sysconfig.get_paths()["stdlib"]
    if os.path.exists(a.corpus) and (not os.path.isdir(a.corpus) or os.listdir(a.corpus)):
        raise UserError(f"--corpus {a.corpus}: exists and is not an empty directory")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise UserError(f"--out {a.out}: exists and is not a directory")
    listing, record = os.path.join(a.out, "heldout.txt"), os.path.join(a.out, "corpus.json")
    for path in (listing, record):  # another pair's record: its target saw that corpus
        if os.path.exists(path):
            raise UserError(f"--out {a.out}: already holds {os.path.basename(path)} (a pair's record); give a new "
                            f"directory")
    train, held = split(stdlib)
    os.makedirs(a.out, exist_ok=True)
    check_outputs({"heldout.txt": listing, "corpus.json": record}, inputs=[a.same_as])
    running = os.path.realpath(stdlib) == os.path.realpath(sysconfig.get_paths()["stdlib"])
    info = {"source": "the Python standard library's top-level *.py files, sorted; file i held out when "
                      f"i % {HOLD_OUT_EVERY} == 0", "stdlib": os.path.abspath(stdlib),
            # the version is known only of the running Python's own library
            "python": platform.python_version() if running else None,
            "implementation": platform.python_implementation() if running else None,
            "training_files": len(train), "training_bytes": sum(os.path.getsize(f) for f in train),
            "training_sha256": files_digest(train),
            "heldout_files": [os.path.basename(f) for f in held], "heldout_sha256": files_digest(held)}
    if a.same_as is not None:
        want = read_json(a.same_as)
        for key in ("training_sha256", "heldout_sha256"):
            if want.get(key) != info[key]:
                raise UserError(f"--same-as {a.same_as}: {key} differs (that pair was built from Python "
                                f"{want.get('python') or '?'}'s standard library, this is {info['python'] or '?'}'s "
                                f"at {stdlib})")
    os.makedirs(a.corpus, exist_ok=True)
    for f in train:
        shutil.copy(f, a.corpus)
    atomic_write(listing, "".join(name + "\n" for name in info["heldout_files"]))
    write_json(record, info)
    print(f"corpus: {'Python ' + info['python'] if info['python'] else 'the'} standard library ({stdlib}): "
          f"{len(train)} training files "
          f"({info['training_bytes'] / 1e6:.1f} MB, sha256 {info['training_sha256'][:12]}), {len(held)} held out "
          f"(sha256 {info['heldout_sha256'][:12]}); recorded in {record}", flush=True)


def main(argv: Optional[list[str]] = None) -> int:
    return cli_main(CorpusArgs, run, argv, inference=False)


if __name__ == "__main__":
    sys.exit(main())
