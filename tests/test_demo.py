"""The committed demo pair (demo/, made by scripts/train_demo.sh) and `python speculate.py` with no flags."""

from __future__ import annotations

import json
import os

import torch

from conftest import REPO_ROOT

import speculate
from drafter import load_drafter
from model import load_target
from text import Tokenizer

DEMO = REPO_ROOT / "demo"


def test_demo_pair_loads_strictly():
    target = load_target(str(DEMO / "target"))  # strict: every tensor, every shape
    drafter = load_drafter(str(DEMO / "drafter"), target)
    tok = Tokenizer(str(DEMO / "target"))
    assert tok.chat_template is None  # prompts go in raw
    assert tok.decode(tok.encode(speculate.DEMO_PROMPT)) == speculate.DEMO_PROMPT
    assert target.args.vocab_size == tok.tok.get_vocab_size(with_added_tokens=True)
    assert drafter.cfg.confidence_head and drafter.cfg.num_drafts >= 4
    size = sum(os.path.getsize(p) for p in DEMO.rglob("*") if p.is_file())
    assert size <= 25 * 2 ** 20, size
    held = (DEMO / "heldout.txt").read_text().split()
    assert "shutil.py" in held  # the default prompt's source file was not trained on


def test_speculate_without_flags_runs_the_demo(capsys):
    assert speculate.main([]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    ar = [l for l in lines if l.startswith("autoregressive:")]
    sp = [l for l in lines if l.startswith("speculative:")]
    assert len(ar) == 1 and len(sp) == 1 and "tokens/s" in ar[0] and "τ=" in sp[0]
    assert any(l.startswith("speed-up:") and l.endswith("identical: True)") for l in lines), out


def test_demo_greedy_speculative_equals_autoregressive(tmp_path):
    trace = tmp_path / "t.jsonl"
    args = speculate.Args(max_new_tokens=48, trace_file=str(trace))
    with torch.inference_mode():
        summary = speculate.run(args)
    assert args.target is None and args.prompt is None  # the demo defaults do not rewrite the caller's Args
    assert summary["acceptance_length"] > 1.0
    tok = Tokenizer(str(DEMO / "target"))
    with torch.inference_mode():  # the same as asking for the demo pair and prompt by name
        named = speculate.run(speculate.Args(target=str(DEMO / "target"), drafter=str(DEMO / "drafter"),
                                             prompt_ids=",".join(map(str, tok.encode(speculate.DEMO_PROMPT))),
                                             max_new_tokens=48))
    assert named["outputs"] == summary["outputs"]
    rows = [json.loads(l) for l in open(trace)]
    assert any("output_ids" in r for r in rows)


def test_drafter_without_target_is_still_an_error(capsys):
    assert speculate.main(["--drafter", str(DEMO / "drafter"), "--prompt-ids", "1,2"]) == 2
    assert "--target" in capsys.readouterr().err
