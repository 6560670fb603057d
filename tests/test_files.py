"""support/files.py's input checks: what stands at a path that should be a file or a directory to read,
said in the words every program's one-line error uses."""

from __future__ import annotations

import json
import os

import pytest

from support.cli import UserError
from support.files import (
    check_input,
    check_outputs,
    directory_problem,
    file_problem,
    optional_file,
    read_jsonl,
)


@pytest.fixture
def places(tmp_path):
    """A file, a directory, a broken link and a named pipe, by name."""
    (tmp_path / "file").write_text("{}")
    (tmp_path / "dir").mkdir()
    os.symlink(tmp_path / "gone", tmp_path / "broken")
    os.mkfifo(tmp_path / "pipe")
    return {name: str(tmp_path / name) for name in ("file", "dir", "broken", "pipe", "missing")}


@pytest.mark.parametrize("name,expected", [
    ("file", None),
    ("dir", "is a directory, not a file"),
    ("broken", "is a broken link"),
    ("pipe", "is a device or a pipe, not a file (write it to a file first)"),
    ("missing", "prompts file not found"),
])
def test_what_stands_where_a_file_is_wanted(places, name, expected):
    assert file_problem(places[name], "prompts file") == expected


@pytest.mark.parametrize("name,expected", [
    ("dir", None),
    ("file", "is a file, not a directory"),
    ("broken", "is a broken link"),
    ("pipe", "is a device or a pipe, not a directory"),
    ("missing", "directory not found"),
])
def test_what_stands_where_a_directory_is_wanted(places, name, expected):
    assert directory_problem(places[name]) == expected


def test_a_dash_is_neither_standard_input_nor_output_nor_a_file_named_so(tmp_path, monkeypatch):
    """`-` means standard input or output by Unix habit: as an output it wrote a file named `-` in silence,
    as an input it was "not found" (or read a file named `-`)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "-").write_text("{}")
    with pytest.raises(UserError) as e:
        check_input("-", "--prompts-file", "prompts file")
    assert str(e.value) == "--prompts-file -: standard input is not supported here; give a file path"
    assert directory_problem("-") == "standard input is not supported here; give a directory path"
    os.remove(tmp_path / "-")
    with pytest.raises(UserError) as e:
        check_outputs({"--trace-file": None, "--output-file": "-"})
    assert str(e.value) == "--output-file -: standard output is not supported here; give a file path"
    assert os.listdir(tmp_path) == []


def test_an_optional_file_is_a_file_or_nothing(places):
    assert optional_file(places["file"]) is True
    assert optional_file(places["missing"]) is False
    for name in ("dir", "broken", "pipe"):
        with pytest.raises(UserError, match=f"^{places[name]}: is "):
            optional_file(places[name])


def test_a_stream_file_writes_utf8_whatever_the_locale(tmp_path):
    """Output records keep their text as it is (ensure_ascii=False): under an ASCII locale the file is still
    UTF-8, where the locale's encoding failed mid-run with UnicodeEncodeError."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    path = tmp_path / "o.jsonl"
    code = (f"from support.files import StreamFile; f = StreamFile({str(path)!r}); "
            "f.write('\\u4e2d\\u6587 \\u03c4\\n'); f.close()")  # escaped: the command line is ASCII
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), LC_ALL="C", LANG="C", PYTHONUTF8="0",
               PYTHONCOERCECLOCALE="0")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert path.read_bytes() == "中文 τ\n".encode("utf-8")


def test_a_full_disk_while_decoding_is_one_line_and_leaves_no_temporary_file(tmp_path):
    """A write that fails mid-decode (here a file-size limit, as a full disk fails it): one line naming the
    file as given, exit 1, and neither temporary file left. The abort's own close flushed the buffer into
    the same error, so the temporary files stayed and the line was three chained tracebacks."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    out = tmp_path / "outputs"
    out.mkdir()
    command = (f"trap '' XFSZ; ulimit -f 16; exec {sys.executable} speculate.py --target demo/target "
               f"--drafter demo/drafter --prompts-file demo/heldout.jsonl --max-new-tokens 32 "
               f"--trace-file {out / 't.jsonl'} --output-file {out / 'o.jsonl'}")
    done = subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[-1] == f"error: {out / 't.jsonl'}: File too large", lines[-3:]
    assert os.listdir(out) == []


def test_the_completions_are_printed_when_an_output_cannot_be_published(tmp_path, monkeypatch, capsys):
    """--output-file's folder removed while decoding: the run ends in one line naming the file as given,
    exit 1, and the completions and figures are printed all the same (they were lost with the file)."""
    import shutil

    import speculate
    from support.files import StreamFile

    out = tmp_path / "outputs"
    out.mkdir()
    publish = StreamFile.publish

    def folder_gone(self):
        shutil.rmtree(out, ignore_errors=True)
        publish(self)

    monkeypatch.setattr(StreamFile, "publish", folder_gone)
    rc = speculate.main(["--target", "demo/target", "--drafter", "demo/drafter", "--prompts-file",
                         "demo/heldout.jsonl", "--max-new-tokens", "8", "--output-file", str(out / "o.jsonl")])
    captured = capsys.readouterr()
    assert rc == 1
    assert captured.err.strip().splitlines()[-1] == f"error: {out / 'o.jsonl'}: No such file or directory"
    assert captured.out.count("--- request ") == 20 and "speculative: 160 tokens" in captured.out, captured


def test_a_streamed_decode_cut_by_a_reader_gone_keeps_its_files(tmp_path):
    """One prompt streams while it decodes, so `| head` breaks the pipe mid-decode: the files are kept as
    for an interruption (the trace ends in its summary, marked interrupted); they were deleted in silence."""
    import contextlib
    import io

    import speculate

    class Gone(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):  # where cli_main puts /dev/null over stdout: a descriptor of its own here
            return os.open(os.devnull, os.O_WRONLY)

    trace, out = tmp_path / "t.jsonl", tmp_path / "o.jsonl"
    with contextlib.redirect_stdout(Gone()), contextlib.redirect_stderr(io.StringIO()):
        rc = speculate.main(["--target", "demo/target", "--drafter", "demo/drafter", "--prompt", "def add(a, b):",
                             "--max-new-tokens", "64", "--ignore-eos", "--trace-file", str(trace),
                             "--output-file", str(out)])
    assert rc == 141
    summary = json.loads(trace.read_text().splitlines()[-1])
    assert summary["interrupted"] is True and summary["requests"] == 1 and out.is_file()


@pytest.mark.parametrize("ends", [b"\n", b"\r", b"\r\n"])
def test_a_byte_not_utf8_is_reported_on_its_own_line_whatever_the_line_ends(tmp_path, ends):
    """A lone CR ends a line (as text mode reads it): a bad byte after two such lines is on line 3."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(ends.join([b'{"prompt": "a"}', b'{"prompt": "b"}', b'{"prompt": "\xe9"}', b""]))
    with pytest.raises(UserError) as e:
        list(read_jsonl(str(path)))
    assert str(e.value) == f"{path}:3: not UTF-8 text"


def test_an_integer_too_long_to_read_is_one_plain_line(tmp_path):
    """Python refuses an integer of more than 4300 digits with advice for a programmer
    (sys.set_int_max_str_digits); a prompts file's user reads what is wrong and where."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a"}\n{"prompt_ids": [' + "7" * 5000 + ']}\n')
    with pytest.raises(UserError) as e:
        list(read_jsonl(str(path)))
    assert str(e.value) == f"{path}:2: malformed JSON (an integer of more than 4300 digits)"
