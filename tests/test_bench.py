"""bench.py's loops agree with each other, and the random real-shaped presets have the right shapes."""

from __future__ import annotations

import json

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


def test_bench_rows_and_reference_agree(tmp_path, capsys):
    target = make_target(tmp_path / "t")
    drafter = make_drafter(tmp_path / "d", target, oracle=True, oracle_scale=4.0, norm_scale=0.05)
    out = tmp_path / "bench.json"
    # bench.run raises if speculative != autoregressive output, or the reference loop differs.
    rc = bench.main(["--target", target, "--drafter", drafter, "--no-compile", "--batch-sizes", "1,2",
                     "--prompt-len", "6", "--max-new-tokens", "20", "--reference", "True", "--repeats", "2",
                     "--out", str(out)])
    assert rc == 0, capsys.readouterr().err
    rows = json.load(open(out))["rows"]
    assert [(r["mode"], r["batch"]) for r in rows] == [
        ("autoregressive", 1), ("speculative", 1), ("reference (transformers target, eager drafter)", 1),
        ("autoregressive", 2), ("speculative", 2)]
    spec = [r for r in rows if r["mode"] == "speculative"]
    assert all(r["acceptance_length"] > 2 for r in spec)
    assert all(r["bytes_per_round"] > 0 and r["round_ms"] > 0 for r in spec)
    result = json.load(open(out))
    assert result["complete"] is True  # rewritten after each batch size; the last one marks it complete
    assert all(len(r["tokens_per_second_runs"]) == 2 for r in rows)
    assert [r["ratio"] for r in result["ratios"]] == [
        "speculative / autoregressive at batch 1", "this engine / the reference loop at batch 1",
        "speculative / autoregressive at batch 2"]
    assert all(len(r["runs"]) == 2 and r["median"] > 0 for r in result["ratios"])
    printed = capsys.readouterr().out
    assert "speculative / autoregressive at batch 1" in printed and "copy bandwidth" in printed


@pytest.mark.parametrize("flags,needle", [
    (["--repeats", "0"], "--repeats: invalid value 0 (valid: >= 1)"),
    (["--batch-sizes", "1,1"], "--batch-sizes: '1,1' must be distinct positive"),
    (["--batch-sizes", "1,x"], "--batch-sizes: '1,x' is not"),
    (["--max-new-tokens", "0"], "--max-new-tokens: invalid"),
    (["--threads", "-1"], "--threads: invalid"),
    (["--out", "/"], "--out /: is a directory"),
])
def test_bad_flags(flags, needle, capsys):
    assert bench.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
