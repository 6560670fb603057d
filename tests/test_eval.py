"""eval.py: per-dataset acceptance against speculate.py's trace, batch and torchrun invariance,
calibration metrics and Sequential Temperature Scaling, outputs (JSON, PNG) and errors."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import IM_END_ID, QWEN3_LIKE_TEMPLATE, REPO_ROOT, build_tokenizer, run_captured
from drafters import make_drafter, make_target

import eval as ev
import speculate
from sampling import Filters
from support import calibration as cal
from support import distributed, eval_report, flags, metrics

torch.set_num_threads(1)

K = 4
MAX_NEW = 24
# Text prompts over the tiny word-level vocabulary (first turn used; the second is ignored).
ROWS = {
    "gsm8k": ["x = 1 + 2 . print ( x )", "hello world", "for x in y : print ( z )", "if x : return 7",
              "def hello ( ) : return world"],
    "mt-bench": ["the world is a world", "import y", "while x : x = x - 1"],
}


def write_dataset(data_dir, name, prompts):
    os.makedirs(data_dir, exist_ok=True)
    with open(os.path.join(data_dir, f"{name}.jsonl"), "w") as f:
        for p in prompts:
            f.write(json.dumps({"turns": [p, "a second turn that is never used"]}) + "\n")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """A near-bigram target with a word-level tokenizer and chat template, an oracle drafter whose
    confidences straddle 0.6, and a data directory with two tiny datasets."""
    d = tmp_path_factory.mktemp("eval")
    target = make_target(d / "target", vocab_size=64, eos_token_id=IM_END_ID, attn_scale=0.01,
                         max_position_embeddings=256)
    build_tokenizer(64).save(os.path.join(target, "tokenizer.json"))
    with open(os.path.join(target, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "unk_token": "<unk>",
                   "chat_template": QWEN3_LIKE_TEMPLATE}, f)
    drafter = make_drafter(d / "drafter", target, block_size=K, markov="vanilla", oracle=True, oracle_scale=4.0,
                           norm_scale=0.05)
    data = d / "data"
    for name, prompts in ROWS.items():
        write_dataset(data, name, prompts)
    return {"dir": d, "target": target, "drafter": drafter, "data": str(data)}


def run_eval(env, tmp_path, capsys, *extra, datasets="gsm8k,mt-bench", out="results.json"):
    out = tmp_path / out
    args = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"], "--datasets", datasets,
            "--max-new-tokens", MAX_NEW, "--temperature", 0, "--no-progress", "--out", out, *extra]
    rc = ev.main([str(a) for a in args])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    return json.load(open(out)), cap.out, cap.err


TIMING = ("tokens_per_second", "seconds")


def strip_timing(entries):
    return [{k: v for k, v in e.items() if k not in TIMING} for e in entries]


def trace_rounds(env, tmp_path, capsys, name, n, *extra):
    """speculate.py on the rows of a dataset that eval.py picks for n samples (the authors' seeded
    shuffle and cut): the trace file's round records."""
    pf = tmp_path / f"{name}-{n}.jsonl"
    with open(os.path.join(env["data"], f"{name}.jsonl")) as f:
        pf.write_text("".join(ev.select(f.readlines(), n, ev.AUTHORS_SEED)))
    trace = tmp_path / f"{name}.trace.jsonl"
    rc = speculate.main([str(a) for a in ["--target", env["target"], "--drafter", env["drafter"], "--prompts-file", pf,
                                          "--max-new-tokens", MAX_NEW, "--temperature", 0, "--trace-file", trace,
                                          *extra]])
    err = capsys.readouterr().err
    assert rc == 0, err
    lines = [json.loads(l) for l in open(trace)]
    return [l for l in lines if "round" in l], [l for l in lines if l.get("summary")][0]


# ----------------------------------------------------------------------------------------
# Acceptance numbers against the trace of speculate.py

def authors_metrics(rounds, stop, K):
    """The authors' evaluation metrics written out from trace round records (DeepSpec's eval loop):
    a round whose accepted drafts hold a stop token ends at it — its verified and accepted drafts
    and its committed tokens are the drafts up to and including the stop, with no bonus."""
    rows = []
    for r in rounds:
        a, v = r["accepted"], r["verified"]
        eos = [j for j, t in enumerate(r["draft"][:a]) if t in stop]
        rows.append((eos[0] + 1, eos[0] + 1, eos[0] + 1) if eos else (a, v, a + 1))
    R = len(rows)
    committed, verified = sum(t for _, _, t in rows), sum(v for _, v, _ in rows)
    by_pos = [sum(a > j for a, _, _ in rows) / sum(v > j for _, v, _ in rows) if any(v > j for _, v, _ in rows)
              else None for j in range(K)]
    cond = []
    for k in range(1, K + 1):
        tried = [(a, v) for a, v, _ in rows if a >= k - 1 and v >= k]
        cond.append(sum(a >= k for a, _ in tried) / len(tried) if tried else None)
    return {"acceptance_length": committed / R, "draft_tokens_per_proposal": verified / R,
            "verify_rate": committed / (verified + R), "accept_rates_by_position": by_pos,
            "accept_rate_by_position": cond, "num_rounds": R}


@pytest.mark.parametrize("threshold,chat", [(0.0, True), (0.6, True), (0.0, False)])
def test_metrics_equal_hand_count_from_speculate_trace(env, tmp_path, capsys, threshold, chat):
    from support.checkpoint import load_target, stop_token_ids

    assert stop_token_ids(env["target"], load_target(env["target"]).args) == (IM_END_ID,)
    extra = ["--confidence-threshold", threshold] + ([] if chat else ["--no-chat"])
    res, out, _ = run_eval(env, tmp_path, capsys, "--max-samples", 3, *extra)
    assert [e["dataset"] for e in res["datasets"]] == ["gsm8k", "mt-bench"]
    for entry in res["datasets"]:
        rounds, summary = trace_rounds(env, tmp_path, capsys, entry["dataset"], 3, *extra)
        want = authors_metrics(rounds, {IM_END_ID}, K)  # the target's one stop id
        assert entry["num_samples"] == 3
        for key, value in want.items():
            assert entry[key] == pytest.approx(value, abs=1e-12), key
        assert entry["acceptance_length"] == pytest.approx(summary["acceptance_length"], abs=1e-12)
        assert entry["accept_rate_by_position"] == pytest.approx(summary["accept_rate_by_position"], abs=1e-12)
        assert entry["draft_tokens_per_proposal"] == pytest.approx(summary["verified_per_round"], abs=1e-12)
        assert entry["dataset"] in out  # the printed table
    # The numbers are not degenerate: several tokens accepted in some rounds, and with the
    # threshold, some rounds verify fewer drafts than were proposed.
    assert any(e["acceptance_length"] > 1.5 for e in res["datasets"])
    if threshold > 0:
        assert any(e["draft_tokens_per_proposal"] < K for e in res["datasets"])
    else:
        assert all(e["draft_tokens_per_proposal"] <= K for e in res["datasets"])


def test_calibration_records_match_trace(env, tmp_path, capsys):
    res, out, err = run_eval(env, tmp_path, capsys, "--max-samples", 3, datasets="gsm8k")
    assert "device: cpu" in err and "; threads: " in err, err  # as speculate.py says where it runs
    rounds, _ = trace_rounds(env, tmp_path, capsys, "gsm8k", 3)
    C = np.array([r["confidence"] for r in rounds])
    acc = np.array([r["accepted"] for r in rounds])
    raw = res["calibration"]["raw"]
    for k in range(1, K + 1):
        a = np.prod(C[:, :k], axis=1)  # no threshold: every round verified every draft
        y = acc >= k
        assert raw[k - 1]["rounds"] == len(rounds) and raw[k - 1]["survived"] == int(y.sum())
        assert raw[k - 1]["ece"] == pytest.approx(cal.ece(a, y), abs=1e-9)
        assert raw[k - 1]["brier"] == pytest.approx(float(np.mean((a - y) ** 2)), abs=1e-9)
    assert "confidence calibration" in out
    rows = [l for l in out.splitlines() if l.startswith(("dataset ", "gsm8k "))]
    assert [l.split()[0] for l in rows] == ["dataset", "gsm8k"], out  # one dataset: the table printed once


def test_counts_and_rates_by_hand():
    rounds = [dict(accepted=a, verified=v, draft=[0] * K) for a, v in
              [(0, 4), (1, 4), (4, 4), (2, 2), (0, 0), (3, 4), (1, 1)]]
    reqs = [speculate.Request(0, [1], [1, 2], rounds[:4]), speculate.Request(1, [1], [3], rounds[4:])]
    c = metrics.count(reqs, K)
    entry = ev.dataset_entry("x", c, 1.0)
    assert entry["accept_rate_by_position"] == [5 / 6, 3 / 4, 2 / 2, 1 / 2] == metrics.accept_rate_by_position(c)
    assert entry["acceptance_length"] == (11 + 7) / 7 and entry["draft_tokens_per_proposal"] == 19 / 7
    assert entry["verify_rate"] == (11 + 7) / (19 + 7)
    # the authors': rounds that accepted > j drafts / rounds that verified > j drafts
    assert entry["accept_rates_by_position"] == [5 / 6, 3 / 5, 2 / 4, 1 / 4]
    assert metrics.acceptance_length(metrics.count(reqs[:1], K)) == (7 + 4) / 4
    assert metrics.acceptance_length(metrics.count([speculate.Request(2, [1])], K)) is None
    # k=3: (2, 2) accepted two drafts but never sent the third to the target: not tried.
    assert c["tried"] == [6, 4, 2, 2] and c["accepted_at"] == [5, 3, 2, 1]
    assert c["num_rounds"] == 7 and c["accepted"] == 11 and c["verified"] == 19 and c["drafted"] == 28
    assert distributed.sum_counts(c, "cpu") == c  # one process: the counts as they are


def test_a_tree_tries_a_position_where_its_path_has_a_child():
    """A tree sends draft k after accepting drafts 1..k-1 only where the accepted path's last node has
    a child; reaching depth k elsewhere in the tree is not trying it."""
    #      0
    #    1   2      a walk that accepts node 2 (depth 1) stops at a leaf;
    #    3          one that accepts 1 and 3 had node 4 sent after them
    #    4
    leaf = dict(accepted=1, verified=4, draft=[5, 6, 7, 8], parents=[0, 0, 1, 3], path=[2], depth=3, bonus=9)
    deep = dict(leaf, accepted=2, path=[1, 3])
    c = metrics.count([speculate.Request(0, [1], [1, 6, 9, 5, 7, 9], [leaf, deep])], K)
    assert c["tried"][:3] == [2, 1, 1] and c["accepted_at"][:3] == [2, 1, 0]
    assert c["verified_at"][:3] == [2, 2, 2]  # the authors' rates count the depth the tree reached
    assert metrics.accept_rate_by_position(c)[:3] == [1.0, 1.0, 0.0]
    # drafted: the nodes the search reached, not the placeholders of those it did not (parent -1)
    unreached = dict(leaf, draft=[5, 6, 7, 8, 4, 4], parents=[0, 0, 1, 3, -1, -1])
    assert metrics.count([speculate.Request(0, [1], [1, 6, 9], [unreached])], K)["drafted"] == 4


def test_a_position_no_round_tried_has_no_rate():
    """Every round verifies one draft (a threshold schedule): positions 2..K were never tried, so their
    conditional rate is undefined (None, as the authors' code gives), not 0.0 — which would read as a
    position that always rejects; the printed table shows '-'."""
    rounds = [dict(accepted=a, verified=1, draft=[0] * K) for a in (1, 0, 1)]
    c = metrics.count([speculate.Request(0, [1], [1, 2, 3, 4, 5], rounds)], K)
    assert metrics.accept_rate_by_position(c) == [2 / 3] + [None] * (K - 1)
    assert metrics.accept_rates_by_position(c) == [2 / 3] + [None] * (K - 1)
    none = metrics.count([speculate.Request(0, [1], [1])], K)  # no round at all
    assert metrics.accept_rate_by_position(none) == [None] * K
    table = eval_report.format_table(ev.dataset_entry("x", c, 1.0))
    assert table.splitlines()[-1].endswith("0.67" + " -" * (K - 1))


def test_a_stop_token_in_a_rejected_draft_does_not_end_the_round():
    """Only accepted drafts can end a round early: a stop token in the first rejected draft (or later)
    is never committed, so the round counts as usual — accepted + 1 committed."""
    EOS = 9
    rd = dict(accepted=2, verified=4, draft=[1, 2, EOS, EOS], bonus=5)
    assert metrics.round_counts(rd, {EOS}) == (2, 4, 3)
    assert metrics.round_counts(dict(rd, accepted=0, draft=[EOS, 1, 2, 3]), {EOS}) == (0, 4, 1)


def test_a_stop_token_inside_the_accepted_drafts_ends_the_round_there():
    """The last round of a request accepts drafts [5, EOS, 6, 7] (4 of 4, bonus 8): the authors'
    loop stops at the EOS — 2 drafts verified, 2 accepted, 2 tokens committed, no bonus — and
    this project counts it the same way (τ 3.5 below, not 4.0 from counting all of it)."""
    EOS = 9
    rounds = [dict(accepted=2, verified=4, draft=[1, 2, 3, 4], bonus=5),     # 3 committed
              dict(accepted=4, verified=4, draft=[5, EOS, 6, 7], bonus=8)]   # EOS at draft 2
    req = speculate.Request(0, [1], [1, 2, 3, 5, EOS], rounds)
    c = metrics.count([req], K, stop_ids=[EOS])
    want = authors_metrics(rounds, {EOS}, K)
    entry = ev.dataset_entry("x", c, 1.0)
    for key, value in want.items():
        assert entry[key] == pytest.approx(value, abs=1e-12), key
    assert entry["acceptance_length"] == (3 + 2) / 2 and entry["draft_tokens_per_proposal"] == (4 + 2) / 2
    assert entry["verify_rate"] == 5 / (6 + 2) and entry["accept_rates_by_position"] == [1.0, 1.0, 0.0, 0.0]
    assert metrics.acceptance_length(metrics.count([req], K)) == (3 + 5) / 2  # without stop ids: all counted
    # A stop token as the bonus ends the request but not the count: accepted + 1.
    bonus_eos = [dict(accepted=1, verified=4, draft=[5, 6, 7, 8], bonus=EOS)]
    assert metrics.acceptance_length(metrics.count([speculate.Request(1, [1], [0, 5, EOS], bonus_eos)], K, [EOS])) == 2
    # Calibration records stop there too: the round offers positions 1..2, both survived.
    recorded = speculate.Request(0, [1], req.output_ids, [dict(r, confidence=[0.5] * K, round=i)
                                                          for i, r in enumerate(rounds)])
    arrays = cal.round_arrays([recorded], 0, K, [EOS])
    assert arrays["verified"].tolist() == [4, 2] and arrays["accepted"].tolist() == [2, 2]


def test_ignore_eos_counts_rounds_as_they_were_decoded(env, tmp_path, capsys, monkeypatch):
    """--ignore-eos decodes past an accepted stop token, so its rounds are counted without one (the
    target's EOS stays a stop token otherwise)."""
    seen = []
    count = metrics.count

    def recording(requests, K, stop_ids=()):
        seen.append(set(stop_ids))
        return count(requests, K, stop_ids)

    monkeypatch.setattr(ev.metrics, "count", recording)
    run_eval(env, tmp_path, capsys, "--ignore-eos", datasets="gsm8k")
    assert seen and all(stop == set() for stop in seen)
    seen.clear()
    run_eval(env, tmp_path, capsys, datasets="gsm8k")
    assert seen and all(IM_END_ID in stop for stop in seen)


# ----------------------------------------------------------------------------------------
# Invariance: batches and processes

def test_batched_equals_batch_size_one(env, tmp_path, capsys):
    one, _, _ = run_eval(env, tmp_path, capsys, out="one.json")
    many, _, _ = run_eval(env, tmp_path, capsys, "--batch-size", 3, out="many.json")
    assert strip_timing(many["datasets"]) == strip_timing(one["datasets"])
    assert one["datasets"][0]["num_samples"] == len(ROWS["gsm8k"])  # not in the paper table: every row
    for a, b in zip(one["calibration"]["raw"], many["calibration"]["raw"]):
        assert a == pytest.approx(b, abs=1e-6)


def test_torchrun_two_processes_equal_one(env, tmp_path, capsys):
    """Sampled (T = 1, the paper's setting): sample i draws from its own stream seeded seed + i
    whichever rank decodes it, so two processes report exactly what one does."""
    one, printed, _ = run_eval(env, tmp_path, capsys, "--batch-size", 2, "--temperature", 1.0, out="one.json")
    out = tmp_path / "two.json"
    envvars = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO_ROOT / "eval.py"), "--target", env["target"], "--drafter", env["drafter"],
           "--data-dir", env["data"], "--datasets", "gsm8k,mt-bench", "--max-new-tokens", str(MAX_NEW),
           "--temperature", "1.0", "--batch-size", "2", "--no-progress", "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=envvars, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    two = json.load(open(out))
    assert two["config"]["world_size"] == 2
    assert strip_timing(two["datasets"]) == strip_timing(one["datasets"])
    cal1, cal2 = one["calibration"], two["calibration"]
    assert cal2["temperatures"] == cal1["temperatures"]
    for key in ("raw", "raw_heldout", "sts_heldout"):
        for a, b in zip(cal1[key], cal2[key]):
            assert a == pytest.approx(b, abs=1e-6)
    assert list(cal2["raw_by_dataset"]) == list(cal1["raw_by_dataset"]) == ["gsm8k", "mt-bench"]
    for d in cal1["raw_by_dataset"]:
        for a, b in zip(cal1["raw_by_dataset"][d], cal2["raw_by_dataset"][d]):
            assert a == pytest.approx(b, abs=1e-6)
    # the row as it finished and the per-dataset calibration: rank 0 only
    assert p.stdout.count("gsm8k") == printed.count("gsm8k") == 2


def test_torchrun_ranks_share_one_sps_table(env, tmp_path):
    """Under torchrun with unequal shards (3 and 2 prompts) and --sps-table, every rank's engine has one batch
    size and rank 0 alone profiles and writes the table: the same command then reads it back (each rank wrote
    its own, for its own batch, and the rerun refused the file that was kept)."""
    table = tmp_path / "sps.json"
    envvars = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO_ROOT / "eval.py"), "--target", env["target"], "--drafter", env["drafter"],
           "--data-dir", env["data"], "--datasets", "gsm8k", "--max-samples", "5", "--max-new-tokens", "8",
           "--temperature", "0", "--batch-size", "4", "--scheduler", "hardware", "--sps-table", str(table),
           "--no-progress"]
    for run in ("first", "second"):
        p = subprocess.run(cmd + ["--out", str(tmp_path / f"{run}.json")], capture_output=True, text=True,
                           env=envvars, cwd=tmp_path, timeout=300)
        assert p.returncode == 0, (run, p.stderr[-3000:])
    assert json.loads(table.read_text())["batch_capacity"] == 3  # the larger shard's
    first, second = (json.loads((tmp_path / f"{run}.json").read_text()) for run in ("first", "second"))
    assert strip_timing(first["datasets"]) == strip_timing(second["datasets"])


def test_seed_repeats_sampled_runs_and_resets_per_dataset(env, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # the bar, as on a terminal

    def sampled(seed, datasets, out):
        res, _, err = run_eval(env, tmp_path, capsys, "--temperature", 1.0, "--seed", seed, "--batch-size", 2,
                               "--progress", datasets=datasets, out=out)
        return {e["dataset"]: e for e in strip_timing(res["datasets"])}, err

    a, err = sampled(3, "gsm8k,mt-bench", "a.json")
    assert "prompt" in err and "100%" in err  # the progress bar, on stderr
    b, _ = sampled(3, "gsm8k,mt-bench", "b.json")
    c, _ = sampled(4, "gsm8k,mt-bench", "c.json")
    alone, _ = sampled(3, "mt-bench", "d.json")
    assert a == b and a != c
    assert alone["mt-bench"] == a["mt-bench"]  # a dataset's numbers do not depend on the ones before it


# ----------------------------------------------------------------------------------------
# Outputs

def test_calibration_outputs(env, tmp_path, capsys):
    """--calibration-out and --calibration-plot (what --wandb records: tests/test_wandb.py)."""
    cal, png = tmp_path / "cal.json", tmp_path / "rel.png"
    res, out, _ = run_eval(env, tmp_path, capsys, "--calibration-out", cal, "--calibration-plot", png,
                           "--temperature", 1.0, "--seed", 3)
    temps = json.load(open(cal))["temperatures"]
    assert len(temps) == K and all(t > 0 for t in temps) and temps == res["calibration"]["temperatures"]
    import matplotlib.image

    img = matplotlib.image.imread(str(png))  # drawn by plots.py: one panel per position
    assert img.shape[1] > 600 and img.shape[0] > 300 and img[..., :3].std() > 0
    assert res["config"]["temperature"] == 1.0


def test_the_subset_is_the_authors_seeded_shuffle():
    """A file longer than its count: shuffled with random.Random(980406), then cut (DeepSpec's eval);
    a shorter one stays whole and in order."""
    lines = (REPO_ROOT / "data" / "eval" / "gsm8k.jsonl").read_text().splitlines()
    want = list(lines)
    random.Random(980406).shuffle(want)
    got = ev.select(lines, 500, ev.AUTHORS_SEED)
    assert got == want[:500] and len(set(got)) == 500
    assert len(set(got) & set(lines[:500])) < 250  # not the first rows in file order
    assert ev.select(lines[:30], 30, ev.AUTHORS_SEED) == lines[:30] and ev.select(lines, 0, 1) == lines


def test_only_the_subset_is_read_as_prompts(env, tmp_path, capsys, monkeypatch):
    """The records are drawn first and only the chosen ones rendered and tokenized: a record outside the
    subset that could not run refused the whole run (and a 52,002-row file was all tokenized for 500)."""
    from support import text

    data = tmp_path / "data"
    words = ["hello world", "print x", "def x", "the x is a", "x is a", "a b"]
    rows = [{"turns": [w]} for w in words] + [{"turns": ["word " * 20000]}]  # past the context
    data.mkdir()
    (data / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    chosen = ev.select(list(range(len(rows))), 2, ev.AUTHORS_SEED)
    assert len(rows) - 1 not in chosen  # the long record is not drawn
    encoded = []
    real = text.encode
    monkeypatch.setattr(text, "encode", lambda tok, p, where, **kw: (encoded.append(where), real(tok, p, where, **kw))[1])
    res, _, _ = run_eval(dict(env, data=str(data)), tmp_path, capsys, "--max-samples", 2, "--batch-size", 16,
                         datasets="long")
    assert res["datasets"][0]["num_samples"] == 2
    # the batch that ran, beside the flag's (tokens/s depends on it)
    assert (res["config"]["batch_size"], res["config"]["batch_size_resolved"]) == (16, 2)
    assert res["config"]["scheduler_resolved"] == "none"
    # the records' shapes are checked whatever the subset: a file is not taken with one seed, refused with another
    rows[-1] = {"prompt_ids": [5, 6, 7]}
    (data / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc = ev.main([str(a) for a in ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", data,
                                   "--datasets", "long", "--max-samples", 2, "--system-prompt", "be brief",
                                   "--no-progress", "--out", tmp_path / "r2.json"]])
    assert rc == 2 and "long.jsonl:7: a prompt_ids record is token ids" in capsys.readouterr().err
    assert encoded == [f"{data / 'long.jsonl'}:{i + 1}" for i in chosen]


def test_chat_is_refused_only_where_no_dataset_holds_a_text(env, tmp_path, capsys):
    """--chat with datasets of token ids only renders nothing, refused in one line as speculate.py refuses
    it; beside a dataset of texts, it is taken (a per-file check would refuse that)."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "ids.jsonl").write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    shutil.copy(os.path.join(env["data"], "gsm8k.jsonl"), data / "gsm8k.jsonl")
    base = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", data, "--chat",
            "--max-new-tokens", MAX_NEW, "--temperature", 0, "--no-progress"]
    rc = ev.main([str(a) for a in [*base, "--datasets", "ids", "--out", tmp_path / "r.json"]])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0] == (f"error: --chat: every record of {data / 'ids.jsonl'} is token ids, never rendered; "
                      "it would change nothing")
    assert not (tmp_path / "r.json").exists()
    res, _, _ = run_eval(dict(env, data=str(data)), tmp_path, capsys, "--chat", "--max-samples", 1,
                         datasets="ids,gsm8k")
    assert [d["num_samples"] for d in res["datasets"]] == [1, 1]


def test_a_target_without_a_chat_template_is_said_once(env, tmp_path, capsys):
    """The protocol renders prompts with the chat template; a target without one decodes them as written,
    which the run says in a line (only results.json's chat_resolved recorded it), where a record it reads
    is a text: token ids are never rendered."""
    import shutil

    target = tmp_path / "target"
    shutil.copytree(env["target"], target)
    (target / "tokenizer_config.json").unlink()
    res, _, err = run_eval(dict(env, target=str(target)), tmp_path, capsys, "--max-samples", 1, datasets="gsm8k")
    note = (f"chat: off (--target {target} has no chat template): text prompts are decoded as written, not "
            "rendered as the authors render them")
    assert err.splitlines().count(note) == 1 and res["config"]["chat_resolved"] is False, err
    _, _, err = run_eval(dict(env, target=str(target)), tmp_path, capsys, "--max-samples", 1, "--no-chat",
                         datasets="gsm8k")
    assert "chat: off" not in err  # asked for
    data = tmp_path / "data"  # token ids only: nothing is rendered either way
    data.mkdir()
    (data / "ids.jsonl").write_text(json.dumps({"prompt_ids": [5, 6, 7]}) + "\n")
    _, _, err = run_eval(dict(env, target=str(target), data=str(data)), tmp_path, capsys, datasets="ids")
    assert "chat: off" not in err, err


def test_a_budget_that_leaves_no_room_names_the_flag(env, tmp_path, capsys):
    """--max-new-tokens at or past the context: one line naming the flag (it blamed the first prompt, with
    '1 tokens' of room)."""
    rc = ev.main([str(a) for a in ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"],
                                   "--datasets", "gsm8k", "--max-new-tokens", 256, "--no-progress",
                                   "--out", tmp_path / "r.json"]])
    err = capsys.readouterr().err
    assert rc == 2 and err == ("error: --max-new-tokens 256: leaves no room for a prompt in the context of 256 "
                               "tokens\n"), err


def test_rows_are_printed_and_results_written_as_each_dataset_finishes(env, tmp_path, capsys, monkeypatch):
    writes = []
    real = ev.write_json

    def write_json(path, obj, **kw):
        writes.append(json.loads(json.dumps(obj)))
        real(path, obj, **kw)
    monkeypatch.setattr(ev, "write_json", write_json)  # each dataset's results as it finishes
    monkeypatch.setattr(eval_report, "write_json", write_json)  # the run's, complete
    res, out, _ = run_eval(env, tmp_path, capsys, "--max-samples", 2, "--step", 1200)
    progress = [w for w in writes if "datasets" in w]
    assert [(len(w["datasets"]), w["complete"]) for w in progress] == [(1, False), (2, False), (2, True)]
    assert res["complete"] is True and res["config"]["step"] == 1200
    lines = out.splitlines()
    assert lines[0].startswith("dataset") and "#propose" in lines[0] and "accept_rate@0" in lines[0]
    assert lines[2].startswith("gsm8k") and lines[3].startswith("mt-bench")  # one row per dataset, as it finishes


def test_a_row_is_written_before_it_is_printed(env, tmp_path, capsys, monkeypatch):
    """stdout's reader gone (`| head`) while a dataset's row is printed: --out already holds that row."""
    def say(self, text):
        if text.startswith("dataset"):  # the first row, under its header
            raise BrokenPipeError
    monkeypatch.setattr(ev.Progress, "say", say)
    monkeypatch.setattr(sys, "stdout", open(tmp_path / "stdout", "w"))  # cli_main points it at /dev/null
    out = tmp_path / "r.json"
    args = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"], "--datasets", "gsm8k",
            "--max-samples", 1, "--max-new-tokens", 4, "--temperature", 0, "--no-progress", "--out", out]
    assert ev.main([str(a) for a in args]) == 141
    assert [e["dataset"] for e in json.load(open(out))["datasets"]] == ["gsm8k"]


def test_sts_temperatures_do_not_depend_on_an_applied_calibration(env, tmp_path, capsys):
    """Fitting with --calibration applied writes the temperatures fitting without it writes: they are
    always relative to the head's raw logits (a refit is not a no-op [1, 1, ...] on top of the first)."""
    first, second = tmp_path / "cal1.json", tmp_path / "cal2.json"
    run_eval(env, tmp_path, capsys, "--temperature", 1.0, "--calibration-out", first, out="a.json")
    temps = json.load(open(first))["temperatures"]
    assert temps != [1.0] * K
    # a threshold no confidence falls below: the rounds are the first run's, the confidences scaled by T_k
    run_eval(env, tmp_path, capsys, "--temperature", 1.0, "--calibration", first, "--calibration-out", second,
             "--confidence-threshold", 1e-9, out="b.json")
    assert json.load(open(second))["temperatures"] == temps


def test_the_calibration_undone_is_the_one_applied(env, tmp_path, capsys, monkeypatch):
    """The report undoes the temperatures the drafter applied as it loaded, not the file read again at the end
    (replaced meanwhile, e.g. by a concurrent run's --calibration-out, it undid other ones, or failed)."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"temperatures": [2.0] * K}))
    flags = ("--temperature", 1.0, "--calibration", cal, "--confidence-threshold", 1e-9)
    want, _, _ = run_eval(env, tmp_path, capsys, *flags, out="a.json")
    real = ev.load_models

    def load_then_replace(*args, **kwargs):
        m = real(*args, **kwargs)
        cal.write_text(json.dumps({"temperatures": [9.0] * K}))  # the file is rewritten while the run goes on
        return m
    monkeypatch.setattr(ev, "load_models", load_then_replace)
    got, _, _ = run_eval(env, tmp_path, capsys, *flags, out="b.json")
    assert got["calibration"]["raw"] == want["calibration"]["raw"]


def test_a_calibration_fitted_elsewhere_gets_a_note(env, tmp_path, capsys):
    """The STS file records the drafter and the sampling temperature it was fitted at; eval.py and speculate.py
    say so when they apply it to another drafter or at another temperature (its fit depends on both)."""
    cal = tmp_path / "cal.json"
    run_eval(env, tmp_path, capsys, "--temperature", 1.0, "--calibration-out", cal, out="a.json")
    fitted = json.load(open(cal))
    assert fitted["temperature"] == 1.0 and fitted["drafter_dir"] == os.path.realpath(env["drafter"])
    _, _, err = run_eval(env, tmp_path, capsys, "--temperature", 1.0, "--calibration", cal,
                         "--confidence-threshold", 0.5, out="b.json")
    assert "note: --calibration" not in err
    _, _, err = run_eval(env, tmp_path, capsys, "--temperature", 0.5, "--calibration", cal,
                         "--confidence-threshold", 0.5, out="c.json")
    assert f"note: --calibration {cal} was fitted at temperature 1 (this run: 0.5);" in err
    moved = tmp_path / "moved.json"
    moved.write_text(json.dumps({**fitted, "drafter_dir": str(tmp_path / "older-drafter")}))
    rc = speculate.main([str(a) for a in ("--target", env["target"], "--drafter", env["drafter"], "--prompt-ids",
                                          "1,2,3", "--max-new-tokens", 4, "--confidence-threshold", 0.5,
                                          "--calibration", moved, "--temperature", 0)])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert (f"note: --calibration {moved} was fitted on drafter {tmp_path / 'older-drafter'} (this run: "
            f"{os.path.realpath(env['drafter'])}) and at temperature 1 (this run: 0);") in err


def test_temperature_none_is_the_resolved_temperature_everywhere_it_is_said(env, tmp_path, capsys):
    """--temperature None samples as the target's generation_config.json says: the comparison's title, the
    note on a calibration fitted elsewhere, the calibration file and results.json's `sampling` give that
    temperature (the title and the note crashed on None, the file recorded null, and results.json only
    the flag as given)."""
    target = tmp_path / "target"
    shutil.copytree(env["target"], target)
    (target / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.5}))
    at_half = dict(env, target=str(target))
    cal = tmp_path / "cal.json"
    res, _, _ = run_eval(at_half, tmp_path, capsys, "--temperature", "None", "--max-samples", 2,
                         "--calibration-out", cal, out="a.json")
    assert res["config"]["temperature"] is None  # the flag as given ...
    sampling = res["config"]["sampling"]  # ... and how tokens were drawn
    assert (sampling["temperature"], sampling["top_k"]) == (0.5, 0)
    assert sampling["source"].endswith("generation_config.json"), sampling
    fitted = json.load(open(cal))
    assert fitted["temperature"] == 0.5
    cal.write_text(json.dumps({**fitted, "temperature": 1.0}))
    _, _, err = run_eval(at_half, tmp_path, capsys, "--temperature", "None", "--max-samples", 1, "--calibration",
                         cal, "--confidence-threshold", 0.5, datasets="gsm8k", out="b.json")
    assert f"note: --calibration {cal} was fitted at temperature 1 (this run: 0.5);" in err, err
    _, text, _ = run_eval(at_half, tmp_path, capsys, "--temperature", "None", "--max-samples", 1,
                          "--tree-budget", 4, datasets="gsm8k", out="c.json")
    assert "τ at T=0.5" in text, text


def test_a_calibration_file_says_what_each_temperature_was_fitted_on(env, tmp_path, capsys):
    """The file records the rounds each T_k was fitted on and the scheduler: a position no round verified
    kept 1, and a scheduled fit is biased, which nothing said once the file left eval.py; the run warns
    of unfitted positions, and a program applying the file notes both."""
    cal = tmp_path / "cal.json"
    res, _, err = run_eval(env, tmp_path, capsys, "--temperature", 1.0, "--confidence-threshold", 0.999999,
                           "--calibration-out", cal, out="a.json")
    fitted = json.load(open(cal))
    counts = fitted["fit_rounds_by_position"]
    assert fitted["scheduler"] == "threshold" and len(counts) == K
    assert counts == res["calibration"]["fit_rounds_by_position"] and counts[-1] == 0
    assert all(t == 1.0 for t, n in zip(fitted["temperatures"], counts) if n == 0)
    assert "warning: no round of the STS fit part verified position" in err
    m = speculate.load(env["target"], env["drafter"], calibration=str(cal))
    note = flags.calibration_note(m, 1.0)
    assert "under --scheduler threshold, whose records bias it" in note and f"{K} (kept at 1)" in note


def test_a_saturating_calibration_is_not_passed_off_as_the_raw_head(env, tmp_path, capsys):
    """With a sharpening --calibration (small T_k) the recorded float32 sigmoid(logit / T_k) reaches 1.0 and the
    raw head's value is gone: the report must then say so instead of printing other figures as the raw head's."""
    sharp = tmp_path / "sharp.json"
    sharp.write_text(json.dumps({"temperatures": [1e-4] * K}))  # |logit| > 0.002 saturates sigmoid(logit / T)
    plain, _, err = run_eval(env, tmp_path, capsys, "--temperature", 1.0, out="a.json")
    assert "unrecoverable" not in plain["calibration"] and "cannot be recovered" not in err
    res, _, err = run_eval(env, tmp_path, capsys, "--temperature", 1.0, "--calibration", sharp,
                           "--confidence-threshold", 1e-9, out="b.json")
    assert res["calibration"]["raw"] != plain["calibration"]["raw"]  # what the warning is for
    assert res["calibration"]["unrecoverable"] > 0 and err.count("cannot be recovered") == 1


def test_the_calibration_table_says_an_applied_file_was_undone(env, tmp_path, capsys):
    """With --calibration the report is the raw head's (the file's temperatures undone before STS is
    fitted): the table said nothing, and read as the file's own figures."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"temperatures": [2.0] * K}))
    res, out, _ = run_eval(env, tmp_path, capsys, "--temperature", 1.0, "--calibration", cal,
                           "--confidence-threshold", 0.5, out="a.json")
    assert f"of the raw head: the --calibration {cal} temperatures undone" in out
    assert res["calibration"]["undone"] == str(cal)


def test_scheduled_calibration_warns(env, tmp_path, capsys):
    res, _, err = run_eval(env, tmp_path, capsys, "--confidence-threshold", 0.6, "--max-samples", 2)
    assert res["calibration"]["scheduled"] == "threshold"
    assert err.count("warning: calibration measured under --scheduler threshold") == 1


def test_default_sample_counts_and_missing_files(tmp_path, capsys):
    write_dataset(tmp_path, "gsm8k", ["a"])
    write_dataset(tmp_path, "custom", ["a", "b"])
    args = ev.EvalArgs(target="t", data_dir=str(tmp_path), datasets="gsm8k,aime25,custom")
    got, skipped = ev.resolve_datasets(args)
    assert [(n, c) for n, _, c in got] == [("gsm8k", 500), ("custom", 0)]
    assert skipped == [os.path.join(tmp_path, "aime25.jsonl")]  # run() warns once every input is checked
    args.max_samples = 7
    assert [c for _, _, c in ev.resolve_datasets(args)[0]] == [7, 7]
    assert ev.DEFAULT_SAMPLES == {"gsm8k": 500, "math500": 500, "aime25": 30, "humaneval": 164, "mbpp": 256,
                                  "livecodebench": 500, "mt-bench": 80, "alpaca": 500, "arena-hard-v2": 500}


def test_a_data_dir_of_other_datasets_names_them(tmp_path):
    """None of the paper's datasets in --data-dir: the line names the .jsonl files there and --datasets."""
    write_dataset(tmp_path, "mine", ["a"])
    write_dataset(tmp_path, "theirs", ["a"])
    args, _ = ev.resolve_defaults(ev.EvalArgs(target="t", drafter="d", data_dir=str(tmp_path)))
    with pytest.raises(ev.UserError) as e:
        ev.resolve_datasets(args)
    assert str(e.value) == (f"--datasets: none of {', '.join(ev.PAPER_DATASETS)} is in {tmp_path} "
                            "(it holds mine.jsonl, theirs.jsonl: give --datasets mine,theirs)")


def test_help_says_the_demo_modes_budget(capsys):
    """The demo mode's 128-token budget, whatever --datasets, is in --help (it was in a docstring tyro's flat
    group drops, and --max-new-tokens' line said 2048)."""
    with pytest.raises(SystemExit):
        ev.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "a budget of 2048 new tokens (128 in demo mode, whatever --datasets)" in help_text
    assert "(eval.py: the authors' 2048, or 128 in its demo mode," in help_text


def test_help_says_what_max_samples_and_the_compile_cache_default_to(capsys):
    with pytest.raises(SystemExit):
        ev.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: the paper's count; a dataset outside the paper's nine is taken whole)" in help_text
    assert "else ~/.cache/dspark-fast/inductor ($XDG_CACHE_HOME for ~/.cache)" in help_text


def test_the_shipped_benchmark_prompts_are_the_default_data_dir():
    args, _ = ev.resolve_defaults(ev.EvalArgs(target="t", datasets="gsm8k"))
    (name, path, n), = ev.resolve_datasets(args)[0]
    assert os.path.realpath(path) == os.path.realpath(REPO_ROOT / "data" / "eval" / "gsm8k.jsonl") and n == 500


@pytest.mark.parametrize("case", ["missing-data-dir", "unknown-dataset", "none-present",
                                  "bad-split", "plot-without-head", "too-long", "tree-without-drafter",
                                  "filter-at-greedy", "split-without-drafter", "bins-with-a-tree-curve",
                                  "empty-dataset-name", "missing-calibration", "calibration-unscheduled", "sps-table-several-rows",
                                  "prompt-fills-context"])
def test_bad_input_is_one_line_error(env, tmp_path, capsys, case):
    base = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"], "--datasets", "gsm8k",
            "--max-new-tokens", 8, "--no-progress", "--out", tmp_path / "r.json"]
    no_drafter = base[:2] + base[4:]
    long = tmp_path / "long"  # a prompt longer than the target's 256 positions, and no budget given
    write_dataset(long, "gsm8k", [])
    (long / "gsm8k.jsonl").write_text(json.dumps({"prompt_ids": [1] * 300}) + "\n")
    args, want = {
        "missing-data-dir": (base[:5] + [tmp_path / "nope"] + base[6:], "nope"),
        "unknown-dataset": (base[:7] + ["gsm8k,nosuchset"] + base[8:], "nosuchset"),
        "none-present": (base[:7] + ["alpaca"] + base[8:], "alpaca"),
        "bad-split": (base + ["--calibration-split", 1.5], "--calibration-split"),
        "plot-without-head": (base[:2] + base[4:] + ["--calibration-plot", tmp_path / "p.png"], "confidence head"),
        "too-long": (base[:9] + [10_000] + base[10:], "max-new-tokens"),
        "tree-without-drafter": (no_drafter + ["--tree-budget", 4], "--tree-budget 4: a tree is drafted by a --drafter"),
        "filter-at-greedy": (base + ["--temperature", 0, "--top-k", 5], "--top-k 5: a sampling filter"),
        "split-without-drafter": (no_drafter + ["--calibration-split", 0.3], "--calibration-split 0.3: shapes the"),
        "bins-with-a-tree-curve": (base + ["--tree-budget", 4, "--ece-bins", 5], "--ece-bins 5: shapes the"),
        "empty-dataset-name": (base[:7] + ["gsm8k,"] + base[8:], "an empty name between commas"),
        "missing-calibration": (base + ["--confidence-threshold", 0.5, "--calibration", tmp_path / "nope.json"],
                                f"--calibration {tmp_path / 'nope.json'}: calibration file not found"),
        # one SPS table for several engines: the second row refused the first's table after its whole decode
        "sps-table-several-rows": (base + ["--scheduler", "hardware", "--sps-table", tmp_path / "s.json",
                                           "--drafter", tmp_path / "another-drafter"],
                                   "--sps-table " + str(tmp_path / "s.json") +
                                   ": holds one engine's SPS(B), and this run compares several rows"),
        # under the none schedule nothing reads the confidences --calibration scales (as speculate.py refuses it)
        "calibration-unscheduled": (base + ["--calibration", tmp_path / "nope.json"],
                                    "only a scheduled round (--scheduler threshold, hardware, async) or a sampled "
                                    "draft tree reads the confidences"),
        "prompt-fills-context": (base[:5] + [long] + base[6:8] + base[10:],
                                 "gsm8k.jsonl:1: 300 tokens fill the target's context of 256"),
    }[case]
    rc = ev.main([str(a) for a in args])
    err = capsys.readouterr().err
    assert rc == 2
    lines = [l for l in err.strip().splitlines() if l.startswith("error:")]
    assert len(lines) == 1 and want in lines[0], err
    assert "Traceback" not in err
    assert not (tmp_path / "r.json").exists()


def test_calibration_tuning_without_a_confidence_head_is_refused(tmp_path, capsys):
    """--ece-bins shapes the report of a confidence head: refused once the drafter is seen to have none
    (the demo's Eagle3 drafter), before any decoding."""
    demo = REPO_ROOT / "demo"
    args = ["--target", demo / "target", "--drafter", demo / "eagle3", "--data-dir", demo, "--datasets", "heldout",
            "--max-samples", 1, "--max-new-tokens", 4, "--no-progress", "--out", tmp_path / "r.json",
            "--ece-bins", 5]
    rc = ev.main([str(a) for a in args])
    err = capsys.readouterr().err
    assert rc == 2 and err.strip().splitlines()[-1].startswith(
        f"error: --ece-bins 5: shapes the calibration report of a confidence head, and --drafter {demo / 'eagle3'}")
    assert not (tmp_path / "r.json").exists()


def test_progress_counts_every_ranks_prompts_and_never_past_a_dataset():
    """Rank 0 sees its own shard finish and counts `world` prompts each: 20 prompts over 8 ranks give
    rank 0 three requests, which count 20, not 24; a finished dataset's count is exact."""
    progress = ev.Progress(None, "row", total=25, world=8)
    progress.start("a", 20)
    for _ in range(3):
        progress.on_finish(None)
    assert progress.finished + progress.current == 20
    progress.end_dataset()
    progress.start("b", 5)
    progress.on_finish(None)
    assert progress.finished + progress.current == 25
    progress.end_dataset()
    assert progress.finished == 25 and progress.current == 0


def test_calibration_files_without_a_drafter_are_refused_before_loading(env, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(ev, "load_models", lambda *a, **k: pytest.fail("loaded before the flags were checked"))
    for flag in ("--calibration-out", "--calibration-plot"):
        rc = ev.main([str(a) for a in ["--target", env["target"], "--data-dir", env["data"], "--datasets", "gsm8k",
                                       flag, tmp_path / "c.png", "--out", tmp_path / "r.json"]])
        err = capsys.readouterr().err
        assert rc == 2 and err == f"error: {flag}: needs a --drafter with a confidence head\n", err


def test_progress_off_a_terminal_is_plain_lines(env, tmp_path, capsys):
    """stderr captured (not a terminal): no bar frames joined by carriage returns in it."""
    out = tmp_path / "r.json"
    rc = ev.main([str(a) for a in ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"],
                                   "--datasets", "gsm8k", "--max-new-tokens", 8, "--out", out]])
    err = capsys.readouterr().err
    assert rc == 0 and "\r" not in err and "prompt/s" not in err, err


def test_sps_table_and_compile_cache_are_checked_before_loading(env, tmp_path, capsys, monkeypatch):
    """As speculate.py does: a --sps-table that cannot be written and a --compile-cache that is a file
    are refused before the models load (they were found after loading, and compiling); a directory
    given as --sps-table is named as such (the error blamed --out)."""
    monkeypatch.setattr(ev, "load_models", lambda *a, **k: pytest.fail("loaded before the outputs were checked"))
    afile = tmp_path / "afile"
    afile.write_text("x")
    base = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"], "--datasets", "gsm8k",
            "--max-new-tokens", 8, "--no-progress", "--out", tmp_path / "r.json"]
    for extra, want in (
            (["--scheduler", "hardware", "--sps-table", tmp_path / "no" / "s.json"], "--sps-table"),
            (["--scheduler", "hardware", "--sps-table", tmp_path], f"--sps-table {tmp_path}: is a directory"),
            (["--compile", "--compile-cache", afile], f"--compile-cache {afile}: not a directory"),
            (["--calibration-out", tmp_path / "t.json", "--calibration-split", 0], "--calibration-out needs STS")):
        rc = ev.main([str(a) for a in base + extra])
        err = capsys.readouterr().err
        lines = [l for l in err.strip().splitlines() if l.startswith("error:")]
        assert rc == 2 and len(lines) == 1 and want in lines[0], err
    # A missing known dataset's warning comes once every input is checked: never before an error.
    rc = ev.main([str(a) for a in base[2:7] + ["gsm8k,aime25"] + base[8:]])
    err = capsys.readouterr().err
    assert err == f"error: --drafter {env['drafter']}: needs --target, the target it was trained for\n", err
    assert rc == 2
    monkeypatch.undo()
    # ... nor before a checkpoint found unreadable while loading
    rc = ev.main([str(a) for a in ["--target", afile] + base[2:7] + ["gsm8k,aime25"] + base[8:]])
    err = capsys.readouterr().err
    assert rc == 2 and err == f"error: --target {afile}: is a file, not a directory\n", err
    rc = ev.main([str(a) for a in base[:7] + ["gsm8k,aime25"] + base[8:]])
    err = capsys.readouterr().err
    assert rc == 0 and f"warning: {os.path.join(env['data'], 'aime25.jsonl')} not found; skipping dataset aime25" in err
    assert json.loads((tmp_path / "r.json").read_text())["config"]["skipped"] == ["aime25"]


# ----------------------------------------------------------------------------------------
# Metric helpers on hand-computed cases

def test_ece_hand_cases():
    # Bins of width 1/20: 0.05 and 0.06 share bin 1; 0.95 is in bin 19, the last, and so is 1.0.
    p, y = [0.05, 0.06, 0.95, 1.0], [0, 1, 1, 1]
    # bin 1: mean p 0.055, observed 0.5 -> 2/4 * 0.445; bin 19: mean p 0.975, observed 1 -> 2/4 * 0.025
    assert cal.ece(p, y) == pytest.approx(0.5 * 0.445 + 0.5 * 0.025)
    assert cal.ece([0.3, 0.3, 0.3], [1, 0, 0]) == pytest.approx(abs(1 / 3 - 0.3))
    assert cal.ece([1 / 3], [1], bins=3) == pytest.approx(2 / 3)  # the bin edge belongs to the upper bin
    assert cal.ece([], []) is None
    assert cal.ece([0.2, 0.8], [0, 1], bins=1) == pytest.approx(0.0)  # one bin: |mean p - mean y|


def test_auroc_hand_cases():
    assert cal.auroc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == 1.0
    assert cal.auroc([0.1, 0.2, 0.8, 0.9], [1, 1, 0, 0]) == 0.0
    assert cal.auroc([0.5, 0.5, 0.5], [0, 1, 1]) == 0.5  # all tied
    # positives 0.4, 0.8; negatives 0.4, 0.2: pairs (0.4 vs 0.4) tie = 1/2, the other three win -> 3.5 / 4
    assert cal.auroc([0.4, 0.8, 0.4, 0.2], [1, 1, 0, 0]) == pytest.approx(3.5 / 4)
    assert cal.auroc([0.3, 0.4], [1, 1]) is None


def test_brier_hand_cases():
    assert cal.brier([0.5, 1.0, 0.0], [1, 1, 1]) == pytest.approx((0.25 + 0 + 1) / 3)
    assert cal.brier([], []) is None


def test_survival_events_use_rounds_that_verified_k():
    C = np.array([[0.9, 0.5, 0.5], [0.8, 0.5, 0.5], [0.7, 0.4, 0.5]])
    a, y = cal.survival_events(C, verified=[3, 1, 2], accepted=[3, 1, 1], k=2)
    assert a.tolist() == pytest.approx([0.45, 0.28]) and y.tolist() == [True, False]


# ----------------------------------------------------------------------------------------
# Sequential Temperature Scaling

def synthetic_rounds(n, scales, seed=0):
    """Rounds whose true conditional acceptance probabilities are known: π_k = σ(z_k); the head
    reports σ(s_k · z_k) (s > 1: over-confident, s < 1: under-confident); acceptance is drawn
    left to right from π and stops at the first rejection; every round verifies all K drafts."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.8, 1.5, size=(n, len(scales)))
    true = 1 / (1 + np.exp(-z))
    reported = 1 / (1 + np.exp(-z * np.asarray(scales)))
    ok = rng.random(z.shape) < true
    accepted = np.where(ok.all(1), len(scales), np.argmin(ok, axis=1))
    return reported, np.full(n, len(scales)), accepted


def test_sts_lowers_ece_and_keeps_the_order():
    scales = [3.0, 0.4, 2.0, 1.5]
    C, ver, acc = synthetic_rounds(6000, scales)
    fit, held = slice(0, 3000), slice(3000, None)
    temps = cal.fit_sts(C[fit], ver[fit], acc[fit])
    # The fitted temperatures undo the distortion: T_1 ~ s_1, and every T_k sharpens an
    # under-confident position and flattens an over-confident one. (Later T_k also absorb the
    # residual error of the earlier positions' fits, since they calibrate the product a_k.)
    assert temps[0] == pytest.approx(scales[0], rel=0.2)
    assert [t > 1 for t in temps] == [s > 1 for s in scales]
    Cs = cal.apply_temperatures(C[held], temps)
    for k in range(1, len(scales) + 1):
        before = cal.ece(*cal.survival_events(C[held], ver[held], acc[held], k))
        after = cal.ece(*cal.survival_events(Cs, ver[held], acc[held], k))
        assert after < 0.5 * before and after < 0.04, (k, before, after)
        # Monotone per position: the calibrated scores rank the rounds exactly as the raw ones do.
        assert np.array_equal(np.argsort(C[held][:, k - 1], kind="stable"), np.argsort(Cs[:, k - 1], kind="stable"))
    a1_raw, y1 = cal.survival_events(C[held], ver[held], acc[held], 1)
    assert cal.auroc(cal.survival_events(Cs, ver[held], acc[held], 1)[0], y1) == pytest.approx(cal.auroc(a1_raw, y1))


def test_sts_is_sequential_and_respects_verified():
    # A calibrated head keeps temperatures near 1; a position never verified keeps exactly 1.
    C, ver, acc = synthetic_rounds(4000, [1.0, 1.0, 1.0])
    ver = np.minimum(ver, 2)
    acc = np.minimum(acc, ver)
    temps = cal.fit_sts(C, ver, acc)
    assert temps[:2] == pytest.approx([1.0, 1.0], rel=0.25) and temps[2] == 1.0


def test_calibration_report_splits_by_request_per_dataset():
    C, ver, acc = synthetic_rounds(400, [2.0, 2.0])
    i = np.arange(400)
    # Two datasets of 20 requests x 10 rounds, handed over shuffled (as ranks deliver them).
    perm = np.random.default_rng(1).permutation(400)
    parts = [{"dataset": (i >= 200).astype(np.int32)[p], "request": ((i % 200) // 10)[p], "round": (i % 10)[p],
              "confidence": C.astype(np.float32)[p], "verified": ver[p], "accepted": acc[p]}
             for p in (perm[:150], perm[150:])]
    rec = cal.concat_rounds(parts)
    assert rec["dataset"].tolist() == (i >= 200).tolist() and rec["request"].tolist() == ((i % 200) // 10).tolist()
    rep = cal.calibration_report(rec, 0.5, [20, 20])
    assert rep["fit_rounds"] == 200 and rep["heldout_rounds"] == 200  # 10 of 20 requests per dataset
    fit = ((i % 200) // 10) < 10
    assert rep["temperatures"] == cal.fit_sts(C.astype(np.float32)[fit], ver[fit], acc[fit])
    assert all(s["ece"] < r["ece"] for s, r in zip(rep["sts_heldout"], rep["raw_heldout"]))
    assert "temperatures" not in cal.calibration_report(rec, 0.0, [20, 20])


def test_the_calibration_split_counts_every_request_even_one_without_rounds():
    """The first half of 6 requests is requests 0-2 though request 4 ended at its first token (no rounds):
    the fit part is fixed before the run, as eval.py checks its size then (it counted only the requests
    with rounds: 0-1 here)."""
    C, ver, acc = synthetic_rounds(50, [2.0, 2.0])
    rec = {"dataset": np.zeros(50, dtype=np.int32), "request": np.repeat([0, 1, 2, 3, 5], 10),
           "round": np.tile(np.arange(10), 5), "confidence": C.astype(np.float32), "verified": ver,
           "accepted": acc}
    rep = cal.calibration_report(rec, 0.5, [6])
    assert rep["fit_rounds"] == 30 and rep["heldout_rounds"] == 20


def test_calibration_is_reported_per_dataset_too():
    """The head says c_1 = 0.5 everywhere; dataset a accepts every draft 1, dataset b none. Pooled, the
    head looks perfect (ECE 0); per dataset, as the authors report, it is off by 0.5 on each."""
    n = 40
    rec = {"dataset": np.repeat(np.arange(2, dtype=np.int32), n), "request": np.tile(np.arange(n), 2),
           "round": np.zeros(2 * n, dtype=np.int64), "confidence": np.full((2 * n, 1), 0.5, dtype=np.float32),
           "verified": np.ones(2 * n, dtype=np.int64), "accepted": np.repeat([1, 0], n)}
    rep = cal.calibration_report(rec, 0.0, [n, n], names=["a", "b"])
    assert rep["raw"][0]["ece"] == pytest.approx(0.0)
    assert list(rep["raw_by_dataset"]) == ["a", "b"]
    assert [rep["raw_by_dataset"][d][0]["ece"] for d in "ab"] == pytest.approx([0.5, 0.5])
    assert [rep["raw_by_dataset"][d][0]["rounds"] for d in "ab"] == [n, n]
    text = eval_report.format_calibration(rep)
    assert "per dataset" in text and text.splitlines()[-1].split() == ["b", str(n), "0.500"]


@pytest.mark.parametrize("kind", ["hardware", "async"])
def test_sps_scheduler_metrics_equal_speculate_trace(env, tmp_path, capsys, kind):
    from test_scheduler import write_sps_table

    # Batch 1, a fixed cost per round plus 0.3 of it per verified token: the schedule varies.
    table = write_sps_table(tmp_path / "sps.json", env["target"], env["drafter"], 1, 0.0, lambda b: 1 + 0.3 * b)
    extra = ["--scheduler", kind, "--sps-table", table]
    res, _, err = run_eval(env, tmp_path, capsys, "--max-samples", 3, *extra, datasets="gsm8k")
    assert "read from" in err
    entry = res["datasets"][0]
    rounds, summary = trace_rounds(env, tmp_path, capsys, "gsm8k", 3, *extra)
    assert entry["acceptance_length"] == pytest.approx(summary["acceptance_length"], abs=1e-12)
    assert entry["draft_tokens_per_proposal"] == pytest.approx(sum(r["verified"] for r in rounds) / len(rounds))
    assert 0 < entry["verify_rate"] < 1


def test_scheduler_flags_are_checked(env, tmp_path, capsys):
    args = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"], "--datasets", "gsm8k",
            "--scheduler", "threshold", "--no-progress", "--out", str(tmp_path / "r.json")]
    assert ev.main(args) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --scheduler threshold")


def test_unwritable_outputs_are_refused_before_any_work(env, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # without --out: the default results.json would be written here
    for flag in ("--out", "--calibration-plot"):
        args = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"], "--datasets",
                "gsm8k", "--no-progress", flag, str(tmp_path / "missing" / "x")]
        assert ev.main(args) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith(f"error: {flag}")


# ----------------------------------------------------------------------------------------
# Defaults a newcomer meets: the budget against the context, the default --out

def test_default_budget_is_capped_to_the_context_with_a_note(env, tmp_path, capsys):
    """The default 2048 new tokens do not fit this target's 256-token context: capped, in one line, to
    what the longest prompt leaves; a budget given by name that does not fit stays an error."""
    out = tmp_path / "r.json"
    base = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"], "--datasets", "gsm8k",
            "--max-samples", "2", "--temperature", "0", "--no-progress"]
    assert ev.main(base + ["--out", str(out)]) == 0
    err = capsys.readouterr().err
    notes = [l for l in err.splitlines() if l.startswith("note:")]
    assert len(notes) == 1 and notes[0].startswith("note: --max-new-tokens ") and "default 2048" in notes[0], err
    res = json.load(open(out))
    budget = res["config"]["max_new_tokens"]
    longest = int(notes[0].split("longest prompt (")[1].split(" tokens")[0])
    assert budget == 256 - longest == int(notes[0].split()[2].rstrip(":"))
    assert ev.main(base + ["--out", str(out), "--max-new-tokens", "2048"]) == 2
    assert "max-new-tokens" in capsys.readouterr().err


def test_default_out_never_replaces_an_earlier_results_file(env, tmp_path, capsys, monkeypatch):
    """A rerun with no new flags works and loses nothing: results.json, then results-2.json, ... (printed)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results.json").write_text("earlier\n")
    base = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"], "--datasets", "gsm8k",
            "--max-samples", "1", "--max-new-tokens", "4", "--no-progress"]
    assert ev.main(base) == 0
    assert "results written to results-2.json" in capsys.readouterr().err
    assert ev.main(base) == 0
    assert "results written to results-3.json" in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == "earlier\n"
    assert json.load(open(tmp_path / "results-3.json"))["complete"] is True
    assert ev.main(base + ["--out", "results.json"]) == 0  # named: replaced, as every named output is
    assert json.load(open(tmp_path / "results.json"))["complete"] is True
    assert "results written to results.json" in capsys.readouterr().err


def test_default_out_is_taken_when_chosen(env, tmp_path, capsys, monkeypatch):
    """Two evals started together in one folder took the same free name, chosen at start and written at the
    first dataset's end: the last to finish replaced the other's results. The name is created when chosen;
    a run that writes nothing under it (here a refused flag) leaves nothing."""
    monkeypatch.chdir(tmp_path)
    assert (ev.free_name("results.json", claim=True), ev.free_name("results.json", claim=True)) == \
        ("results.json", "results-2.json")
    assert sorted(os.listdir(tmp_path)) == ["results-2.json", "results.json"]
    for name in os.listdir(tmp_path):
        os.remove(name)
    flags = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"], "--datasets",
             "nosuchset", "--max-samples", "1", "--max-new-tokens", "4", "--no-progress"]
    assert ev.main(flags) == 2
    assert "nosuchset" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []


def test_default_out_in_an_input_directory_is_taken_as_the_same_name_given(env, tmp_path, capsys, monkeypatch):
    """Run from inside the target's directory with no --out: the default results.json is judged as
    `--out results.json` is (a new file beside the checkpoint), not refused as the file the run itself
    had just created there."""
    target = tmp_path / "target"
    shutil.copytree(env["target"], target)
    monkeypatch.chdir(target)
    base = ["--target", ".", "--drafter", env["drafter"], "--data-dir", env["data"], "--datasets", "gsm8k",
            "--max-samples", "1", "--max-new-tokens", "4", "--no-progress"]
    assert ev.main(base) == 0, capsys.readouterr().err
    assert "results written to results.json" in capsys.readouterr().err
    assert json.load(open(target / "results.json"))["complete"] is True


def test_demo_mode_defaults_resolve_to_the_demo_pair_and_its_heldout_prompts(monkeypatch, tmp_path):
    """`python eval.py` alone: the demo pair on demo/heldout.jsonl at 128 tokens (the whole run is in
    tests/test_newcomer.py); --datasets or --data-dir given keep the benchmark meaning."""
    monkeypatch.chdir(tmp_path)
    args, demo = ev.resolve_defaults(ev.EvalArgs())
    assert demo and args.datasets == "heldout" and os.path.samefile(args.data_dir, REPO_ROOT / "demo")
    assert os.path.samefile(args.target, REPO_ROOT / "demo" / "target") and args.out == "results.json"
    assert args.decode.max_new_tokens is None and ev.DEMO_BUDGET == 128  # the budget is resolved against the prompts
    args, demo = ev.resolve_defaults(ev.EvalArgs(datasets="gsm8k"))
    assert demo and os.path.samefile(args.data_dir, ev.DATA_DIR)
    args, demo = ev.resolve_defaults(ev.EvalArgs(target="t"))
    assert not demo and args.datasets == ",".join(ev.PAPER_DATASETS) and args.data_dir == ev.DATA_DIR


def test_one_drafters_calibration_applies_to_its_tree_curve(env, tmp_path, capsys):
    """--calibration with --tree-budget: the drafter's confidences shape its sampled trees, so the curve
    is evaluated with the temperatures (it was refused as "several rows"); a greedy curve reads no
    confidence and two drafters would share one drafter's temperatures: both refused."""
    from drafters import make_eagle3

    K = json.loads(open(os.path.join(env["drafter"], "config.json")).read())["block_size"]
    cal = tmp_path / "sts.json"
    cal.write_text(json.dumps({"temperatures": [2.0] * K}))
    base = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"], "--datasets",
            "gsm8k", "--max-samples", "2", "--max-new-tokens", "8", "--no-progress", "--tree-budget", "4",
            "--calibration", str(cal), "--out", str(tmp_path / "r.json")]
    assert ev.main(base + ["--temperature", "1"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert ev.main(base + ["--temperature", "0"]) == 2
    assert "a greedy draft tree ranks its branches" in capsys.readouterr().err
    eagle3 = make_eagle3(tmp_path / "eagle3", env["target"], ttt_length=3)
    assert ev.main(base[:-4] + ["--drafter", eagle3, "--calibration", str(cal), "--out", str(tmp_path / "r.json")]) == 2
    assert "and this run compares 2 drafters" in capsys.readouterr().err


def test_several_drafters_and_a_tree_curve_read_as_one_table(env, tmp_path, capsys, monkeypatch):
    """--drafter repeated: a row each, datasets as columns with the mean, as the paper's Table 1 reads;
    --tree-budget N adds a block drafter's chain and its tree at 4, 8, ... N. results.json holds every row
    (its top-level "datasets" are the first row's), each with its engine's compile time; the config's is
    their sum."""
    from drafters import make_eagle3

    built = []
    row_engine = ev.row_engine

    def timed_engine(*args):
        engine = row_engine(*args)
        built.append(engine)
        engine.compile_seconds = float(len(built))  # as if compiled: 1, 2, 3, ... seconds
        return engine
    monkeypatch.setattr(ev, "row_engine", timed_engine)
    eagle3 = make_eagle3(tmp_path / "eagle3", env["target"], ttt_length=3)
    out = tmp_path / "r.json"
    base = ["--target", env["target"], "--data-dir", env["data"], "--datasets", "gsm8k,mt-bench", "--max-samples", "2",
            "--max-new-tokens", "12", "--no-progress", "--temperature", "0", "--out", str(out)]
    missing = ["--datasets", "gsm8k,aime25,mt-bench"]  # aime25 is not in the data directory
    assert ev.main(base + missing + ["--drafter", env["drafter"], "--drafter", eagle3, "--tree-budget", "8"]) == 0
    text = capsys.readouterr().out
    assert text.endswith("\n(the mean leaves out aime25: not found)\n"), text  # the paper's mean is over all
    table = text[text.index("τ at T=0"):].splitlines()[:-1]
    assert table[0].split() == ["τ", "at", "T=0", "gsm8k", "mt-bench", "mean"]
    labels = [line.rsplit(maxsplit=3)[0] for line in table[2:]]  # then two datasets' τ and the mean
    assert labels == ["drafter chain", "drafter tree 4", "drafter tree 8", "eagle3"], table
    res = json.loads(out.read_text())
    assert [r["label"] for r in res["rows"]] == labels and [r["tree_budget"] for r in res["rows"]] == [0, 4, 8, 0]
    assert res["datasets"] == res["rows"][0]["datasets"] and res["complete"] is True
    assert [r["compile_seconds"] for r in res["rows"]] == [1.0, 2.0, 3.0, 4.0]
    assert res["config"]["compile_seconds"] == 10.0
    for line, row in zip(table[2:], res["rows"]):
        taus = [e["acceptance_length"] for e in row["datasets"]]
        assert line.split()[-3:] == [f"{taus[0]:.2f}", f"{taus[1]:.2f}", f"{sum(taus) / 2:.2f}"]
    assert all(e["num_samples"] == 2 for r in res["rows"] for e in r["datasets"])
    # the same directory under another spelling too (it was decoded twice)
    for again in (env["drafter"], env["drafter"] + "/", os.path.relpath(env["drafter"])):
        assert ev.main(base + ["--drafter", env["drafter"], "--drafter", again]) == 2
        err = capsys.readouterr().err
        assert f"--drafter {again}: the same drafter as --drafter {env['drafter']}, given twice" in err, err
    assert ev.main(base + ["--drafter", env["drafter"], "--drafter", eagle3, "--calibration-out", str(tmp_path / "c.json")]) == 2
    assert "compares several rows" in capsys.readouterr().err
    # a curve needs a block drafter; a tree temperature needs a curve
    assert ev.main(base + ["--drafter", eagle3, "--tree-budget", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tree-budget 8: trees grow from a block drafter") and err.count("\n") == 1, err
    assert ev.main(base + ["--drafter", env["drafter"], "--tree-temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --tree-temperature 0.5: ranks the branches") and err.count("\n") == 1, err


def test_each_rows_engine_is_built_with_no_earlier_rows_caches_held(env, tmp_path, capsys, monkeypatch):
    """Every row is checked alone against free memory before the first decodes, so each row's engine is
    built with the last row's engine gone and no other drafter's caches held: a tree curve's rows (each
    longer than the last) held two rows' target caches at the switch, and an earlier drafter kept its
    caches to the end of the run."""
    from drafters import make_eagle3

    def kv_bytes(model):
        caches = [layer.self_attn.kv_cache for layer in model.layers]
        return sum(c.k.nbytes + c.v.nbytes for c in caches if c is not None)

    models = []  # every model an engine was built on
    held = []  # at each build: this run's live engines, and the KV bytes of models the row does not use
    init = speculate.Engine.__init__

    def counted_init(self, target, drafter, *args, **kwargs):
        for model in (target, drafter):
            if model is not None and all(model is not seen for seen in models):
                models.append(model)
        live = sum(engine.target is target for engine in speculate.LIVE_ENGINES)
        others = [model for model in models if model is not target and model is not drafter]
        held.append((live, sum(map(kv_bytes, others))))
        init(self, target, drafter, *args, **kwargs)
    monkeypatch.setattr(speculate.Engine, "__init__", counted_init)
    eagle3 = make_eagle3(tmp_path / "eagle3", env["target"], ttt_length=3)
    out = tmp_path / "r.json"
    args = ["--target", env["target"], "--drafter", env["drafter"], "--drafter", eagle3, "--tree-budget", "8",
            "--data-dir", env["data"], "--datasets", "mt-bench", "--max-samples", "1", "--max-new-tokens", "8",
            "--no-progress", "--temperature", "0", "--out", str(out)]
    assert ev.main(args) == 0, capsys.readouterr().err
    assert len(json.loads(out.read_text())["rows"]) == 4  # chain, tree 4, tree 8, eagle3
    assert held == [(0, 0)] * 4


def test_a_prompt_past_one_drafters_context_names_that_drafter(env, tmp_path, capsys):
    """In a comparison, a prompt that does not fit a drafter's context says which --drafter (it said "the
    drafter's context" of whichever it was), in one line."""
    small = tmp_path / "small"
    shutil.copytree(env["drafter"], small)
    config = json.loads((small / "config.json").read_text())
    config["max_position_embeddings"] = 8
    (small / "config.json").write_text(json.dumps(config))
    out = tmp_path / "r.json"
    args = ["--target", env["target"], "--drafter", env["drafter"], "--drafter", small, "--data-dir", env["data"],
            "--datasets", "gsm8k", "--max-samples", 2, "--max-new-tokens", 4, "--temperature", 0, "--no-progress",
            "--out", out]
    assert ev.main([str(a) for a in args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --drafter {small}: "), err
    assert err[0].endswith("exceed the drafter's context of 8 (max_position_embeddings)"), err
    assert not out.exists()


def test_every_rows_engine_is_checked_before_the_first_decodes(env, tmp_path, capsys, monkeypatch):
    """A row that cannot run (here the largest sampled tree, over the free memory) is refused before
    any row decodes: no engine is built, nothing is written."""
    from support import flags

    monkeypatch.setattr(flags, "free_memory", lambda device: 2**40)
    real_tree_bytes = flags.tree_round_bytes

    def tree_bytes(m, drafter, budget, sampled):
        if budget == 8:
            return 2**50
        return real_tree_bytes(m, drafter, budget, sampled)

    monkeypatch.setattr(flags, "tree_round_bytes", tree_bytes)
    built = []
    monkeypatch.setattr(ev, "make_engine", lambda *args, **kwargs: built.append(args))
    out = tmp_path / "r.json"
    args = ["--target", env["target"], "--drafter", env["drafter"], "--data-dir", env["data"],
            "--datasets", "gsm8k", "--max-samples", "2", "--max-new-tokens", "12", "--no-progress",
            "--temperature", "1", "--tree-budget", "8", "--out", str(out)]
    assert ev.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: the KV caches for --batch-size") and err[-1].endswith("--tree-budget")
    assert not built and not out.exists()


def test_an_eagle3_draft_length_is_the_runs_number_of_positions(env, tmp_path, capsys):
    """--draft-length sets an Eagle3 chain's drafts a round: results.json's num_drafts and the W&B
    acceptance table follow it, not the checkpoint's ttt_length."""
    from types import SimpleNamespace

    from drafters import make_eagle3

    from support import runlog

    eagle3 = make_eagle3(tmp_path / "eagle3", env["target"], ttt_length=4)
    out = tmp_path / "r.json"
    args = ["--target", env["target"], "--drafter", eagle3, "--draft-length", "2", "--data-dir", env["data"],
            "--datasets", "gsm8k", "--max-samples", "2", "--max-new-tokens", "12", "--temperature", "0",
            "--no-progress", "--out", str(out)]
    assert ev.main(args) == 0
    err = capsys.readouterr().err
    assert "drafts/round=2 " in err and "drafts/round=4" not in err, err  # the line said the checkpoint's 4
    res = json.loads(out.read_text())
    assert res["config"]["num_drafts"] == 2 and "drafts/round=2 " in res["config"]["drafter_config"]
    assert all(len(e["accept_rates_by_position"]) == 2 for e in res["datasets"])
    rc, _, err = run_captured(["--target", env["target"], "--drafter", eagle3, "--draft-length", "3",
                               "--prompt-ids", "1,2,3", "--max-new-tokens", "4"])
    assert rc == 0 and "drafts/round=3 " in err and "drafts/round=4" not in err, err

    class Table:  # as wandb.Table: every row as wide as the columns
        def __init__(self, columns, data):
            assert all(len(row) == len(columns) for row in data), (columns, data)
            self.columns = columns

    logged = {}
    run = SimpleNamespace(log=lambda values, step=None: logged.update(values),
                          summary=SimpleNamespace(update=lambda values: None))
    plot = SimpleNamespace(line=lambda *a, **k: None)
    log = runlog.Log(run, SimpleNamespace(Table=Table, plot=plot))
    eval_report.log_results(log, res, step=None, image=None, files={})
    assert logged["acceptance"].columns[-2:] == ["accept_rate@0", "accept_rate@1"]
    # a config with more drafts than any row measured: the table is as wide as the rows' rates
    wider = dict(res, config=dict(res["config"], num_drafts=4))
    eval_report.log_results(log, wider, step=None, image=None, files={})
    assert logged["acceptance"].columns[-2:] == ["accept_rate@0", "accept_rate@1"]


def test_draft_length_sets_the_eagle3_rows_of_a_comparison(env, tmp_path, capsys):
    """Beside a block drafter, --draft-length is the Eagle3 row's chain (the block drafter drafts its
    block, as a tree budget is the block drafter's alone); with block drafters only it is refused."""
    from drafters import make_eagle3

    eagle3 = make_eagle3(tmp_path / "eagle3", env["target"], ttt_length=4)
    out = tmp_path / "r.json"
    common = ["--target", env["target"], "--data-dir", env["data"], "--datasets", "gsm8k", "--max-samples", "2",
              "--max-new-tokens", "12", "--temperature", "0", "--no-progress", "--draft-length", "2"]
    assert ev.main(common + ["--drafter", env["drafter"], "--drafter", eagle3, "--out", str(out)]) == 0, \
        capsys.readouterr().err
    block, chain = json.loads(out.read_text())["rows"]
    assert len(block["datasets"][0]["accept_rates_by_position"]) == K
    assert len(chain["datasets"][0]["accept_rates_by_position"]) == 2
    capsys.readouterr()
    assert ev.main(common + ["--drafter", env["drafter"], "--out", str(tmp_path / "s.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --draft-length 2: only an Eagle3 drafter's chain length is chosen") and \
        err.count("\n") == 1, err
    # a schedule refused for one of several drafters names that one (the first has a confidence head)
    scheduled = common[:-2] + ["--confidence-threshold", "0.5", "--drafter", env["drafter"], "--drafter", eagle3,
                               "--out", str(tmp_path / "t.json")]
    assert ev.main(scheduled) == 2
    err = capsys.readouterr().err
    assert err == f"error: --drafter {eagle3}: --confidence-threshold 0.5: the --drafter has no confidence head, " \
                  "whose confidences a scheduled round reads\n", err


def test_wandb_tables_and_chart_hold_every_row_of_a_comparison():
    """Several rows (drafters, tree budgets): W&B's acceptance table and by-position chart hold each
    row's datasets, labelled by row, as wide as the row that drafts most."""
    from types import SimpleNamespace

    from support import runlog

    def entry(dataset, rates):
        conditional = [None] + rates[1:]
        return {"dataset": dataset, "num_samples": 2, "num_rounds": 5, "acceptance_length": 2.0,
                "draft_tokens_per_proposal": 3.0, "verify_rate": 1.0, "tokens_per_second": 9.0,
                "accept_rates_by_position": rates, "accept_rate_by_position": conditional}

    chain = {"label": "d chain", "tree_budget": 0, "datasets": [entry("gsm8k", [0.9, 0.5])]}
    eagle3 = {"label": "e3", "tree_budget": 0,
              "datasets": [entry("gsm8k", [0.8, 0.6, 0.4, 0.2]), entry("mbpp", [0.7, 0.5, 0.3, 0.1])]}
    res = {"datasets": chain["datasets"], "rows": [chain, eagle3], "calibration": None}
    tables = {}

    class Table:  # as wandb.Table: every row as wide as the columns
        def __init__(self, columns, data):
            assert all(len(row) == len(columns) for row in data), (columns, data)
            self.columns = columns
            self.data = data

    def line(table, x, y, stroke, title):
        tables["chart"] = table

    logged = {}
    run = SimpleNamespace(log=lambda values, step=None: logged.update(values),
                          summary=SimpleNamespace(update=lambda values: None))
    log = runlog.Log(run, SimpleNamespace(Table=Table, plot=SimpleNamespace(line=line)))
    eval_report.log_results(log, res, step=None, image=None, files={})
    table = logged["acceptance"]
    assert table.columns[:3] == ["row", "tree_budget", "dataset"]
    assert table.columns[-4:] == [f"accept_rate@{j}" for j in range(4)]
    assert [r[:3] for r in table.data] == [["d chain", 0, "gsm8k"], ["e3", 0, "gsm8k"], ["e3", 0, "mbpp"]]
    assert table.data[0][-2:] == [None, None]  # the chain measured two positions
    series = [r[0] for r in tables["chart"].data]
    assert series == ["d chain: gsm8k"] * 2 + ["e3: gsm8k"] * 4 + ["e3: mbpp"] * 4


def test_a_rows_mean_tau_is_over_every_dataset_or_undefined():
    """Table 1's mean: a row with a dataset of no rounds (τ undefined) has no mean, rather than one
    over fewer datasets than the other rows'."""
    def row(label, taus):
        return {"label": label, "datasets": [{"dataset": f"d{i}", "acceptance_length": t}
                                             for i, t in enumerate(taus)]}

    table = eval_report.format_comparison([row("a", [2.0, 4.0]), row("b", [3.0, None])], temperature=0)
    lines = table.splitlines()
    assert lines[2].split() == ["a", "2.00", "4.00", "3.00"]
    assert lines[3].split() == ["b", "3.00", "-", "-"]


def test_results_config_names_the_drafters_and_the_skipped_datasets():
    """results.json's config: one drafter's description as it is, several as a list, none as None; the
    datasets asked for without a file are listed as skipped, by name."""
    from types import SimpleNamespace

    def drafter(name):
        return SimpleNamespace(cfg=SimpleNamespace(describe=lambda num_drafts=None: name))

    args = ev.EvalArgs(target="t", datasets="gsm8k, aime25,custom")
    m = SimpleNamespace(dtype=torch.float32)
    skipped_files = [os.path.join("data", "eval", "aime25.jsonl")]  # resolve_datasets' second list
    sampling = flags.Sampling(1.0, Filters(top_k=20), "from --temperature, --top-k")
    for drafters, want in [([], None), ([drafter("a")], "a"), ([drafter("a"), drafter("b")], ["a", "b"])]:
        c = ev.config(args, 2, 7, 4, "none", 1.5, drafters, True, False, m, skipped_files, sampling)
        assert c["sampling"] == {"temperature": 1.0, "top_k": 20, "top_p": 1.0, "min_p": 0.0,
                                 "source": "from --temperature, --top-k"}
        assert c["drafter_config"] == want
        assert c["skipped"] == ["aime25"]  # as named, without the space around it
        assert (c["world_size"], c["num_drafts"], c["compile_seconds"]) == (2, 7, 1.5)
        assert (c["chat_resolved"], c["compile_resolved"], c["dtype_resolved"]) == (True, False, "float32")
        assert c["datasets"] == "gsm8k, aime25,custom"


def test_hub_drafters_are_named_by_their_repository_in_the_comparison():
    """A drafter read from a Hugging Face cache snapshot is its ORG/NAME in the table and results.json's rows
    (it was the snapshot folder's name: the 40-digit commit); a local directory is its folder's name."""
    from types import SimpleNamespace

    dspark = SimpleNamespace(cfg=SimpleNamespace(layout="dspark"))
    eagle3 = SimpleNamespace(cfg=SimpleNamespace(layout="eagle3"))
    hub = os.path.join("cache", "models--org--dr", "snapshots", "d" * 40)
    rows = ev.rows_of([dspark, eagle3], [hub, os.path.join("runs", "eagle3")], 0, None)
    assert [r.label for r in rows] == ["org/dr", "eagle3"]
    # the same repository at two revisions: the full paths tell them apart
    other = os.path.join("cache", "models--org--dr", "snapshots", "e" * 40)
    assert [r.label for r in ev.rows_of([dspark, dspark], [hub, other], 0, None)] == [hub, other]


def test_the_api_warns_of_a_calibration_fitted_elsewhere(env, tmp_path):
    """speculate.load(calibration=...) then generate: the note the command line prints (another drafter,
    another temperature, a scheduled fit) comes as a UserWarning; it said nothing."""
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"temperatures": [1.5] * K, "temperature": 1.0, "scheduler": "threshold"}))
    m = speculate.load(env["target"], env["drafter"], calibration=str(cal))
    with pytest.warns(UserWarning, match=r"was fitted at temperature 1 \(this run: 0\) and under --scheduler"):
        speculate.generate(m, [[1, 2, 3]], max_new_tokens=4, temperature=0.0, confidence_threshold=0.5)


def test_the_api_notes_the_calibration_it_loaded_whatever_happens_to_the_file(env, tmp_path, monkeypatch):
    """The note compares what load() read, fitted on this drafter: after a change of directory (a relative
    path given to load()) or the file rewritten, generate neither fails nor warns of another drafter."""
    import warnings

    cal = tmp_path / "cal.json"
    drafter = os.path.realpath(env["drafter"])
    cal.write_text(json.dumps({"temperatures": [1.5] * K, "temperature": 0.0, "drafter_dir": drafter}))
    monkeypatch.chdir(tmp_path)
    m = speculate.load(os.path.relpath(env["target"]), os.path.relpath(drafter), calibration="cal.json")
    monkeypatch.chdir(REPO_ROOT)
    cal.write_text("[]")  # rewritten since
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no note: fitted on this drafter, at this temperature
        speculate.generate(m, [[1, 2, 3]], max_new_tokens=4, temperature=0.0, confidence_threshold=0.5)


def test_the_api_warns_of_generation_config_keys_not_applied(env, tmp_path):
    """Sampling as the target's generation_config.json says, through the API: what the file asks for and this
    decoding does not apply comes as a UserWarning, as the command line says it at start."""
    target = tmp_path / "target"
    shutil.copytree(env["target"], target)
    config = {"do_sample": True, "temperature": 0.6, "repetition_penalty": 1.3}
    (target / "generation_config.json").write_text(json.dumps(config))
    m = speculate.load(str(target), env["drafter"])
    with pytest.warns(UserWarning, match=r"generation_config.json: not applied here: repetition_penalty 1.3"):
        speculate.generate(m, [[1, 2, 3]], max_new_tokens=4)


def test_each_extra_drafter_is_counted_before_it_loads(tmp_path, monkeypatch, capsys):
    """A comparison's second drafter is counted against what is free beside the models already loaded (only
    the first was): one line naming it."""
    from support import checkpoint

    free = iter([2**40])  # the target and the first drafter fit; then 1 KiB is left

    monkeypatch.setattr(checkpoint, "free_memory", lambda device: next(free, 2**10))
    data = tmp_path / "data"
    data.mkdir()
    (data / "code.jsonl").write_text(json.dumps({"turns": ["import os\n"]}) + "\n")
    demo = os.path.join(REPO_ROOT, "demo")
    rc = ev.main(["--target", os.path.join(demo, "target"), "--drafter", os.path.join(demo, "drafter"),
                  "--drafter", os.path.join(demo, "eagle3"), "--data-dir", str(data), "--datasets", "code",
                  "--max-new-tokens", "4", "--no-progress", "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err[-1].startswith(f"error: --drafter {os.path.join(demo, 'eagle3')}: its weights need"), err


def test_a_temperature_at_the_grids_end_gets_a_note(env, tmp_path, capsys, monkeypatch):
    """STS searches 0.05 to 20: a temperature on an end may be short of the best one (seen with few rounds),
    which the file and the table showed as any other."""
    real = ev.calibration_report

    def at_edge(*args, **kwargs):
        report = real(*args, **kwargs)
        report["temperatures"][0] = float(cal.STS_GRID[-1])
        return report

    monkeypatch.setattr(ev, "calibration_report", at_edge)
    _, _, err = run_eval(env, tmp_path, capsys, "--temperature", 1.0, "--calibration-out", tmp_path / "c.json")
    assert "note: STS temperatures at an end of their grid (0.05 to 20) at position 1" in err, err


def test_the_fit_part_is_the_split_of_the_requests_without_float_error():
    """floor(split x n), as documented: 0.29 of 100 requests is 29 (floating point made it 28)."""
    assert cal.fit_requests(0.29, 100) == 29 and cal.fit_requests(0.5, 7) == 3 and cal.fit_requests(0.0, 5) == 0
