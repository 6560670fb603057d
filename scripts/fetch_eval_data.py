"""Rebuild the benchmark prompt files in data/eval/ from their public sources.

    python scripts/fetch_eval_data.py --list               # what it knows, where each comes from
    python scripts/fetch_eval_data.py alpaca               # write data/eval/alpaca.jsonl
    python scripts/fetch_eval_data.py --out-dir /tmp/eval  # every dataset, somewhere else
    python scripts/fetch_eval_data.py gsm8k --force        # replace an existing file

One {"turns": [str, ...]} per line, as eval.py reads. The conversions (`*_record`) reproduce the shipped
files byte for byte from the same upstream rows; a file that differs is reported, not an error
(data/eval/README.md: sources and licenses). Needs a network and `pip install datasets`, imported only
when a download starts. Files are never replaced without --force and are written whole or not at all
(a download that fails leaves no folder it made).
Exit status: 0; 2 on a usage error (one line); 1 if a download fails; 130 / 143 on SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "data", "eval")

# Record conversions: one upstream row -> {"turns": [...]}. MATH_SUFFIX follows every math question.
MATH_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."


def gsm8k_record(row: dict) -> dict:
    """openai/gsm8k: the `question`, then the step-by-step instruction."""
    return {"turns": [row["question"] + MATH_SUFFIX]}


def math_record(row: dict) -> dict:
    """MATH-500 and the AIME sets: the `problem`, then the step-by-step instruction."""
    return {"turns": [row["problem"] + MATH_SUFFIX]}


def alpaca_record(row: dict) -> dict:
    """tatsu-lab/alpaca: the `instruction`; a non-empty `input` follows under an "Input:" header."""
    text = row["instruction"]
    if row.get("input"):
        text = f"{text}\n\nInput:\n{row['input']}"
    return {"turns": [text]}


def mt_bench_record(row: dict) -> dict:
    """HuggingFaceH4/mt_bench_prompts: `prompt` already is the list of user turns (two per question)."""
    turns = row["prompt"]
    if not isinstance(turns, list):
        raise ValueError(f"mt-bench: 'prompt' must be a list of turns, got {type(turns).__name__}")
    return {"turns": list(turns)}


def humaneval_record(row: dict) -> dict:
    """openai/openai_humaneval: the function stub and docstring (`prompt`) in a python code fence."""
    head = "Write a solution to the following problem and make sure that it passes the tests:"
    return {"turns": [f"{head}\n```python\n{row['prompt']}\n```"]}


def mbpp_record(row: dict) -> dict:
    """google-research-datasets/mbpp, sanitized config: the task description (`prompt`) alone."""
    return {"turns": [row["prompt"]]}


def lbpp_record(row: dict) -> dict:
    """CohereLabs/lbpp (python): the `instruction` alone."""
    return {"turns": [row["instruction"]]}


def swe_bench_record(row: dict) -> dict:
    """princeton-nlp/SWE-bench_Lite: the issue text (`problem_statement`) between a header and a request."""
    text = (f"Problem Statement:\n{row['problem_statement']}\n"
            "Please fix the issue described above.")
    return {"turns": [text]}


LCB_HEAD = ("You are an expert Python programmer. "
            "You will be given a question (problem specification) and "
            "will generate a correct Python program that matches the specification "
            "and passes all tests. "
            "You will NOT return anything except for the program")
LCB_TAIL = "### Answer: (use the provided format with backticks)"


def livecodebench_record(row: dict) -> dict:
    """livecodebench/code_generation_lite: its prompt around `question_content`, and `starter_code`
    or a placeholder."""
    starter = row.get("starter_code") or ""
    if starter:
        fmt, code = "Use the following code structure:", starter
    else:
        fmt, code = "Write your code in the following format:", "# YOUR CODE HERE"
    text = (f"{LCB_HEAD}\n\n### Question:\n{row['question_content']}\n\n"
            f"### Format: {fmt}\n```python\n{code}\n```\n\n{LCB_TAIL}")
    return {"turns": [text]}


def arena_hard_record(row: dict) -> dict:
    """lmarena-ai/arena-hard-auto, data/arena-hard-v2.0/question.jsonl: the `prompt`."""
    return {"turns": [row["prompt"]]}


def check_record(record: dict, where: str) -> dict:
    """A record eval.py reads: turns of text, none blank, each valid Unicode."""
    turns = record.get("turns") if isinstance(record, dict) else None
    strings = isinstance(turns, list) and all(isinstance(t, str) and t.strip() for t in turns)
    if not strings or not turns:
        raise ValueError(f"{where}: expected a non-empty list of non-blank strings in 'turns', "
                         f"got {repr(turns)[:200]}")
    for t in turns:
        try:
            t.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: a turn is not valid Unicode (a lone surrogate)") from None
    return record


def record_line(record: dict) -> str:
    return json.dumps(record, ensure_ascii=False) + "\n"


@dataclass(frozen=True)
class Source:
    name: str                       # output file <name>.jsonl
    repo: str                       # Hugging Face dataset id
    split: str
    convert: Callable[[dict], dict]
    config: Optional[str] = None    # datasets config (subset) name
    # read these files of the repo instead of load_dataset (jsonl or parquet)
    files: tuple[str, ...] = ()
    sha256: Optional[str] = None    # the copy shipped in data/eval/, when there is one
    note: str = ""

    def describe(self) -> str:
        if self.files:
            where = ", ".join(self.files)
        else:
            where = f"config={self.config or '-'} split={self.split}"
        return f"{self.name:14s} {self.repo}  ({where}){'  ' + self.note if self.note else ''}"


SOURCES = (
    Source("gsm8k", "openai/gsm8k", "test", gsm8k_record, config="main",
           sha256="63330a20a17f416fdfca978ebcd5124f8da5546affb3a079b65a6e8daf42b41f"),
    Source("math500", "HuggingFaceH4/MATH-500", "test", math_record,
           sha256="4f530d9d3126dca41c12a96e78ec0dd460b7202052ba86101c4da159cea33aac"),
    Source("aime24", "HuggingFaceH4/aime_2024", "train", math_record,
           sha256="98b2449571c23886d67f99224ecdb4e48ad6cf74955b2908f70fbea9d66dead7"),
    Source("aime25", "MathArena/aime_2025", "train", math_record,
           sha256="b8835996839caa1d982c5bb9ecaeca636424f0b8ed9f33a40b084feb1c1766d0"),
    Source("alpaca", "tatsu-lab/alpaca", "train", alpaca_record,
           note="not shipped: all 52,002 rows (eval.py samples 500 by its seeded shuffle)"),
    Source("mt-bench", "HuggingFaceH4/mt_bench_prompts", "train", mt_bench_record,
           sha256="df05defbcea350dff39f7d2996a7cba8a029e6e06069dfcdab11ceb998d743b0"),
    Source("humaneval", "openai/openai_humaneval", "test", humaneval_record,
           sha256="7aaed6a3987007ecee4851ee4572fde214aa2a36ae83fa21be9c5f443aa71675"),
    Source("mbpp", "google-research-datasets/mbpp", "test", mbpp_record, config="sanitized",
           sha256="019b981f7122e39ce58866cf93f4206511c72532cb537bbaf298753a0f128ba7"),
    Source("lbpp", "CohereLabs/lbpp", "test", lbpp_record, files=("python/test.parquet",),
           sha256="0b973ef7ec26993896884a2cbfde640706390261778b4dc7a221ccb95b539ae2"),
    Source("swe-bench", "princeton-nlp/SWE-bench_Lite", "test", swe_bench_record,
           sha256="fb8f2e01529b5093b193797e449522a0fd6d51f61be0885a30a622fb23564ba8"),
    Source("livecodebench", "livecodebench/code_generation_lite", "test", livecodebench_record,
           files=tuple(f"test{i}.jsonl" for i in ("", 2, 3, 4, 5, 6)),
           sha256="40ed536492f331ac27b3b68506072366ca1d3a304b92c31d822574e778c87318",
           note="downloads several GB (the files carry the test cases)"),
    Source("arena-hard-v2", "lmarena-ai/arena-hard-auto", "test", arena_hard_record,
           files=("data/arena-hard-v2.0/question.jsonl",),
           sha256="e5fcce94ffb1a2ef2082b5c63ac36608f2b7faf00da13ecb94ce2adc649b7b91"),
)
BY_NAME = {s.name: s for s in SOURCES}


class UsageError(Exception):
    """A mistake of the caller: exit status 2, one line on stderr."""


class Interrupted(KeyboardInterrupt):
    """SIGINT / SIGTERM, as a KeyboardInterrupt: no library's `except Exception` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame):
    raise Interrupted(signum)


def check_output_file(path: str):
    """Before any download: a regular file (links followed), or nothing yet."""
    real = os.path.realpath(path)
    if os.path.isdir(real):
        raise UsageError(f"{path}: is a directory, not a file "
                         "(remove it, or give another --out-dir)")
    if os.path.exists(real) and not os.path.isfile(real):
        raise UsageError(f"{path}: is a device or a pipe, not a file; "
                         "remove it, or give another --out-dir")


def _need(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise UsageError(f"this needs the {package!r} package: pip install datasets") from None


def packages_needed(src: Source) -> tuple[str, ...]:
    if not src.files:
        return ("datasets",)
    has_parquet = any(f.endswith(".parquet") for f in src.files)
    return ("huggingface_hub", "pyarrow") if has_parquet else ("huggingface_hub",)


def check_packages(sources: Iterable[Source]):
    """A missing package, before anything is downloaded."""
    import importlib.util

    for src in sources:
        for name in packages_needed(src):
            if importlib.util.find_spec(name) is None:
                raise UsageError(f"{src.name}: needs the {name!r} package: pip install datasets")


def upstream_rows(src: Source) -> Iterator[dict]:
    """The source's rows, in the dataset's own order (needs a network)."""
    if not src.files:
        datasets = _need("datasets")
        args = (src.repo, src.config) if src.config else (src.repo,)
        yield from datasets.load_dataset(*args, split=src.split)
        return
    hub = _need("huggingface_hub")
    for name in src.files:
        path = hub.hf_hub_download(src.repo, filename=name, repo_type="dataset")
        if name.endswith(".parquet"):
            yield from _need("pyarrow.parquet").read_table(path).to_pylist()
            continue
        with open(path, encoding="utf-8-sig") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{src.repo} {name}:{number}: malformed JSON ({e.msg})") from None
                yield row


def write_records(src: Source, rows: Iterable[dict], path: str,
                  max_rows: Optional[int] = None) -> tuple[int, str]:
    """`rows` converted into `path`, atomically -> (records written, the file's sha256). Not written (a
    download that fails or is stopped), the folders made for it are removed again."""
    folder = os.path.dirname(os.path.abspath(path))
    made = []  # the folders this call makes, innermost first
    missing = folder
    while not os.path.exists(missing):
        made.append(missing)
        missing = os.path.dirname(missing)
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    digest, count = hashlib.sha256(), 0
    written = False
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            for i, row in enumerate(rows):
                if max_rows is not None and count >= max_rows:
                    break
                where = f"{src.repo} row {i}"
                try:
                    record = src.convert(row)
                except (KeyError, TypeError, AttributeError, IndexError) as e:  # a row of another shape
                    raise ValueError(f"{where}: cannot convert ({type(e).__name__}: {e})") from None
                line = record_line(check_record(record, where))
                f.write(line)
                digest.update(line.encode("utf-8"))
                count += 1
            f.flush()
            os.fsync(f.fileno())
        if count == 0:
            raise ValueError(f"{src.repo}: no rows")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600: the mode open() would give
        os.replace(tmp, path)
        written = True
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
        if not written:
            for made_folder in made:
                with contextlib.suppress(OSError):  # removed only while empty
                    os.rmdir(made_folder)
    return count, digest.hexdigest()


class Flags(argparse.ArgumentParser):
    def error(self, message):  # one line, not argparse's usage and then the error
        raise UsageError(message)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = Flags(
        description="Rebuild data/eval/<name>.jsonl ({\"turns\": [...]} per line) "
                    "from the public datasets "
                    "(needs a network and `pip install datasets`).")
    p.add_argument("names", nargs="*", metavar="NAME",
                   help=f"datasets to build (default: all): {', '.join(BY_NAME)}")
    p.add_argument("--out-dir", default=DEFAULT_OUT,
                   help="where to write <name>.jsonl (default: data/eval)")
    p.add_argument("--force", action="store_true", help="replace files that already exist")
    p.add_argument("--max-rows", type=int, default=None,
                   help="write at most this many records per file (smoke tests)")
    p.add_argument("--list", action="store_true",
                   help="print the known datasets and their sources, then exit")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = parse_args(argv)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.list:
        for src in SOURCES:
            print(src.describe())
        return 0
    handlers = {}
    if threading.current_thread() is threading.main_thread():
        handlers = {s: signal.signal(s, _interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        unknown = [n for n in args.names if n not in BY_NAME]
        if unknown:
            raise UsageError(f"unknown dataset {unknown[0]!r} (known: {', '.join(BY_NAME)})")
        if args.max_rows is not None and args.max_rows < 1:
            raise UsageError(f"--max-rows: invalid value {args.max_rows} (valid: >= 1)")
        chosen = [BY_NAME[n] for n in dict.fromkeys(args.names)] or list(SOURCES)
        paths = {s.name: os.path.join(args.out_dir, f"{s.name}.jsonl") for s in chosen}
        if not args.out_dir.strip():
            raise UsageError("--out-dir: empty")
        if args.out_dir == "-":  # the wording of support/cli.py's refuse_standard_output
            raise UsageError("--out-dir -: standard output is not supported here; give a directory path")
        # it, or the nearest folder that exists, must take files
        probe = os.path.abspath(args.out_dir)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        if not os.path.isdir(probe) or not os.access(probe, os.W_OK):
            if probe == os.path.abspath(args.out_dir):
                problem = "not a directory"
            else:
                problem = f"cannot be created ({probe} is not a writable directory)"
            raise UsageError(f"--out-dir {args.out_dir}: " + problem)
        for path in paths.values():
            check_output_file(path)
        existing = [p for p in paths.values() if os.path.exists(p)]
        if existing and not args.force:  # checked for all before downloading anything
            raise UsageError(f"{existing[0]} exists (pass --force to replace it)"
                             + (f", and {len(existing) - 1} more" if len(existing) > 1 else ""))
        check_packages(chosen)
        for src in chosen:
            path = paths[src.name]
            print(f"{src.name}: reading {src.repo} ...", file=sys.stderr, flush=True)
            count, sha = write_records(src, upstream_rows(src), path, args.max_rows)
            if src.sha256 is None:
                same = "no shipped copy to compare"
            elif args.max_rows is not None:
                same = "--max-rows: not compared with the shipped copy"
            else:
                same = "identical to the shipped copy" if sha == src.sha256 else \
                    "DIFFERS from the shipped copy (upstream changed?)"
            print(f"wrote {path}: {count} records from {src.repo}, sha256 {sha[:16]}… ({same})")
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a download or a conversion failed
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    # Ctrl-C or SIGTERM: write_records has removed its temporary file
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"interrupted by {signal.Signals(signum).name}: stopped; "
              "the files written before are kept, no partial one", file=sys.stderr)
        return 128 + signum
    finally:
        for s, h in handlers.items():
            signal.signal(s, h)
    return 0


if __name__ == "__main__":
    sys.exit(main())
