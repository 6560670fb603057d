"""scripts/fetch_eval_data.py without a network: --help, the refusal to overwrite, the record
conversions on fake rows, the atomic writer, and the conversions against the shipped data/eval files."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "fetch_eval_data.py"
DATA = ROOT / "data" / "eval"


def load_script():
    spec = importlib.util.spec_from_file_location("fetch_eval_data", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


fe = load_script()


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_help_exits_0_without_datasets():
    r = run("--help")
    assert r.returncode == 0, r.stderr
    assert "--force" in r.stdout and "--out-dir" in r.stdout
    # The script must not import the optional packages at start-up.
    probe = subprocess.run([sys.executable, "-c",
                            f"import sys; sys.argv=['x', '--help']; import runpy\n"
                            f"try:\n    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
                            f"except SystemExit:\n    pass\n"
                            f"print('datasets' in sys.modules, 'huggingface_hub' in sys.modules)"],
                           capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip().splitlines()[-1] == "False False"


def test_list_names_every_source():
    r = run("--list")
    assert r.returncode == 0, r.stderr
    for name in ("gsm8k", "alpaca", "livecodebench", "arena-hard-v2"):
        assert name in r.stdout
    assert "tatsu-lab/alpaca" in r.stdout


def test_refuses_to_overwrite_without_force(tmp_path):
    existing = tmp_path / "gsm8k.jsonl"
    existing.write_text("keep me\n")
    r = run("gsm8k", "--out-dir", str(tmp_path))
    assert r.returncode == 2
    assert "--force" in r.stderr and str(existing) in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert existing.read_text() == "keep me\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gsm8k.jsonl"]  # no temporary left behind
    r = run("gsm8k")  # the default --out-dir, data/eval, named as a plain path
    assert r.returncode == 2 and r.stderr == f"error: {DATA / 'gsm8k.jsonl'} exists (pass --force to replace it)\n"


def test_refuses_before_any_download_when_one_of_many_exists(tmp_path):
    (tmp_path / "mbpp.jsonl").write_text("x\n")
    r = run("gsm8k", "mbpp", "--out-dir", str(tmp_path))  # gsm8k is missing, but nothing may start
    assert r.returncode == 2 and "mbpp.jsonl" in r.stderr
    assert not (tmp_path / "gsm8k.jsonl").exists()


def test_unknown_name_and_bad_max_rows(tmp_path):
    r = run("nope", "--out-dir", str(tmp_path))
    assert r.returncode == 2 and "unknown dataset 'nope'" in r.stderr
    r = run("gsm8k", "--max-rows", "0", "--out-dir", str(tmp_path))
    assert r.returncode == 2 and "--max-rows" in r.stderr
    (tmp_path / "afile").write_text("x")
    for out_dir, needle in ((str(tmp_path / "afile" / "sub"), "cannot be created"), ("", "--out-dir: empty"),
                            (str(tmp_path / "afile"), "not a directory"),
                            ("-", "--out-dir -: standard output is not supported here")):
        r = run("gsm8k", "--out-dir", out_dir)
        assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1, r.stderr
    # argparse's own refusals too: one line, without its usage line
    for argv, needle in ((["--bogus"], "unrecognized arguments: --bogus"), (["--max-rows", "x"], "'x'")):
        r = run(*argv, "--out-dir", str(tmp_path))
        assert r.returncode == 2 and r.stderr.startswith("error: ") and needle in r.stderr, r.stderr
        assert r.stderr.count("\n") == 1, r.stderr


STUB_HUB = """
import json, os, time

def hf_hub_download(repo, filename, repo_type=None):  # the test's stand-in: no network
    open(os.environ["STUB_CALLED"], "w").close()
    if os.environ.get("STUB_FAIL"):
        raise OSError("offline")
    if os.environ.get("STUB_HANG"):
        time.sleep(120)
    path = os.path.join(os.path.dirname(os.environ["STUB_CALLED"]), "rows.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"prompt": "Write a poem."}) + "\\n")
    return path
"""


def stub_hub_env(tmp_path, **extra):
    """Environment in which the script's huggingface_hub is a stub that marks tmp_path/called when asked."""
    (tmp_path / "stub" / "huggingface_hub").mkdir(parents=True)
    (tmp_path / "stub" / "huggingface_hub" / "__init__.py").write_text(STUB_HUB)
    return dict(os.environ, PYTHONPATH=str(tmp_path / "stub"), STUB_CALLED=str(tmp_path / "called"), **extra)


def test_download_through_the_stub_hub(tmp_path):
    """The stand-in hub the tests below use: a run through it writes the converted file."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(SCRIPT), "arena-hard-v2", "--out-dir", str(out)], capture_output=True,
                       text=True, timeout=120, env=stub_hub_env(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (out / "arena-hard-v2.jsonl").read_text() == '{"turns": ["Write a poem."]}\n'


def test_output_path_that_is_a_directory_is_refused_before_downloading(tmp_path):
    out = tmp_path / "out"
    (out / "arena-hard-v2.jsonl").mkdir(parents=True)
    r = subprocess.run([sys.executable, str(SCRIPT), "arena-hard-v2", "--out-dir", str(out), "--force"],
                       capture_output=True, text=True, timeout=120, env=stub_hub_env(tmp_path))
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"{out / 'arena-hard-v2.jsonl'}: is a directory" in r.stderr
    assert not (tmp_path / "called").exists()  # nothing downloaded


def test_a_failed_download_leaves_no_folder_it_made(tmp_path):
    """The folders --out-dir names are made before the first row arrives; a download that fails removes
    them again (the file is written whole or not at all, and so is its folder)."""
    (tmp_path / "had").mkdir()
    out = tmp_path / "had" / "new" / "sub"
    r = subprocess.run([sys.executable, str(SCRIPT), "arena-hard-v2", "--out-dir", str(out)], capture_output=True,
                       text=True, timeout=120, env=stub_hub_env(tmp_path, STUB_FAIL="1"))
    assert r.returncode == 1 and r.stderr.splitlines()[-1] == "error: OSError: offline", r.stderr
    assert (tmp_path / "called").exists() and os.listdir(tmp_path / "had") == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interrupted_download_is_one_line_and_leaves_no_partial_file(tmp_path, sig):
    out = tmp_path / "out"
    out.mkdir()
    (out / "gsm8k.jsonl").write_text("kept\n")  # another dataset's file, not touched
    p = subprocess.Popen([sys.executable, str(SCRIPT), "arena-hard-v2", "--out-dir", str(out)], text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=stub_hub_env(tmp_path, STUB_HANG="1"))
    t0 = time.time()
    while not (tmp_path / "called").exists():  # the download has started (and the temporary file is open)
        assert p.poll() is None, p.communicate()
        assert time.time() - t0 < 60
        time.sleep(0.05)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig, err
    lines = err.strip().splitlines()  # "arena-hard-v2: reading ...", then the interruption
    assert len(lines) == 2 and lines[1].startswith(f"interrupted by {sig.name}"), err
    assert sorted(f.name for f in out.iterdir()) == ["gsm8k.jsonl"]


S = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@pytest.mark.parametrize("convert, row, turns", [
    (fe.gsm8k_record, {"question": "What is 2+2?", "answer": "4"}, ["What is 2+2?" + S]),
    (fe.math_record, {"problem": "Solve $x^2=4$.", "answer": "2"}, ["Solve $x^2=4$." + S]),
    (fe.alpaca_record, {"instruction": "Name a color.", "input": "", "output": "red"}, ["Name a color."]),
    (fe.alpaca_record, {"instruction": "Translate.", "input": "Hallo", "output": "Hello"},
     ["Translate.\n\nInput:\nHallo"]),
    (fe.mt_bench_record, {"prompt": ["First?", "Second?"], "category": "writing"}, ["First?", "Second?"]),
    (fe.humaneval_record, {"prompt": "def f(x):\n    \"\"\"Double.\"\"\"\n"},
     ["Write a solution to the following problem and make sure that it passes the tests:\n"
      "```python\ndef f(x):\n    \"\"\"Double.\"\"\"\n\n```"]),
    (fe.mbpp_record, {"prompt": "Write a function to add.", "task_id": 2}, ["Write a function to add."]),
    (fe.lbpp_record, {"instruction": "Write a python function f.", "language": "python"},
     ["Write a python function f."]),
    (fe.swe_bench_record, {"problem_statement": "Crash on empty input."},
     ["Problem Statement:\nCrash on empty input.\nPlease fix the issue described above."]),
    (fe.arena_hard_record, {"prompt": "Write a poem.", "uid": "abc"}, ["Write a poem."]),
])
def test_record_conversions(convert, row, turns):
    assert convert(row) == {"turns": turns}


def test_livecodebench_record_with_and_without_starter_code():
    with_code = fe.livecodebench_record({"question_content": "Add two numbers.",
                                         "starter_code": "class Solution:\n    def add(self, a, b):\n        "})
    text = with_code["turns"][0]
    assert text.startswith("You are an expert Python programmer.")
    assert "### Question:\nAdd two numbers.\n\n### Format: Use the following code structure:\n```python\n" \
           "class Solution:\n    def add(self, a, b):\n        \n```\n\n### Answer:" in text
    plain = fe.livecodebench_record({"question_content": "Read N.", "starter_code": ""})["turns"][0]
    assert "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```\n\n" in plain
    assert plain.endswith("### Answer: (use the provided format with backticks)")


def test_check_record_refuses_empty_turns():
    with pytest.raises(ValueError):
        fe.check_record({"turns": []}, "row 0")
    with pytest.raises(ValueError):
        fe.check_record({"turns": [""]}, "row 0")
    with pytest.raises(ValueError, match="non-blank"):  # eval.py refuses a blank prompt: it was written
        fe.check_record({"turns": ["   "]}, "row 0")
    with pytest.raises(ValueError, match="row 0: a turn is not valid Unicode"):  # a UnicodeEncodeError, unnamed
        fe.check_record({"turns": ["a\ud800"]}, "row 0")


def test_rows_that_cannot_be_read_or_converted_are_named(tmp_path):
    """An upstream row of another shape (a KeyError) or a line that is not JSON was an error naming no row."""
    src = fe.BY_NAME["gsm8k"]
    with pytest.raises(ValueError, match=r"^openai/gsm8k row 1: cannot convert \(KeyError: 'question'\)$"):
        fe.write_records(src, iter([{"question": "Q1"}, {"uid": 1}]), str(tmp_path / "g.jsonl"))
    assert not (tmp_path / "g.jsonl").exists()
    stub = tmp_path / "stub" / "huggingface_hub"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text(STUB_HUB.replace('f.write(json.dumps({"prompt": "Write a poem."}) + "\\n")',
                                                        'f.write(\'{"prompt": "a"}\\nnot json\\n\')'))
    r = subprocess.run([sys.executable, str(SCRIPT), "arena-hard-v2", "--out-dir", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(tmp_path / "stub"), STUB_CALLED=str(tmp_path / "called")))
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and last.startswith("error: ") and last.endswith(
        "lmarena-ai/arena-hard-auto data/arena-hard-v2.0/question.jsonl:2: malformed JSON (Expecting value)"), r.stderr


def test_write_records_is_atomic_and_counts(tmp_path):
    src = fe.BY_NAME["gsm8k"]
    out = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "Q1 ’"}, {"question": "Q2"}, {"question": "Q3"}]
    count, sha = fe.write_records(src, iter(rows), str(out), max_rows=2)
    data = out.read_bytes()
    assert count == 2 and hashlib.sha256(data).hexdigest() == sha
    assert data.decode("utf-8") == "".join(json.dumps({"turns": [q["question"] + S]}, ensure_ascii=False) + "\n"
                                           for q in rows[:2])
    assert "’" in data.decode("utf-8")  # non-ASCII kept as is, as in the shipped files
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes it, not mkstemp's 0600

    def broken():
        yield {"question": "fine"}
        raise ConnectionError("network gone")

    out.write_text("old\n")
    with pytest.raises(ConnectionError):
        fe.write_records(src, broken(), str(out))
    assert out.read_text() == "old\n"  # the old file survives a failed rebuild
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gsm8k.jsonl"]


# The shipped files: rebuild each line from a row recovered out of it and require the same bytes,
# so the conversions are the ones that made data/eval.

def _recover(name: str, turns: list[str]) -> dict:
    t = turns[0]
    if name == "gsm8k":
        return {"question": t.removesuffix(S)}
    if name in ("math500", "aime24", "aime25"):
        return {"problem": t.removesuffix(S)}
    if name == "mt-bench":
        return {"prompt": turns}
    if name == "humaneval":
        return {"prompt": re.fullmatch(r"(?s)[^\n]*\n```python\n(.*)\n```", t).group(1)}
    if name == "mbpp":
        return {"prompt": t}
    if name == "lbpp":
        return {"instruction": t}
    if name == "swe-bench":
        return {"problem_statement": re.fullmatch(r"(?s)Problem Statement:\n(.*)\nPlease fix the issue described "
                                                  r"above\.", t).group(1)}
    if name == "arena-hard-v2":
        return {"prompt": t}
    if name == "livecodebench":
        m = re.fullmatch(r"(?s).*?\n\n### Question:\n(.*)\n\n### Format: ([^\n]*)\n```python\n(.*)\n```\n\n"
                         r"### Answer: \(use the provided format with backticks\)", t)
        starter = m.group(3) if m.group(2) == "Use the following code structure:" else ""
        return {"question_content": m.group(1), "starter_code": starter}
    raise KeyError(name)


@pytest.mark.parametrize("name", [s.name for s in fe.SOURCES if s.sha256])
def test_conversions_reproduce_the_shipped_lines(name):
    path = DATA / f"{name}.jsonl"
    assert path.is_file(), f"{path} missing"
    with open(path, encoding="utf-8", newline="") as f:
        lines = f.readlines()
    for line in lines:
        turns = json.loads(line)["turns"]
        assert fe.record_line(fe.BY_NAME[name].convert(_recover(name, turns))) == line


@pytest.mark.parametrize("name", [s.name for s in fe.SOURCES if s.sha256])
def test_shipped_files_match_their_recorded_sha256(name):
    assert hashlib.sha256((DATA / f"{name}.jsonl").read_bytes()).hexdigest() == fe.BY_NAME[name].sha256


@pytest.mark.skipif(importlib.util.find_spec("datasets") is not None, reason="datasets is installed here")
def test_missing_package_fails_before_writing_anything(tmp_path):
    out = tmp_path / "new"
    r = run("gsm8k", "--out-dir", str(out))
    assert r.returncode == 2 and "pip install datasets" in r.stderr
    assert not out.exists()
