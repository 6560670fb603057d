"""scripts/regenerate.py end to end on the committed demo pair: records with the conversation regenerated turn
by turn (system kept, old answers replaced), sampling settings recorded, outputs independent of batch, chunk and
shard, greedy speculative == greedy autoregressive, --resume of a torn .partial, one-line errors, and the
records training a drafter through train.py."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys

import pytest
import torch

from conftest import REPO_ROOT
from test_train_data import run_train

torch.set_num_threads(1)

_spec = importlib.util.spec_from_file_location("regenerate", REPO_ROOT / "scripts" / "regenerate.py")
regenerate = sys.modules["regenerate"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(regenerate)

DEMO = REPO_ROOT / "demo"
PROMPTS = [
    {"turns": ["def add(a, b):", "and now subtract"]},
    {"prompt": "import os\n"},
    {"messages": [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "class Point:"},
                  {"role": "assistant", "content": "an old answer"}], "id": 7},
    {"prompt": "for i in range(10):"},
]


def regen(tmp_path, name, *flags, drafter=True, prompts=None):
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("".join(json.dumps(p) + "\n" for p in (prompts or PROMPTS)))
    out = tmp_path / name
    argv = ["--target", DEMO / "target", "--prompts", pf, "--out", out, "--max-new-tokens", 12, "--no-progress",
            "--device", "cpu", *flags] + (["--drafter", DEMO / "drafter"] if drafter else [])
    import tyro
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), torch.inference_mode():
        res = regenerate.run(tyro.cli(regenerate.Args, args=[str(a) for a in argv]))
    return [json.loads(line) for line in open(out)], res


def test_regenerate_end_to_end_on_the_demo_pair(tmp_path):
    recs, res = regen(tmp_path, "a.jsonl", "--batch-size", 3, "--chunk-size", 3)
    assert res["conversations"] == 4 and res["responses"] == 5 and res["acceptance_length"] > 1
    assert [r["source"] for r in recs] == [f"{tmp_path / 'prompts.jsonl'}:{i}" for i in range(1, 5)]
    roles = [[m["role"] for m in r["messages"]] for r in recs]
    assert roles == [["user", "assistant", "user", "assistant"], ["user", "assistant"],
                     ["system", "user", "assistant"], ["user", "assistant"]]
    assert recs[2]["id"] == 7 and recs[2]["messages"][0]["content"] == "You write Python."
    assert recs[2]["messages"][2]["content"] != "an old answer"
    assert recs[0]["messages"][2]["content"] == "and now subtract"
    g = recs[0]["regenerated"]
    assert (g["temperature"], g["top_p"], g["top_k"], g["min_p"], g["enable_thinking"], g["max_new_tokens"]) == \
        (0.7, 0.8, 20, 0.0, False, 12)
    assert len(g["finish_reasons"]) == 2 and all(0 < n <= 12 for n in g["response_tokens"])
    # The same records whatever the batch, the chunk or the shard (per-request random streams).
    again, _ = regen(tmp_path, "b.jsonl", "--batch-size", 1, "--chunk-size", 1)
    assert again == recs
    halves = [regen(tmp_path, f"s{i}.jsonl", "--num-shards", 2, "--shard-index", i)[0] for i in (0, 1)]
    assert halves[0] + halves[1] == [recs[0], recs[2], recs[1], recs[3]]
    # Greedy: speculative decoding is lossless.
    spec, _ = regen(tmp_path, "g1.jsonl", "--temperature", 0)
    plain, _ = regen(tmp_path, "g2.jsonl", "--temperature", 0, drafter=False)
    assert [r["messages"] for r in spec] == [r["messages"] for r in plain]
    # The records train a drafter (chat path of train.py, the demo target's ChatML fallback).
    rc, out, err = run_train(["--target", DEMO / "target", "--data", tmp_path / "a.jsonl", "--out", tmp_path / "d",
                              "--steps", 2, "--seq-len", 64, "--batch-size", 2, "--block-size", 3, "--depth", 1,
                              "--markov-rank", 8])
    assert rc == 0, err
    assert "4 conversations packed into" in err and len(out["losses"]) == 2


def test_resume_continues_a_torn_partial(tmp_path):
    full, _ = regen(tmp_path, "full.jsonl", "--chunk-size", 1)
    out = tmp_path / "r.jsonl"
    (tmp_path / "r.jsonl.partial").write_text(json.dumps(full[0]) + "\n" + '{"messages": [{"ro')
    resumed, res = regen(tmp_path, "r.jsonl", "--chunk-size", 1, "--resume")
    assert resumed == full and res["responses"] == 3  # the first conversation (two turns) was not redone
    assert not (tmp_path / "r.jsonl.partial").exists() and out.exists()


@pytest.mark.parametrize("flags,needle", [
    (["--shard-index", 2, "--num-shards", 2], "--shard-index: invalid value 2"),
    (["--max-context", 12], "--max-context 12: must exceed --max-new-tokens 12"),
    (["--temperature", -1], "--temperature: invalid value -1.0"),
    (["--chunk-size", 0], "--chunk-size: invalid value 0"),
    (["--prompts", "nope.jsonl"], "--prompts nope.jsonl: file not found"),
    (["--prompts", "bad.jsonl"], "bad.jsonl:1: expected"),
])
def test_bad_inputs_are_one_line_errors(tmp_path, capsys, monkeypatch, flags, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "x"}) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"turns": []}) + "\n")
    argv = ["--target", DEMO / "target", "--prompts", "p.jsonl", "--out", "o.jsonl", "--max-new-tokens", 12,
            "--no-progress", "--device", "cpu", *flags]
    assert regenerate.main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
