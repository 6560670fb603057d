"""bench.py's loops agree with each other, and the random real-shaped presets have the right shapes."""

from __future__ import annotations

import json
import logging
import sys
import warnings

import pytest

from drafters import make_drafter, make_target

import bench
from drafter import random_drafter
from model import random_target


def test_presets_on_meta():
    t = random_target("qwen3-8b", device="meta")
    assert sum(p.numel() for p in t.parameters()) == 8_190_735_360
    d = random_drafter(t)
    assert d.cfg.target_layer_ids == (1, 9, 17, 25, 33) and d.cfg.block_size == 7
    assert d.cfg.layers.num_hidden_layers == 5 and d.cfg.markov_rank == 256 and d.cfg.confidence_with_markov
    assert random_drafter(random_target("qwen3-14b", device="meta")).cfg.target_layer_ids == (1, 10, 19, 28, 37)
    t4 = random_target("qwen3-4b", device="meta")
    assert t4.lm_head.weight is t4.embed_tokens.weight


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_bench_rows_and_reference_agree(tmp_path, capsys):
    target = make_target(tmp_path / "t")
    drafter = make_drafter(tmp_path / "d", target, oracle=True, oracle_scale=4.0, norm_scale=0.05)
    out = tmp_path / "bench.json"
    # The reference loop hands transformers a cache object under the keyword it wants: no deprecation
    # warning, neither a Python one nor one through transformers' (once-only, so reset) logger.
    once = getattr(logging.Logger, "warning_once", None)
    if hasattr(once, "cache_clear"):
        once.cache_clear()
    logged = _Records()
    logging.getLogger("transformers").addHandler(logged)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            # bench.run raises if speculative != autoregressive output, or the reference loop differs.
            rc = bench.main(["--target", target, "--drafter", drafter, "--no-compile", "--batch-sizes", "1,2",
                             "--prompt-len", "6", "--max-new-tokens", "20", "--reference", "True", "--repeats", "2",
                             "--out", str(out)])
    finally:
        logging.getLogger("transformers").removeHandler(logged)
    assert rc == 0, capsys.readouterr().err
    assert [str(w.message) for w in warned] == [] and logged.messages == []
    rows = json.load(open(out))["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [
        ("autoregressive", 1), ("speculative", 1), ("reference (transformers target, eager drafter)", 1),
        ("autoregressive", 2), ("speculative", 2)]
    spec = [r for r in rows if r["mode"] == "speculative"]
    assert all(r["acceptance_length"] > 2 for r in spec)
    assert all(r["bytes_per_round"] > 0 and r["round_ms"] > 0 for r in spec)
    for r in rows:  # the split comes from one run's own rounds: its parts add up to that round, none negative
        if "draft_ms" in r:
            assert min(r["draft_ms"], r["verify_ms"], r["rest_ms"]) >= 0 and r["verify_ms"] > 0
            assert r["draft_ms"] + r["verify_ms"] + r["rest_ms"] == pytest.approx(r["split_round_ms"], rel=1e-9)
            assert (r["draft_ms"] > 0) == (r["mode"] == "speculative")
    result = json.load(open(out))
    assert result["complete"] is True  # rewritten after each batch size; the last one marks it complete
    assert all(len(r["tokens_per_second_runs"]) == 2 for r in rows)
    assert [r["ratio"] for r in result["ratios"]] == [
        "speculative / autoregressive at batch 1", "this engine / the reference loop at batch 1",
        "speculative / autoregressive at batch 2"]
    assert all(len(r["runs"]) == 2 and r["median"] > 0 for r in result["ratios"])
    printed = capsys.readouterr().out
    assert "speculative / autoregressive at batch 1" in printed and "copy bandwidth" in printed


def test_reference_loop_without_transformers(tmp_path, capsys, monkeypatch):
    """transformers is test-only: without it the default skips the reference loop with one line on
    stderr, and asking for it (--reference True) is a one-line error before anything is built."""
    target = make_target(tmp_path / "t")
    drafter = make_drafter(tmp_path / "d", target, oracle=True)
    capsys.readouterr()  # (building them printed a progress bar)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers now fails
    out = tmp_path / "bench.json"
    flags = ["--target", target, "--drafter", drafter, "--no-compile", "--prompt-len", "6", "--max-new-tokens", "8",
             "--repeats", "1"]
    assert bench.main(flags + ["--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reference loop" in err and "skipped: transformers is not installed" in err, err
    assert [r["mode"] for r in json.load(open(out))["rows"]] == ["autoregressive", "speculative"]
    assert bench.main(flags + ["--reference", "True"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --reference") and "not installed" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("flags,needle", [
    (["--repeats", "0"], "--repeats: invalid value 0 (valid: 1 to 1000)"),
    (["--batch-sizes", "1,1"], "--batch-sizes: '1,1' must be distinct positive"),
    (["--batch-sizes", "1,x"], "--batch-sizes: '1,x' is not"),
    (["--max-new-tokens", "0"], "--max-new-tokens: invalid"),
    (["--threads", "-1"], "--threads: invalid"),
    (["--out", "/"], "--out /: is a directory"),
    (["--kernels", "triton"], "--kernels triton: the Triton kernels need"),  # cpu, outside the interpreter
])
def test_bad_flags(flags, needle, capsys):
    assert bench.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err


def test_outputs_must_match_in_float32_and_are_counted_otherwise(tmp_path):
    """bench.compare_outputs: float32 raises on any difference; bf16 reports each differing request with
    the target's top-2 logit gap where it starts (K+1-token verify vs 1-token step rounding)."""
    from model import load_target

    target = load_target(make_target(tmp_path / "t"))
    prompts = [[1, 2, 3], [4, 5]]
    runs = {"autoregressive": [{"outputs": [[7, 8, 9], [10, 11]]}],
            "speculative": [{"outputs": [[7, 8, 9], [10, 12]]}]}
    with pytest.raises(AssertionError, match="speculative .* different tokens"):
        bench.compare_outputs(runs, prompts, target, exact=True, what="batch 2")
    differ = bench.compare_outputs(runs, prompts, target, exact=False, what="batch 2")
    assert list(differ) == ["speculative"]
    (d,) = differ["speculative"]
    assert d["request"] == 1 and d["first_token"] == 1 and d["logit_gap"] >= 0
    runs["speculative"][0]["outputs"][1] = [10, 11]
    assert bench.compare_outputs(runs, prompts, target, exact=True, what="batch 2") == {}


def device_run_module():
    import importlib.util

    from conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location("device_run", REPO_ROOT / "scripts" / "device_run.py")
    device_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(device_run)
    return device_run


def test_device_script_bench_steps_pass_bench_checks(tmp_path):
    """Every bench step of scripts/device_run.py, real and dry, passes bench.py's own flag checks (the first
    GPU call died there: eager-b1 had a --compile-mode without --compile); the dry run's arguments are the
    real run's but for the device, the toy-layered preset and the sizes."""
    device_run = device_run_module()
    for step in ("eager-b1", "compiled-b1", "compiled-b32", "triton-b32"):
        real = device_run.bench_args(step, False, str(tmp_path / "out.json"))
        dry = device_run.bench_args(step, True, str(tmp_path / "out.json"))
        for args in (real, dry):
            bench.check_args(bench.BenchArgs(**args))
        assert real["device"] == "cuda" and real["model"] == "qwen3-8b" and real["dtype"] == "bfloat16"
        assert real["batch_sizes"] == ("32" if step.endswith("b32") else "1")
        assert real["compile"] == (step != "eager-b1") and real.get("compile_mode") == (
            "reduce-overhead" if step != "eager-b1" else None)
        assert real["kernels"] == ("triton" if step == "triton-b32" else "torch")
        differ = {k for k in real if real[k] != dry[k]}
        assert differ == {"model", "device", "prompt_len", "max_new_tokens", "repeats"} | (
            {"batch_sizes"} if step.endswith("b32") else set()), differ
        assert dry["model"] == "qwen3-tiny"


def test_device_script_dry_run(tmp_path):
    """scripts/device_run.py's plumbing end to end on CPU (small shapes, no CUDA): every step runs in
    its own process and leaves its results, so the first GPU run is not where it is debugged. A relative
    --out from another directory lands there; steps that do nothing here say "skipped"."""
    import subprocess
    import sys

    from conftest import REPO_ROOT

    script = str(REPO_ROOT / "scripts" / "device_run.py")
    p = subprocess.run([sys.executable, script, "--dry-run", "--out", "out", "--steps", "env,eager-b1,triton,suite"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    out = tmp_path / "out"
    summary = json.load(open(out / "summary.json"))
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [
        ("env", "ok"), ("eager-b1", "ok"), ("triton", "skipped"), ("suite", "skipped")]
    res = json.load(open(out / "eager-b1.json"))
    assert [r["mode"] for r in res["rows"]] == ["autoregressive", "speculative"]
    assert "qwen3-tiny" in json.dumps(res) and "bfloat16" in json.dumps(res)
    assert "=== eager-b1" in (out / "log.txt").read_text() and json.load(open(out / "env.json"))["torch"]
    # One line and status 2 for its own bad flags; without CUDA and without --dry-run it says so.
    (tmp_path / "afile").write_text("x")
    for argv, needle in ((["--dry-run", "--steps", ""], "--steps: none given"),
                         (["--dry-run", "--budget", "5"], "--budget 5"),
                         (["--dry-run", "--out", str(tmp_path / "afile")], "is a file"),
                         (["--out", str(out)], "needs a CUDA device")):
        p = subprocess.run([sys.executable, script, *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1 and needle in p.stderr, p.stderr


def device_run(argv, cwd, **kw):
    import subprocess

    from conftest import REPO_ROOT

    return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "device_run.py"), "--dry-run", *argv],
                          capture_output=True, text=True, timeout=300, cwd=cwd, **kw)


def test_device_script_checks_out_before_any_step(tmp_path):
    """--out that cannot be made, a file the steps write that is a directory, an earlier summary.json that is
    not one: one line naming it and status 2 before the first step (the first was an OSError traceback)."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "o1" / "env.json").mkdir(parents=True)
    (tmp_path / "o2" / "summary.json").mkdir(parents=True)
    (tmp_path / "o3").mkdir()
    (tmp_path / "o3" / "summary.json").write_text('{"steps": 3}')
    for out, needle in (("afile/dr", "--out {}/afile/dr: cannot create it"), ("o1", "--out {}/o1/env.json: is a dir"),
                        ("o2", "--out {}/o2/summary.json: is a dir"), ("o3", "{}/o3/summary.json: not a summary")):
        p = device_run(["--steps", "env", "--out", out], tmp_path)
        assert p.returncode == 2 and p.stdout == "" and p.stderr.count("\n") == 1, p.stderr
        assert needle.format(tmp_path) in p.stderr, p.stderr
    assert not (tmp_path / "o1" / "log.txt").exists()
    assert (tmp_path / "o3" / "summary.json").read_text() == '{"steps": 3}'


def test_device_script_calls_into_one_out_merge(tmp_path):
    """A second call into the same --out (the GPU run's --steps triton-b32 call) keeps the first call's steps in
    summary.json, each entry naming its call, replaces the steps it reruns, and heads its part of log.txt."""
    assert device_run(["--steps", "env,triton", "--out", "out"], tmp_path).returncode == 0
    assert device_run(["--steps", "env", "--out", "out"], tmp_path).returncode == 0
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    assert [(s["step"], s["status"], s["call"]) for s in summary["steps"]] == [
        ("env", "ok", 2), ("triton", "skipped", 1)]
    assert [(c["call"], c["steps"]) for c in summary["calls"]] == [(1, ["env", "triton"]), (2, ["env"])]
    log = (tmp_path / "out" / "log.txt").read_text()
    assert log.count("##### call ") == 2 and "##### call 2 at " in log and log.count("=== env") == 2
    assert json.load(open(tmp_path / "out" / "env.json"))["torch"]


def test_device_script_interrupted_keeps_a_summary(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) mid-step: the step is stopped, summary.json says
    what finished, the step interrupted and the rest not run; one line on stderr, no traceback, exit 130. The
    step's file from an earlier call is removed when it runs again (the summary no longer lists it)."""
    import os
    import signal
    import subprocess

    from conftest import REPO_ROOT

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "eager-b1.json").write_text("{}")  # an earlier call's: gone once the step runs again
    p = subprocess.Popen([sys.executable, str(REPO_ROOT / "scripts" / "device_run.py"), "--dry-run", "--steps",
                          "env,eager-b1,triton", "--out", "out"], cwd=tmp_path, text=True, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, start_new_session=True)
    printed = []
    for line in p.stdout:
        printed.append(line)
        if line.startswith("=== eager-b1 (at most"):
            break
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert err.count("\n") == 1 and err.startswith("interrupted by SIGINT") and "Traceback" not in out, err + out
    summary = json.load(open(tmp_path / "out" / "summary.json"))
    assert [(s["step"], s["status"]) for s in summary["steps"]] == [
        ("env", "ok"), ("eager-b1", "interrupted"), ("triton", "not run: interrupted")]
    assert sorted(os.listdir(tmp_path / "out")) == ["env.json", "log.txt", "summary.json"]


def test_reference_drafter_is_plain_and_equal(monkeypatch):
    """The reference loop's drafter is the engine's weights in plain modules — no fused projections, no
    packed GEMMs (this project's speed-ups, which the loop it is measured against does not have) —
    reading transformers' embedding and lm_head, and it drafts what the engine's drafter drafts."""
    pytest.importorskip("transformers")
    import torch

    import cpu_kernels
    monkeypatch.setattr(cpu_kernels, "PACK_MIN_ELEMENTS", 0)  # pack the tiny pair's weights, as a large pair's are
    target, drafter = bench.bigram_pair("cpu", torch.float32, 0)
    hf = bench.transformers_copy(target)
    plain = bench.reference_drafter(drafter, hf)
    assert drafter.layers[0].self_attn.vkq_weight is not None and plain.layers[0].self_attn.vkq_weight is None
    assert plain.fc.packed is None and all(getattr(m, "packed", None) is None for m in plain.modules())
    assert plain.target.lm_head is hf.lm_head and plain.target.embed_tokens is hf.model.embed_tokens
    tokens = torch.randint(0, target.args.vocab_size - 1, (1, 12))
    with torch.no_grad():
        feats = torch.randn(1, 12, len(drafter.cfg.target_layer_ids) * target.args.hidden_size)
        outs = []
        for d in (drafter, plain):
            d.setup_caches(1, 64)
            d.commit_context(feats, torch.arange(12)[None])
            outs.append(d(tokens[:, -1], torch.tensor([12])))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
