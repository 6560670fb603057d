"""Ctrl-C and SIGTERM stop a run cleanly: one line on stderr, exit 130 / 143, and what was finished
is kept — speculate.py prints the finished completions and ends its trace with a summary marked
"interrupted"; eval.py leaves its results marked incomplete and interrupted."""

from __future__ import annotations

import contextlib
import glob
import io
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO_ROOT, build_tokenizer
from drafters import make_drafter, make_target


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    d = tmp_path_factory.mktemp("signals")
    target = make_target(d / "target", vocab_size=48)
    build_tokenizer(48).save(os.path.join(target, "tokenizer.json"))  # eval's datasets are text
    drafter = make_drafter(d / "drafter", target, block_size=4, oracle=True)
    return d, target, drafter


def start(args, cwd):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return subprocess.Popen([sys.executable] + [str(a) for a in args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for(predicate, proc, timeout=120):
    t0 = time.time()
    while not predicate():
        assert proc.poll() is None, f"the run ended before the signal: {proc.communicate()}"
        assert time.time() - t0 < timeout, "timed out waiting"
        time.sleep(0.05)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_speculate_interrupted_keeps_finished_requests(pair, tmp_path, sig, code):
    d, target, drafter = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [1 + i % 40, 2, 3]}) + "\n" for i in range(400)))
    trace = tmp_path / "trace.jsonl"
    p = start([REPO_ROOT / "speculate.py", "--target", target, "--drafter", drafter, "--prompts-file", prompts,
               "--max-new-tokens", 40, "--trace-file", trace], tmp_path)
    # The trace is written to a temporary file beside its target and synced per finished request.
    partial = lambda: [f for f in glob.glob(str(tmp_path / ".trace.jsonl.*.tmp")) if "output_ids" in open(f).read()]
    wait_for(partial, p)
    p.send_signal(sig)
    out, err = p.communicate(timeout=120)
    assert p.returncode == code, err
    # the settings line, the drafter line, then the interruption
    assert err.splitlines()[-1].startswith(f"interrupted by {signal.Signals(sig).name}") and err.count("\n") <= 3, err
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    summary = lines[-1]
    assert summary["summary"] and summary["interrupted"] is True and summary["requests"] == 400
    ends = [x for x in lines if "output_ids" in x]
    assert 1 <= summary["finished_requests"] == len(ends) < 400
    # tokens/s counts every token decoded in the time: the finished requests' and those in flight
    decoded = sum(len(x["output_ids"]) for x in ends)
    finished = {x["request"] for x in ends}
    in_flight = {x["request"] for x in lines if "round" in x and x["request"] not in finished}
    for r in in_flight:
        rounds = [x for x in lines if x.get("round") is not None and x["request"] == r]
        decoded += 1 + sum(x["accepted"] + 1 for x in rounds)  # its first token, then each round's
    assert summary["decoded_tokens"] == decoded >= sum(len(x["output_ids"]) for x in ends)
    seconds = summary["prefill_seconds"] + summary["decode_seconds"]
    assert summary["tokens_per_second"] == pytest.approx(decoded / seconds)
    printed = out.splitlines()
    labels = [line for line in printed if line.startswith("--- request ")]
    assert len(labels) == len(ends) and len(printed) == 2 * len(ends)  # the finished completions, no statistics line
    assert all(line for line in printed)
    assert not glob.glob(str(tmp_path / ".trace.jsonl.*.tmp"))


def test_eval_interrupted_leaves_results_marked_incomplete(pair, tmp_path):
    d, target, drafter = pair
    data = tmp_path / "data"
    data.mkdir()
    (data / "first.jsonl").write_text(json.dumps({"turns": ["x"]}) + "\n")
    (data / "second.jsonl").write_text("".join(json.dumps({"turns": ["y"]}) + "\n" for _ in range(2000)))
    out = tmp_path / "results.json"
    p = start([REPO_ROOT / "eval.py", "--target", target, "--drafter", drafter, "--data-dir", data, "--datasets",
               "first,second", "--max-new-tokens", 40, "--no-chat", "--no-progress", "--out", out], tmp_path)
    wait_for(out.exists, p)  # written as soon as the first dataset is done
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 143 and err.splitlines()[-1].startswith("interrupted by SIGTERM"), err
    res = json.loads(out.read_text())
    assert res["complete"] is False and res["interrupted"] is True
    assert [e["dataset"] for e in res["datasets"]] == ["first"]


def test_a_stream_interrupted_ends_its_line(pair, tmp_path, monkeypatch, capsys):
    """One request's text streams on stdout; interrupted mid-way, its line is ended, so that on a terminal
    the interruption's line starts a line of its own (it was written on the end of the text)."""
    import speculate
    from support.report import Printer

    d, target, drafter = pair
    real = Printer.on_round

    def round_then_signal(self, req):
        real(self, req)
        if self.shown:
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(Printer, "on_round", round_then_signal)
    rc = speculate.main(["--target", target, "--drafter", drafter, "--prompt", "a b", "--max-new-tokens", "40",
                         "--no-chat", "--temperature", "0"])
    out, err = capsys.readouterr()
    assert rc == 130 and err.splitlines()[-1].startswith("interrupted by SIGINT"), err
    assert out and out.endswith("\n") and out.count("\n") == 1, out


def test_a_second_signal_while_the_first_unwinds_the_run_exits_at_once():
    """The first SIGINT / SIGTERM raises Interrupted and hands any second one to _exit_now, which exits
    with 128 + the signal and one line (a second Ctrl-C landing in the first's line or its unwinding was a
    traceback and status 1); cli_main puts the caller's handlers back either way."""
    from support import cli

    previous = cli._set_handlers(cli._interrupt)
    try:
        with pytest.raises(cli.Interrupted):
            cli._interrupt(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGINT) is cli._exit_now and signal.getsignal(signal.SIGTERM) is cli._exit_now
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    code = ("import os, signal; from support import cli; cli._set_handlers(cli._exit_now); "
            "os.kill(os.getpid(), signal.SIGTERM); print('not reached')")
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert (p.returncode, p.stdout, p.stderr) == (143, "", "interrupted again by SIGTERM: exiting now\n")


def eval_in_process(pair, tmp_path, datasets: str) -> tuple[int, object]:
    """eval.py's main, in this process, on datasets (comma-separated) of one prompt each: its exit
    status and the --out path."""
    import eval as ev

    d, target, drafter = pair
    data = tmp_path / "data"
    data.mkdir()
    for name in datasets.split(","):
        (data / f"{name}.jsonl").write_text(json.dumps({"turns": [name]}) + "\n")
    out = tmp_path / "results.json"
    rc = ev.main(["--target", target, "--drafter", drafter, "--data-dir", str(data), "--datasets", datasets,
                  "--max-new-tokens", "8", "--no-chat", "--no-progress", "--out", str(out)])
    return rc, out


def raises_interrupted(signum):
    """A stand-in for a function that a signal interrupts (as cli_main's handler raises it)."""
    from support.cli import Interrupted

    def interrupted(*args, **kwargs):
        raise Interrupted(signum)

    return interrupted


def test_eval_interrupted_while_writing_results_still_marks_them(pair, tmp_path, monkeypatch):
    """A signal that lands while eval.py rewrites --out after a dataset (its file already in place, the
    write not yet returned) still leaves the results marked interrupted, with what was done."""
    import eval as ev

    real, calls = ev.write_json, []

    def write_then_signal(path, obj):
        real(path, obj)
        calls.append(obj)
        if len(calls) == 1:  # the first dataset's results, written: SIGTERM arrives now
            raises_interrupted(signal.SIGTERM)()

    monkeypatch.setattr(ev, "write_json", write_then_signal)
    rc, out = eval_in_process(pair, tmp_path, "first,second")
    assert rc == 143
    res = json.loads(out.read_text())
    assert res["complete"] is False and res["interrupted"] is True
    assert [e["dataset"] for e in res["datasets"]] == ["first"]


def test_eval_interrupted_while_its_first_engine_is_built_says_nothing_was_written(pair, tmp_path,
                                                                                    monkeypatch, capsys):
    """A signal while the first engine is made (compiling, or profiling SPS(B): minutes on a CPU), before
    any dataset is decoded: the interruption's one line and exit status, and no results file."""
    import eval as ev

    monkeypatch.setattr(ev, "make_engine", raises_interrupted(signal.SIGINT))
    rc, out = eval_in_process(pair, tmp_path, "first")
    err = capsys.readouterr().err
    assert rc == 130, err
    assert err.splitlines()[-1] == "interrupted by SIGINT: stopped; nothing was written", err
    assert "Traceback" not in err and not out.exists()


def test_eval_interrupted_while_calibrating_marks_the_results(pair, tmp_path, monkeypatch):
    """After the last dataset, while the calibration is computed: --out was left "complete": false with no
    "interrupted" (the handler covered the datasets only)."""
    import eval as ev

    monkeypatch.setattr(ev, "calibration_report", raises_interrupted(signal.SIGINT))
    rc, out = eval_in_process(pair, tmp_path, "first")
    assert rc == 130
    res = json.loads(out.read_text())
    assert res["complete"] is False and res["interrupted"] is True and len(res["datasets"]) == 1


def test_eval_interrupted_between_its_results_and_calibration_writes_both(pair, tmp_path, monkeypatch, capsys):
    """SIGINT right after the finished results are written: the calibration file is written too, then the
    run stops with 130 (it stopped there, leaving "complete" results beside an older calibration file)."""
    import eval as ev
    from support import eval_report

    d, target, drafter = pair
    data = tmp_path / "data"
    data.mkdir()
    (data / "first.jsonl").write_text("".join(json.dumps({"turns": [w]}) + "\n" for w in "abcd"))
    out = tmp_path / "results.json"
    calibration = tmp_path / "sts.json"
    calibration.write_text("{}")  # an earlier run's
    real = eval_report.write_json

    def write_then_signal(path, obj):
        real(path, obj)
        if path == str(out) and obj["complete"]:
            os.kill(os.getpid(), signal.SIGINT)  # (handled by cli_main's handler, deferred until published)

    monkeypatch.setattr(eval_report, "write_json", write_then_signal)
    rc = ev.main(["--target", target, "--drafter", drafter, "--data-dir", str(data), "--datasets", "first",
                  "--max-new-tokens", "8", "--no-chat", "--no-progress", "--out", str(out),
                  "--calibration-out", str(calibration)])
    err = capsys.readouterr().err
    assert rc == 130 and err.splitlines()[-1].startswith("interrupted by SIGINT"), err
    assert json.loads(out.read_text())["complete"] is True
    assert len(json.loads(calibration.read_text())["temperatures"]) == 4


def test_eval_interrupted_after_a_dataset_names_the_results_file(pair, tmp_path, monkeypatch, capsys):
    """The interruption's line names the results kept, a default --out being whichever name was free (it
    said "what was finished is kept", and the name came only at a normal end)."""
    import eval as ev

    d, target, drafter = pair
    data = tmp_path / "data"
    data.mkdir()
    for name in ("first", "second"):
        (data / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [w]}) + "\n" for w in "ab"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results.json").write_text("{}")  # an earlier run's
    real = ev.write_json
    signalled = []

    def write_then_signal(path, obj):
        real(path, obj)
        if not signalled:  # after the first dataset's snapshot
            signalled.append(path)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ev, "write_json", write_then_signal)
    rc = ev.main(["--target", target, "--drafter", drafter, "--data-dir", str(data), "--datasets", "first,second",
                  "--max-new-tokens", "8", "--no-chat", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 130 and err.splitlines()[-1] == "interrupted by SIGINT: stopped; what was written: results-2.json", err
    assert json.loads((tmp_path / "results-2.json").read_text())["complete"] is False


class Terminal(io.StringIO):
    """A stderr that says it is a terminal: progress is a bar."""

    def isatty(self):
        return True


def test_an_interruption_line_starts_below_the_bar(pair, tmp_path, monkeypatch):
    """eval.py's bar is closed before the interruption's line, which starts a line of its own (it was
    written after the bar's last frame, and the bar drawn again below it)."""
    import eval as ev

    d, target, drafter = pair
    data = tmp_path / "data"
    data.mkdir()
    (data / "first.jsonl").write_text("".join(json.dumps({"turns": [w]}) + "\n" for w in "abc"))
    finished = []

    def signal_at_first(self, req):
        finished.append(req)
        os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(ev.Progress, "on_finish", signal_at_first)
    err = Terminal()
    with contextlib.redirect_stderr(err):
        rc = ev.main(["--target", target, "--drafter", drafter, "--data-dir", str(data), "--datasets", "first",
                      "--max-new-tokens", "8", "--no-chat", "--out", str(tmp_path / "r.json")])
    lines = err.getvalue().split("\n")
    assert rc == 130 and finished and lines[-1] == "", err.getvalue()
    assert lines[-2].startswith("interrupted by SIGINT"), err.getvalue()


def test_a_signal_after_decoding_waits_for_the_outputs(pair, tmp_path, monkeypatch, capsys):
    """SIGINT while the finished completions are printed, after decoding: the trace and the output file
    are published whole (they were left as .NAME.*.tmp), then the run stops with 130."""
    import speculate
    from support.report import Printer

    d, target, drafter = pair
    real = Printer.finish

    def finish_then_signal(self, completions):
        os.kill(os.getpid(), signal.SIGINT)  # (handled by cli_main's handler, deferred until published)
        real(self, completions)

    monkeypatch.setattr(Printer, "finish", finish_then_signal)
    rc = speculate.main(["--target", target, "--drafter", drafter, "--prompt-ids", "1,2,3", "--max-new-tokens", "8",
                         "--trace-file", str(tmp_path / "t.jsonl"), "--output-file", str(tmp_path / "o.jsonl")])
    assert rc == 130, capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["o.jsonl", "t.jsonl"]
    assert json.loads((tmp_path / "t.jsonl").read_text().splitlines()[-1])["summary"] is True
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 1


def test_interrupted_is_not_an_error_of_the_code_it_lands_in(tmp_path, monkeypatch):
    """Interrupted is a BaseException, as KeyboardInterrupt is: landing in the tokenizer's load (whose bare
    `except Exception` named every failure a bad file) it stays the run's interruption."""
    from support import text
    from support.cli import Interrupted

    build_tokenizer(48).save(str(tmp_path / "tokenizer.json"))

    import tokenizers

    class Landing:
        @staticmethod
        def from_file(path):
            raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(tokenizers, "Tokenizer", Landing)
    with pytest.raises(Interrupted):
        text.Tokenizer(str(tmp_path))


@pytest.mark.parametrize("files", [[], ["--output-file"], ["--trace-file", "--output-file"]])
def test_the_interruption_line_says_what_was_written(pair, tmp_path, monkeypatch, capsys, files):
    """Ctrl-C's line names the files the run kept, or says that nothing was written and how to keep the
    finished requests (it said "what was finished is kept" with no file written)."""
    import speculate
    from support.cli import Interrupted
    from support.report import Decoding

    d, target, drafter = pair
    real = Decoding.on_finish

    def finish_then_interrupt(self, c):
        real(self, c)
        raise Interrupted(signal.SIGINT)  # as cli_main's handler raises it, after the first request ends

    monkeypatch.setattr(Decoding, "on_finish", finish_then_interrupt)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [1 + i, 2, 3]}) + "\n" for i in range(3)))
    paths = {"--trace-file": str(tmp_path / "t.jsonl"), "--output-file": str(tmp_path / "o.jsonl")}
    given = [a for f in files for a in (f, paths[f])]
    rc = speculate.main(["--target", target, "--drafter", drafter, "--prompts-file", str(prompts),
                         "--max-new-tokens", "8"] + given)
    err = capsys.readouterr().err
    assert rc == 130, err
    kept = (f"what was written: {', '.join(paths[f] for f in files)}" if files else
            "nothing was written (--output-file FILE keeps finished requests)")
    assert err.splitlines()[-1] == f"interrupted by SIGINT: stopped; {kept}", err
    assert sorted(os.listdir(tmp_path)) == sorted(["p.jsonl"] + [os.path.basename(paths[f]) for f in files])
    if files:
        assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 1


def test_an_error_in_the_middle_of_a_decode_leaves_no_output_files(pair, tmp_path, monkeypatch, capsys):
    """A decode that fails part way (here a non-finite logit in a later round, as NonFinite says it) is
    one error line, and the trace and output files it was writing are dropped, temporaries and all:
    no file half a run's."""
    import speculate
    from support.report import Decoding

    d, target, drafter = pair
    real = Decoding.on_finish

    def finish_then_fail(self, c):
        real(self, c)
        raise speculate.NonFinite(1, "round 2")

    monkeypatch.setattr(Decoding, "on_finish", finish_then_fail)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [1 + i, 2, 3]}) + "\n" for i in range(3)))
    rc = speculate.main(["--target", target, "--drafter", drafter, "--prompts-file", str(prompts),
                         "--max-new-tokens", "8", "--trace-file", str(tmp_path / "t.jsonl"),
                         "--output-file", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err
    assert rc == 2 and err.splitlines()[-1].startswith("error: request 1, round 2: the logits are not finite"), err
    assert "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["p.jsonl"]


def test_a_reader_that_goes_away_costs_no_file_and_no_traceback(pair, tmp_path):
    """`python speculate.py ... | head`: stdout's pipe breaks when the completions are printed. The trace and
    the output file were published first, whole; the run ends quietly with a shell's SIGPIPE status (it
    left both as temporary files and printed a BrokenPipeError traceback)."""
    d, target, drafter = pair
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [1 + i, 2, 3]}) + "\n" for i in range(3)))
    p = start([REPO_ROOT / "speculate.py", "--target", target, "--drafter", drafter, "--prompts-file", prompts,
               "--max-new-tokens", 8, "--trace-file", tmp_path / "t.jsonl", "--output-file", tmp_path / "o.jsonl"],
              tmp_path)
    p.stdout.close()  # the reader is gone before anything is printed
    err = p.stderr.read()
    p.wait(timeout=120)
    assert p.returncode == 128 + signal.SIGPIPE, err
    assert "Traceback" not in err, err
    assert sorted(os.listdir(tmp_path)) == ["o.jsonl", "p.jsonl", "t.jsonl"]
    assert len((tmp_path / "o.jsonl").read_text().splitlines()) == 3
    assert json.loads((tmp_path / "t.jsonl").read_text().splitlines()[-1])["summary"] is True


HELD = """
import os, signal, time
from support.cli import signals_held
with signals_held():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.2)
    print("first held", flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    print("not reached", flush=True)
print("after", flush=True)
"""


def test_signals_held_wait_for_the_first_signal_and_exit_at_the_second():
    """What signals_held guards (the W&B finish of a finished run) goes on past one signal, which then
    ends nothing more; a second exits at once, so an upload that hangs can still be left."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    p = subprocess.run([sys.executable, "-c", HELD], env=env, capture_output=True, text=True, timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, p.stderr
    assert p.stdout == "first held\n"
    assert p.stderr == "interrupted again by SIGTERM: exiting now\n"
    one = HELD.replace('    os.kill(os.getpid(), signal.SIGTERM)\n    time.sleep(30)\n', "")
    p = subprocess.run([sys.executable, "-c", one], env=env, capture_output=True, text=True, timeout=60)
    assert (p.returncode, p.stdout, p.stderr) == (0, "first held\nnot reached\nafter\n", "")


def test_an_interrupted_demo_baseline_gives_no_hint_of_a_file_that_keeps_nothing(monkeypatch, capsys):
    """The demo's autoregressive baseline writes no files: stopped there, the last line advised
    --output-file, which would have kept nothing."""
    import speculate
    from support.cli import Interrupted
    from support.report import Decoding

    real = Decoding.on_finish

    def finish_then_interrupt(self, c):
        real(self, c)
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(Decoding, "on_finish", finish_then_interrupt)
    rc = speculate.main(["--prompt-ids", "1,2,3", "--max-new-tokens", "4"])
    err = capsys.readouterr().err
    assert rc == 130 and err.splitlines()[-1] == "interrupted by SIGINT: stopped; nothing was written", err
