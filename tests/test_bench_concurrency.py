"""scripts/bench_concurrency.py: the verification schedulers under load, on the committed demo pair."""

from __future__ import annotations

import json
import os
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import bench_concurrency as bc  # noqa: E402

from speculate import DEMO_DIR  # noqa: E402

DEMO_K = json.load(open(os.path.join(DEMO_DIR, "drafter", "config.json")))["block_size"]  # drafts per round

CONCURRENCY_FIELDS = {"concurrency", "mode", "total_tokens_per_second", "per_request_tokens_per_second",
                      "acceptance_length", "verified_per_round", "tokens", "seconds", "vs_none", "profile_seconds",
                      "outputs_agree", "modelled_tokens_per_unit"}
MODES = ("autoregressive", "none", "threshold", "hardware", "async")


def test_concurrency_mode_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "conc.json", tmp_path / "conc.png"
    # The demo head's confidences sit around 0.75-0.9: at 0.8 the threshold scheduler cuts some rounds short.
    rc = bc.main(["--concurrency", "1,2", "--max-new-tokens", "12", "--repeats", "2", "--requests-per-slot", "2",
                     "--out", str(out), "--plot", str(png)])
    assert rc == 0, capsys.readouterr().err
    result = json.load(open(out))
    rows = result["rows"]
    assert [(r["concurrency"], r["mode"]) for r in rows] == [(c, m) for c in (1, 2) for m in MODES]
    assert all(CONCURRENCY_FIELDS <= set(r) for r in rows)
    assert set(result["sps"]) == {"1", "2"} and set(result["sps"]["2"]) == {"hardware", "async"}
    assert result["prompts"] == 20 and result["sps_synthetic"] is None
    # The config records the flags this benchmark reads, by their names (θ as --confidence-threshold), not the
    # decode settings it refuses.
    config = result["config"]
    assert config["confidence_threshold"] == 0.8 and config["max_new_tokens"] == 12 and config["temperature"] == 0.0
    assert {"device", "dtype", "threads", "compile", "compile_mode", "seed", "concurrency"} <= set(config)
    assert not {"threshold", "scheduler", "batch_size", "top_k"} & set(config)
    for r in rows:
        c = r["concurrency"]
        assert r["outputs_agree"] is True  # greedy: bench raises if any scheduler's tokens differ
        assert r["tokens"] == 12 * c * 2  # c x 2 requests; the demo prompts are code: no EOS within 12 tokens
        assert len(r["total_tokens_per_second_runs"]) == 2
        # The medians of the repeats: tokens/s and tokens / seconds (their harmonic twin) both lie within the
        # repeats' range, however far apart a loaded machine puts the repeats.
        lo, hi = min(r["total_tokens_per_second_runs"]), max(r["total_tokens_per_second_runs"])
        assert lo <= r["total_tokens_per_second"] <= hi
        assert lo * (1 - 1e-9) <= r["tokens"] / r["seconds"] <= hi * (1 + 1e-9)
        # c rows busy at a time: a request's own rate is at least its share of the total (within the
        # clocks' difference and the drain at the end, when fewer than c requests are left).
        assert r["per_request_tokens_per_second"] >= 0.5 * r["total_tokens_per_second"] / c
        assert (r["profile_seconds"] is not None) == (r["mode"] in ("hardware", "async"))
        assert r["modelled_tokens_per_unit"] is None
        none = next(x for x in rows if x["concurrency"] == c and x["mode"] == "none")
        assert r["vs_none"] == pytest.approx(r["total_tokens_per_second"] / none["total_tokens_per_second"])
        if r["mode"] == "autoregressive":
            assert r["acceptance_length"] == 1 and r["verified_per_round"] == 0
        else:
            assert 1 < r["acceptance_length"] <= DEMO_K + 1 and 0 <= r["verified_per_round"] <= DEMO_K
    by = {(r["concurrency"], r["mode"]): r for r in rows}
    assert by[1, "none"]["verified_per_round"] == DEMO_K
    assert by[1, "threshold"]["verified_per_round"] < DEMO_K
    printed = capsys.readouterr().out
    assert printed.count("\n| 2 | ") == 5 and "| total ÷ none |" in printed and "modelled" not in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # drawn by plots.py (tests/test_plots.py checks the figure)
    assert result["complete"] is True


def test_an_interrupted_run_keeps_the_levels_it_finished(tmp_path, capsys, monkeypatch):
    """--out is rewritten after every level, marked incomplete until the last: SIGTERM during the second
    level leaves the first's rows, and the last line names the file (it said so and kept nothing)."""
    import signal

    from support.cli import Interrupted

    real = bc.run_level

    def run_level(args, s, m, prompts, modes, c):
        if c == 2:
            raise Interrupted(signal.SIGTERM)
        return real(args, s, m, prompts, modes, c)

    monkeypatch.setattr(bc, "run_level", run_level)
    out = tmp_path / "conc.json"
    argv = ["--concurrency", "1,2", "--max-new-tokens", "4", "--repeats", "1", "--requests-per-slot", "1",
            "--schedulers", "none"]
    assert bc.main(argv + ["--out", str(out)]) == 143
    assert f"what was written: {out}" in capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["complete"] is False and {r["concurrency"] for r in result["rows"]} == {1}
    assert bc.main(argv) == 143
    assert "nothing was written (--out FILE keeps each finished level)" in capsys.readouterr().err


def test_caches_past_free_memory_are_refused_before_the_first_level(monkeypatch, capsys):
    """The largest level's KV caches are checked against free memory as speculate.py checks its batch:
    one line naming --concurrency (an allocator traceback came after the models were built)."""
    from support import flags

    monkeypatch.setattr(flags, "free_memory", lambda device: 1 << 20)
    assert bc.main(["--concurrency", "1,64", "--max-new-tokens", "4", "--schedulers", "none"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the KV caches for --concurrency 64 x ") and "lower --concurrency" in err, err


def test_concurrency_outputs_that_differ_fail_loudly(monkeypatch):
    timed = bc.timed_generate

    def corrupt_hardware(engine, prompts, max_new_tokens):
        r = timed(engine, prompts, max_new_tokens)
        if engine.scheduler.kind == "hardware":
            r["outputs"][0][-1] += 1
        return r

    monkeypatch.setattr(bc, "timed_generate", corrupt_hardware)
    with pytest.raises(AssertionError, match="hardware .* different tokens"):
        bc.main(["--concurrency", "1", "--max-new-tokens", "4", "--repeats", "1"])


def test_cliffs_sps_is_flat_inside_a_tile_and_drops_past_its_edge():
    sps = bc.cliffs_sps(40)
    assert len(sps) == 41 and sps[0] == sps[1] == sps[16] == pytest.approx(1 / 1.25)
    assert sps[17] == sps[32] == pytest.approx(1 / 1.5) and sps[33] == pytest.approx(1 / 1.75)


@pytest.mark.parametrize("kind", ["hardware", "async"])
def test_a_synthetic_curve_prices_a_compiled_round_at_its_bucket(kind):
    """Compiled, a round of n verify tokens is padded to a bucket, which the engine pays and the modelled
    column charges: the schedulers price it there too, as a profiled table's route does (they priced SPS(n):
    70 tokens at 0.444, padded to 96 at 0.400). Eager, the curve is taken as it is."""
    from scheduler import Scheduler

    curve = bc.cliffs_sps(12 * 8)
    compiled = Scheduler(kind, 7, 12, compiled=True)
    bc.use_curve(compiled, curve)
    assert compiled.bucket(70) == 96 and compiled.sps[70] == pytest.approx(curve[96])
    assert all(compiled.sps[n] == pytest.approx(curve[compiled.bucket(n)]) for n in range(1, 12 * 8 + 1))
    eager = Scheduler(kind, 7, 12)
    bc.use_curve(eager, curve)
    assert eager.sps.tolist() == curve and eager.bucket(70) == 70


def test_concurrency_with_a_synthetic_sps_curve(tmp_path, capsys):
    out = tmp_path / "conc.json"
    rc = bc.main(["--concurrency", "4", "--schedulers", "none,hardware,async", "--sps-synthetic", "cliffs",
                  "--max-new-tokens", "8", "--repeats", "1", "--requests-per-slot", "1", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    result = json.load(open(out))
    assert result["sps_synthetic"] == "cliffs"
    assert result["sps"]["4"]["async"]["steps_per_second"] == pytest.approx(bc.cliffs_sps(4 * (DEMO_K + 1)))
    for r in result["rows"]:
        assert r["profile_seconds"] is None and r["outputs_agree"] is True
        assert r["modelled_tokens_per_unit"] > 0
    auto = next(r for r in result["rows"] if r["mode"] == "autoregressive")
    # Four rows of 1 token each: every round costs 1.25 units, one token per request per round.
    assert auto["modelled_tokens_per_unit"] == pytest.approx(4 / 1.25, rel=0.05)
    assert "modelled tokens per unit (synthetic SPS)" in capsys.readouterr().out


def test_concurrency_prompts_file_and_sampling(tmp_path, capsys):
    from support.text import Tokenizer

    pf = tmp_path / "p.jsonl"
    ids = Tokenizer(os.path.join(DEMO_DIR, "target")).encode("import os\n")
    pf.write_text(json.dumps({"prompt": "def main():\n"}) + "\n" + json.dumps({"prompt_ids": ids}) + "\n")
    out = tmp_path / "conc.json"
    rc = bc.main(["--concurrency", "3", "--schedulers", "hardware", "--prompts-file", str(pf),
                     "--temperature", "1.0", "--max-new-tokens", "6", "--repeats", "1", "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    result = json.load(open(out))
    assert result["prompts"] == 2  # cycled to fill the batch of 3
    assert [r["mode"] for r in result["rows"]] == ["autoregressive", "hardware"]
    assert all(r["outputs_agree"] is None and r["vs_none"] is None for r in result["rows"])  # sampled; no none


@pytest.mark.parametrize("flags,needle", [
    (["--concurrency", "1,x"], "--concurrency: '1,x' is not"),
    (["--concurrency", "0"], "--concurrency: '0' must be"),
    (["--concurrency", "2", "--schedulers", "none,fast"], "--schedulers"),
    (["--concurrency", "2", "--schedulers", "none,threshold", "--sps-synthetic", "cliffs"], "--sps-synthetic"),
    (["--concurrency", "2", "--confidence-threshold", "0"], "--confidence-threshold: invalid"),
    (["--concurrency", "2", "--confidence-threshold", "1.5"], "--confidence-threshold: invalid"),
    (["--concurrency", "2", "--schedulers", "none,hardware", "--confidence-threshold", "0.5"],
     "--confidence-threshold 0.5: only the threshold scheduler reads it"),
    (["--concurrency", "2", "--scheduler", "async"], "--scheduler: bench_concurrency.py times every scheduler of "
                                                     "--schedulers"),
    (["--concurrency", "2", "--batch-size", "8"], "--batch-size: bench_concurrency.py decodes --concurrency"),
    (["--concurrency", "2", "--top-k", "5"], "--top-k: bench_concurrency.py decodes with --max-new-tokens"),
    (["--concurrency", "2", "--top-p", "0.9"], "(speculate.py decodes with it)"),
    (["--concurrency", "2", "--temperature", "None"], "--temperature None"),
    (["--concurrency", "2", "--threads", "0"], "--threads: invalid"),
    (["--concurrency", "2", "--compile-cache", "c"], "--compile-cache: only used with --compile"),
    (["--concurrency", "2", "--repeats", "0"], "--repeats: invalid"),
    (["--max-new-tokens", "0"], "--max-new-tokens: invalid"),
    (["--max-new-tokens", "1"], "--max-new-tokens: invalid value 1"),  # the prefill's token: no round
    (["--concurrency", "2", "--plot", "c.pdf"], "--plot c.pdf"),
    (["--concurrency", "2", "--target", "somewhere"], "give both"),
    (["--concurrency", "2", "--prompts-file", "/nonexistent.jsonl"], "prompts file not found"),
    (["--prompts-file", ""], "--prompts-file: empty path"),  # was the demo's prompts, without a word
    (["--concurrency", "2", "--plot", "/nonexistent/c.png"], "--plot /nonexistent/c.png: directory"),
    (["--out", "/"], "--out /: is a directory"),
])
def test_concurrency_bad_flags(flags, needle, capsys):
    assert bc.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err


def test_prompts_file_needed_is_said_before_the_models_load(monkeypatch, capsys):
    """A pair named by --target/--drafter (here the demo's own, spelled out) without --prompts-file: one line
    before any model loads (it came after), which does not call it another pair than the demo's."""
    monkeypatch.setattr(bc, "load_models", None)  # loading the models would be a TypeError
    assert bc.main(["--concurrency", "1", "--target", os.path.join(DEMO_DIR, "target"), "--drafter",
                    os.path.join(DEMO_DIR, "drafter")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --prompts-file: needed with --target/--drafter") and err.count("\n") == 1, err
    assert bc.main(["--concurrency", "1", "--target", os.path.join(DEMO_DIR, "target"), "--drafter",
                    os.path.join(DEMO_DIR, "drafter"), "--prompts-file", "no-such.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --prompts-file no-such.jsonl: prompts file not found\n", err
    assert bc.main(["--concurrency", "1", "--target", os.path.join(DEMO_DIR, "target"), "--drafter",
                    os.path.join(DEMO_DIR, "drafter"), "--prompts-file", DEMO_DIR]) == 2
    err = capsys.readouterr().err
    assert err == f"error: --prompts-file {DEMO_DIR}: is a directory, not a file\n", err


def test_a_prompt_past_the_drafters_context_is_refused_with_the_users_budget(tmp_path, capsys):
    """As speculate.py checks it: the drafter's positions bound the prompt too, with --max-new-tokens named
    (the engine refused it later, naming the warm-up's budget)."""
    import shutil
    drafter = tmp_path / "drafter"
    shutil.copytree(os.path.join(DEMO_DIR, "drafter"), drafter)
    cfg = json.loads((drafter / "config.json").read_text())
    cfg["max_position_embeddings"] = 64
    (drafter / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt_ids": list(range(1, 101))}) + "\n")
    rc = bc.main(["--concurrency", "1", "--target", os.path.join(DEMO_DIR, "target"), "--drafter", str(drafter),
                  "--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "16", "--schedulers", "threshold"])
    err = capsys.readouterr().err
    assert rc == 2 and "100 tokens + --max-new-tokens 16 exceed the drafter's context of 64" in err, err


def test_a_chat_template_that_cannot_be_used_is_refused_as_speculate_refuses_it(tmp_path, capsys):
    """A template list without a "default" one: text prompts would go in as raw text, unlike a usable
    template's; speculate.py refuses such a target, and so does this benchmark (one line, before timing)."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(os.path.join(DEMO_DIR, "target"), target)
    (target / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use",
                                                                               "template": "x"}]}))
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "def foo"}) + "\n")
    rc = bc.main(["--concurrency", "1", "--target", str(target), "--drafter", os.path.join(DEMO_DIR, "drafter"),
                  "--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "4", "--schedulers", "none",
                  "--repeats", "1", "--requests-per-slot", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "names no 'default' template" in err and err.count("\n") == 1, err


def test_schedulers_that_read_confidences_need_a_drafter_with_a_confidence_head(tmp_path, capsys):
    """An Eagle3 drafter has no confidence head: the scheduled modes are refused with one line (the
    async one failed inside the profile, the others ran as `none` under their names); `none` runs."""
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt_ids": [1, 2, 3]}) + "\n")
    base = ["--concurrency", "1", "--target", os.path.join(DEMO_DIR, "target"), "--drafter",
            os.path.join(DEMO_DIR, "eagle3"), "--prompts-file", str(tmp_path / "p.jsonl"), "--max-new-tokens", "4"]
    capsys.readouterr()
    assert bc.main(base + ["--schedulers", "none,threshold"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --schedulers none,threshold: threshold read") and err.count("\n") == 1, err
    assert bc.main(base + ["--schedulers", "none"]) == 0


def test_low_precision_counts_differences_instead_of_raising(monkeypatch, tmp_path):
    """In bf16/fp16 a near-tie can flip an argmax between a verify pass and a one-token step, as bench.py
    allows: the outputs are compared inexactly, and a mode that differed is recorded as not agreeing
    rather than stopping the benchmark."""
    seen = []

    def compare(runs, prompts, target, exact, what):
        seen.append(exact)
        return {"hardware": [{"request": 0, "repeat": 0, "first_token": 3, "logit_gap": 0.01}]}

    monkeypatch.setattr(bc, "compare_outputs", compare)
    out = tmp_path / "conc.json"
    rc = bc.main(["--concurrency", "1", "--max-new-tokens", "4", "--repeats", "1", "--requests-per-slot", "1",
                  "--schedulers", "none,hardware", "--dtype", "bfloat16", "--out", str(out)])
    assert rc == 0
    assert seen == [False]
    agree = {r["mode"]: r["outputs_agree"] for r in json.load(open(out))["rows"]}
    assert agree == {"autoregressive": True, "none": True, "hardware": False}


def test_a_level_where_no_round_ran_prints_no_tau():
    """Requests that all stop at their first token run no round: τ and the verified drafts are none, shown
    as a dash in the table (a number formatted from None was a traceback after every level had run)."""
    run = {"total_tokens_per_second": 10.0, "per_request_tokens_per_second": 10.0, "acceptance_length": None,
           "verified_per_round": None, "tokens": 4, "seconds": 0.4}
    engine = SimpleNamespace(compile_seconds=0.0)
    row = bc.level_row([run, dict(run, total_tokens_per_second=12.0)], 2, "none", engine, None, None, True)
    assert row["acceptance_length"] is None and row["total_tokens_per_second"] == 11.0
    row["vs_none"] = 1.0
    assert bc.table_markdown([row]).splitlines()[-1] == "| 2 | none | 11.0 | 10.0 | — | — | 1.00× |  |"


def test_ignore_eos_is_read_and_the_header_says_how_requests_end(monkeypatch, capsys):
    """The engines stop a request at the target's EOS, so --ignore-eos changes the run: it was refused as
    changing nothing, and the header said "N new tokens each" of requests that may stop sooner."""
    seen = []
    real = bc.Engine

    def engine(*args, **kwargs):
        seen.append(tuple(kwargs["stop_ids"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(bc, "Engine", engine)
    flags = ["--concurrency", "1", "--max-new-tokens", "4", "--repeats", "1", "--requests-per-slot", "1",
             "--schedulers", "none"]
    assert bc.main(flags) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "at most 4 new tokens each (the target's EOS ends a request)" in header
    assert seen and all(ids for ids in seen)
    seen.clear()
    assert bc.main(flags + ["--ignore-eos"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert ", 4 new tokens each," in header and seen and all(ids == () for ids in seen)


def test_calibration_is_applied_and_refused_where_nothing_reads_it(tmp_path, monkeypatch, capsys):
    """performance.md says to calibrate the head before comparing hardware and async: the benchmark that
    compares them takes --calibration now (no such flag), and refuses it with --schedulers none."""
    cal = tmp_path / "sts.json"
    cal.write_text(json.dumps({"temperatures": [2.0] * DEMO_K}))
    seen = {}
    real = bc.load_models

    def load_models(*args, **kwargs):
        m = real(*args, **kwargs)
        seen["temperatures"] = m.drafter.confidence_head.temperature.tolist()
        return m

    monkeypatch.setattr(bc, "load_models", load_models)
    out = tmp_path / "c.json"
    flags = ["--concurrency", "1", "--max-new-tokens", "4", "--repeats", "1", "--requests-per-slot", "1",
             "--calibration", str(cal)]
    assert bc.main(flags + ["--schedulers", "threshold", "--out", str(out)]) == 0, capsys.readouterr().err
    assert seen["temperatures"] == [2.0] * DEMO_K
    assert json.load(open(out))["config"]["calibration"] == str(cal)
    capsys.readouterr()
    assert bc.main(flags + ["--schedulers", "none"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --calibration {cal}: only a scheduler"), err
    assert "of a --drafter with a confidence head" in err[0]  # a head-less drafter refuses a scheduler


def test_compile_says_what_it_compiles(tmp_path, monkeypatch, capsys):
    """--compile: a line before the models load (speculate.py's), then one on stderr for each engine
    compiled, every concurrency compiling every mode; minutes each on a CPU, so a run is not silent. The
    engines here run eagerly (their warmup is what compiles)."""
    from support.flags import compiling_line

    real = bc.Engine
    verbose = []

    def eager(*args, **kwargs):
        verbose.append(kwargs["compile_verbose"])
        return real(*args, **dict(kwargs, compile=False))

    monkeypatch.setattr(bc, "Engine", eager)
    cache = tmp_path / "cache"
    argv = ["--compile", "--compile-cache", str(cache), "--concurrency", "1,2", "--schedulers", "none",
            "--max-new-tokens", "4", "--repeats", "1", "--requests-per-slot", "1"]
    assert bc.main(argv + ["--verbose"]) == 0  # read, as speculate.py and bench.py read it
    assert verbose == [True] * 4
    capsys.readouterr()
    assert bc.main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == compiling_line(str(cache), 4), err
    compiling = [line for line in err if ": compiling " in line]
    assert compiling == [f"concurrency {c}: compiling {mode} ({i}/2)" for c in (1, 2)
                         for i, mode in enumerate(("autoregressive", "none"), 1)], err
