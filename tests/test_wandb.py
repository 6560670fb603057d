"""What a --wandb run records, read back from the offline run (docs/logging.md).

Each program runs once per module (in-process, WANDB_MODE=offline, its own WANDB_DIR) on the committed
demo pair, and the tests read its run-*.wandb file back: the LevelDB-style log wandb writes (a 7-byte
header, 32 KiB blocks of checksummed records, each a `wandb_internal_pb2.Record`), decoded here with
wandb's own protobuf classes. From it: the config, every history row, the summary, the artifacts and
the exit code; tables and images are read from the run's files/ folder. A subprocess of speculate.py is
stopped by SIGINT and its run is found marked interrupted; a UserError after the start marks it failed.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import NamedTuple

import pytest
from conftest import REPO_ROOT

import eval as ev
import speculate
import train
from support import runlog

DEMO = REPO_ROOT / "demo"
DEMO_K = json.loads((DEMO / "drafter" / "config.json").read_text())["block_size"]  # drafts per round
CODE = ["import os\n", "def main():\n", "class Point:\n", "for i in range(10):\n"]


# ----------------------------------------------------------------------------------------
# Reading an offline run

def records(path: Path):
    """The protobuf records of a run-*.wandb file: a header (":W&B", 0xBEE1, version 0), then 32 KiB
    blocks of records [crc32 of type + data, length, type: 1 full, 2 first, 3 middle, 4 last]."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:7] == struct.pack("<4sHB", b":W&B", 0xBEE1, 0), "not a wandb run log"
    i, buf = 7, b""
    while i + 7 <= len(data):
        left = 32768 - i % 32768
        if left < 7:  # a block's tail too short for a header is padding
            i += left
            continue
        crc, n, kind = struct.unpack("<IHB", data[i:i + 7])
        chunk = data[i + 7:i + 7 + n]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"{path}: corrupt record at {i}"
        i += 7 + n
        buf += chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def _items(items) -> dict:
    """{"a.b": value} from a record's key / nested_key items."""
    return {".".join(x.nested_key) if len(x.nested_key) else x.key: json.loads(x.value_json) for x in items}


class OfflineRun(NamedTuple):
    dir: Path
    run: object          # the RunRecord: project, display_name, run_group, tags, ...
    config: dict
    history: list        # one dict per history row, keys flattened with "."
    summary: dict
    artifacts: list      # ArtifactRecords
    exit_code: object    # None: the run never finished
    step_metrics: dict   # define_metric's: {glob of keys: the key they are charted against}

    def table(self, key: str, row: dict) -> dict:
        """A logged table's JSON (columns, data), from the history row that logged it."""
        assert row[f"{key}._type"] == "table-file", row
        return json.loads((self.dir / "files" / row[f"{key}.path"]).read_text())

    def rows_with(self, key: str) -> list:
        return [h for h in self.history if key in h]

    def artifact(self, name: str):
        found = [a for a in self.artifacts if a.name == f"{self.run.run_id}-{name}"]
        assert len(found) == 1, [a.name for a in self.artifacts]
        return found[0]


def read_run(wandb_dir: Path) -> OfflineRun:
    (path,) = Path(wandb_dir, "wandb").glob("offline-run-*/run-*.wandb")
    run, config, history, summary, artifacts, exit_code = None, {}, [], {}, [], None
    step_metrics = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            run = r.run
            config.update(_items(r.run.config.update))
        elif kind == "config":
            config.update(_items(r.config.update))
        elif kind == "history":
            history.append(_items(r.history.item))
        elif kind == "summary":
            summary.update(_items(r.summary.update))
        elif kind == "artifact":
            artifacts.append(r.artifact)
        elif kind == "exit":
            exit_code = r.exit.exit_code
        elif kind == "metric" and r.metric.glob_name:
            step_metrics[r.metric.glob_name] = r.metric.step_metric
    return OfflineRun(path.parent, run, config, history, summary, artifacts, exit_code, step_metrics)


def md5_b64(path) -> str:
    return base64.b64encode(hashlib.md5(Path(path).read_bytes()).digest()).decode()


def assert_file_artifact(run: OfflineRun, name: str, kind: str, path):
    art = run.artifact(name)
    assert art.type == kind
    (entry,) = art.manifest.contents
    assert entry.path == os.path.basename(path) and entry.digest == md5_b64(path)


def git_head():
    try:
        p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True)
    except OSError:
        return None
    return p.stdout.strip() if p.returncode == 0 else None


@contextlib.contextmanager
def offline(wandb_dir: Path, **extra):
    """WANDB_MODE=offline into `wandb_dir`, wandb's other folders beside it; wandb torn down after."""
    with pytest.MonkeyPatch.context() as mp:
        for k in ("WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_GROUP", "WANDB_TAGS", "WANDB_ENTITY"):
            mp.delenv(k, raising=False)
        env = {**dict(WANDB_MODE="offline", WANDB_DIR=str(wandb_dir), WANDB_SILENT="true",
                      WANDB_CONFIG_DIR=str(wandb_dir / "config"), WANDB_DATA_DIR=str(wandb_dir / "data"),
                      WANDB_CACHE_DIR=str(wandb_dir / "cache")), **extra}
        for k, v in env.items():
            mp.setenv(k, v)
        try:
            yield env
        finally:
            if "wandb" in sys.modules:
                sys.modules["wandb"].teardown()


def call(main, argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------------------
# speculate.py: the demo (baseline, then speculative) over a prompts file

@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    d = tmp_path_factory.mktemp("wandb_speculate")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in CODE[:3]))
    files = {"trace": d / "trace.jsonl", "outputs": d / "outputs.jsonl"}
    with offline(d):
        rc, out, err = call(speculate.main, [
            "--prompts-file", prompts, "--max-new-tokens", 16, "--batch-size", 2, "--log-every", 2,
            "--trace-file", files["trace"], "--output-file", files["outputs"], "--wandb", "--wandb-project", "p1",
            "--wandb-name", "demo-run", "--wandb-group", "g1", "--wandb-tags", "a,b c"])
    assert rc == 0, err
    return read_run(d), files, out


def test_speculate_config_names_and_finish(spec):
    run, _, _ = spec
    assert (run.run.project, run.run.display_name, run.run.run_group, list(run.run.tags)) == \
        ("p1", "demo-run", "g1", ["a", "b c"])
    c = run.config
    assert c["program"] == "speculate.py" and c["max_new_tokens"] == 16 and c["batch_size"] == 2  # the flags
    assert c["target"] == str(DEMO / "target") and c["device"] == "cpu" and c["dtype_resolved"] == "float32"
    assert c["sampling"]["temperature"] == 0 and c["scheduler_resolved"] == "none" and c["compile_resolved"] is False
    assert c["chat_resolved"] is False  # the demo's tokenizer has no template (--chat not given: None)
    assert c["target_config"]["vocab_size"] == 4096 and c["drafter_config"] is not None and c["demo"] is True
    assert c["torch"] and "git_dirty" in c
    head = git_head()
    if head is not None:
        assert c["git_commit"] == head
    assert run.exit_code == 0 and run.summary["status"] == "finished"


def test_speculate_logs_figures_while_decoding(spec):
    run, _, _ = spec
    for name, K in (("autoregressive", 0), ("speculative", DEMO_K)):
        # charted against the step each row logs
        assert run.step_metrics[f"{name}/*"] == f"{name}/step", run.step_metrics
        rows = run.rows_with(f"{name}/step")
        rows = [r for r in rows if f"{name}/tokens_per_second" in r]
        assert len(rows) >= 3, rows  # every 2 batched steps, and the last
        steps = [r[f"{name}/step"] for r in rows]
        assert steps == sorted(steps) and steps[0] == 2 and steps[1] == 4
        last = rows[-1]
        assert last[f"{name}/requests_done"] == 3 and last[f"{name}/tokens"] == 3 * 16
        assert last[f"{name}/tokens_per_second"] > 0
        hist = last[f"{name}/accepted_length.values"]
        assert len(hist) == K + 2 and last[f"{name}/accepted_length._type"] == "histogram"
        assert hist[0] == 0  # a round commits one token at least
        # the last row's τ and verified/round are the summary's (one definition, metrics.py)
        assert last[f"{name}/acceptance_length"] == pytest.approx(run.summary[f"{name}/acceptance_length"])
        assert last[f"{name}/verified_per_round"] == pytest.approx(run.summary[f"{name}/verified_per_round"])
        # the histogram's mean is τ: Σ length x rounds = τ x all rounds
        rounds_total = sum(hist)
        assert last[f"{name}/step"] < rounds_total  # a step verifies a round of each request of the batch
        assert sum(length * n for length, n in enumerate(hist)) == pytest.approx(
            last[f"{name}/acceptance_length"] * rounds_total)
    assert run.summary["speculative/acceptance_length"] > 1 == run.summary["autoregressive/acceptance_length"]


def test_speculate_summary_chart_table_and_artifacts(spec):
    run, files, out = spec
    s = run.summary
    assert s["speed_up"] > 0 and s["greedy_outputs_identical"] is True
    assert f"speed-up: {s['speed_up']:.2f}x" in out
    assert len(s["speculative/accept_rate_by_position"]) == DEMO_K
    # accept rate by position: a bar chart over a table of the summary's rates
    assert run.config["_wandb.visualize.speculative/accept_rate_by_position"]["panel_config"]
    (row,) = run.rows_with("speculative/accept_rate_by_position_table._type")
    chart = run.table("speculative/accept_rate_by_position_table", row)
    assert chart["columns"] == ["position", "accept_rate"]
    tried = [(k + 1, r) for k, r in enumerate(s["speculative/accept_rate_by_position"]) if r is not None]
    # a position no round tried has no bar
    assert [r[0] for r in chart["data"]] == [k for k, _ in tried]
    assert [r[1] for r in chart["data"]] == pytest.approx([r for _, r in tried])
    # the requests: prompt, completion and figures, as the output file has them
    (row,) = run.rows_with("speculative/requests_table._type")
    table = run.table("speculative/requests_table", row)
    recs = {r["request"]: r for r in map(json.loads, files["outputs"].read_text().splitlines())}
    assert len(table["data"]) == 3
    for r in table["data"]:
        got = dict(zip(table["columns"], r))
        want = recs[got["request"]]
        assert got["prompt"] == CODE[got["prompt_index"]] and got["completion"] == want["text"]
        assert (got["finish_reason"], got["tokens"], got["rounds"]) == \
            (want["finish_reason"], len(want["output_ids"]), want["num_rounds"])
        assert got["acceptance_length"] == pytest.approx(want["acceptance_length"])
    assert run.rows_with("autoregressive/requests_table._type")  # the baseline's too
    assert_file_artifact(run, "trace", "trace", files["trace"])
    assert_file_artifact(run, "outputs", "outputs", files["outputs"])


# ----------------------------------------------------------------------------------------
# eval.py: two datasets, sampled, with calibration and STS

@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    d = tmp_path_factory.mktemp("wandb_eval")
    data = d / "data"
    data.mkdir()
    for name, prompts in (("code-a", CODE), ("code-b", CODE[::-1])):
        (data / f"{name}.jsonl").write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    paths = {"out": d / "results.json", "cal": d / "cal.json", "plot": d / "rel.svg"}
    with offline(d):
        rc, out, err = call(ev.main, [
            "--target", DEMO / "target", "--drafter", DEMO / "drafter", "--data-dir", data, "--datasets",
            "code-a,code-b", "--max-new-tokens", 16, "--temperature", 1, "--no-progress", "--step", 7,
            "--out", paths["out"], "--calibration-out", paths["cal"], "--calibration-plot", paths["plot"],
            "--wandb"])
    assert rc == 0, err
    return read_run(d), paths


def test_eval_rows_charts_image_and_artifacts(evaluated):
    run, paths = evaluated
    results = json.loads(paths["out"].read_text())
    assert run.exit_code == 0 and run.summary["status"] == "finished" and run.run.job_type == "eval"
    assert run.config["program"] == "eval.py" and run.config["step"] == 7 and run.config["num_drafts"] == DEMO_K
    assert run.config["target_config"]["vocab_size"] == 4096 and run.config["datasets_resolved"] == {
        "code-a": 4, "code-b": 4}
    rows = [h for h in run.history if h.get("_step") == 7]
    assert len(rows) == 1  # everything at --step
    row = rows[0]
    for e in results["datasets"]:
        for k in ("acceptance_length", "draft_tokens_per_proposal", "verify_rate", "num_samples"):
            assert row[f"{e['dataset']}/{k}"] == pytest.approx(e[k])
        assert row[f"{e['dataset']}/accept_rate@0"] == pytest.approx(e["accept_rates_by_position"][0])
    # per-position acceptance: one line chart over a table (dataset, position, rates)
    for chart in ("accept_rates_by_position", "calibration/ece_by_position"):
        assert run.config[f"_wandb.visualize.{chart}"]["panel_config"]
    # the chart of the authors' rates is named as results.json names them, not as the conditional ones
    assert "_wandb.visualize.accept_rate_by_position" not in run.config
    by_pos = run.table("accept_rates_by_position_table", row)
    assert len(by_pos["data"]) == 2 * DEMO_K
    (first,) = [e for e in results["datasets"] if e["dataset"] == "code-a"]
    assert [r[2] for r in by_pos["data"] if r[0] == "code-a"] == first["accept_rates_by_position"]
    # calibration: table, scalars (Brier included), the reliability diagram as an image
    cal = results["calibration"]
    table = run.table("calibration", row)
    assert "brier" in table["columns"] and "heldout_brier_sts" in table["columns"] and len(table["data"]) == DEMO_K
    for m in cal["raw"]:
        assert run.summary[f"calibration/brier_{m['position']}"] == pytest.approx(m["brier"])
        assert run.summary[f"calibration/ece_{m['position']}"] == pytest.approx(m["ece"])
    assert run.summary["calibration/temperature_1"] == pytest.approx(cal["temperatures"][0])
    for d, ms in cal["raw_by_dataset"].items():  # and per dataset
        assert d in ("code-a", "code-b") and run.summary[f"{d}/calibration/ece_1"] == pytest.approx(ms[0]["ece"])
    assert row["calibration/reliability_diagram._type"] == "image-file"  # drawn as PNG: the flag asked for SVG
    png = run.dir / "files" / row["calibration/reliability_diagram.path"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and row["calibration/reliability_diagram.width"] > 600
    assert_file_artifact(run, "results", "results", paths["out"])
    assert_file_artifact(run, "calibration", "calibration", paths["cal"])


def test_eval_logs_every_drafters_config(tmp_path):
    """With several drafters, drafter_config holds each one's config.json, in row order."""
    other = tmp_path / "drafter-b"
    shutil.copytree(DEMO / "drafter", other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["note"] = "b"  # a key the loader does not read, kept as written
    (other / "config.json").write_text(json.dumps(cfg))
    data = tmp_path / "data"
    data.mkdir()
    (data / "code.jsonl").write_text(json.dumps({"turns": [CODE[0]]}) + "\n")
    with offline(tmp_path):
        rc, _, err = call(ev.main, [
            "--target", DEMO / "target", "--drafter", DEMO / "drafter", "--drafter", other, "--data-dir", data,
            "--datasets", "code", "--max-new-tokens", 4, "--no-progress", "--wandb", "--out", tmp_path / "r.json"])
    assert rc == 0, err
    run = read_run(tmp_path)
    first = json.loads((DEMO / "drafter" / "config.json").read_text())
    assert run.config["drafter_config"] == [first, cfg]


def test_the_config_records_the_budget_and_batch_size_the_run_resolved(tmp_path):
    """--max-new-tokens and --batch-size as the run resolved them, as results.json has them (the config
    kept --max-new-tokens null, and no resolved batch size): eval.py's demo pair, and speculate.py."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "code.jsonl").write_text(json.dumps({"turns": [CODE[0]]}) + "\n")
    with offline(tmp_path / "eval"):
        rc, _, err = call(ev.main, ["--data-dir", data, "--datasets", "code", "--batch-size", 8, "--no-progress",
                                    "--wandb", "--out", tmp_path / "r.json"])
    assert rc == 0, err
    results = json.loads((tmp_path / "r.json").read_text())["config"]
    c = read_run(tmp_path / "eval").config
    assert (c["max_new_tokens"], c["batch_size"], c["batch_size_resolved"]) == (
        results["max_new_tokens"], 8, results["batch_size_resolved"]) == (128, 8, 1)
    with offline(tmp_path / "speculate"):
        rc, _, err = call(speculate.main, ["--target", DEMO / "target", "--prompt-ids", "1,2,3", "--wandb"])
    assert rc == 0, err
    assert isinstance(read_run(tmp_path / "speculate").config["max_new_tokens"], int)


def test_drafter_resolved_is_one_a_row(tmp_path):
    """With --tree-budget one drafter gives several rows: drafter_resolved, one a drafter, did not line up
    with `rows`."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "code.jsonl").write_text(json.dumps({"turns": [CODE[0]]}) + "\n")
    with offline(tmp_path):
        rc, _, err = call(ev.main, ["--data-dir", data, "--datasets", "code", "--max-new-tokens", 4,
                                    "--tree-budget", 4, "--temperature", 0, "--no-progress", "--wandb",
                                    "--out", tmp_path / "r.json"])
    assert rc == 0, err
    c = read_run(tmp_path).config
    assert len(c["rows"]) > 1 and len(c["drafter_resolved"]) == len(c["rows"]), c
    assert c["drafter_resolved"][0].startswith("drafter")


def test_the_results_file_is_named_last_after_wandb_finishes(tmp_path):
    """Standard error's last line names the results file (docs/evaluation.md), also after wandb's own lines
    on finishing the run, which followed it."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "code.jsonl").write_text(json.dumps({"turns": [CODE[0]]}) + "\n")
    out = tmp_path / "r.json"
    with offline(tmp_path, WANDB_SILENT="false"):
        rc, _, err = call(ev.main, [
            "--target", DEMO / "target", "--drafter", DEMO / "drafter", "--data-dir", data, "--datasets", "code",
            "--max-new-tokens", 4, "--no-progress", "--wandb", "--out", out])
    assert rc == 0, err
    assert "wandb:" in err and err.splitlines()[-1] == f"results written to {out}", err


def test_rows_named_by_their_paths_each_get_one_wandb_section(tmp_path):
    """Two drafters of one name are labelled by their paths; a path's slashes nested the W&B keys into
    sections named after its first folder (one for both rows: "" or ".."). Each row is one section now."""
    for side in ("x", "y"):
        shutil.copytree(DEMO / "drafter", tmp_path / side / "drafter")
    data = tmp_path / "data"
    data.mkdir()
    (data / "code.jsonl").write_text(json.dumps({"turns": [CODE[0]]}) + "\n")
    with offline(tmp_path):
        rc, _, err = call(ev.main, [
            "--target", DEMO / "target", "--drafter", tmp_path / "x" / "drafter", "--drafter",
            tmp_path / "y" / "drafter", "--data-dir", data, "--datasets", "code", "--max-new-tokens", 4,
            "--no-progress", "--wandb", "--out", tmp_path / "r.json"])
    assert rc == 0, err
    keys = {k for row in read_run(tmp_path).history for k in row if k.endswith("/acceptance_length")}
    assert keys == {str(tmp_path / side / "drafter").replace("/", "|") + "/code/acceptance_length"
                    for side in ("x", "y")}, keys


# ----------------------------------------------------------------------------------------
# train.py: two steps, a scheduled eval, checkpoints as artifacts

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("wandb_train")
    corpus = d / "corpus.txt"
    corpus.write_text((REPO_ROOT / "support" / "cli.py").read_text()[:6000])
    evals = d / "evals"
    evals.mkdir()
    (evals / "code.jsonl").write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in CODE[:2]))
    out = d / "drafter"
    with offline(d):
        rc, _, err = call(train.main, [
            "--target", DEMO / "target", "--data", corpus, "--out", out, "--steps", 2, "--seq-len", 24,
            "--batch-size", 2, "--block-size", 3, "--depth", 1, "--markov-rank", 8, "--anchors-per-seq", 4,
            "--device", "cpu", "--no-progress", "--peak-tflops", 1, "--eval-every", 2, "--eval-datasets", "code",
            "--eval-data-dir", evals, "--eval-samples", 2, "--eval-max-new-tokens", 8, "--wandb", "--wandb-artifacts",
            "--log-every", 1])
    assert rc == 0, err
    return read_run(d), out


def test_train_logs_throughput_evals_and_checkpoints(trained):
    run, out = trained
    assert run.exit_code == 0 and run.summary["status"] == "finished" and run.config["program"] == "train.py"
    c = run.config
    assert c["steps"] == 2 and c["global_batch"] == 2 and c["dtype_resolved"] == "float32"
    assert c["target_config"]["vocab_size"] == 4096 and c["drafter_config"]["block_size"] == 3
    assert c["step_flops"] > 0 and c["trained_parameters"] > 0
    steps = {h["_step"]: h for h in run.history}
    for s in (1, 2):
        for k in ("loss", "tau", "lr", "grad_norm", "tokens_per_second", "mfu", "eta_seconds"):
            assert k in steps[s], (s, sorted(steps[s]))
        assert steps[s]["tokens_per_second"] > 0 and 0 < steps[s]["mfu"]
    assert steps[2]["eta_seconds"] == 0
    assert "eval/code/acceptance_length" in steps[2] and "eval/code/accept_rate@0" in steps[2]
    assert steps[2]["eval/code/num_samples"] == 2 and "eval/code/conditional_accept_rate@1" in steps[2]  # as eval.py
    assert "eval/calibration/brier_1" in steps[2]
    art = run.artifact("checkpoint")
    assert art.type == "model" and {"step-2", "latest"} <= set(art.aliases)
    assert {e.path for e in art.manifest.contents} == {"config.json", "model.safetensors"}  # nothing else in --out
    assert json.loads(art.metadata)["step"] == 2


def test_every_key_a_run_adds_to_its_config_is_in_the_docs(spec, evaluated, trained):
    """Besides the flags, each config key a program logs is named in docs/logging.md."""
    import dataclasses

    from support import flags
    from support.cli import flag_group

    def flag_fields(cls) -> set:
        names = set()
        for f in dataclasses.fields(cls):
            group = flag_group(f)
            if group is not None:
                names |= flag_fields(type(group))
            names.add(f.name)
        return names

    doc = (REPO_ROOT / "docs" / "logging.md").read_text()
    for (run, *_), cls in ((spec, flags.Args), (evaluated, ev.EvalArgs), (trained, train.Args)):
        added = {k.split(".")[0] for k in run.config if not k.startswith("_")} - flag_fields(cls)
        assert added and not [k for k in sorted(added) if f"`{k}`" not in doc], (cls, added)


def test_a_resumed_training_goes_on_in_its_wandb_run(tmp_path):
    """--resume continues the W&B run the training state recorded (it started a new, unlinked run, whose
    checkpoint artifacts went to a collection of their own); a checkpoint resumed into another --out is a
    branch, with a run of its own (it went on in the original's, two trajectories in one history)."""
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"prompt_ids": list(range(1, 40))}) + "\n" for _ in range(4)))
    out = tmp_path / "o"
    base = ["--target", DEMO / "target", "--data-ids", ids, "--out", out, "--steps", 2, "--seq-len", 32,
            "--anchors-per-seq", 2, "--block-size", 3, "--depth", 1, "--log-every", 1, "--save-every", 1,
            "--no-progress", "--wandb", "--wandb-artifacts"]
    with offline(tmp_path):
        rc, _, err = call(train.main, base + ["--stop-at", 1])
        assert rc == 0, err
        first = json.loads((out / "checkpoint-1" / "training_state.json").read_text())["wandb_run_id"]
        rc, _, err = call(train.main, base + ["--resume", out])
        assert rc == 0, err
        branch = tmp_path / "branch"
        rc, _, err = call(train.main, base + ["--resume", out, "--out", branch, "--steps", 3])
        assert rc == 0, err
    runs = sorted(Path(tmp_path, "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 3, runs
    run_ids = []
    for path in runs:
        for r in records(path):
            if r.WhichOneof("record_type") == "run":
                run_ids.append(r.run.run_id)
    assert json.loads((out / "checkpoint-2" / "training_state.json").read_text())["wandb_run_id"] == first
    branched = json.loads((branch / "checkpoint-3" / "training_state.json").read_text())["wandb_run_id"]
    assert branched != first and sorted(run_ids) == sorted([first, first, branched])


def test_a_refused_resume_leaves_the_wandb_run_as_it_was(tmp_path):
    """A resume refused (a finished run, another global batch, other data) reopened the finished W&B run
    and marked it failed; it is refused in one line before W&B starts."""
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"prompt_ids": list(range(1, 40))}) + "\n" for _ in range(4)))
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"prompt_ids": list(range(2, 41))}) + "\n" for _ in range(4)))
    out = tmp_path / "o"
    base = ["--target", DEMO / "target", "--out", out, "--steps", 2, "--seq-len", 32,
            "--anchors-per-seq", 2, "--block-size", 3, "--depth", 1, "--no-progress", "--wandb"]
    with offline(tmp_path):
        rc, _, err = call(train.main, base + ["--data-ids", ids])
        assert rc == 0, err
        resume = base + ["--resume", out]
        refusals = [
            (["--data-ids", ids], "already at step 2, nothing to do up to step 2"),
            (["--data-ids", ids, "--steps", 3, "--batch-size", 2], "global batch is 4 sequences, now 2"),
            (["--data-ids", other, "--steps", 3], "differs from the run's data"),
        ]
        for flags, needle in refusals:
            rc, _, err = call(train.main, resume + flags)
            lines = err.strip().splitlines()
            assert rc == 2 and len(lines) == 1 and needle in lines[0], err
        # a run id wandb.init refuses, in a line that named neither the file nor the key
        state_json = out / "checkpoint-2" / "training_state.json"
        saved = json.loads(state_json.read_text())
        for bad in ["a/b", ""]:
            state_json.write_text(json.dumps(dict(saved, wandb_run_id=bad)))
            rc, _, err = call(train.main, resume + ["--data-ids", ids, "--steps", 3])
            assert rc == 2 and err.strip().splitlines() == [
                f"error: {state_json}: 'wandb_run_id' must be a W&B run id or null (got {bad!r})"], err
        state_json.write_text(json.dumps(saved))
        # an optimizer state not whole, refused as the state is read (it reopened the run to mark it failed)
        from safetensors import safe_open
        from safetensors.torch import load_file, save_file

        state = out / "checkpoint-2" / "training_state.safetensors"
        with safe_open(str(state), "pt") as f:
            metadata = f.metadata()
        tensors = load_file(str(state))
        del tensors[sorted(tensors)[0]]
        save_file(tensors, str(state), metadata=metadata)
        rc, _, err = call(train.main, resume + ["--data-ids", ids, "--steps", 3])
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and "training_state.safetensors: optimizer state" in lines[0], err
    runs = list(Path(tmp_path, "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    run = read_run(tmp_path)
    assert run.exit_code == 0 and run.summary["status"] == "finished"


# ----------------------------------------------------------------------------------------
# How a run ends: failed (a UserError after the start), interrupted (SIGINT); and bad flags

def test_a_user_error_after_the_start_marks_the_run_failed_and_env_vars_apply(tmp_path):
    # the variables parsed as their flags are: "x, y" is the tags x and y (wandb's own reading kept " y")
    with offline(tmp_path, WANDB_PROJECT="from-env", WANDB_RUN_GROUP="env-group", WANDB_TAGS="x, y"):
        rc, _, err = call(speculate.main, ["--target", DEMO / "target", "--prompt-ids", "1,2,99999",
                                           "--max-new-tokens", 4, "--wandb"])
    assert rc == 2 and err.strip().splitlines()[-1].startswith("error: --prompt-ids: token id 99999"), err
    run = read_run(tmp_path)
    assert (run.run.project, run.run.run_group, list(run.run.tags)) == ("from-env", "env-group", ["x", "y"])
    assert run.exit_code == 2 and run.summary["status"] == "failed" and "99999" in run.summary["error"]


def test_sigint_marks_a_logged_run_interrupted(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [1 + i % 40, 2, 3]}) + "\n" for i in range(400)))
    trace = tmp_path / "trace.jsonl"
    with offline(tmp_path):
        argv = [REPO_ROOT / "speculate.py", "--target", DEMO / "target", "--drafter", DEMO / "drafter",
                "--prompts-file", prompts, "--max-new-tokens", 40, "--trace-file", trace, "--wandb"]
        p = subprocess.Popen([sys.executable] + [str(a) for a in argv], cwd=tmp_path, text=True,
                             env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        t0 = time.time()
        while not any("output_ids" in f.read_text() for f in tmp_path.glob(".trace.jsonl.*.tmp")):
            assert p.poll() is None, p.communicate()
            assert time.time() - t0 < 120, "no request finished"
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and err.strip().splitlines()[-1].startswith("interrupted by SIGINT"), err
    run = read_run(tmp_path)
    assert run.exit_code == 130 and run.summary["status"] == "interrupted" and run.summary["error"] == "SIGINT"
    done = json.loads(trace.read_text().splitlines()[-1])["finished_requests"]
    assert 1 <= run.summary["speculative/requests_logged"] == done < 400
    # the number asked and the table of the finished ones, each under a key of its own
    assert run.summary["speculative/requests"] == 400 and "speculative/requests_table._type" in run.summary
    assert "speculative/requests._type" not in run.summary
    assert_file_artifact(run, "trace", "trace", trace)  # the trace as it was published


def test_a_signal_during_wandb_init_acts_once_the_run_exists(tmp_path, monkeypatch):
    """SIGINT while wandb.init runs (which catches what the handler raises there): it was lost, and the run
    decoded to the end with exit 0. It waits for the run to start, then ends it as interrupted."""
    import wandb

    real = wandb.init

    def init(*args, **kwargs):
        run = real(*args, **kwargs)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
        except BaseException:  # wandb's own handling, as it may catch an exception inside init
            pass
        return run

    with offline(tmp_path):
        monkeypatch.setattr(wandb, "init", init)
        rc, _, err = call(speculate.main, ["--target", DEMO / "target", "--prompt-ids", "1,2,3",
                                           "--max-new-tokens", 4, "--wandb"])
    assert rc == 130 and err.strip().splitlines()[-1].startswith("interrupted by SIGINT"), err
    run = read_run(tmp_path)
    assert run.exit_code == 130 and run.summary["status"] == "interrupted" and run.summary["error"] == "SIGINT"


@pytest.mark.parametrize("argv,code", [([], 0), (["--prompt-ids", "1,2,99999"], 2)])
def test_a_signal_while_the_run_finishes_leaves_the_exit_code_wandb_shows(tmp_path, monkeypatch, argv, code):
    """SIGINT inside wandb's Run.finish: the program exited 130, "interrupted", while W&B recorded the run
    finished with exit code 0 (or failed with 2). The finish now completes, and the program exits with
    the run's code."""
    from wandb.sdk import wandb_run

    real = wandb_run.Run.finish

    def finish(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        return real(self, *args, **kwargs)

    with offline(tmp_path):
        monkeypatch.setattr(wandb_run.Run, "finish", finish)
        rc, _, err = call(speculate.main, ["--target", DEMO / "target", "--prompt-ids", "1,2,3",
                                           "--max-new-tokens", 4, "--wandb", *argv])
    assert rc == code and "interrupted" not in err, err
    assert read_run(tmp_path).exit_code == code


@pytest.mark.parametrize("program,flags,needle", [
    ("speculate", ["--wandb-name", "x"], "--wandb-name: needs --wandb"),
    ("speculate", ["--wandb", "--wandb-tags", "a,,b"], "--wandb-tags 'a,,b': an empty tag"),
    ("speculate", ["--wandb", "--wandb-project", "a/b"], "--wandb-project 'a/b': W&B takes"),
    ("speculate", ["--wandb", "--log-every", 0], "--log-every: invalid value 0"),
    ("speculate", ["--wandb", "WANDB_TAGS=a,,b"], "WANDB_TAGS='a,,b': an empty tag"),
    ("speculate", ["--wandb", "WANDB_PROJECT=a/b"], "WANDB_PROJECT='a/b': W&B takes"),
    ("speculate", ["--wandb", "WANDB_PROJECT= "], "WANDB_PROJECT=' ': empty"),
    ("speculate", ["--wandb", "WANDB_RUN_GROUP= "], "WANDB_RUN_GROUP=' ': empty"),
    # wandb's own variables, named (wandb's pydantic error named neither the variable nor its value)
    ("speculate", ["--wandb", "WANDB_SILENT=maybe"], "WANDB_SILENT='maybe': Input should be a valid boolean"),
    ("eval", ["--wandb", "WANDB_INIT_TIMEOUT=abc"], "WANDB_INIT_TIMEOUT='abc': Input should be a valid number"),
    # WANDB_DIR under a file: wandb put the run in the temporary directory, saying so in a warning only
    ("speculate", ["--wandb", "WANDB_DIR=FILE/x"], "WANDB_DIR='FILE/x': FILE is a file, not a directory"),
    # training's variables refused before the target and the data load (an empty --data refused first)
    ("train", ["--wandb", "WANDB_MODE=bogus", "EMPTY"], "WANDB_MODE='bogus' is not one of"),
    ("train", ["--wandb", "WANDB_SILENT=maybe", "EMPTY"], "WANDB_SILENT='maybe'"),
    ("eval", ["--wandb-group", "g"], "--wandb-group: needs --wandb"),
    ("eval", ["--wandb", "--wandb-entity", " "], "--wandb-entity: empty"),
    ("train", ["--wandb-project", "p"], "--wandb-project: needs --wandb"),
    ("train", ["--wandb-artifacts"], "--wandb-artifacts: needs --wandb"),
])
def test_bad_wandb_flags_are_one_line_errors_before_any_run(tmp_path, program, flags, needle):
    base = {"speculate": (speculate.main, ["--prompt-ids", "1,2"]),
            "eval": (ev.main, ["--target", DEMO / "target", "--out", tmp_path / "r.json"]),
            "train": (train.main, ["--target", DEMO / "target", "--data", REPO_ROOT / "support" / "cli.py",
                                   "--out", tmp_path / "o"])}
    main, argv = base[program]
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    flags = [str(f).replace("FILE", str(a_file)) for f in flags]
    needle = needle.replace("FILE", str(a_file))
    if "EMPTY" in flags:  # a --data that loading refuses, once the target is loaded
        (tmp_path / "empty.txt").write_text("")
        argv = [tmp_path / "empty.txt" if a == REPO_ROOT / "support" / "cli.py" else a for a in argv]
        flags.remove("EMPTY")
    env = dict(f.split("=", 1) for f in flags if str(f).startswith("WANDB_"))  # variables, not flags
    flags = [f for f in flags if not str(f).startswith("WANDB_")]
    with offline(tmp_path, **env):
        rc, _, err = call(main, argv + flags)
    assert rc == 2 and err.strip().splitlines() == [err.strip()] and needle in err, err
    assert not (tmp_path / "wandb").exists()


@pytest.mark.parametrize("error,code,status", [
    (runlog.UserError("x"), 2, "failed"), (ValueError("x"), 1, "failed"), (KeyboardInterrupt(), 130, "interrupted"),
    (runlog.Interrupted(signal.SIGTERM), 143, "interrupted"), (runlog.Interrupted(signal.SIGINT), 130, "interrupted"),
    (BrokenPipeError(), 141, "interrupted")])  # `| head`: the process's quiet exit, not a bug's 1
def test_how_an_exception_ends_a_run(error, code, status):
    assert runlog._ending(error) == (code, status)


def test_a_bad_wandb_mode_names_the_variable(tmp_path):
    with offline(tmp_path, WANDB_MODE="bogus"):
        rc, _, err = call(speculate.main, ["--prompt-ids", "1,2", "--max-new-tokens", 2, "--wandb"])
    assert rc == 2 and err.strip().splitlines() == [err.strip()] and "WANDB_MODE='bogus'" in err, err


@pytest.mark.parametrize("program", ["speculate", "train"])
def test_a_logging_failure_mid_run_stops_the_logging_not_the_run(tmp_path, monkeypatch, program):
    """wandb's service lost mid-run (here its Run.log raising from the third call): one warning, and the run
    finishes with its outputs (speculate.py dropped its finished --trace-file and --output-file, train.py
    the steps since its last checkpoint, each ending in a wandb traceback)."""
    from wandb.sdk import wandb_run

    calls = []

    def lost(self, *args, **kwargs):
        calls.append(1)
        raise ConnectionResetError("Connection lost")

    with offline(tmp_path):
        real = wandb_run.Run.log

        def log(self, *args, **kwargs):
            if len(calls) >= 2:
                return lost(self)
            calls.append(1)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(wandb_run.Run, "log", log)
        if program == "speculate":
            files = [tmp_path / "t.jsonl", tmp_path / "o.jsonl"]
            rc, out, err = call(speculate.main, [
                "--target", DEMO / "target", "--drafter", DEMO / "drafter", "--prompts-file",
                DEMO / "heldout.jsonl", "--max-new-tokens", 8, "--log-every", 1, "--wandb",
                "--trace-file", files[0], "--output-file", files[1]])
        else:
            ids = tmp_path / "ids.jsonl"
            ids.write_text("".join(json.dumps({"prompt_ids": list(range(1, 40))}) + "\n" for _ in range(4)))
            files = [tmp_path / "o" / "checkpoint-4" / "model.safetensors"]
            rc, out, err = call(train.main, [
                "--target", DEMO / "target", "--data-ids", ids, "--out", tmp_path / "o", "--steps", 4,
                "--seq-len", 32, "--anchors-per-seq", 2, "--log-every", 1, "--save-every", 2, "--wandb",
                "--no-progress"])
    warnings = [line for line in err.splitlines() if line.startswith("warning: --wandb")]
    assert rc == 0, err
    assert warnings == ["warning: --wandb: logging stopped, the run goes on without it (Connection lost)"], err
    assert len(calls) == 3  # nothing more was logged after the failure
    assert all(f.is_file() for f in files), err
    assert "Traceback" not in err


def test_a_full_disk_while_staging_an_artifact_stops_the_logging_not_the_run(tmp_path, monkeypatch):
    """wandb copies an artifact's files into its staging folder: a full disk there stopped train.py after its
    first checkpoint, outside the guard on wandb's calls."""
    import errno

    import wandb

    def full(self, path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "staging" / "x"))

    monkeypatch.setattr(wandb.Artifact, "add_file", full)
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"prompt_ids": list(range(1, 40))}) + "\n" for _ in range(4)))
    with offline(tmp_path):
        rc, _, err = call(train.main, [
            "--target", DEMO / "target", "--data-ids", ids, "--out", tmp_path / "o", "--steps", 4, "--seq-len", 32,
            "--anchors-per-seq", 2, "--save-every", 2, "--wandb", "--wandb-artifacts", "--no-progress"])
    assert rc == 0, err
    assert [line for line in err.splitlines() if line.startswith("warning: --wandb")] == [
        "warning: --wandb: logging stopped, the run goes on without it "
        f"([Errno 28] No space left on device: '{tmp_path / 'staging' / 'x'}')"], err
    assert (tmp_path / "o" / "checkpoint-4").is_dir()


@pytest.mark.parametrize("error", ["ImportError", "TypeError"])
def test_a_wandb_that_does_not_import_is_one_line(tmp_path, monkeypatch, error):
    """Installed and broken (a protobuf it cannot use, whose version mismatch is a TypeError): one line, not
    the traceback (a TypeError went past the handler)."""
    broken = tmp_path / "broken" / "wandb"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text(f'raise {error}("cannot import name builder from protobuf")\n')
    monkeypatch.syspath_prepend(str(tmp_path / "broken"))
    monkeypatch.delitem(sys.modules, "wandb", raising=False)
    rc, _, err = call(speculate.main, ["--prompt-ids", "1,2", "--max-new-tokens", 2, "--wandb"])
    assert rc == 2 and err.strip().splitlines() == [
        "error: --wandb: the wandb package does not import (cannot import name builder from protobuf)"], err


def test_wandb_not_installed_is_one_line(tmp_path, monkeypatch):
    """--wandb without the package: one line before any work (a ModuleNotFoundError traceback)."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    rc, _, err = call(speculate.main, ["--prompt-ids", "1,2", "--max-new-tokens", 2, "--wandb"])
    assert rc == 2 and err.strip().splitlines() == ["error: --wandb: needs the wandb package (pip install wandb)"], err


def test_a_reader_gone_from_stdout_still_gets_the_decode_logged(tmp_path):
    """`| head`: the files are published before the completions print, and the W&B run gets the decode's
    summary, requests and files as well (a broken pipe there skipped them all)."""

    class Gone(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self):  # where cli_main puts /dev/null over stdout: a descriptor of its own here
            self.fd = os.open(os.devnull, os.O_WRONLY)
            return self.fd

    outputs = tmp_path / "o.jsonl"
    with offline(tmp_path):
        err = io.StringIO()
        with contextlib.redirect_stdout(Gone()), contextlib.redirect_stderr(err):
            rc = speculate.main([str(a) for a in [
                "--target", DEMO / "target", "--drafter", DEMO / "drafter", "--prompts-file",
                DEMO / "heldout.jsonl", "--max-new-tokens", 4, "--wandb", "--output-file", outputs]])
    assert rc == 141, err.getvalue()
    run = read_run(tmp_path)
    assert run.summary["speculative/requests_logged"] == 20 and "speculative/acceptance_length" in run.summary
    assert_file_artifact(run, "outputs", "outputs", outputs)


def test_a_reader_gone_before_the_calibration_table_costs_eval_no_file_nor_logging(tmp_path):
    """`eval.py | head`: the calibration table was printed before --calibration-plot, --calibration-out and
    the W&B logging, and the broken pipe skipped them all, silently."""

    class Gone(io.StringIO):
        def write(self, text):
            if "confidence calibration" in text:
                raise BrokenPipeError(32, "Broken pipe")
            return super().write(text)

        def fileno(self):  # where cli_main puts /dev/null over stdout: a descriptor of its own here
            self.fd = os.open(os.devnull, os.O_WRONLY)
            return self.fd

    data = tmp_path / "data"
    data.mkdir()
    (data / "code.jsonl").write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in CODE))
    paths = {"out": tmp_path / "r.json", "cal": tmp_path / "c.json", "plot": tmp_path / "rel.png"}
    with offline(tmp_path):
        err = io.StringIO()
        with contextlib.redirect_stdout(Gone()), contextlib.redirect_stderr(err):
            rc = ev.main([str(a) for a in [
                "--target", DEMO / "target", "--drafter", DEMO / "drafter", "--data-dir", data, "--datasets",
                "code", "--max-new-tokens", 16, "--temperature", 1, "--no-progress", "--out", paths["out"],
                "--calibration-out", paths["cal"], "--calibration-plot", paths["plot"], "--wandb"]])
    assert rc == 141, err.getvalue()
    assert paths["cal"].is_file() and paths["plot"].is_file()
    run = read_run(tmp_path)
    assert run.exit_code == 141 and "calibration/ece_1" in run.summary
    assert_file_artifact(run, "results", "results", paths["out"])
    assert_file_artifact(run, "calibration", "calibration", paths["cal"])


def test_train_target_logs_the_config_json_it_writes(tmp_path):
    """scripts/train_target.py's target_config is the config.json its checkpoints hold, as the other
    programs log a target's (it was the in-memory settings: eos_token_ids, no model_type)."""
    import importlib.util

    train_target = sys.modules.get("train_target")  # as test_train.py loads it, when it ran here first
    if train_target is None:
        spec = importlib.util.spec_from_file_location("train_target", REPO_ROOT / "scripts" / "train_target.py")
        train_target = sys.modules["train_target"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(train_target)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(x, y):\n    return x + y\n" * 200)
    out = tmp_path / "target"
    with offline(tmp_path):
        rc, _, err = call(train_target.main, [
            "--data", corpus, "--tokenizer-from-corpus", "--vocab-size", 280, "--out", out, "--steps", 2,
            "--seq-len", 16, "--batch-size", 2, "--hidden-size", 16, "--layers", 2, "--heads", 2, "--kv-heads", 1,
            "--head-dim", 8, "--intermediate-size", 32, "--no-progress", "--wandb"])
    assert rc == 0, err
    assert read_run(tmp_path).config["target_config"] == json.loads((out / "config.json").read_text())


# ----------------------------------------------------------------------------------------
# torchrun: a run rank 0 cannot start stops every rank

@pytest.mark.parametrize("program", ["train.py", "eval.py", "scripts/train_target.py"])
def test_a_run_rank0_cannot_start_stops_every_rank(program, tmp_path):
    """Rank 0 alone starts W&B; the others went on into the process group and waited for it until torchrun
    killed them, 30 s later. Every rank now joins the group first and leaves on rank 0's error."""
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"prompt_ids": list(range(3, 43))}) + "\n")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def add(x, y):\n    return x + y\n" * 20)
    evals = tmp_path / "evals"
    evals.mkdir()
    (evals / "code.jsonl").write_text(json.dumps({"turns": [CODE[0]]}) + "\n")
    flags = {
        "train.py": ["--target", DEMO / "target", "--data-ids", ids, "--steps", 1, "--seq-len", 40,
                     "--device", "cpu"],
        "eval.py": ["--target", DEMO / "target", "--drafter", DEMO / "drafter", "--data-dir", evals,
                    "--datasets", "code", "--max-new-tokens", 4],
        "scripts/train_target.py": ["--data", corpus, "--tokenizer-from-corpus", "--vocab-size", 280, "--steps", 1,
                                    "--seq-len", 16, "--hidden-size", 16, "--layers", 1, "--heads", 2,
                                    "--kv-heads", 1, "--head-dim", 8, "--intermediate-size", 32, "--device", "cpu"],
    }[program]
    # online with no API key (no netrc in HOME): only wandb.init, on rank 0, finds the run cannot start
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), WANDB_MODE="online",
               WANDB_DIR=str(tmp_path), HOME=str(tmp_path), WANDB_CONFIG_DIR=str(tmp_path / "config"))
    env.pop("WANDB_API_KEY", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO_ROOT / program), *map(str, flags), "--out", str(tmp_path / "out"), "--no-progress", "--wandb"]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert p.returncode != 0
    assert p.stderr.count("error: --wandb: the run could not start (No API key") == 1, p.stderr[-3000:]
    assert "Unable to shutdown process" not in p.stderr, p.stderr[-3000:]  # torchrun's SIGKILL after 30 s
