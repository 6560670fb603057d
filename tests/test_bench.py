"""bench.py's loops agree with each other, and the random real-shaped presets have the right shapes."""

from __future__ import annotations

import json
import os
import sysconfig

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


# ----------------------------------------------------------------------------------------
# --concurrency: schedulers under load, on the committed demo pair

CONCURRENCY_FIELDS = {"concurrency", "mode", "total_tokens_per_second", "per_request_tokens_per_second",
                      "acceptance_length", "verified_per_round", "tokens", "seconds", "vs_none", "profile_seconds",
                      "outputs_agree"}


def read_png(path):
    """(width, height, pixels [H, W, 3]) of an 8-bit RGB PNG, every chunk's CRC checked."""
    import struct
    import zlib

    import numpy as np

    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    at, chunks = 8, []
    while at < len(data):
        n, = struct.unpack(">I", data[at:at + 4])
        tag, body, crc = data[at + 4:at + 8], data[at + 8:at + 8 + n], data[at + 8 + n:at + 12 + n]
        assert struct.unpack(">I", crc)[0] == zlib.crc32(tag + body) & 0xFFFFFFFF, tag
        chunks.append((tag, body))
        at += 12 + n
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND"
    w, h, depth, colour = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (depth, colour) == (8, 2)
    raw = zlib.decompress(b"".join(body for tag, body in chunks if tag == b"IDAT"))
    assert len(raw) == h * (1 + 3 * w)
    rows = np.frombuffer(raw, dtype=np.uint8).reshape(h, 1 + 3 * w)
    assert (rows[:, 0] == 0).all()  # filter 0 (what write_png writes): the rest is the pixels
    return w, h, rows[:, 1:].reshape(h, w, 3)


# The default prompts are cut from this Python's standard library (the files in demo/heldout.txt);
# another Python version may lack one of them, and bench then asks for --prompts-file instead.
HELDOUT_PRESENT = all(os.path.isfile(os.path.join(sysconfig.get_paths()["stdlib"], n))
                      for n in open(os.path.join(bench.DEMO_DIR, "heldout.txt")).read().split())


@pytest.mark.skipif(not HELDOUT_PRESENT, reason="this Python's standard library lacks a demo held-out file")
def test_concurrency_mode_table_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "conc.json", tmp_path / "conc.png"
    # The demo head's confidences sit around 0.75-0.9: at 0.8 the threshold scheduler cuts some rounds short.
    rc = bench.main(["--concurrency", "1,2", "--max-new-tokens", "12", "--repeats", "2", "--requests-per-slot", "2",
                     "--out", str(out), "--plot", str(png)])
    assert rc == 0, capsys.readouterr().err
    result = json.load(open(out))
    rows = result["rows"]
    assert [(r["concurrency"], r["mode"]) for r in rows] == [
        (c, m) for c in (1, 2) for m in ("autoregressive", "none", "threshold", "hardware")]
    assert all(CONCURRENCY_FIELDS <= set(r) for r in rows)
    assert set(result["sps"]) == {"1", "2"} and result["prompts"] == 20
    for r in rows:
        c = r["concurrency"]
        assert r["outputs_agree"] is True  # greedy: bench raises if any scheduler's tokens differ
        assert r["tokens"] == 12 * c * 2  # c x 2 requests; the demo prompts are code: no EOS within 12 tokens
        assert len(r["total_tokens_per_second_runs"]) == 2
        assert r["total_tokens_per_second"] == pytest.approx(r["tokens"] / r["seconds"], rel=0.2)
        # c rows busy at a time: a request's own rate is at least its share of the total (within the
        # clocks' difference and the drain at the end, when fewer than c requests are left).
        assert r["per_request_tokens_per_second"] >= 0.5 * r["total_tokens_per_second"] / c
        assert (r["profile_seconds"] is not None) == (r["mode"] == "hardware")
        none = next(x for x in rows if x["concurrency"] == c and x["mode"] == "none")
        assert r["vs_none"] == pytest.approx(r["total_tokens_per_second"] / none["total_tokens_per_second"])
        if r["mode"] == "autoregressive":
            assert r["acceptance_length"] == 1 and r["verified_per_round"] == 0
        else:
            assert 1 < r["acceptance_length"] <= 6 and 0 <= r["verified_per_round"] <= 5
    by = {(r["concurrency"], r["mode"]): r for r in rows}
    assert by[1, "none"]["verified_per_round"] == 5
    assert by[1, "threshold"]["verified_per_round"] < 5
    printed = capsys.readouterr().out
    assert printed.count("\n| 2 | ") == 4 and "| total ÷ none |" in printed
    w, h, img = read_png(png)
    assert (w, h) == bench.PLOT_SIZE
    for m, colour in bench.MODE_COLOURS.items():  # every mode's line is drawn
        assert (img == colour).all(-1).sum() > 20, m


@pytest.mark.skipif(not HELDOUT_PRESENT, reason="this Python's standard library lacks a demo held-out file")
def test_concurrency_outputs_that_differ_fail_loudly(monkeypatch):
    timed = bench.timed_generate

    def corrupt_hardware(engine, prompts, max_new_tokens):
        r = timed(engine, prompts, max_new_tokens)
        if engine.scheduler == "hardware":
            r["outputs"][0][-1] += 1
        return r

    monkeypatch.setattr(bench, "timed_generate", corrupt_hardware)
    with pytest.raises(AssertionError, match="hardware .* different tokens"):
        bench.main(["--concurrency", "1", "--max-new-tokens", "4", "--repeats", "1"])


def test_concurrency_prompts_file_and_sampling(tmp_path, capsys):
    from model import Tokenizer

    pf = tmp_path / "p.jsonl"
    ids = Tokenizer(os.path.join(bench.DEMO_DIR, "target")).encode("import os\n")
    pf.write_text(json.dumps({"prompt": "def main():\n"}) + "\n" + json.dumps({"prompt_ids": ids}) + "\n")
    out = tmp_path / "conc.json"
    rc = bench.main(["--concurrency", "3", "--schedulers", "hardware", "--prompts-file", str(pf),
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
    (["--concurrency", "2", "--threshold", "0"], "--threshold: invalid"),
    (["--concurrency", "2", "--repeats", "0"], "--repeats: invalid"),
    (["--repeats", "0"], "--repeats: invalid"),
    (["--batch-sizes", "1,1"], "--batch-sizes: '1,1' must be distinct positive"),
    (["--max-new-tokens", "0"], "--max-new-tokens: invalid"),
    (["--concurrency", "2", "--batch-sizes", "4"], "--batch-sizes: not used with --concurrency"),
    (["--plot", "x.png"], "--plot: only used with --concurrency"),
    (["--concurrency", "2", "--target", "somewhere"], "give both --target and --drafter"),
    (["--concurrency", "2", "--prompts-file", "/nonexistent.jsonl"], "prompts file not found"),
    (["--concurrency", "2", "--plot", "/nonexistent/c.png"], "--plot /nonexistent/c.png: directory"),
    (["--out", "/"], "--out /: is a directory"),
])
def test_concurrency_bad_flags(flags, needle, capsys):
    assert bench.main(flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1, err
