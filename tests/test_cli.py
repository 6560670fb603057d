"""speculate.py in baseline mode (no drafter) against transformers, and its CLI contract."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ENDOFTEXT_ID, IM_END_ID, REPO_ROOT, copy_target, edit_config, render_chat, run_captured

import scheduler as sched
import speculate
from support import cli, text
from support.cli import cli_main
from support.flags import Rendering


def read_trace_parts(path):
    """A trace file's (round lines, request end lines, summary line); exactly one summary, the last line."""
    lines = [json.loads(l) for l in open(path)]
    rounds = [l for l in lines if "round" in l]
    requests = [l for l in lines if "output_ids" in l]
    summary = [l for l in lines if l.get("summary")]
    assert len(summary) == 1 and lines[-1] is summary[0]
    return rounds, requests, summary[0]


def hf_greedy(hf, prompt, max_new_tokens, stop_ids):
    """transformers' greedy generation, cut after the first stop token."""
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                          eos_token_id=list(stop_ids), pad_token_id=0, attention_mask=torch.ones(1, len(prompt)))
    ids = out[0, len(prompt):].tolist()
    for i, t in enumerate(ids):
        if t in stop_ids:
            return ids[:i + 1]
    return ids


PROMPTS = [[7, 12, 30, 9, 41], [20, 21], [50, 8, 8, 33, 14, 19, 60, 2, 44]]


def test_greedy_equals_transformers(tiny_target, tmp_path):
    trace = tmp_path / "t.jsonl"
    pf = tmp_path / "p.jsonl"
    pf.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    # Batch of prompts with different lengths, decoded together.
    rc, out, err = run_captured(["--target", tiny_target.path, "--prompts-file", pf, "--max-new-tokens", 24,
                                 "--batch-size", 3, "--trace-file", trace])
    assert rc == 0, err
    _, requests, summary = read_trace_parts(trace)
    stop = {IM_END_ID, ENDOFTEXT_ID}
    for req, p in zip(sorted(requests, key=lambda r: r["request"]), PROMPTS):
        assert req["output_ids"] == hf_greedy(tiny_target.hf_model, p, 24, stop)
        assert req["acceptance_length"] == 1.0
    assert summary["acceptance_length"] == 1.0 and summary["accept_rate_by_position"] == []
    # Batch size 1 gives the same.
    for i, p in enumerate(PROMPTS):
        rc, out, err = run_captured(["--target", tiny_target.path, "--prompt-ids", ",".join(map(str, p)),
                                     "--max-new-tokens", 24, "--trace-file", trace])
        assert rc == 0, err
        by_index = {r["request"]: r for r in requests}  # end lines come in the order requests finish
        assert read_trace_parts(trace)[1][0]["output_ids"] == by_index[i]["output_ids"]


def test_budget_eos_and_round_records(target_factory, tmp_path):
    # No stop tokens at all: every request produces exactly the budget.
    t = target_factory(eos_token_id=None, generation_eos_token_id=None)
    trace = tmp_path / "t.jsonl"
    rc, _, err = run_captured(["--target", t.path, "--prompt-ids", "3,4,5", "--max-new-tokens", 17,
                               "--num-samples", 2, "--batch-size", 2, "--trace-file", trace])
    assert rc == 0, err
    rounds, requests, _ = read_trace_parts(trace)
    assert [len(r["output_ids"]) for r in requests] == [17, 17]
    assert all(r["finish_reason"] == "length" and r["num_rounds"] == 16 for r in requests)
    assert all(r["draft"] == [] and r["accepted"] == 0 and r["verified"] == 0 and r["confidence"] is None
               for r in rounds)
    out = requests[0]["output_ids"]
    # Each round's anchor is the previous committed token and its bonus the next one.
    mine = [r for r in rounds if r["request"] == 0]
    assert [r["anchor"] for r in mine] == out[:-1] and [r["bonus"] for r in mine] == out[1:]

    # Make the 6th generated token a stop token: the row ends exactly there, stop included.
    eos = out[5]
    first = out.index(eos)
    t2 = copy_target(t.path, tmp_path / "eos")
    edit_config(t2, lambda c: c.update(eos_token_id=eos))
    rc, _, err = run_captured(["--target", t2, "--prompt-ids", "3,4,5", "--max-new-tokens", 17,
                               "--trace-file", trace])
    assert rc == 0, err
    req = read_trace_parts(trace)[1][0]
    assert req["output_ids"] == out[:first + 1] and req["finish_reason"] == "stop"


def test_one_token_is_said_in_the_singular(tiny_target):
    """A request that ends on its prefill token: "1 token", in the request's header and the figures line."""
    rc, out, err = run_captured(["--target", tiny_target.path, "--prompt-ids", "3,4,5", "--num-samples", 2,
                                 "--max-new-tokens", 1])
    assert rc == 0, err
    assert out.count(": 1 token, length ---") == 2 and "autoregressive: 2 tokens in" in out, out
    rc, out, err = run_captured(["--target", tiny_target.path, "--prompt-ids", "3,4,5", "--max-new-tokens", 1])
    assert rc == 0, err
    assert "autoregressive: 1 token in" in out, out


def test_mixed_batch_rows_stop_independently(target_factory, tmp_path):
    t = target_factory(eos_token_id=None, generation_eos_token_id=None)
    trace = tmp_path / "t.jsonl"
    singles = []
    for p in PROMPTS:
        rc, _, err = run_captured(["--target", t.path, "--prompt-ids", ",".join(map(str, p)), "--max-new-tokens", 12,
                                   "--trace-file", trace])
        singles.append(read_trace_parts(trace)[1][0]["output_ids"])
    eos = singles[0][3]  # a token row 0 reaches early; other rows may or may not reach it
    t2 = copy_target(t.path, tmp_path / "eos")
    edit_config(t2, lambda c: c.update(eos_token_id=eos))
    pf = tmp_path / "p.jsonl"
    pf.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    rc, _, err = run_captured(["--target", t2, "--prompts-file", pf, "--max-new-tokens", 12, "--batch-size", 3,
                               "--trace-file", trace])
    assert rc == 0, err
    for req, single in zip(sorted(read_trace_parts(trace)[1], key=lambda r: r["request"]), singles):
        expect = single[:single.index(eos) + 1] if eos in single else single
        assert req["output_ids"] == expect
        assert req["finish_reason"] == ("stop" if eos in single else "length")


def test_sampled_run_repeats_with_seed(tiny_target, tmp_path):
    outs = []
    for seed in (5, 5, 6):
        trace = tmp_path / f"t{len(outs)}.jsonl"
        rc, _, err = run_captured(["--target", tiny_target.path, "--prompt-ids", "9,10,11", "--max-new-tokens", 20,
                                   "--temperature", 1.0, "--seed", seed, "--num-samples", 3, "--batch-size", 3,
                                   "--trace-file", trace])
        assert rc == 0, err
        outs.append([r["output_ids"] for r in read_trace_parts(trace)[1]])
    assert outs[0] == outs[1]
    assert outs[0] != outs[2]
    assert len({tuple(o) for o in outs[0]}) > 1  # the samples are independent


def test_text_prompt_uses_chat_template(tiny_target, tmp_path):
    from support.text import Tokenizer

    tok = Tokenizer(str(tiny_target.path))
    trace = tmp_path / "t.jsonl"
    outs = {}
    for flag in ("--chat", "--no-chat", None):
        args = ["--target", tiny_target.path, "--prompt", "def hello ( x ) :", "--max-new-tokens", 5,
                "--trace-file", trace] + ([flag] if flag else [])
        rc, out, err = run_captured(args)
        assert rc == 0, err
        outs[flag] = read_trace_parts(trace)[1][0]["output_ids"]
        assert out.splitlines()[0] == tok.decode(outs[flag], skip_special_tokens=True)  # printed without specials
    chat_ids = tok.encode(render_chat(tok, "def hello ( x ) :"))
    assert chat_ids[:1] == [tok.encode("<|im_start|>")[0]]
    assert outs["--chat"] == outs[None]  # the directory has a template: chat is the default
    assert outs["--chat"] == hf_greedy(tiny_target.hf_model, chat_ids, 5, {IM_END_ID, ENDOFTEXT_ID})
    raw = tok.encode("def hello ( x ) :")
    assert outs["--no-chat"] == hf_greedy(tiny_target.hf_model, raw, 5, {IM_END_ID, ENDOFTEXT_ID})


def _one_error_line(rc, out, err, *needles):
    assert rc != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error:") and "Traceback" not in err
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])


def test_bad_inputs_exit_with_one_line(tiny_target, tmp_path):
    t = str(tiny_target.path)
    cases = [
        (["--target", tmp_path / "nope", "--prompt-ids", "1,2"], ["nope"]),
        (["--target", t, "--prompt-ids", "1,2,640"], ["640", "vocabulary"]),
        (["--target", t, "--prompt-ids", "1,x"], ["--prompt-ids"]),
        (["--target", t, "--prompt-ids", ",".join(["5"] * 120), "--max-new-tokens", 20], ["context"]),
        (["--target", t, "--prompts-file", tmp_path / "missing.jsonl"], ["missing.jsonl"]),
        (["--target", t], ["--prompt"]),
        (["--target", t, "--prompt-ids", "1", "--max-new-tokens", 0], ["--max-new-tokens"]),
    ]
    bad_file = tmp_path / "bad.jsonl"
    bad_file.write_text('{"prompt_ids": [1, 2]}\n{"nothing": 1}\n')
    cases.append((["--target", t, "--prompts-file", bad_file], ["bad.jsonl:2"]))
    broken = copy_target(t, tmp_path / "broken")
    (broken / "config.json").write_text("{not json")
    cases.append((["--target", broken, "--prompt-ids", "1,2"], ["config.json", "malformed"]))
    for args, needles in cases:
        _one_error_line(*run_captured(args), *needles)


@pytest.mark.parametrize("argv,line", [
    (["--max-new-tokens", "abc"], "--max-new-tokens: expects {None}|INT (invalid literal for int() with base 10: 'abc')"),
    (["--batch-size", "1.5"], "--batch-size: expects INT (invalid literal for int() with base 10: '1.5')"),
    (["--scheduler", "foo"], f"--scheduler foo: not one of {{None,{','.join(sched.KINDS)}}}"),
    (["--max-new-token", "5"], "--max-new-token: no such flag (did you mean --max-new-tokens?)"),
    (["--temp", "0"], "--temp: no such flag (did you mean --temperature?)"),
    (["--nope"], "--nope: no such flag (--help lists the flags)"),
    (["--max-new-tokens"], "--max-new-tokens: no value given (expects {None}|INT)"),
    (["--max-new-tokens", "--compile"], "--max-new-tokens: no value given (expects {None}|INT)"),
    (["--stop", "--"], '--stop: no value given (expects STR; a value that starts with "-" is written --stop=VALUE)'),
    (["--prompt", "-x y"],
     '--prompt: no value given (expects {None}|STR; a value that starts with "-" is written --prompt=VALUE)'),
    (["--system_prompt", "-x"], '--system-prompt: no value given (expects {None}|STR; a value that starts with "-" '
                                'is written --system-prompt=VALUE)'),
    # a flag after it, in tyro's other spelling: no value is missing a dash, so no hint
    (["--stop", "--max_new_tokens", "3"], "--stop: no value given (expects STR)"),
    (["--compile", "x"], "--compile: takes no value (x given): --compile or --no-compile"),
    (["--compile=True"], "--compile: takes no value (True given): --compile or --no-compile"),
    (["--no-compile", "False"], "--no-compile: takes no value (False given): --compile or --no-compile"),
    (["--max-new-tokens", "3", "3"], "3: unexpected (no flag before it takes a value; --help lists the flags)"),
    (["-x"], "-x: no such flag (--help lists the flags)"),
    ([""], "'': unexpected (no flag before it takes a value; --help lists the flags)"),
    (["--drafter", "a", "--drafter=b"], "--drafter: given 2 times; speculate.py decodes with one (eval.py compares "
                                         "several)"),
])
def test_flags_tyro_rejects_are_one_line_errors(argv, line):
    """A malformed value, an unknown flag or choice, a missing value: one line naming the flag (tyro's
    parse-error events, a close flag suggested), exit status 2, before anything is read."""
    rc, out, err = run_captured(argv)
    assert rc == 2 and out == ""
    assert err.strip().splitlines() == [f"error: {line}"], err


@pytest.mark.parametrize("program", ["bench", "bench_concurrency", "regenerate"])
def test_one_drafter_programs_refuse_a_second(program, capsys):
    """eval.py takes --drafter again and again, a row each; a program of one drafter kept the last in silence."""
    import importlib

    module = sys.modules.get(program) or importlib.import_module(program)  # scripts/ is on the path
    assert module.main(["--drafter", "a", "--drafter", "b"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: --drafter: given 2 times; "), err


def test_an_error_holding_a_newline_is_one_line(capsys):
    """A path is put into an error line as given: its control characters are escaped, so that the error
    stays one line (a UserError's and a refused file's)."""
    @dataclasses.dataclass
    class Nothing:
        pass

    def bad_path(args):
        raise cli.UserError("--target demo/tar\nget\r: not found")

    def refused(args):
        raise PermissionError(13, "Permission denied", "/tmp/x\ny")

    assert cli_main(Nothing, bad_path, []) == 2
    assert capsys.readouterr().err == "error: --target demo/tar\\nget\\r: not found\n"
    assert cli_main(Nothing, refused, []) == 1
    assert capsys.readouterr().err == "error: /tmp/x\\ny: Permission denied\n"


def test_under_torchrun_rank_0_alone_says_a_refusal_and_the_others_wait_for_it(capsys):
    """Every rank meets rank 0's refusal (a locked --out, a bad flag): rank 0 prints it and exits 2, the
    others exit 0 without a word, so that torchrun waits for rank 0's line (a rank's failure makes it stop
    the others at once). A RankError, met by one rank alone, is that rank's line and exit 2."""
    @dataclasses.dataclass
    class Nothing:
        pass

    def locked(args):
        raise cli.UserError("--out o: another run is writing it now")

    def lost(args):
        raise cli.RankError("rank 1 of 2: another process stopped")

    assert cli_main(Nothing, locked, [], rank0=lambda: True) == 2
    assert capsys.readouterr().err == "error: --out o: another run is writing it now\n"
    assert cli_main(Nothing, locked, [], rank0=lambda: False) == 0
    assert capsys.readouterr().err == ""
    assert cli_main(Nothing, lost, [], rank0=lambda: False) == 2
    assert capsys.readouterr().err == "error: rank 1 of 2: another process stopped\n"


def test_a_tyro_whose_parse_events_differ_prints_its_own_box(capsys, monkeypatch):
    """The hook reads tyro's private events; where their fields differ, tyro's own message, not a traceback."""
    def other_fields(event, args_class, argv):
        raise AttributeError("'UnrecognizedArgs' object has no attribute 'tokens'")
    monkeypatch.setattr(cli, "parse_error_line", other_fields)
    with pytest.raises(SystemExit) as e:
        speculate.main(["--nope"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--nope" in err and "Traceback" not in err


@dataclasses.dataclass
class NeedsTwo:
    corpus: str
    """Where the corpus goes."""
    out: str
    """Where the rest goes."""


def test_missing_required_flags_are_one_line(capsys):
    rc = cli_main(NeedsTwo, lambda args: None, ["--out", "o"])
    assert rc == 2
    assert capsys.readouterr().err.splitlines() == ["error: --corpus: required (--help says what each takes)"]


def test_subprocess_exit_status_and_stderr(tiny_target, tmp_path):
    """The real process: status 2 and one stderr line for a bad input; 0 and ids for a good one."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    bad = subprocess.run([sys.executable, "speculate.py", "--target", str(tmp_path / "nope"), "--prompt-ids", "1"],
                         cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    good = subprocess.run([sys.executable, "speculate.py", "--target", str(tiny_target.path), "--prompt-ids", "1,2,3",
                           "--max-new-tokens", "4", "--no-chat"], cwd=REPO_ROOT, capture_output=True, text=True, env=env)
    assert good.returncode == 0, good.stderr
    assert "tokens/s" in good.stdout and "τ=1.00" in good.stdout


@pytest.mark.parametrize("where,needle", [("missing-folder", "does not exist"), ("directory", "is a directory")])
def test_unwritable_trace_file_is_refused_before_any_work(tiny_target, tmp_path, where, needle):
    path = tmp_path / "no" / "t.jsonl" if where == "missing-folder" else tmp_path
    rc, _, err = run_captured(["--target", tiny_target.path, "--prompt-ids", "1,2", "--max-new-tokens", 2,
                               "--trace-file", path])
    assert rc == 2 and needle in err and err.strip().splitlines()[-1].startswith("error: --trace-file"), err


def test_auto_defaults_resolve_the_same_through_the_cli_and_the_python_api(capsys):
    """--chat/--compile default to "auto" (None), resolved in one place; what a caller sets is kept."""
    import tyro

    assert tyro.cli(speculate.Args, args=[]).rendering.chat is None
    given = speculate.Args(rendering=Rendering(chat=False), decode=speculate.Settings(compile=True))
    assert tyro.cli(speculate.Args, args=["--no-chat", "--compile"]) == given
    assert (given.rendering.chat, given.decode.compile) == (False, True)  # nothing rewrites them behind the caller's back

    class Tok:
        chat_template = "{{ x }}"
    assert text.auto_chat(None, Tok()) is True and text.auto_chat(False, Tok()) is False
    assert text.auto_chat(None, None) is False and text.auto_chat(True, None) is True
    with pytest.raises(SystemExit):
        speculate.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--compile, --no-compile" in help_text and "None: on for cuda, off for cpu" in help_text
    assert "Default: on when the tokenizer has a template" in help_text


class Terminal(io.StringIO):
    """A stderr that says it is a terminal."""

    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_only_and_stdout_unchanged(tiny_target, tmp_path, monkeypatch):
    """Several requests show a bar on stderr (requests done, tokens/s, τ) when stderr is a terminal; never
    with --no-progress or off a terminal, and standard output is the same either way."""
    import tqdm

    init = tqdm.tqdm.__init__  # draw at every update, not at most every 0.1 s: the run is shorter than that
    monkeypatch.setattr(tqdm.tqdm, "__init__", lambda self, *a, **k: init(self, *a, **dict(k, mininterval=0)))
    pf = tmp_path / "p.jsonl"
    pf.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    base = ["--target", tiny_target.path, "--prompts-file", pf, "--max-new-tokens", 6, "--batch-size", 2]

    def run(extra, err):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            assert speculate.main([str(a) for a in base + extra]) == 0, err.getvalue()
        return out.getvalue().splitlines()[:-1], err.getvalue()  # the figures line's timings differ

    shown_out, shown = run([], Terminal())
    quiet_out, quiet = run(["--no-progress"], Terminal())
    plain_out, plain = run([], io.StringIO())
    assert "3/3" in shown and "tok/s" in shown and "τ=" in shown and "autoregressive" in shown
    assert "tok/s" not in quiet and "tok/s" not in plain and quiet == plain
    assert shown_out == quiet_out == plain_out
    (tmp_path / "one.jsonl").write_text(json.dumps({"prompt_ids": PROMPTS[0]}) + "\n")
    _, one = run(["--prompts-file", tmp_path / "one.jsonl"], Terminal())
    assert "tok/s" not in one  # one request streams its text: no bar


def test_progress_lines_off_a_terminal(tiny_target, tmp_path, monkeypatch):
    """Off a terminal (a batch job's log) several requests print plain progress lines on stderr, at most
    one every `Lines.every` seconds (here 0, so one a request); standard output is unchanged."""
    from support import runlog

    init = runlog.Lines.__init__
    monkeypatch.setattr(runlog.Lines, "__init__", lambda self, every=60.0: init(self, 0.0))
    pf = tmp_path / "p.jsonl"
    pf.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    rc, out, err = run_captured(["--target", tiny_target.path, "--prompts-file", pf, "--max-new-tokens", 6,
                                 "--batch-size", 2])
    assert rc == 0, err
    lines = [line for line in err.splitlines() if "requests done" in line]
    assert len(lines) == len(PROMPTS), err  # one a request finished (no drafter: autoregressive only)
    assert lines[-1].startswith(f"autoregressive: {len(PROMPTS)}/{len(PROMPTS)} requests done, ")
    assert "tok/s, τ=" in lines[-1]
    rc, _, quiet = run_captured(["--target", tiny_target.path, "--prompts-file", pf, "--max-new-tokens", 6,
                                 "--batch-size", 2, "--no-progress"])
    assert rc == 0 and "requests done" not in quiet


def test_the_settings_line_names_the_device_and_a_gpu_left_unused(tiny_target, monkeypatch):
    """--device defaults to cpu: the settings line says so, and where a GPU is visible, how to run on it."""
    args = ["--target", tiny_target.path, "--prompt-ids", "1,2", "--max-new-tokens", 2]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without a GPU
    rc, _, err = run_captured(args)
    assert rc == 0, err
    settings = [line for line in err.splitlines() if "threads: " in line]
    assert len(settings) == 1 and settings[0].startswith("device: cpu; threads: "), err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    rc, _, err = run_captured(args)
    assert rc == 0, err
    assert "device: cpu (a GPU is here: --device cuda runs on it); threads: " in err, err


def test_num_samples_under_greedy_decoding_says_the_samples_are_the_same(tiny_target):
    """--num-samples N decodes each prompt N times: greedy, that is N copies, and a note says so."""
    args = ["--target", tiny_target.path, "--prompt-ids", "1,2", "--max-new-tokens", 2, "--num-samples", 2]
    rc, out, err = run_captured(args)
    assert rc == 0, err
    assert "note: --num-samples 2 under greedy decoding: a prompt's samples are the same tokens" in err, err
    rc, _, err = run_captured(args + ["--temperature", 1])
    assert rc == 0 and "note: --num-samples" not in err, err
    rc, _, err = run_captured(args[:-2])
    assert rc == 0 and "note: --num-samples" not in err, err


def test_compile_says_what_comes_before_the_long_steps(tiny_target, tmp_path, monkeypatch):
    """--compile prints what it is about to do (load, then compile, cached after a first compile) before
    loading starts, so a long silent wait is explained."""
    from support.cli import UserError

    def stop(*args, **kwargs):
        raise UserError("stopped at loading")
    monkeypatch.setattr(speculate, "load_models", stop)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cc"))  # set by the run; restored after the test
    rc, _, err = run_captured(["--target", tiny_target.path, "--prompt-ids", "1,2", "--max-new-tokens", 2, "--compile",
                               "--compile-cache", tmp_path / "cc"])
    lines = err.splitlines()
    assert rc == 2 and lines[-1] == "error: stopped at loading", err
    assert lines[0].startswith("loading the models; compiling the round next") and "cached in" in lines[0], err


def test_eval_compile_says_where_its_cache_is(tmp_path, monkeypatch, capsys):
    """eval.py --compile, as speculate.py, names the compile cache before the models load."""
    import eval as ev
    from support.cli import UserError

    def stop(*args, **kwargs):
        raise UserError("stopped at loading")
    monkeypatch.setattr(ev, "load_models", stop)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "cc"))  # set by the run; restored after the test
    assert ev.main(["--max-samples", "1", "--compile", "--compile-cache", str(tmp_path / "cc"),
                    "--out", str(tmp_path / "r.json")]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1] == "error: stopped at loading", lines
    assert f"loading the models; compiling the round next (a first compile takes minutes on a CPU, then it is " \
           f"cached in {tmp_path / 'cc'})" in lines, lines


def test_a_drafter_without_its_target_says_it_needs_the_target():
    """--drafter alone (no --target): the line says the drafter needs the target it was trained for, not
    only that no target directory was given."""
    drafter = REPO_ROOT / "demo" / "drafter"
    rc, _, err = run_captured(["--drafter", drafter, "--prompt-ids", "1,2"])
    assert rc == 2 and err == f"error: --drafter {drafter}: needs --target, the target it was trained for\n", err


def test_integral_range_bounds_print_as_integers():
    """A range's integral bounds print in full (10485760, not 1.04858e+07); others as they were."""
    from types import SimpleNamespace

    from support import flags
    from support.cli import UserError, check_ranges

    with pytest.raises(UserError) as e:
        flags.check_settings(speculate.Settings(max_new_tokens=0), "cpu")
    assert str(e.value) == "--max-new-tokens: invalid value 0 (valid: 1 to 10485760)"
    for spec, value, valid in (("[0, 4611686018427387904]", -1, "0 to 4611686018427387904"),
                               ("(0, 0.5]", 0.75, "> 0 and <= 0.5"), ("[0.0001, 10000]", 0.0, "0.0001 to 10000"),
                               ("[1, inf)", 0, ">= 1"), ("(-inf, 2.5e+07)", 3e7, "< 25000000")):
        with pytest.raises(UserError) as e:
            check_ranges(SimpleNamespace(x=value), x=spec)
        assert str(e.value) == f"--x: invalid value {value!r} (valid: {valid})", spec


NO_EFFECT = "without a --drafter the decoding is autoregressive, so it would change nothing"


@pytest.mark.parametrize("flags,needle", [
    (["--confidence-threshold", 0.5], f"--confidence-threshold 0.5: thresholds a drafter's confidences; {NO_EFFECT}"),
    (["--scheduler", "hardware"], f"--scheduler hardware: chooses how many of a drafter's drafts a round verifies; "
                                  f"{NO_EFFECT}"),
    (["--scheduler", "async"], f"--scheduler async: chooses how many of a drafter's drafts a round verifies; "
                               f"{NO_EFFECT}"),
    (["--scheduler", "hardware", "--sps-table", "SPS"], f"--sps-table SPS: sizes the rounds of a drafter's scheduler; "
                                                         f"{NO_EFFECT}"),
    (["--confidence-threshold", 0.5, "--verify-buckets", "4,8"],
     f"--verify-buckets 4,8: pads the verification of a drafter's drafts; {NO_EFFECT}"),
    (["--confidence-threshold", 0.5, "--calibration", "CAL"], f"--calibration CAL: calibrates a drafter's confidence "
                                                              f"head; {NO_EFFECT}"),
    (["--calibration", "CAL"], f"--calibration CAL: calibrates a drafter's confidence head; {NO_EFFECT}"),
    (["--tree-budget", 4], f"--tree-budget 4: a tree is drafted by a --drafter; {NO_EFFECT}"),
    (["--draft-length", 3], f"--draft-length 3: sets how many drafts an Eagle3 drafter proposes; {NO_EFFECT}"),
    (["--tree-temperature", 1.0], "--tree-temperature 1: ranks the branches of a draft tree, and no --tree-budget"),
    (["--temperature", 0, "--top-k", 5], "--top-k 5: a sampling filter, and --temperature 0 decodes greedily"),
    (["--temperature", 0, "--top-p", 0.9], "--top-p 0.9: a sampling filter, and --temperature 0 decodes greedily"),
    (["--temperature", 0, "--min-p", 0.1], "--min-p 0.1: a sampling filter, and --temperature 0 decodes greedily"),
])
def test_a_setting_that_needs_a_drafter_is_refused_without_one(tiny_target, tmp_path, monkeypatch, flags,
                                                                needle):
    """Decode settings only a drafter reads (and a sampling filter at --temperature 0) would change nothing
    without --drafter: refused with one line before anything loads, not ignored in silence."""
    def loaded(*args, **kwargs):
        pytest.fail("the models were loaded before the flags were refused")
    monkeypatch.setattr(speculate, "load_models", loaded)
    given = [str(tmp_path / "s.json") if f == "SPS" else str(tmp_path / "c.json") if f == "CAL" else f
             for f in flags]
    needle = needle.replace("SPS", str(tmp_path / "s.json")).replace("CAL", str(tmp_path / "c.json"))
    rc, out, err = run_captured(["--target", tiny_target.path, "--prompt-ids", "1,2", "--max-new-tokens", 2] + given)
    _one_error_line(rc, out, err)
    assert rc == 2 and err.startswith(f"error: {needle}"), err


def test_a_sampling_filter_at_temperature_0_is_refused_with_a_drafter_too():
    """Greedy decoding drafts and accepts argmaxes, whatever a filter keeps: with a drafter as without
    one, a filter at --temperature 0 is refused, on the command line and in the API alike."""
    from support.cli import UserError

    pair = ["--target", str(REPO_ROOT / "demo" / "target"), "--drafter", str(REPO_ROOT / "demo" / "drafter")]
    rc, out, err = run_captured(pair + ["--prompt-ids", "1,2", "--temperature", "0", "--top-p", "0.5"])
    _one_error_line(rc, out, err, "--top-p 0.5: a sampling filter, and --temperature 0 decodes greedily")
    m = speculate.load()
    with pytest.raises(UserError, match="--min-p 0.1: a sampling filter"):
        speculate.generate(m, [[1, 2]], max_new_tokens=2, temperature=0, min_p=0.1)


@pytest.mark.parametrize("drafter", ["drafter", "eagle3"])
def test_a_tree_temperature_without_a_tree_is_refused(drafter):
    """--tree-temperature ranks a tree's branches: with a chain (a block drafter without --tree-budget,
    or an Eagle3 drafter) it would change nothing, on the command line and in the API alike."""
    from support.cli import UserError

    pair = ["--target", str(REPO_ROOT / "demo" / "target"), "--drafter", str(REPO_ROOT / "demo" / drafter)]
    rc, out, err = run_captured(pair + ["--prompt-ids", "1,2", "--tree-temperature", "0.5"])
    _one_error_line(rc, out, err, "--tree-temperature 0.5", "no --tree-budget")
    m = speculate.load(str(REPO_ROOT / "demo" / "target"), str(REPO_ROOT / "demo" / drafter))
    with pytest.raises(UserError, match="--tree-temperature 0.5: ranks the branches"):
        speculate.generate(m, [[1, 2]], max_new_tokens=2, tree_temperature=0.5)


@pytest.mark.parametrize("extra", [["--drafter", "DRAFTER"], ["--random-init", "qwen3-8b"], []])
def test_drafter_settings_pass_where_there_is_a_drafter(extra, tmp_path):
    """The same settings are taken with a --drafter, with --random-init (it brings one) and in the demo
    (which has one); without a drafter a sampling filter alone (T = 1), --scheduler none and the default
    --tree-temperature are taken too."""
    import tyro

    from support import flags

    extra = [str(REPO_ROOT / "demo" / "drafter") if x == "DRAFTER" else x for x in extra]
    target = [] if extra[:1] != ["--drafter"] else ["--target", str(REPO_ROOT / "demo" / "target")]
    for given in (["--confidence-threshold", "0.5"], ["--tree-budget", "4"],
                  ["--tree-budget", "4", "--tree-temperature", "1.0"]):
        args = tyro.cli(flags.Args, args=target + extra + ["--prompt-ids", "1,2"] + given)
        args, _, _ = flags.resolve_demo(args, str(REPO_ROOT / "demo"))
        flags.check_command_line(args)
    for given in (["--top-k", "5"], ["--scheduler", "none"], ["--tree-temperature", "0.3"], ["--temperature", "0"]):
        args = tyro.cli(flags.Args, args=["--target", str(REPO_ROOT / "demo" / "target"), "--prompt-ids", "1,2"]
                        + given)
        flags.check_command_line(args)


@pytest.mark.parametrize("setting", [dict(scheduler="hardware"), dict(confidence_threshold=0.5),
                                     dict(scheduler="threshold", confidence_threshold=0.5, verify_buckets="1,2")])
def test_the_api_refuses_a_drafters_setting_without_a_drafter(setting):
    """generate() with models that have no drafter refuses what only a drafter's round reads, as the command
    line does (it decoded autoregressively and said nothing)."""
    from support.cli import UserError

    m = speculate.load(str(REPO_ROOT / "demo" / "target"))
    with pytest.raises(UserError, match="without a --drafter the decoding is autoregressive"):
        speculate.generate(m, [[1, 2]], max_new_tokens=2, **setting)


def test_triton_kernels_where_triton_cannot_run_are_refused_by_every_program(monkeypatch, capsys):
    """--kernels triton on a CPU without Triton's interpreter: one line from speculate.py, eval.py and the API
    alike (eval.py and the API fell back to the torch kernels in silence)."""
    import eval as ev
    import kernels
    from support.cli import UserError

    monkeypatch.setattr(kernels, "_triton_ok", lambda *tensors: False)
    target = str(REPO_ROOT / "demo" / "target")
    rc, out, err = run_captured(["--target", target, "--prompt-ids", "1,2", "--kernels", "triton"])
    _one_error_line(rc, out, err, "--kernels triton: the Triton kernels need")
    rc = ev.main(["--target", target, "--kernels", "triton", "--max-samples", "1"])
    _one_error_line(rc, *capsys.readouterr(), "--kernels triton: the Triton kernels need")
    m = speculate.load(target)
    with pytest.raises(UserError, match="--kernels triton: the Triton kernels need"):
        speculate.generate(m, [[1, 2]], max_new_tokens=2, kernels="triton")


def test_triton_interpret_set_after_triton_was_imported_says_so():
    """Building a model imports triton (through torch), which fixes its mode: TRITON_INTERPRET=1 set after
    load() was refused with 'set TRITON_INTERPRET=1', which the caller had just done."""
    pytest.importorskip("triton")
    code = ("import os, sys, speculate; m = speculate.load(); print('triton' in sys.modules)\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "try: speculate.generate(m, [[5, 6, 7]], max_new_tokens=2, kernels='triton')\n"
            "except speculate.UserError as e: print(e)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    imported, said = done.stdout.strip().splitlines()
    if imported != "True":  # this torch did not import triton: nothing fixed its mode early
        pytest.skip("loading did not import triton")
    assert said == ("--kernels triton: TRITON_INTERPRET=1 was set after triton was imported, "
                                   "which fixes its mode: set it before importing torch"), said


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_triton_kernels_on_cuda_without_cuda_are_one_line(capsys):
    """--kernels triton --device cuda where torch has no CUDA: one line naming the device (checked with the
    settings, first), not torch's AssertionError from building a tensor on the device."""
    rc = speculate.main(["--target", str(REPO_ROOT / "demo" / "target"), "--prompt-ids", "1,2", "--kernels", "triton",
                         "--device", "cuda"])
    assert rc == 2 and capsys.readouterr().err == "error: --device cuda: no CUDA device is available\n"


@pytest.mark.parametrize("device", ["", 0, False])
def test_a_falsy_device_is_refused_not_taken_for_the_default(device):
    """resolve_device's default is for no device (None); an empty or falsy one picked cpu or cuda in
    silence."""
    with pytest.raises(cli.UserError) as e:
        cli.resolve_device(device)
    assert str(e.value) == f"--device {device!r}: cpu, cuda or cuda:N"


def test_the_api_takes_numpy_token_ids_and_names_a_mixed_list():
    """numpy's integers are token ids, as they are settings; a list that mixes ids with something else is
    named for what it is (it was called a conversation without a chat template)."""
    import numpy as np

    from support.cli import UserError

    m = speculate.load(str(REPO_ROOT / "demo" / "target"))
    plain = speculate.generate(m, [5, 6], max_new_tokens=3)
    numpy_ids = speculate.generate(m, [np.int64(5), np.int64(6)], max_new_tokens=3)
    assert numpy_ids[0].output_ids == plain[0].output_ids
    assert numpy_ids[0].prompt_ids == [5, 6] and all(type(t) is int for t in numpy_ids[0].prompt_ids)
    with pytest.raises(UserError, match="^prompt 0: token ids hold True, which is not a token id$"):
        speculate.generate(m, [True, 5], max_new_tokens=3)
    with pytest.raises(UserError, match="^prompts: a list mixing token ids and other prompts"):
        speculate.generate(m, [5, "a"], max_new_tokens=3)
    # an array, a tensor or a list of lists among the prompts is named for what it is, not a conversation
    for prompt, kind in ((np.array([1, 2]), "ndarray"), (torch.tensor([1, 2]), "Tensor"), ([[1]], "list")):
        with pytest.raises(UserError, match=rf"^prompt 0: expected a text, a list of token ids or a conversation "
                                            rf".*, got {kind} "):
            speculate.generate(m, [prompt], max_new_tokens=3)


def test_a_file_the_system_refuses_is_one_line(tmp_path, capsys):
    """An OSError that names its file (no permission, a full disk) is one line naming it and exit 1, not a
    traceback; one that names none is the code's and stays a traceback."""
    from dataclasses import dataclass

    @dataclass
    class Nothing:
        pass

    def refused(args):
        raise PermissionError(13, "Permission denied", str(tmp_path / "prompts.jsonl"))

    assert cli_main(Nothing, refused, []) == 1
    assert capsys.readouterr().err == f"error: {tmp_path / 'prompts.jsonl'}: Permission denied\n"

    def nameless(args):
        raise OSError("something else")

    with pytest.raises(OSError, match="something else"):
        cli_main(Nothing, nameless, [])


@pytest.mark.parametrize("script,reads,refused", [
    ("scripts/bench.py", "bench.py reads --max-new-tokens, --seed,", ["--batch-size", "--top-k"]),
    ("scripts/bench_concurrency.py", "bench_concurrency.py reads --max-new-tokens, --temperature,", ["--top-k"]),
    ("scripts/regenerate.py", "regenerate.py reads --max-new-tokens, --temperature,", ["--scheduler"]),
])
def test_a_scripts_help_says_which_decode_flags_it_reads(script, reads, refused):
    """The scripts list speculate.py's decode flags with speculate.py's help text; their description says
    which they read (the others, listed too, are refused whatever their value)."""
    p = subprocess.run([sys.executable, str(REPO_ROOT / script), "--help"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert p.returncode == 0, p.stderr
    description = " ".join(p.stdout.split("╭")[0].split())
    assert reads in description and "; any other is refused." in description, description
    for name in refused:
        assert name not in description.split("; any other")[0]


def test_the_prompt_flags_help_says_when_it_is_rendered_as_a_chat():
    """--prompt is rendered as --chat decides: a tokenizer without a template (the demo's) sends it raw
    unless --chat, so its help does not say it is rendered unless --no-chat."""
    p = subprocess.run([sys.executable, str(REPO_ROOT / "speculate.py"), "--help"], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, COLUMNS="200"))
    assert p.returncode == 0, p.stderr
    entry = " ".join(p.stdout.split("--prompt {None}|STR")[1].split("--prompt-ids")[0].replace("│", " ").split())
    assert entry.startswith("One prompt as text, rendered as a chat if --chat is on (its default: on when the "
                            "tokenizer has a template)"), entry


@pytest.mark.parametrize("program,argv", [
    ("speculate.py", []),
    ("scripts/bench.py", []),
    ("scripts/bench_concurrency.py", []),
    ("scripts/regenerate.py", ["--target", "demo/target", "--prompts", "p.jsonl", "--out", "o.jsonl"]),
])
def test_one_process_programs_refuse_torchrun_in_one_line(program, argv, monkeypatch, capsys):
    """Under torchrun each process would do all the work and write the same files: refused, one line in all
    (rank 0's; the other ranks leave silently, with 0 lest torchrun stop rank 0 before its line), before
    anything runs."""
    import importlib

    path = REPO_ROOT / program
    monkeypatch.syspath_prepend(str(path.parent))
    module = importlib.import_module(path.stem)
    for name, value in {"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "0")
    assert module.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {path.name} runs as one process, not under torchrun: "), err
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(SystemExit) as e:
        module.main(argv)
    assert e.value.code == 0 and capsys.readouterr().err == ""


TYRO_PROGRAMS = ["speculate.py", "eval.py", "train.py", "scripts/regenerate.py", "scripts/bench.py",
                 "scripts/bench_concurrency.py", "scripts/train_target.py", "scripts/gemm_bench.py",
                 "scripts/demo_corpus.py", "scripts/demo_prompts.py", "scripts/demo_selfdata.py"]


def stub_lines(help_text: str) -> list[str]:
    """The help lines that hold one word although the next line's first word would fit after it: a
    docstring's source line break, kept, that left a stub of a wrapped line."""
    stubs = []
    bodies = [line.rstrip().removeprefix("│").removesuffix("│") for line in help_text.splitlines()]
    for body, after in zip(bodies, bodies[1:]):
        words = body.split()
        indent = len(body) - len(body.lstrip())
        after_indent = len(after) - len(after.lstrip())
        if len(words) != 1 or indent < 10 or not after.strip() or after_indent != indent:
            continue
        width = len(body) - 1 - indent  # the help column, less the space before the box's edge
        if len(words[0]) + 1 + len(after.split()[0]) <= width:
            stubs.append(f"{words[0]!r} before {after.strip()!r}")
    return stubs


def help_of(program: str) -> str:
    """`program --help` as a terminal shows it, at the width COLUMNS says."""
    import importlib

    module = importlib.import_module((REPO_ROOT / program).stem)  # scripts/ is on the path
    out = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # utf-8: the box a terminal shows
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        module.main(["--help"])
    out.seek(0)
    return out.read()


def continued_help_lines(help_text: str) -> list[str]:
    """The option lines whose help goes on from the line above: at a width no help fills, a line
    break that tyro kept (a docstring's source line break)."""
    continued = []
    bodies = [line.rstrip().removeprefix("│").removesuffix("│").rstrip() for line in help_text.splitlines()]
    for above, body in zip(bodies, bodies[1:]):
        column = len(body) - len(body.lstrip())
        if not body.strip() or column < 10 or body.lstrip().startswith("-"):
            continue
        if len(above) <= column or above[column] == " ":
            continue  # the line above holds no help: a flag whose help starts on this line
        if len(above) - len(above.lstrip()) == column or above[column - 2:column] == "  ":
            continued.append(body.strip())
    return continued


def test_help_texts_are_one_line_a_paragraph_on_a_wide_terminal(monkeypatch):
    """A help docstring's source line breaks are not the help's: on a terminal wider than any help
    text, each option's help is one line (tyro kept each source line on a line of its own)."""
    monkeypatch.setenv("COLUMNS", "1000")
    continued = {}
    for program in TYRO_PROGRAMS:
        lines = continued_help_lines(help_of(program))
        if lines:
            continued[program] = lines[:3]
    assert continued == {}


def test_no_help_line_is_a_stub_of_a_wrapped_sentence(monkeypatch):
    """In the 80-column box no help line is one word that the next line's first would have joined
    ("mode," then "capped to ..."): what a docstring's source line break that tyro kept leaves."""
    monkeypatch.setenv("COLUMNS", "80")
    stubs = {}
    for program in TYRO_PROGRAMS:
        help_text = help_of(program)
        assert "╭─ options" in help_text, program
        if stub_lines(help_text):
            stubs[program] = stub_lines(help_text)
    assert stubs == {}
