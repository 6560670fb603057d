"""The demo pair's text: the running Python's standard library, top-level *.py files, 5% held out.

    python scripts/demo_corpus.py --corpus /tmp/corpus --out /tmp/pair   # scripts/train_demo.sh's first step

File i of `sorted(stdlib/*.py)` is held out when i % 20 == 0; the others are copied into --corpus.
--out gets heldout.txt and corpus.json: the Python version, file counts and digests of both parts
(another Python's library builds another pair, and the digests tell them apart).
"""

from __future__ import annotations

import contextlib
import glob
import os
import platform
import shutil
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from typing import Optional

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from demo_prompts import files_digest  # noqa: E402

from support.cli import UserError, cli_main, refuse_standard_output
from support.files import atomic_write, check_input, check_outputs, read_json, write_json  # noqa: E402
from support.trainer import folder_write_problem  # noqa: E402

HOLD_OUT_EVERY = 20


@dataclass
class CorpusArgs:
    """Split the running Python's standard library into the demo pair's training and held-out files."""

    corpus: str
    """A new (or empty) directory for the training files (not inside --out: all of it is training text)."""
    out: str
    """The pair's directory, for heldout.txt and corpus.json."""
    stdlib: Optional[str] = None
    """The standard library to read (default: the running Python's)."""
    same_as: Optional[str] = None
    """A corpus.json the new corpus must equal (rebuilding only a pair's drafter)."""


def split(stdlib: str, given: bool) -> tuple[list[str], list[str]]:
    """(training files, held-out files) of `stdlib` (`given`: by --stdlib)."""
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    if len(files) < HOLD_OUT_EVERY:
        problem = f"{len(files)} top-level *.py files; not a standard library"
        if given:
            raise UserError(f"--stdlib {stdlib}: {problem}")
        raise UserError(f"{stdlib}: {problem} (give --stdlib)")
    train = []
    held = []
    for i, f in enumerate(files):
        if i % HOLD_OUT_EVERY == 0:
            held.append(f)
        else:
            train.append(f)
    return train, held


def check_folder(path: str, flag: str, beside: bool = False):
    """The nearest existing folder of `path` (`beside`: its parent's) takes files."""
    folder = os.path.realpath(path)
    if beside:
        folder = os.path.dirname(folder)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: cannot be made ({folder} is not a directory)")
    problem = folder_write_problem(folder)  # a read-only folder or filesystem
    if problem:
        raise UserError(f"{flag} {path}: cannot write in {folder} ({problem})")


def run(a: CorpusArgs):
    if a.stdlib is not None and not a.stdlib.strip():
        raise UserError("--stdlib: empty; give a standard library's folder, or leave the flag out")
    stdlib = a.stdlib or sysconfig.get_paths()["stdlib"]
    listing, record = check_paths(a)
    train, held = split(stdlib, given=a.stdlib is not None)
    info = corpus_record(stdlib, train, held)
    if a.same_as is not None:
        want = read_json(a.same_as)
        for key in ("training_sha256", "heldout_sha256"):
            if key not in want:
                raise UserError(f"--same-as {a.same_as}: not a corpus.json (no {key})")
            if want[key] != info[key]:
                built_from = want.get("python") or "?"
                this = info["python"] or "?"
                raise UserError(f"--same-as {a.same_as}: {key} differs (that pair was built from Python "
                                f"{built_from}'s standard library, this is {this}'s at {stdlib})")
    write_corpus(a, train, info)
    whose = "the"
    if info["python"]:
        whose = "Python " + info["python"]
    megabytes = info["training_bytes"] / 1e6
    print(f"corpus: {whose} standard library ({stdlib}): {len(train)} training files "
          f"({megabytes:.1f} MB, sha256 {info['training_sha256'][:12]}), {len(held)} held out "
          f"(sha256 {info['heldout_sha256'][:12]}); recorded in {record}", flush=True)


def check_paths(a: CorpusArgs) -> tuple[str, str]:
    """--corpus and --out before anything is read: separate, new, and writable. Returns the paths of the
    held-out listing and the record."""
    for flag, path in (("--corpus", a.corpus), ("--out", a.out)):
        if not path.strip():
            raise UserError(f"{flag}: empty path")
        refuse_standard_output(path, flag, "directory")
    if a.same_as is not None:
        check_input(a.same_as, "--same-as")
    if os.path.exists(a.corpus) and (not os.path.isdir(a.corpus) or os.listdir(a.corpus)):
        raise UserError(f"--corpus {a.corpus}: exists and is not an empty directory")
    if os.path.exists(a.out) and not os.path.isdir(a.out):
        raise UserError(f"--out {a.out}: exists and is not a directory")
    corpus = os.path.realpath(a.corpus)
    out = os.path.realpath(a.out)
    nested = corpus.startswith(out + os.sep) or out.startswith(corpus + os.sep)
    if corpus == out or nested:
        raise UserError(f"--out {a.out}: is (inside, or holds) --corpus {a.corpus}, whose every file is "
                        f"training text; give them separate directories")
    listing = os.path.join(a.out, "heldout.txt")
    record = os.path.join(a.out, "corpus.json")
    for path in (listing, record):  # another pair's record: its target saw that corpus
        if os.path.exists(path):
            raise UserError(f"--out {a.out}: already holds {os.path.basename(path)} (a pair's record); "
                            f"give a new directory")
    check_folder(a.corpus, "--corpus", beside=True)
    if os.path.ismount(corpus):
        raise UserError(f"--corpus {a.corpus}: is a mount point (the corpus is made beside it and renamed "
                        f"to it); give a new folder inside it")
    check_folder(a.out, "--out")
    if os.path.isdir(a.out):
        check_outputs({"heldout.txt": listing, "corpus.json": record}, inputs=[a.same_as])
    return listing, record


def corpus_record(stdlib: str, train: list[str], held: list[str]) -> dict:
    """corpus.json: where the files came from, and digests of the training and held-out files. The
    Python version only when `stdlib` is the running interpreter's (another's is not known here)."""
    running = os.path.realpath(stdlib) == os.path.realpath(sysconfig.get_paths()["stdlib"])
    python = None
    implementation = None
    if running:
        python = platform.python_version()
        implementation = platform.python_implementation()
    source = ("the Python standard library's top-level *.py files, sorted; file i held out when "
              f"i % {HOLD_OUT_EVERY} == 0")
    training_bytes = sum(os.path.getsize(f) for f in train)
    heldout_names = [os.path.basename(f) for f in held]
    return {"source": source, "stdlib": os.path.abspath(stdlib), "python": python,
            "implementation": implementation, "training_files": len(train), "training_bytes": training_bytes,
            "training_sha256": files_digest(train), "heldout_files": heldout_names,
            "heldout_sha256": files_digest(held)}


def missing_top(path: str) -> Optional[str]:
    """The outermost folder of `path` that does not exist yet (None: it exists)."""
    top = None
    p = os.path.realpath(path)
    while not os.path.exists(p):
        top = p
        p = os.path.dirname(p)
    return top


def write_corpus(a: CorpusArgs, train: list[str], info: dict):
    """Copy beside --corpus, write the record, rename: a run stopped on the way removes what it made."""
    corpus = os.path.realpath(a.corpus)
    listing = os.path.join(a.out, "heldout.txt")
    record = os.path.join(a.out, "corpus.json")
    made = []  # the folders this run makes
    for path in (a.out, corpus):
        top = missing_top(path)
        if top is not None:
            made.append(top)
    tmp = None
    done = False
    try:
        os.makedirs(a.out, exist_ok=True)
        os.makedirs(os.path.dirname(corpus), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(corpus), prefix="." + os.path.basename(corpus) + ".",
                               suffix=".tmp")
        for f in train:
            shutil.copy(f, tmp)
        atomic_write(listing, "".join(name + "\n" for name in info["heldout_files"]))
        write_json(record, info)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 -> makedirs' mode
        try:
            os.replace(tmp, corpus)  # over an empty --corpus too
        except OSError as e:
            raise UserError(f"--corpus {a.corpus}: cannot be replaced by the copy ({e.strerror})") from None
        done = True
    finally:
        if not done:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            for path in (listing, record):  # absent before this run (checked)
                if os.path.exists(path):
                    os.remove(path)
            for top in made:  # the folders this run made, if still empty
                for folder, _, _ in os.walk(top, topdown=False):
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)


def main(argv: Optional[list[str]] = None) -> int:
    return cli_main(CorpusArgs, run, argv, inference=False)


if __name__ == "__main__":
    sys.exit(main())
