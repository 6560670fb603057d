"""scripts/device_run.py on CPU: its stages end to end in a dry run, and its plumbing (caps, flags, signals,
what a stage stopped at its cap leaves), so that the GPU run is not where it is debugged."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys

import bench
import pytest
import torch
from conftest import REPO_ROOT

from support.cli import from_flat

SCRIPT = str(REPO_ROOT / "scripts" / "device_run.py")
spec = importlib.util.spec_from_file_location("device_run", SCRIPT)
device_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(device_run)

BENCH_STAGES = ("smoke", "compiled-b1", "eagle3-b1", "tree-b1", "compiled-b32", "eager-b1", "tree-sampled-b1",
                "kernels-b1")


def test_caps_fit_one_call():
    """The default stages' caps, and the time to stop the last one at its cap, fit the default budget of
    under 9 minutes (a call may take 10)."""
    assert list(device_run.STAGES) == ["env", "smoke", "compiled-b1", "eagle3-b1", "tree-b1", "triton",
                                       "compiled-b32", "eager-b1", "tree-sampled-b1", "kernels-b1"]
    assert device_run.DEFAULT_STAGES == ("env", "smoke", "compiled-b1", "eagle3-b1", "tree-b1", "triton")
    caps = sum(device_run.STAGES[s] for s in device_run.DEFAULT_STAGES)
    assert caps + device_run.STOP_GRACE <= device_run.BUDGET <= 540


def test_bench_stages_pass_bench_checks(tmp_path, monkeypatch):
    """Every bench stage's arguments, real and dry, pass bench.py's own flag checks; the dry run's differ only in
    device, preset and sizes; smoke is float32 (bench then asserts equal tokens) at batch 1 and 4."""
    import kernels

    monkeypatch.setattr(kernels, "check_backend", lambda name, device: None)  # the GPU's Triton is not here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # nor its GPU, which --device cuda needs
    for stage in BENCH_STAGES:
        real = device_run.bench_args(stage, False, str(tmp_path / "out.json"))
        dry = device_run.bench_args(stage, True, str(tmp_path / "out.json"))
        for args in (real, dry):
            bench.check_args(from_flat(bench.BenchArgs, args))
        assert real["device"] == "cuda" and dry["device"] == "cpu" and dry["model"] == "qwen3-tiny"
        assert real["compile"] == (stage != "eager-b1") and real["compile_mode"] == (
            "reduce-overhead" if stage != "eager-b1" else None)
        differ = {k for k in real if real[k] != dry[k]}
        assert differ <= {"model", "device", "prompt_len", "max_new_tokens", "repeats", "batch_sizes"}, differ
    smoke = device_run.bench_args("smoke", False, "x.json")
    assert (smoke["model"], smoke["dtype"], smoke["batch_sizes"]) == ("bigram-35m", "float32", "1,4")
    assert device_run.bench_args("compiled-b32", False, "x.json")["batch_sizes"] == "32"
    assert device_run.bench_args("compiled-b1", False, "x.json")["model"] == "qwen3-8b"
    assert device_run.bench_args("kernels-b1", False, "x.json")["kernels"] == "triton"
    assert "kernels" not in device_run.bench_args("compiled-b1", False, "x.json")  # bench's default: torch
    sampled = device_run.bench_args("tree-sampled-b1", False, "x.json")
    assert sampled["temperature"] == 1.0 and "temperature" not in device_run.bench_args("tree-b1", False, "x")


def test_torch_log_flags_recompiles_and_skipped_cuda_graphs():
    """What makes a timing suspect is flagged: a recompile's log line, and skipped CUDA graphs that torch counted;
    counted from a mark on, so a stage's rows carry only what was logged while they were measured."""
    import torch
    from torch._dynamo.utils import counters

    torch._logging.set_logs(recompiles=True)
    log = device_run.TorchLog()
    try:
        mark = log.mark()
        f = torch.compile(lambda x: x * 2, backend="eager")
        f(torch.ones(3))
        f(torch.ones(3, dtype=torch.float64))
        assert any(line.startswith("Recompiling") for line in log.flagged(mark))
        counters["inductor"]["cudagraph_skips"] += 2
        assert log.flagged(log.mark()) == [] and "skipping cudagraphs: 2 graph(s)" in log.flagged(mark)[-1]
    finally:
        counters["inductor"]["cudagraph_skips"] -= 2
        torch._logging.set_logs()
        from torch._logging._internal import log_registry
        for name in log_registry.get_log_qnames():
            logging.getLogger(name).removeHandler(log)


def test_dry_run_every_stage(tmp_path):
    """Every stage end to end on CPU (tiny preset, Triton's interpreter, compiled where the stage compiles), from
    another directory with a relative --out: each stage's file with its rows and checks (every difference within
    its tolerance), the SDPA backends, warnings on the stage and on every row, env.json, log.txt, summary.json.
    Neither tyro nor wandb may be imported: the GPU machine has neither. About a minute and a half on two idle
    cores; the timeout allows for a loaded machine."""
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    for name in ("tyro", "wandb"):
        (blocked / f"{name}.py").write_text("raise ImportError('not on the GPU machine')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked)] + os.environ.get("PYTHONPATH", "").split(
        os.pathsep)).rstrip(os.pathsep))
    p = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", "out"], capture_output=True, text=True,
                       timeout=420, cwd=tmp_path, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    assert [(s["stage"], s["status"]) for s in summary["stages"]] == [(s, "ok") for s in device_run.DEFAULT_STAGES]
    assert all(s["seconds"] > 0 and s["failed_checks"] == [] for s in summary["stages"])
    assert {"perf_hints", "recompiles"} <= set(summary["torch_logs"].split(","))
    env = json.loads((out / "env.json").read_text())
    assert {"torch", "triton", "python", "cuda", "cuda_available", "driver_version", "gpu", "sdpa_enabled",
            "torch_logs"} <= set(env) and env["driver_version"] is None and env["dry_run"] is True
    log = (out / "log.txt").read_text()
    for stage in device_run.DEFAULT_STAGES:
        assert f"=== {stage}\n" in log
        if stage == "env":
            continue
        doc = json.loads((out / f"{stage}.json").read_text())
        assert doc["stage"] == stage and doc["complete"] is True and doc["warnings"] == [] and "error" not in doc
        for c in doc["checks"]:
            assert c["ok"] and isinstance(c["max_diff"], float) and c["max_diff"] <= c["tolerance"], c
        if stage == "triton":
            names = [c["name"].split(" B=")[0] for c in doc["checks"]]
            assert names == ["chain", "chain", "verify_sampled", "attention", "attention",
                             "compiled chain", "compiled verify_sampled", "compiled attention"], names
            assert all(c["tolerance"] > 0 for c in doc["checks"] if "chain" in c["name"] or "attention" in c["name"])
            timed = [c["name"] for c in doc["checks"] if c.get("reference_us", 0) > 0 and c.get("triton_us", 0) > 0]
            assert timed == [c["name"] for c in doc["checks"][:5]], timed  # the eager checks, each timed
            continue
        batches = [1, 2] if stage == "smoke" else [2] if stage == "compiled-b32" else [1]
        budgets = [2, 4] if stage == "tree-b1" else [0]
        assert [(r["mode"], r["batch"], r["tree_budget"]) for r in doc["rows"]] == [
            (m, b, t) for t in budgets for b in batches for m in ("autoregressive", "speculative")]
        assert all(r["warnings"] == [] for r in doc["rows"])
        assert doc["config"]["model"] == "qwen3-tiny" and doc["config"]["dtype"] == (
            "float32" if stage == "smoke" else "bfloat16")
        verifies = ["verify"]
        if stage == "tree-b1":  # a tree's attention: its nodes and the anchor, over its longer cache
            verifies = ["tree 2 verify", "tree 4 verify"]
        assert set(doc["sdpa"]) == {f"b{b} {w}" for b in batches for w in verifies + ["step"]}
        assert all(s["runs"] in s["can_run"] for s in doc["sdpa"].values())
        assert [c["name"] for c in doc["checks"]] == {"smoke": ["speculative_tokens_equal"],
                                                      "compiled-b1": ["verify_logits"]}.get(stage, [])


def test_dry_run_of_the_sampled_tree_stage(tmp_path):
    """tree-sampled-b1, asked for by --stages, end to end on CPU: tree-b1's rows (budgets 2 and 4 in a
    dry run), every one sampled at temperature 1, with no check that compares tokens."""
    p = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(tmp_path / "out"),
                        "--stages", "tree-sampled-b1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "tree-sampled-b1.json").read_text())
    assert doc["complete"] is True and doc["checks"] == [] and doc["config"]["temperature"] == 1.0
    assert [(r["mode"], r["tree_budget"]) for r in doc["rows"]] == [
        (m, t) for t in (2, 4) for m in ("autoregressive", "speculative")]
    assert all(r["acceptance_length"] >= 1 for r in doc["rows"])
    assert [r["tree_budget"] for r in doc["ratios"]] == [2, 4]  # each budget's (the first was overwritten)


def test_a_tree_stages_file_is_complete_only_when_the_stage_is(tmp_path, monkeypatch):
    """A tree stage runs bench once a budget: each run's document is merged into the stage's file without
    its "complete", which the stage sets as it ends (a stage stopped in its second run read complete)."""
    import bench

    st = device_run.Stage("tree-b1", str(tmp_path), True)
    calls = []

    def run(args):  # bench.run: one document a budget, complete as far as that run goes
        calls.append(args.decode.tree_budget)
        row = {"mode": "speculative", "batch": 1}
        bench.write_json("unused", {"rows": [row], "ratios": [{"ratio": "x"}], "complete": True, "config": {}})

    monkeypatch.setattr(bench, "run", run)
    for budget in (2, 4):
        device_run.bench_rows(st, {"tree_budget": budget, "batch_sizes": "1"})
    doc = json.loads((tmp_path / "tree-b1.json").read_text())
    assert calls == [2, 4] and doc["complete"] is False
    assert [r["tree_budget"] for r in doc["rows"]] == [2, 4] and [r["tree_budget"] for r in doc["ratios"]] == [2, 4]


def test_dry_run_of_the_triton_round_stage(tmp_path):
    """kernels-b1, asked for by --stages, end to end on CPU: compiled-b1's rows with --kernels triton, the
    kernels in Triton's interpreter (traced code takes the references there)."""
    p = subprocess.run([sys.executable, SCRIPT, "--dry-run", "--out", str(tmp_path / "out"),
                        "--stages", "kernels-b1"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    doc = json.loads((tmp_path / "out" / "kernels-b1.json").read_text())
    assert doc["complete"] is True and doc["config"]["kernels"] == "triton"
    assert [(r["mode"], r["batch"]) for r in doc["rows"]] == [("autoregressive", 1), ("speculative", 1)]


def test_a_stage_stopped_at_its_cap_keeps_what_it_wrote(tmp_path, monkeypatch, capsys):
    """A stage past its cap is stopped and marked timed out; the rows and checks it had written stay, and the
    summary names its failed checks; a stage the budget leaves no time for is not run."""
    def command(stage, out, dry):
        doc = {"stage": stage, "rows": [{"mode": "autoregressive"}], "checks": [{"name": "x", "ok": False}],
               "warnings": ["Recompiling function f"]}
        path = os.path.join(out, device_run.stage_file(stage))
        return [sys.executable, "-c", f"import json, time; json.dump({doc!r}, open({path!r}, 'w')); "
                                      f"print('wrote', flush=True); time.sleep(60)"]
    monkeypatch.setattr(device_run, "stage_command", command)
    (tmp_path / "eager-b1.json").write_text('{"complete": true}')  # an earlier call's: not this one's result
    assert device_run.run_stages(["smoke", "eager-b1"], str(tmp_path), True, 12, {"smoke": 2, "eager-b1": 60}) == 1
    summary = json.loads((tmp_path / "summary.json").read_text())
    smoke, eager = summary["stages"]
    assert smoke["status"] == "timed out" and smoke["rows"] == 1 and smoke["failed_checks"] == ["x"]
    assert smoke["warnings"] == 1 and 2 <= smoke["seconds"] < 12
    assert eager == {"stage": "eager-b1", "status": "not run: budget spent", "cap_s": 60}
    assert not (tmp_path / "eager-b1.json").exists()
    assert json.loads((tmp_path / "smoke.json").read_text())["rows"] == [{"mode": "autoregressive"}]
    printed = capsys.readouterr().out
    assert "wrote" in (tmp_path / "log.txt").read_text() and "=== smoke: timed out" in printed
    assert "=== eager-b1: not run, the budget is spent" in printed


def test_timings_on_a_gpu_add_cuda_graph_replays_or_why_not(monkeypatch):
    """A kernel and its reference are timed call by call everywhere, and on a GPU also replayed from a
    CUDA graph, as a compiled round runs them; a capture that fails leaves its error, not a crash."""
    monkeypatch.setattr(device_run, "microseconds", lambda fn, dev, reps: 10.0)
    monkeypatch.setattr(device_run, "graph_microseconds", lambda fn, reps: fn())
    assert device_run.timings(lambda: 1.0, lambda: 2.0, "cpu", 3) == {"reference_us": 10.0, "triton_us": 10.0}
    assert device_run.timings(lambda: 1.0, lambda: 2.0, "cuda", 3) == {
        "reference_us": 10.0, "triton_us": 10.0, "reference_graph_us": 1.0, "triton_graph_us": 2.0}

    def uncapturable():
        raise RuntimeError("operation not permitted when stream is capturing")
    speed = device_run.timings(lambda: 1.0, uncapturable, "cuda", 3)
    assert speed == {"reference_us": 10.0, "triton_us": 10.0, "reference_graph_us": 1.0,
                     "graph_error": "RuntimeError: operation not permitted when stream is capturing"}


def test_a_graph_that_does_not_compile_is_a_failed_check(tmp_path, monkeypatch):
    """The triton stage's compiled checks: where one graph fails to compile, its checks fail with the
    error, and the others are still made (on the H100 the attention's compile error had ended the stage
    before the chain's and the verify's compiled checks were written)."""
    import torch

    import kernels

    real = torch.compile

    def compile(fn=None, **kw):
        if fn is kernels.cached_attention:
            def broken(*args):
                raise RuntimeError("the attention kernel did not lower")
            return broken
        return real(fn, fullgraph=True, dynamic=False, backend="eager")
    monkeypatch.setattr(torch, "compile", compile)
    st = device_run.Stage("triton", str(tmp_path), True)
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        device_run.compiled_checks(st, device_run.DRY, torch.bfloat16, torch.float16, "cpu", g, True)
    doc = json.loads((tmp_path / "triton.json").read_text())
    verdicts = [(c["name"], c["ok"]) for c in doc["checks"]]
    assert verdicts == [("compiled chain", True), ("compiled verify_sampled", True), ("compiled attention", False)]
    failed = doc["checks"][-1]
    assert failed["max_diff"] == "inf" and failed["error"] == "RuntimeError: the attention kernel did not lower"
    assert device_run.failed_checks(doc) == ["compiled attention"]


@pytest.mark.parametrize("argv,needle", [
    (["--dry-run", "--stages", ""], "--stages: none given"),
    (["--dry-run", "--stages", "smoke,bogus"], "--stages: unknown stage 'bogus'"),
    (["--dry-run", "--stages", "env,env"], "a stage given twice"),
    (["--dry-run", "--budget", "5"], "--budget 5: must be"),
    (["--dry-run", "--budget", "12"], "--budget 12: must be a number of seconds from 20 to 3600"),
    (["--dry-run", "--budget", "nan"], "--budget nan: must be"),
    (["--dry-run", "--budget", "x"], "argument --budget: invalid float value: 'x'"),
    (["--dry-run", "--bogus"], "unrecognized arguments: --bogus"),
    (["--dry-run", "--out", ""], "--out: empty path"),
    (["--dry-run", "--out", "afile"], "--out afile: is a file"),
    (["--dry-run", "--out", "afile/dr"], "--out {}/afile/dr: cannot create it"),
    (["--dry-run", "--out", "o1"], "--out {}/o1/smoke.json: is a directory"),
    (["--out", "o2"], "no CUDA device here"),
])
def test_bad_flags_one_line_before_any_stage(argv, needle, tmp_path, monkeypatch, capsys):
    """A bad flag or --out: one line, status 2, nothing run or written (a file a stage writes that is a folder)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "o1" / "smoke.json").mkdir(parents=True)
    assert device_run.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("error: ") and needle.format(tmp_path) in err, err
    assert not (tmp_path / "o1" / "log.txt").exists() and not (tmp_path / "o2").exists()


def test_help():
    p = subprocess.run([sys.executable, SCRIPT, "--help"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and "--dry-run" in p.stdout and "compiled-b32" in p.stdout


def test_interrupted_keeps_a_summary(tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) mid-stage: the stage is stopped, summary.json
    says what finished, the stage interrupted and the rest not run; one line on stderr, no traceback, exit 130."""
    p = subprocess.Popen([sys.executable, SCRIPT, "--dry-run", "--stages", "env,smoke,triton", "--out", "out"],
                         cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         process_group=0)
    for line in p.stdout:
        if line.startswith("=== smoke (at most"):
            break
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert err.count("\n") == 1 and err.startswith("interrupted by SIGINT") and "Traceback" not in out, err + out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(s["stage"], s["status"]) for s in summary["stages"]] == [
        ("env", "ok"), ("smoke", "interrupted"), ("triton", "not run: interrupted")]
