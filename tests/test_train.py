"""train.py: the distillation losses, the packed mask, training forward == inference drafter,
short runs that lower the loss and write checkpoints that load and decode losslessly, exact
resume, and one-line errors; scripts/train_target.py (a target pre-trained with a BPE tokenizer
trained on the corpus, then a drafter distilled from it).

Everything runs on the tiny random targets of conftest.py, single-threaded, in seconds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math
import os
import random
import re
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT

import speculate
import train
from drafter import MARKOV_HEADS, VanillaMarkov
from support import checkpoint, text, trainer
from support.cli import UserError

torch.set_num_threads(1)

TRAIN_TARGET = REPO_ROOT / "scripts" / "train_target.py"
_spec = importlib.util.spec_from_file_location("train_target", TRAIN_TARGET)
train_target = sys.modules["train_target"] = importlib.util.module_from_spec(_spec)  # dataclasses look it up
_spec.loader.exec_module(train_target)


# ----------------------------------------------------------------------------------------
# Helpers

def run_train(args, program=train, progress=False) -> tuple[int, dict, str]:
    """program.run (train.py, or scripts/train_target.py) through its CLI parsing, in-process:
    (exit status, result or {}, stderr)."""
    import tyro

    err = io.StringIO()
    result = {}
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        a = tyro.cli(program.Args, args=[str(x) for x in args] + ([] if progress else ["--no-progress"]))
        try:
            result = program.run(a)
            rc = 0
        except UserError as e:
            print(f"error: {e}", file=err)
            rc = 2
    return rc, result, err.getvalue()


def write_ids(path, n_seqs, length, vocab, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n_seqs):
            f.write(json.dumps({"prompt_ids": [rng.randrange(vocab) for _ in range(length)]}) + "\n")
    return path


def decode_ids(target, drafter_dir, tmp_path, prompts=((1, 2, 3, 4), (7, 30, 2)), max_new=16):
    """speculate.main greedy on the prompts; returns the output ids per request (from the trace)."""
    pf = tmp_path / "prompts.jsonl"
    pf.write_text("".join(json.dumps({"prompt_ids": list(p)}) + "\n" for p in prompts))
    trace = tmp_path / f"trace_{drafter_dir is not None}.jsonl"
    argv = ["--target", str(target), "--prompts-file", str(pf), "--max-new-tokens", str(max_new),
            "--trace-file", str(trace), "--batch-size", "2"]
    if drafter_dir is not None:
        argv += ["--drafter", str(drafter_dir)]
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = speculate.main(argv)
    assert rc == 0, err.getvalue()
    lines = [json.loads(l) for l in trace.read_text().splitlines()]
    ends = sorted((l for l in lines if "output_ids" in l), key=lambda l: l["request"])
    summary = [l for l in lines if l.get("summary")][0]
    return [e["output_ids"] for e in ends], summary


SMALL = ["--seq-len", 24, "--batch-size", 2, "--block-size", 4, "--depth", 2, "--markov-rank", 16]


# ----------------------------------------------------------------------------------------
# Losses on hand-computed cases

def test_default_layer_ids_are_deepspecs_spacing():
    """1 + i(L-4)/4, i = 0..4: the published drafters' ids for Qwen3-4B/8B (36 layers) and 14B (40)."""
    assert train.default_layer_ids(36) == (1, 9, 17, 25, 33)
    assert train.default_layer_ids(40) == (1, 10, 19, 28, 37)
    assert train.default_layer_ids(5) == (1, 2)  # a shallow target's spacing collapses
    assert train.default_layer_ids(3) == (0, 1)  # under 5 layers: every layer but the last
    assert train.default_layer_ids(1) == (-1,)  # one layer: the embeddings


def test_default_losses_are_deepspecs_recipe():
    """Without loss flags, training weighs slots by exp(-j/4) and the terms 0.1 / 0.9 / 1.0 (CE, TV,
    confidence BCE), as DeepSpec trains the published drafters."""
    args = train.Args(target="unused", data="unused", out="unused")
    assert (args.gamma, args.alpha_ce, args.alpha_tv, args.alpha_conf) == (4.0, 0.1, 0.9, 1.0)
    assert torch.allclose(train.slot_weights(7, args.gamma), torch.exp(-torch.arange(7.0) / 4))


def test_slot_weights():
    w = train.slot_weights(4, 4.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5), math.exp(-0.75)]))
    assert torch.allclose(train.slot_weights(3, 2.0), torch.tensor([1.0, math.exp(-0.5), math.exp(-1.0)]))


def test_loss_terms_by_hand():
    # Two slots, V = 2. Slot 0: p_d = (1/4, 3/4), label 1, p_t = (1/2, 1/2), conf logit 0.
    # Slot 1: p_d = (1/2, 1/2), label 0, p_t = (1, 0) (logits 0 / -inf-ish), conf logit ln 3.
    draft = torch.tensor([[[0.0, math.log(3)], [0.0, 0.0]]])
    target = torch.tensor([[[0.0, 0.0], [0.0, -1e4]]])
    labels = torch.tensor([[1, 0]])
    conf = torch.tensor([[0.0, math.log(3)]])
    valid = torch.tensor([[True, True]])
    t = train.distill_losses(draft, target, labels, valid, conf, gamma=4.0)
    w0, w1 = 1.0, math.exp(-0.25)
    ce0, ce1 = -math.log(0.75), -math.log(0.5)
    tv0, tv1 = 0.5, 1.0  # ‖p_d − p_t‖_1, no ½
    c0, c1 = 1 - 0.25, 1 - 0.5  # soft labels 1 − ½‖·‖_1
    bce0 = -(c0 * math.log(0.5) + (1 - c0) * math.log(0.5))  # σ(0) = 1/2
    bce1 = -(c1 * math.log(0.75) + (1 - c1) * math.log(0.25))  # σ(ln 3) = 3/4
    den = w0 + w1
    assert t["ce"].item() == pytest.approx((w0 * ce0 + w1 * ce1) / den, rel=1e-5)
    assert t["tv"].item() == pytest.approx((w0 * tv0 + w1 * tv1) / den, rel=1e-5)
    assert t["conf"].item() == pytest.approx((w0 * bce0 + w1 * bce1) / den, rel=1e-5)
    assert torch.allclose(t["accept"], torch.tensor([[c0, c1]]))
    args = train.Args()
    assert train.total_loss(t, args).item() == pytest.approx(
        0.1 * t["ce"].item() + 0.9 * t["tv"].item() + 1.0 * t["conf"].item(), rel=1e-6)

    # A slot whose label runs past the sequence end carries no weight: slot 0 alone.
    t0 = train.distill_losses(draft, target, labels, torch.tensor([[True, False]]), conf, gamma=4.0)
    assert t0["ce"].item() == pytest.approx(ce0, rel=1e-5)
    assert t0["tv"].item() == pytest.approx(tv0, rel=1e-5)
    assert t0["conf"].item() == pytest.approx(bce0, rel=1e-5)
    # The soft label is detached: the confidence loss sends no gradient into the draft logits.
    d, c = draft.clone().requires_grad_(True), conf.clone().requires_grad_(True)
    train.distill_losses(d, target, labels, valid, c, 4.0)["conf"].backward()
    assert d.grad is None and c.grad is not None
    # No head: no conf term.
    assert "conf" not in train.distill_losses(draft, target, labels, valid, None, 4.0)


def test_lr_schedule():
    a = train.Args(steps=100, lr=1.0, warmup_frac=0.04)
    assert [trainer.lr_at(s, a) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # DeepSpec's CosineAnnealingWarmupLR: T_max = steps - W, so the last step still learns
    assert trainer.lr_at(4, a) == 1.0
    assert trainer.lr_at(4 + 19, a) == pytest.approx(0.5 * (1 + math.cos(math.pi * 19 / 96)))
    assert trainer.lr_at(99, a) == pytest.approx(0.5 * (1 + math.cos(math.pi * 95 / 96)))
    assert trainer.lr_at(99, a) > 2e-4
    lin = train.Args(steps=11, lr=1.0, warmup_frac=0.0, schedule="linear", min_lr_frac=0.1)
    lin_lrs = [trainer.lr_at(s, lin) for s in (0, 5, 10)]
    assert lin_lrs == pytest.approx([1.0, 0.1 + 0.9 * 6 / 11, 0.1 + 0.9 / 11])
    # one step past warm-up is the last: it is the start of the decay, at the peak
    two = train.Args(steps=2, lr=1.0, warmup_frac=0.08)
    assert [trainer.lr_at(s, two) for s in range(2)] == [1.0, 1.0]
    # W = ceil(frac x steps) of the fraction given: 0.07 x 100 (7.000000000000001 in floats) is 7 steps
    for frac, steps, W in [(0.07, 100, 7), (0.07, 10000, 700), (0.04, 6800, 272), (0.29, 100, 29)]:
        warm = train.Args(steps=steps, lr=1.0, warmup_frac=frac)
        assert trainer.lr_at(0, warm) == 1 / W and trainer.lr_at(W - 1, warm) == 1.0, (frac, steps)


# ----------------------------------------------------------------------------------------
# The packed attention mask

def test_block_mask_is_the_definition():
    T, K = 7, 3
    anchors = torch.tensor([[0, 2, 5], [1, 3, 4]])
    m = train.block_mask(anchors, T, K)
    B, N = anchors.shape
    assert m.shape == (B, N * K, T + N * K) and m.dtype == torch.bool
    for b in range(B):
        for i in range(N):
            for j in range(K):
                row = i * K + j
                for col in range(T + N * K):
                    if col < T:  # context row `col`: strictly before this block's anchor
                        want = col < anchors[b, i].item()
                    else:  # block row: same block only, any slot (bidirectional)
                        want = (col - T) // K == i
                    assert m[b, row, col].item() == want, (b, row, col)


# ----------------------------------------------------------------------------------------
# Training forward == inference

class RowsMarkov(VanillaMarkov):
    """A head written on rows, as decoding calls it (h [rows, H], prev [rows]): nn.GRUCell takes no more."""
    kind = "rows"

    def __init__(self, H: int, V: int, r: int):
        super().__init__(H, V, r)
        self.cell = torch.nn.GRUCell(r + H, r)

    def step(self, h, prev, state):
        state = self.cell(torch.cat([self.markov_w1(prev), h], dim=-1), state)
        return self.markov_w2(state), state


HEADS_AND_ROWS = [(head, True) for head in MARKOV_HEADS] + [("rows", True), ("none", False)]


@pytest.mark.parametrize("markov,confidence", HEADS_AND_ROWS)
def test_training_forward_equals_inference_drafter(tiny_target, markov, confidence, monkeypatch):
    """One packed batch of anchors: each block's h, U, Markov logits and confidence equal drafter.Drafter's
    cached path (commit_context of features < a, then drafter(anchor, a)), in float32. The heads run on
    the batch as drafter_loss passes it, [B, N, K, H], a head written on rows too."""
    monkeypatch.setitem(MARKOV_HEADS, "rows", RowsMarkov)
    target = checkpoint.load_target(str(tiny_target.path))
    args = train.Args(block_size=4, depth=2, markov=markov, markov_rank=8, confidence=confidence,
                      confidence_with_markov=markov != "none", init_std=0.3, seed=3)
    cfg = train.drafter_config(args, target, str(tiny_target.path))
    d = train.build_drafter(cfg, args, target, "cpu").eval()
    with torch.no_grad():  # non-trivial norms, so a swapped or skipped one would show
        for n, p in d.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    T, K = 16, 4
    tokens = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[0, 3, 7, 14]])  # empty context, middle, and a block running past the end
    with torch.no_grad():
        _, feats = target.hidden(tokens, capture=d.cfg.target_layer_ids)  # cache-free, causal
        h = train.block_forward(d, feats, tokens, anchors)[0]  # [N, K, H]
        labels = torch.cat([tokens[0], torch.zeros(K, dtype=torch.long)])
        prevs = []  # [1, K] each, teacher-forced
        for a in anchors[0].tolist():
            prevs.append(torch.cat([tokens[0, a:a + 1], labels[a + 1:a + K]])[None])
        z_all, conf_all = train.head_outputs(d, h[None], torch.stack(prevs, dim=1))  # [1, N, K, ...]
        for i, a in enumerate(anchors[0].tolist()):
            prev = prevs[i]
            z = z_all[:, i]
            conf = None
            if conf_all is not None:
                conf = conf_all[:, i]
            d.setup_caches(1, T + K)
            if a > 0:
                d.commit_context(feats[:, :a], torch.arange(a)[None])
            h_ref, U_ref = d(tokens[:, a], torch.tensor([a]))
            assert torch.allclose(h[i], h_ref[0], atol=1e-4), f"anchor {a}: hidden differs"
            z_ref = U_ref.clone()
            if d.markov_head is not None:
                state = None
                for j in range(K):
                    b, state = d.markov_head.step(h_ref[:, j], prev[:, j], state)
                    z_ref[:, j] += b
            assert torch.allclose(z, z_ref, atol=1e-4), f"anchor {a}: draft logits differ"
            if confidence:
                assert torch.allclose(torch.sigmoid(conf), d.confidence(h_ref, prev), atol=1e-5)
            else:
                assert conf is None and d.confidence(h_ref, prev) is None


def test_drafter_loss_equals_slow_reference(tiny_target):
    """drafter_loss on a packed batch == distill_losses over blocks built one by one from the definition:
    labels x_{a+j+1}, teacher-forced prev [x_a, labels[:-1]], the target's distribution at a+j, the
    inference drafter's logits and confidence, slots past the end unsupervised."""
    target = checkpoint.load_target(str(tiny_target.path))
    args = train.Args(block_size=4, depth=2, markov="gated", markov_rank=8, init_std=0.3, seed=5)
    cfg = train.drafter_config(args, target, str(tiny_target.path))
    d = train.build_drafter(cfg, args, target, "cpu").eval()
    B, T, K = 2, 12, 4
    tokens = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(2))
    anchors = torch.tensor([[0, 4, 9], [2, 3, 10]])
    with torch.no_grad():
        loss, terms, valid = train.drafter_loss(d, target, tokens, anchors, args)
        target.setup_caches(B, T)
        full_logits, feats = target(tokens, torch.arange(T).expand(B, T), capture=d.cfg.target_layer_ids)
        z_ref, t_ref, lab_ref, val_ref, c_ref = [], [], [], [], []
        for b in range(B):
            for a in anchors[b].tolist():
                lab = [tokens[b, a + j + 1].item() if a + j + 1 < T else 0 for j in range(K)]
                prev = torch.tensor([[tokens[b, a].item()] + lab[:-1]])
                d.setup_caches(1, T + K)
                if a > 0:
                    d.commit_context(feats[b:b + 1, :a], torch.arange(a)[None])
                h, U = d(tokens[b:b + 1, a], torch.tensor([a]))
                state, z = None, U.clone()
                for j in range(K):
                    bias, state = d.markov_head.step(h[:, j], prev[:, j], state)
                    z[:, j] += bias
                z_ref.append(z[0])
                t_ref.append(full_logits[b, [min(a + j, T - 1) for j in range(K)]])
                lab_ref.append(torch.tensor(lab))
                val_ref.append(torch.tensor([a + j + 1 < T for j in range(K)]))
                c_ref.append(torch.logit(d.confidence(h, prev)[0].double()).float())
        ref = train.distill_losses(torch.stack(z_ref), torch.stack(t_ref), torch.stack(lab_ref), torch.stack(val_ref),
                                   torch.stack(c_ref), args.gamma)
    assert torch.equal(valid.view(-1, K), torch.stack(val_ref))
    for k in ("ce", "tv", "conf"):
        assert terms[k].item() == pytest.approx(ref[k].item(), rel=1e-4, abs=1e-5), k
    assert loss.item() == pytest.approx(train.total_loss(ref, args).item(), rel=1e-4)


# ----------------------------------------------------------------------------------------
# Short runs: the loss goes down, the checkpoint loads and decodes losslessly

@pytest.fixture(scope="module")
def near_bigram(tmp_path_factory):
    """tests/drafters.py's near-bigram target (vocab 48, no tokenizer) and a corpus of its own greedy
    continuations of random 3-token starts (as DeepSpec distils on target-generated responses)."""
    from drafters import make_target

    d = tmp_path_factory.mktemp("near_bigram")
    tdir = make_target(d / "target")
    target = checkpoint.load_target(tdir)
    x = torch.randint(0, target.args.vocab_size, (16, 3), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for _ in range(29):  # batched greedy, cache-free
            h, _ = target.hidden(x)  # cache-free, causal
            x = torch.cat([x, target.lm_head(h[:, -1]).argmax(-1, keepdim=True)], dim=1)
    ids = d / "ids.jsonl"
    ids.write_text("".join(json.dumps({"prompt_ids": row}) + "\n" for row in x.tolist()))
    return tdir, ids


@pytest.mark.parametrize("heads", ["dspark", "dflash"])
def test_training_lowers_loss_and_decodes_losslessly(near_bigram, tmp_path, heads):
    """30 steps lower the loss; the checkpoint loads as a published one; greedy speculative decoding
    with it equals the target alone, and its drafts get accepted (τ 1.0 untrained, ~2.1 here)."""
    tdir, ids = near_bigram
    out = tmp_path / "drafter"
    flags = ["--markov-rank", 16]
    if heads == "dflash":  # DeepSpec's dflash configs: both heads off, cross-entropy only
        flags = ["--markov", "none", "--no-confidence", "--alpha-ce", 1, "--alpha-tv", 0]
    rc, res, err = run_train(["--target", tdir, "--data-ids", ids, "--out", out, "--steps", 30, "--lr", 3e-3,
                              "--warmup-frac", 0.0, "--seq-len", 32, "--batch-size", 4, "--anchors-per-seq", 16,
                              "--block-size", 4, "--depth", 2, *flags])
    assert rc == 0, err
    losses = res["losses"]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) < 0.85 * sum(losses[:5]), losses

    # DeepSpec's layout: config keys and tensor names as published; load_drafter reads it.
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["block_size"] == 4 and cfg["num_hidden_layers"] == 2
    assert cfg["num_target_layers"] == 3 and cfg["target_layer_ids"] == [0, 1] and cfg["mask_token_id"] == 47
    assert cfg["markov_head_type"] == (None if heads == "dflash" else "vanilla")
    assert cfg["enable_confidence_head"] == (heads == "dspark")
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight",
            "layers.1.self_attn.k_norm.weight"} <= names
    if heads == "dspark":
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                "confidence_head.proj.bias"} <= names
    else:
        assert not any(n.startswith(("markov", "confidence")) for n in names)
    target = checkpoint.load_target(tdir)
    d = checkpoint.load_drafter(str(out), target)
    assert d.cfg.layout == "dspark" and d.cfg.num_drafts == 4
    assert (d.cfg.markov_head_type, d.cfg.confidence_head) == (("vanilla", True) if heads == "dspark" else (None, False))

    prompts = ((1, 2, 3, 4), (7, 30, 2), (11,), (40, 5))
    base, _ = decode_ids(tdir, None, tmp_path, prompts)
    spec, summary = decode_ids(tdir, out, tmp_path, prompts)
    assert spec == base
    assert summary["acceptance_length"] > 1.3, summary


def ckpt(out):
    """The complete checkpoint a training directory's `latest` names."""
    return out / (out / "latest").read_text().strip()


def test_markov_none_alone_trains_a_confidence_head_without_the_markov_feature(tiny_target, tmp_path):
    """--confidence-with-markov left out follows the Markov head: --markov none alone was refused, naming a
    flag not given."""
    ids = write_ids(tmp_path / "ids.jsonl", 2, 24, 64)
    out = tmp_path / "o"
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", out, "--steps", 1, *SMALL[:-2],
                            "--markov", "none"])
    assert rc == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["markov_rank"] == 0 and cfg["enable_confidence_head"] is True
    assert cfg["confidence_head_with_markov"] is False


def test_the_eta_counts_the_checkpoints_between_steps(tiny_target, tmp_path, monkeypatch):
    """A run that checkpoints (or evaluates) every step spends that time every step: the ETA counts it, the
    steps' own time beside it (it counted the steps alone)."""
    import time

    real = train.save_state

    def slow_save(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)
    monkeypatch.setattr(train, "save_state", slow_save)
    ids = write_ids(tmp_path / "ids.jsonl", 2, 24, 64)
    out = tmp_path / "o"
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", out, "--steps", 4,
                            "--save-every", 1, *SMALL])
    assert rc == 0, err
    log = [json.loads(line) for line in open(out / trainer.LOG_JSONL)]
    step_2 = log[1]
    assert step_2["step"] == 2 and step_2["eta_seconds"] >= 2 * 0.3 / 2, step_2  # 2 steps left, 0.3 s in 2 steps
    assert log[-1]["eta_seconds"] == 0


def test_resume_equals_uninterrupted_run(tiny_target, tmp_path):
    ids = write_ids(tmp_path / "ids.jsonl", 6, 24, 64, seed=1)
    common = ["--target", tiny_target.path, "--data-ids", ids, "--steps", 6, "--anchors-per-seq", 5,
              "--warmup-frac", 0.2, "--markov", "rnn", "--markov-rank", 8, *SMALL]
    rc, straight, err = run_train(common + ["--out", tmp_path / "a"])
    assert rc == 0, err
    rc, first, err = run_train(common + ["--out", tmp_path / "b", "--stop-at", 3])
    assert rc == 0, err
    assert json.loads((ckpt(tmp_path / "b") / "training_state.json").read_text())["step"] == 3
    rc, second, err = run_train(common + ["--out", tmp_path / "c", "--resume", tmp_path / "b"])
    assert rc == 0, err
    assert second["start"] == 3 and second["step"] == 6
    assert first["losses"] + second["losses"] == pytest.approx(straight["losses"], rel=1e-6)
    assert json.loads((ckpt(tmp_path / "c") / "training_state.json").read_text())["step"] == 6
    from safetensors.torch import load_file
    wa, wc = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "c" / "model.safetensors"))
    assert wa.keys() == wc.keys()
    for k in wa:
        assert torch.allclose(wa[k], wc[k], atol=1e-6, rtol=0), k
    # Optimizer state, too.
    sa = load_file(str(ckpt(tmp_path / "a") / "training_state.safetensors"))
    sc = load_file(str(ckpt(tmp_path / "c") / "training_state.safetensors"))
    assert sa.keys() == sc.keys() and all(torch.allclose(sa[k], sc[k], atol=1e-6, rtol=0) for k in sa)
    # A resumed run must repeat the flags that shape the model or the step.
    rc, _, err = run_train(common[:-2] + ["--depth", 3, "--out", tmp_path / "d", "--resume", tmp_path / "b"])
    assert rc == 2 and "--depth" in err
    # ... and train the same kind of model: scripts/train_target.py does not resume a drafter's state.
    rc, _, err = run_train(["--data-ids", ids, "--out", tmp_path / "e", "--resume", tmp_path / "b"], train_target)
    assert rc == 2 and "a drafter training state, not a target one" in err


def test_resume_refuses_a_checkpoint_holding_another_drafter(tiny_target, tmp_path):
    """The flags a run records are checked first; a checkpoint whose config.json was changed since (here
    its mask token) is refused too, by the drafter it holds, before any step."""
    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64, seed=1)
    common = ["--target", tiny_target.path, "--data-ids", ids, "--steps", 2, "--anchors-per-seq", 4, *SMALL]
    rc, _, err = run_train(common + ["--out", tmp_path / "a", "--stop-at", 1])
    assert rc == 0, err
    config = ckpt(tmp_path / "a") / "config.json"
    cfg = json.loads(config.read_text())
    cfg["mask_token_id"] = (cfg["mask_token_id"] + 1) % cfg["vocab_size"]
    config.write_text(json.dumps(cfg))
    rc, _, err = run_train(common + ["--out", tmp_path / "b", "--resume", tmp_path / "a"])
    assert rc == 2 and "holds another drafter than the flags build (mask_token_id " in err, err
    # flags left out and given at the values they resolve to are the same run ("was None, now '0,1'")
    config.write_text(json.dumps(dict(cfg, mask_token_id=(cfg["mask_token_id"] - 1) % cfg["vocab_size"])))
    layers = ",".join(map(str, cfg["target_layer_ids"]))
    rc, _, err = run_train(common + ["--out", tmp_path / "c", "--resume", tmp_path / "a", "--target-layer-ids",
                                     layers, "--mask-token-id", (cfg["mask_token_id"] - 1) % cfg["vocab_size"]])
    assert rc == 0, err


def test_resume_never_writes_into_the_checkpoint_it_reads(tiny_target, tmp_path):
    """A checkpoint named directly is resumed into a new directory; --out naming that checkpoint (or a folder
    inside it) is refused before any step, its files untouched."""
    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64, seed=1)
    common = ["--target", tiny_target.path, "--data-ids", ids, "--steps", 3, "--anchors-per-seq", 4, *SMALL]
    rc, _, err = run_train(common + ["--out", tmp_path / "run", "--stop-at", 2])
    assert rc == 0, err
    checkpoint = ckpt(tmp_path / "run")
    before = {f.name: f.read_bytes() for f in checkpoint.iterdir()}
    for out in (checkpoint, checkpoint / "more"):
        rc, _, err = run_train(common + ["--out", out, "--resume", checkpoint])
        assert rc == 2 and f"--out {out}: is (inside) {checkpoint}, which this run reads" in err, err
    assert {f.name: f.read_bytes() for f in checkpoint.iterdir()} == before
    rc, summary, err = run_train(common + ["--out", tmp_path / "next", "--resume", checkpoint])
    assert rc == 0 and summary["start"] == 2 and summary["step"] == 3, err


def test_resume_refuses_other_data_or_target(tiny_target, tmp_path):
    """The training state records digests of the data and the target: --resume refuses other token windows
    (the same number of them) and another target (the same shapes, one weight scaled), naming the flag; a
    byte-identical copy of the target passes; a state that records no digests is refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    ids = write_ids(tmp_path / "ids.jsonl", 6, 24, 64, seed=1)
    other_ids = write_ids(tmp_path / "other.jsonl", 6, 24, 64, seed=2)
    common = ["--steps", 4, "--anchors-per-seq", 4, *SMALL]
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", tmp_path / "a", "--stop-at", 2,
                            *common])
    assert rc == 0, err
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", other_ids, "--out", tmp_path / "b",
                            "--resume", tmp_path / "a", *common])
    assert rc == 2 and f"--data-ids {other_ids}: differs from the run's data" in err, err

    scaled = tmp_path / "scaled"
    shutil.copytree(tiny_target.path, scaled)
    w = load_file(str(scaled / "model.safetensors"))
    w["model.layers.0.mlp.down_proj.weight"] *= 1.5
    save_file(w, str(scaled / "model.safetensors"), metadata={"format": "pt"})
    rc, _, err = run_train(["--target", scaled, "--data-ids", ids, "--out", tmp_path / "c", "--resume", tmp_path / "a",
                            *common])
    assert rc == 2 and f"--target {scaled}: differs from the run's target" in err, err

    same = tmp_path / "same"
    shutil.copytree(tiny_target.path, same)
    rc, res, err = run_train(["--target", same, "--data-ids", ids, "--out", tmp_path / "d", "--resume", tmp_path / "a",
                              *common])
    assert rc == 0 and res["start"] == 2, err

    state = ckpt(tmp_path / "a") / "training_state.json"  # as written before the digests were recorded
    state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != "identity"}))
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", tmp_path / "e",
                            "--resume", tmp_path / "a", *common])
    assert rc == 2 and "records no digest of its" in err, err


def test_bfloat16_training_on_cpu(tiny_target, tmp_path):
    """--device cpu --dtype bfloat16: the frozen target (float32, its CPU GEMMs packed for the few-row kernel)
    runs under autocast, so its products take F.linear, which autocast casts, not the float32-only kernel."""
    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    rc, res, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", tmp_path / "o", "--steps", 2,
                              "--anchors-per-seq", 4, "--device", "cpu", "--dtype", "bfloat16", *SMALL])
    assert rc == 0, err
    assert len(res["losses"]) == 2 and all(math.isfinite(x) for x in res["losses"])


def test_run_stopped_before_its_first_checkpoint_leaves_out_usable(tiny_target, tmp_path, monkeypatch):
    """A run interrupted before its first checkpoint leaves --out with its log alone: --resume there says there
    is nothing to resume, and the same --out starts afresh (its log the new run's only). A directory holding a
    checkpoint is still never started over."""
    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    out = tmp_path / "o"
    flags = ["--target", tiny_target.path, "--data-ids", ids, "--out", out, "--steps", 3, "--anchors-per-seq", 4,
             *SMALL]
    loss, calls = train.drafter_loss, []

    def interrupted(*a, **k):
        calls.append(1)
        if len(calls) == 2:  # Ctrl-C during step 2, step 1 logged
            raise KeyboardInterrupt
        return loss(*a, **k)

    monkeypatch.setattr(train, "drafter_loss", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_train(flags)
    monkeypatch.undo()
    assert sorted(os.listdir(out)) == ["train_log.jsonl"]
    assert [json.loads(l)["step"] for l in (out / "train_log.jsonl").read_text().splitlines()] == [1]

    rc, _, err = run_train(flags + ["--resume", out])
    assert rc == 2 and "stopped before its first checkpoint" in err, err
    rc, res, err = run_train(flags)
    assert rc == 0 and res["start"] == 0, err
    assert "starting afresh" in err
    assert [json.loads(l)["step"] for l in (out / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3]
    rc, _, err = run_train(flags)
    assert rc == 2 and "already holds a training run; give a new directory, or continue that run with --resume" \
        in err, err
    # a directory that holds no training run (a published drafter): --resume is not offered, it would fail
    other = tmp_path / "published"
    other.mkdir()
    (other / "config.json").write_text("{}")
    rc, _, err = run_train([a if a != out else other for a in flags])
    assert rc == 2 and "already holds files, and no training run; give a new directory" in err, err
    assert "--resume" not in err


def test_a_second_run_writing_the_same_out_at_once_is_refused(tiny_target, tmp_path, monkeypatch):
    """Run 1 (here its lock, held by the test) writes --out before its first checkpoint: run 2 on the same
    --out is one line, before any work, and leaves run 1's log as it was (it took it for a stopped run's
    and wrote its own). No file is added to --out, and one a run made and left empty goes."""
    import fcntl

    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    out = tmp_path / "o"
    out.mkdir()
    (out / trainer.LOG_JSONL).write_text('{"step": 1}\n')
    flags = ["--target", tiny_target.path, "--data-ids", ids, "--out", out, "--steps", 2, "--anchors-per-seq", 4,
             *SMALL]
    held = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # run 1's
        rc, _, err = run_train(flags)
    finally:
        os.close(held)
    assert rc == 2 and err == f"error: --out {out}: another run is writing it now; give each run its own --out\n"
    assert os.listdir(out) == [trainer.LOG_JSONL] and (out / trainer.LOG_JSONL).read_text() == '{"step": 1}\n'
    # run 1 has checkpointed: still the lock's line, not the advice to --resume a run that is running
    (out / "checkpoint-1").mkdir()
    held = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        rc, _, err = run_train(flags)
        assert rc == 2 and err == f"error: --out {out}: another run is writing it now; give each run its own --out\n"
    finally:
        os.close(held)
    (out / "checkpoint-1").rmdir()
    rc, res, err = run_train(flags)  # run 1 gone: its log a stopped run's
    assert rc == 0 and "starting afresh" in err and trainer.LOG_JSONL in os.listdir(out), err
    seen = []

    def fails(args):
        seen.append(os.path.isdir(args.out))
        raise UserError("stopped before writing")

    monkeypatch.setattr(train, "train_drafter", fails)
    fresh = tmp_path / "fresh"
    rc, _, err = run_train([a if a != out else fresh for a in flags])
    assert rc == 2 and seen == [True] and not fresh.exists(), err


def test_ctrl_c_while_a_checkpoint_is_published_leaves_one_whole_checkpoint(tmp_path, monkeypatch):
    """A write that fails: the half-written checkpoint goes (it was left as .checkpoint-N.tmp); Ctrl-C while
    the files are written or switched: it takes effect once the checkpoint is whole and named (a Ctrl-C
    during the last save threw the finished run away; during the switch, two checkpoints were left, or
    links half made)."""
    import signal

    from support import trainer

    def write(directory):
        with open(os.path.join(directory, "model.safetensors"), "w") as f:
            f.write(directory)

    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.json").write_text("{}")  # a file of the user's in --out: not the checkpoint's
    # the model files linked to the top of --out (what --wandb-artifacts logs), the training state left out
    assert trainer.publish_checkpoint(str(out), 1, write) == [str(out / "model.safetensors")]
    (out / "notes.json").unlink()

    def interrupted(directory):
        write(directory)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        trainer.publish_checkpoint(str(out), 2, interrupted)
    assert sorted(os.listdir(out)) == ["checkpoint-1", "latest", "model.safetensors"]

    def signalled_while_writing(directory):
        os.kill(os.getpid(), signal.SIGINT)
        write(directory)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.publish_checkpoint(str(out), 2, signalled_while_writing)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sorted(os.listdir(out)) == ["checkpoint-2", "latest", "model.safetensors"]
    assert (out / "latest").read_text() == "checkpoint-2\n"

    atomic_write = trainer.atomic_write

    def signalled(path, data):  # the switch's `latest` write, with a Ctrl-C arriving just before it
        os.kill(os.getpid(), signal.SIGINT)
        atomic_write(path, data)

    monkeypatch.setattr(trainer, "atomic_write", signalled)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # what a program starts with
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.publish_checkpoint(str(out), 3, write)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert sorted(os.listdir(out)) == ["checkpoint-3", "latest", "model.safetensors"]
    assert (out / "latest").read_text() == "checkpoint-3\n"
    assert (out / "model.safetensors").read_text().endswith(".checkpoint-3.tmp")


def test_a_run_refused_by_the_lock_leaves_the_holders_new_out(tmp_path, monkeypatch):
    """Two runs starting at once on a new --out: both see it missing, the other makes and locks it first. The
    refused run does not remove it (it did, empty, under the other run's lock)."""
    import fcntl

    from support import trainer

    out = tmp_path / "o"
    real_isdir = os.path.isdir
    held = []

    def isdir(path):  # the other run makes and locks --out just after this one looked
        there = real_isdir(path)
        if not held:
            out.mkdir()
            held.append(os.open(out, os.O_RDONLY))
            fcntl.flock(held[0], fcntl.LOCK_EX)
        return there
    monkeypatch.setattr(os.path, "isdir", isdir)
    try:
        with pytest.raises(UserError, match="another run is writing it now"):
            with trainer.out_held(str(out), True):
                pass
        assert real_isdir(out)
    finally:
        os.close(held[0])


def test_a_stop_during_a_save_names_the_checkpoint_it_published(tiny_target, tmp_path, monkeypatch, capsys):
    """A SIGINT while checkpoint-2 is written waits for it, and the line names checkpoint-2: it named
    checkpoint-1, which the save had just removed."""
    import signal

    from support import trainer

    publish = trainer.publish_checkpoint

    def signalled_at_step_2(out, step, write):
        def write_and_signal(directory):
            if step == 2:
                os.kill(os.getpid(), signal.SIGINT)
            write(directory)
        return publish(out, step, write_and_signal)
    monkeypatch.setattr(trainer, "publish_checkpoint", signalled_at_step_2)
    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    out = tmp_path / "o"
    rc = train.main([str(a) for a in ["--target", tiny_target.path, "--data-ids", ids, "--out", out, "--steps", 3,
                                      "--anchors-per-seq", 4, *SMALL, "--save-every", 1, "--no-progress"]])
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert rc == 130 and last == f"interrupted by SIGINT: stopped; what was written: {out / 'checkpoint-2'}", err
    assert (out / "checkpoint-2").is_dir() and not (out / "checkpoint-1").exists()


def test_an_interruption_line_starts_below_the_training_bar(tiny_target, tmp_path, monkeypatch):
    """On a terminal the bar is closed before the interruption's line, which starts a line of its own (it
    was written after the bar's last frame, and the bar drawn again below it); the line says what is kept."""
    import signal

    from support import trainer

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    lr_at = trainer.lr_at

    def signal_at_the_second_step(step, args):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return lr_at(step, args)

    monkeypatch.setattr(trainer, "lr_at", signal_at_the_second_step)
    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    # the line names the checkpoint a --resume continues from ("what was finished is kept" hid lost steps)
    resumed = "nothing was written (the checkpoint it resumed from is as it was; --save-every N keeps finished steps)"
    for out, extra, kept in (("o", [], "nothing was written (--save-every N keeps finished steps)"),
                             ("s", ["--save-every", 1], f"what was written: {tmp_path / 's' / 'checkpoint-1'}"),
                             # resumed into its own --out: its checkpoint-1 is not this run's writing
                             ("s", ["--resume", tmp_path / "s", "--steps", 4], resumed)):
        err = Terminal()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = train.main([str(a) for a in ["--target", tiny_target.path, "--data-ids", ids, "--out",
                                              tmp_path / out, "--steps", 3, "--anchors-per-seq", 4, *SMALL, *extra]])
        lines = err.getvalue().split("\n")
        assert rc == 130 and lines[-1] == "", err.getvalue()
        assert lines[-2] == f"interrupted by SIGINT: stopped; {kept}", err.getvalue()


def test_an_interrupted_evaluation_names_its_file_beside_the_checkpoint(tiny_target, tmp_path, monkeypatch):
    """Stopped during --eval-every's evaluation, after its first dataset: the line names the checkpoint a
    --resume continues from and the partial eval_step<N>.json eval.py wrote."""
    import signal

    import eval as evaluation

    evals = tmp_path / "evals"
    evals.mkdir()
    for name in ("a", "b"):
        (evals / f"{name}.jsonl").write_text(json.dumps({"turns": ["hello world"]}) + "\n")
    format_table = evaluation.format_table

    def signal_after_the_first_dataset(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return format_table(*args, **kwargs)

    monkeypatch.setattr(evaluation, "format_table", signal_after_the_first_dataset)
    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    out = tmp_path / "o"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = train.main([str(a) for a in ["--target", tiny_target.path, "--data-ids", ids, "--out", out,
                                          "--steps", 2, "--anchors-per-seq", 4, *SMALL, "--eval-every", 1,
                                          "--eval-data-dir", evals, "--eval-datasets", "a,b",
                                          "--eval-max-new-tokens", 4, "--no-progress"]])
    last = err.getvalue().splitlines()[-1]
    assert rc == 130
    assert last == (f"interrupted by SIGINT: stopped; what was written: {out / 'checkpoint-1'}, "
                    f"{out / 'eval_step1.json'}"), err.getvalue()
    assert json.loads((out / "eval_step1.json").read_text())["interrupted"] is True


def test_a_full_disk_while_saving_is_one_line_and_leaves_no_temporary_checkpoint(tiny_target, tmp_path):
    """A checkpoint the system cannot write (here a file-size limit, as a full disk fails it): one line naming
    the file, exit 1, no temporary checkpoint left. safetensors' own error was a traceback."""
    import subprocess
    import sys

    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    out = tmp_path / "o"
    flags = " ".join(str(a) for a in ["--target", tiny_target.path, "--data-ids", ids, "--out", out, "--steps", 1,
                                      "--anchors-per-seq", 4, "--no-progress", *SMALL])
    command = f"trap '' XFSZ; ulimit -f 16; exec {sys.executable} train.py {flags}"
    done = subprocess.run(["bash", "-c", command], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert lines[-1] == f"error: {out / '.checkpoint-1.tmp' / 'model.safetensors'}: File too large", lines[-3:]
    assert not [name for name in os.listdir(out) if name.endswith(".tmp")]


def test_a_gradient_that_is_not_finite_stops_before_the_optimizer_step(tiny_target, tmp_path, monkeypatch):
    """A finite loss whose gradient is NaN (an overflow in a backward) stops the run as a NaN loss does,
    before the step: it went into the weights, a --save-every checkpoint saved them as `latest` and removed
    the last good one, and the run was lost."""
    from support import checkpoint

    real = train.drafter_loss
    calls = []

    def nan_gradient_at_the_fourth(d, *a, **k):
        loss, *rest = real(d, *a, **k)
        calls.append(1)
        if len(calls) == 4:
            w = d.fc.weight
            loss = loss + 0 * torch.sqrt(w[0, 0] - w[0, 0].detach())  # adds 0, and a NaN gradient
        return (loss, *rest)

    monkeypatch.setattr(train, "drafter_loss", nan_gradient_at_the_fourth)
    opened = []  # the files the loop opens (train_log.jsonl), closed however it stops

    def recorded_open(*a, **k):
        opened.append(open(*a, **k))
        return opened[-1]

    monkeypatch.setattr(trainer, "open", recorded_open, raising=False)
    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    out = tmp_path / "o"
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", out, "--steps", 6,
                            "--anchors-per-seq", 4, "--save-every", 2, *SMALL])
    assert rc == 2 and "error: step 4: the gradient norm is nan (not finite" in err, err
    assert opened and all(f.closed for f in opened), opened
    assert err.endswith(f"its last checkpoint, {out / 'checkpoint-2'}, is kept\n"), err
    assert (out / "latest").read_text() == "checkpoint-2\n"
    checkpoint.load_drafter(str(out / "checkpoint-2"), checkpoint.load_target(str(tiny_target.path)))


def test_a_slow_first_step_is_left_out_of_the_speed(tiny_target, tmp_path, monkeypatch):
    """The first step of a process (with --compile, the compilation's minutes) does not count in tokens/s
    and the ETA once later steps are timed: it did for the first 20 steps."""
    import time

    real = train.DraftStep.forward
    calls = []

    def slow_first(self, *a, **k):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(3)
        return real(self, *a, **k)

    monkeypatch.setattr(train.DraftStep, "forward", slow_first)
    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", tmp_path / "o", "--steps", 3,
                            "--anchors-per-seq", 4, *SMALL])
    assert rc == 0, err
    log = [json.loads(line) for line in open(tmp_path / "o" / trainer.LOG_JSONL)]
    tokens_per_step = 2 * 24  # --batch-size 2 x --seq-len 24
    assert log[0]["tokens_per_second"] < tokens_per_step / 3  # one step timed: the slow one
    assert log[-1]["tokens_per_second"] > tokens_per_step / 0.9  # the two after it alone


def test_progress_off_a_terminal_is_plain_lines(tiny_target, tmp_path, capsys):
    """stderr in a file (here captured): no bar frames piling up in it (they did, one per step, joined by
    carriage returns), a plain line instead — at the last step, and at most every 15 s before it —
    with the bar's figures: loss, τ, tokens/s, the time to go."""
    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", tmp_path / "o", "--steps", 3,
                            "--anchors-per-seq", 4, *SMALL], progress=True)
    assert rc == 0, err
    assert "\r" not in err and "it/s" not in err, err
    assert [l for l in err.splitlines() if l.startswith("step ")] == [l for l in err.splitlines() if "step 3/3: loss" in l]
    assert re.search(r"step 3/3: loss [\d.]+, τ [\d.]+, [\d,]+ tokens/s, [\d.]+ min to go", err), err


def test_checking_out_makes_no_file_in_it(tmp_path, monkeypatch):
    """Every torchrun rank checks --out: a probe file made there by one rank read as "already holds files"
    to another listing it at that moment. The check reads the folder's mount and permissions instead."""
    import tempfile
    from types import SimpleNamespace

    from support import trainer
    out = tmp_path / "o"
    out.mkdir()
    monkeypatch.setattr(tempfile, "mkstemp", lambda *a, **k: pytest.fail("a file made in --out"))
    trainer.check_out_dir(SimpleNamespace(out=str(out), resume=None), inputs=[])
    assert os.listdir(out) == []


def test_resume_alone_says_a_resumed_run_repeats_its_flags(tmp_path, capsys):
    """`--resume DIR` without the flags every run needs says so as a resumed run's rule, in one line
    naming what is missing (train.py and scripts/train_target.py alike)."""
    run = tmp_path / "run"
    rc = train.main(["--resume", str(run)])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2
    assert err == [f"error: --resume {run}: a resumed run takes the original run's flags again (--target, "
                   "--data or --data-ids, --out, ...): --target, --data, --out missing"]
    rc = train_target.main(["--resume", str(run), "--data", str(tmp_path / "c.txt")])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2
    assert err == [f"error: --resume {run}: a resumed run takes the original run's flags again (--data or "
                   "--data-ids, --out, ...): --out missing"]


def test_a_finished_runs_out_says_to_keep_out_when_resuming(tmp_path):
    """--out of a training run offers --resume, and says --out stays (a resumed run needs both)."""
    from types import SimpleNamespace

    out = tmp_path / "o"
    out.mkdir()
    (out / "latest").write_text("checkpoint-2")
    with pytest.raises(UserError) as e:
        trainer.check_out_dir(SimpleNamespace(out=str(out), resume=None), inputs=[])
    assert str(e.value).endswith(f"continue that run with --resume {out} (keeping --out {out})")


def test_an_unwritable_existing_out_is_refused_before_loading(tiny_target, tmp_path, monkeypatch):
    """An existing, empty --out on a read-only filesystem: one line at the check (it failed with a
    traceback at the first log write, after the target and data were loaded). Simulated: root may
    write anywhere, so the read-only mount is simulated."""
    from conftest import make_read_only

    ids = write_ids(tmp_path / "ids.jsonl", 4, 24, 64)
    out = tmp_path / "ro"
    out.mkdir()
    make_read_only(monkeypatch, out)
    monkeypatch.setattr(train, "load_target", lambda *a, **k: pytest.fail("loaded before --out was checked"))
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", out, "--steps", 1, *SMALL])
    assert rc == 2 and f"--out {out}: cannot write in {out} (Read-only file system)" in err, err


# ----------------------------------------------------------------------------------------
# scripts/train_target.py, and a drafter on top of it from text

CORPUS = '''def add(x, y):
    """Return the sum of x and y."""
    return x + y


def mul(x, y):
    return x * y


class Point:
    def __init__(self, x, y):
        self.x = x
        self.y = y

    def norm(self):
        return (self.x ** 2 + self.y ** 2) ** 0.5
'''


def test_train_target_from_corpus_then_drafter(tmp_path):
    data = tmp_path / "src"
    data.mkdir()
    for i in range(6):
        (data / f"m{i}.py").write_text(CORPUS.replace("add", f"add{i}"))
    (data / "notes.txt").write_text("plain text is read as well\n" * 3)
    out = tmp_path / "target"
    rc, res, err = run_train(["--data", data, "--tokenizer-from-corpus", "--vocab-size", 300,
                              "--out", out, "--steps", 20, "--seq-len", 32, "--batch-size", 4, "--hidden-size", 32,
                              "--layers", 2, "--heads", 4, "--kv-heads", 2, "--head-dim", 8, "--intermediate-size", 64,
                              "--max-position-embeddings", 128, "--lr", 1e-2, "--warmup-frac", 0.1], train_target)
    assert rc == 0, err
    assert res["losses"][-1] < 0.7 * res["losses"][0], res["losses"]

    target = checkpoint.load_target(str(out))
    assert target.args.num_hidden_layers == 2 and target.args.vocab_size <= 300
    tok = text.Tokenizer(str(out))
    assert tok.decode(tok.encode(CORPUS)) == CORPUS  # byte-level BPE round-trips source text
    eos = tok.tok.token_to_id("<|endoftext|>")
    assert checkpoint.stop_token_ids(str(out), target.args) == (eos,)
    # each checkpoint (and its --wandb-artifacts copy) is a target that reads text: its tokenizer inside
    assert text.Tokenizer(str(out / "checkpoint-20")).encode(CORPUS) == tok.encode(CORPUS)
    # transformers reads the directory too, with the same logits.
    import transformers
    hf = transformers.Qwen3ForCausalLM.from_pretrained(str(out)).eval()
    x = torch.tensor([tok.encode("def add0(x, y):")])
    with torch.no_grad():
        assert torch.allclose(target(x)[0], hf(input_ids=x).logits, atol=1e-4)

    # The demo pipeline: a drafter distilled from text through that target's tokenizer.
    dout = tmp_path / "drafter"
    rc, res, err = run_train(["--target", out, "--data", data, "--out", dout, "--steps", 3, "--seq-len", 32,
                              "--batch-size", 2, "--block-size", 3, "--depth", 1, "--markov-rank", 8,
                              "--anchors-per-seq", 8])
    assert rc == 0, err
    d = checkpoint.load_drafter(str(dout), target)
    assert d.cfg.mask_token_id == tok.tok.token_to_id("<|mask|>")
    assert d.cfg.target_layer_ids == (0,)


def test_text_jsonl_data(tiny_target, tmp_path):
    """--data as JSON lines ("text" and "turns") through the target's tokenizer."""
    words = "def x = y + 1 : return x if hello world else print ( z ) , 0 1 2 3".split()
    rng = random.Random(0)
    with open(tmp_path / "chat.jsonl", "w") as f:
        for i in range(6):
            line = " ".join(rng.choice(words) for _ in range(20))
            f.write(json.dumps({"text": line} if i % 2 else {"turns": [line, line[::-1]]}) + "\n")
    rc, res, err = run_train(["--target", tiny_target.path, "--data", tmp_path / "chat.jsonl", "--out", tmp_path / "o",
                              "--steps", 2, "--anchors-per-seq", 4, *SMALL])
    assert rc == 0, err
    assert "sequences of 24 tokens" in err


# ----------------------------------------------------------------------------------------
# Bad inputs: one line, non-zero exit, no traceback

@pytest.mark.parametrize("case,needle", [
    ("missing_data", "file or directory not found"),
    ("bad_ids", "outside the vocabulary"),
    ("bad_json", "malformed JSON"),
    ("too_short", "fewer than one sequence"),
    ("no_target", "--target"),
    ("last_layer", "last layer"),
    ("both_data", "exactly one of --data, --data-ids"),
    ("no_tokenizer", "--tokenizer"),
    ("unknown_suffix", "a file is read by its suffix: .txt/.py/.md/.rst as text, .jsonl/.json as JSON lines"),
])
def test_bad_inputs_are_one_line_errors(tiny_target, tmp_path, capsys, case, needle):
    ids = write_ids(tmp_path / "ids.jsonl", 2, 24, 64)
    base = ["--target", tiny_target.path, "--out", tmp_path / "o", "--steps", 1, *SMALL]
    argv = {
        "missing_data": base + ["--data", tmp_path / "nope.txt"],
        "bad_ids": base + ["--data-ids", write_ids(tmp_path / "bad.jsonl", 1, 30, 65, seed=5)],
        "bad_json": base + ["--data-ids", tmp_path / "x.jsonl"],
        "too_short": base + ["--data-ids", write_ids(tmp_path / "s.jsonl", 1, 10, 64)],
        "no_target": ["--data-ids", ids, "--out", tmp_path / "o"],
        "last_layer": base + ["--data-ids", ids, "--target-layer-ids", "0,2"],
        "both_data": base + ["--data-ids", ids, "--data", ids],
        "no_tokenizer": ["--data", ids, "--out", tmp_path / "o"],  # scripts/train_target.py
        "unknown_suffix": base + ["--data", tmp_path / "chats.ndjson"],  # read as text, it trained on JSON's braces
    }[case]
    (tmp_path / "x.jsonl").write_text("{not json\n")
    (tmp_path / "chats.ndjson").write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")
    if case == "bad_ids":  # make sure an out-of-range id is there
        (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt_ids": [1, 2, 64] * 10}) + "\n")
    program = train_target if case == "no_tokenizer" else train
    rc = program.main([str(a) for a in argv] + ["--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


def test_a_target_context_below_the_rows_is_refused(tmp_path, capsys):
    """scripts/train_target.py --max-position-embeddings below --seq-len: one line (it was raised to
    --seq-len in silence)."""
    (tmp_path / "c.txt").write_text("hello world. " * 300)
    argv = ["--data", tmp_path / "c.txt", "--out", tmp_path / "o", "--tokenizer", REPO_ROOT / "demo" / "target",
            "--seq-len", 16, "--max-position-embeddings", 8, "--no-progress"]
    assert train_target.main([str(a) for a in argv]) == 2
    assert capsys.readouterr().err == ("error: --max-position-embeddings 8: below --seq-len 16, the length of "
                                       "the rows the target is trained on\n")


def test_help_says_what_w_is_and_the_cpu_dtype(capsys):
    with pytest.raises(SystemExit):
        train.main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "from lr/W to lr over its W = ceil(frac x --steps) steps" in help_text
    assert "Default: bfloat16 on cuda, float32 on cpu." in help_text


def test_mode_flag_is_gone(tiny_target, tmp_path, capsys):
    """train.py distils drafters only: the target's pre-training is scripts/train_target.py, and
    `--mode target` is an unrecognized flag (one line, exit status 2)."""
    rc = train.main(["--mode", "target", "--target", str(tiny_target.path), "--out", str(tmp_path / "o")])
    assert rc == 2
    assert capsys.readouterr().err.splitlines() == ["error: --mode: no such flag (--help lists the flags)"]


def demo_command() -> str:
    """train.py's documented demo-scale command (its module docstring), continuation lines joined."""
    doc = train.__doc__.replace("\\\n", " ")
    line = next(l.strip() for l in doc.splitlines() if l.strip().startswith("python train.py --target demo/target"))
    return " ".join(line.split())


def test_demo_scale_training_command_runs(tmp_path):
    """The documented demo-scale command, at 2 steps into a temporary --out: a drafter for demo/target that
    the loader reads and that decodes losslessly (greedy speculative == the target alone)."""
    cmd = demo_command().replace("python ", f'"{sys.executable}" ')  # the suite's interpreter, not PATH's python
    assert "--steps 120" in cmd and "--out /tmp/demo-drafter" in cmd, cmd
    out = tmp_path / "demo-drafter"
    cmd = cmd.replace("--steps 120", "--steps 2").replace("--out /tmp/demo-drafter", f"--out {out}")
    p = subprocess.run(["bash", "-c", cmd + " --no-progress"], capture_output=True, text=True, cwd=REPO_ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "step 2: loss" in p.stdout and "drafter written to" in p.stdout, p.stdout
    # the one step it was timed over, said as one, and which (it was "over the last 1 steps")
    assert "tokens/s over the last step (this process's first, with its one-off costs, left out)" in p.stdout
    speeds = {m for m in re.findall(r"([\d,]+) tokens/s", p.stdout + p.stderr)}
    assert len(speeds) == 1, (p.stdout, p.stderr)  # one run, one tokens/s figure on stdout and stderr
    m = speculate.load(str(REPO_ROOT / "demo" / "target"), str(out))
    prompt = json.loads((REPO_ROOT / "demo" / "heldout.jsonl").read_text().splitlines()[0])["prompt_ids"]
    spec = speculate.generate(m, [prompt], max_new_tokens=16, temperature=0.0, ignore_eos=True)
    alone = speculate.generate(speculate.load(str(REPO_ROOT / "demo" / "target")), [prompt], max_new_tokens=16,
                               temperature=0.0, ignore_eos=True)
    assert spec[0].output_ids == alone[0].output_ids


def test_train_target_script_runs_standalone(tmp_path):
    """scripts/train_target.py as its own program: --help lists its flags with help text; a few steps on
    a tiny corpus write a target that loads."""
    def script(*argv):
        return subprocess.run([sys.executable, str(TRAIN_TARGET), *map(str, argv)], capture_output=True, text=True,
                              cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})

    help_ = script("--help")
    assert help_.returncode == 0, help_.stderr
    for flag in ("--tokenizer-from-corpus", "--hidden-size", "--kv-heads", "--lr", "--resume"):
        assert flag in help_.stdout
    assert "--block-size" not in help_.stdout and "--mode" not in help_.stdout
    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    out = tmp_path / "t"
    r = script("--data", tmp_path / "corpus.txt", "--tokenizer-from-corpus", "--vocab-size", 280, "--out", out,
               "--steps", 3, "--seq-len", 16, "--batch-size", 2, "--hidden-size", 16, "--layers", 2, "--heads", 2,
               "--kv-heads", 1, "--head-dim", 8, "--intermediate-size", 32, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert "step 3: loss" in r.stdout and "target written to" in r.stdout
    assert checkpoint.load_target(str(out)).args.num_hidden_layers == 2
    assert json.loads((ckpt(out) / "training_state.json").read_text())["kind"] == "target"
    # Resumed on other text (the same size): refused by the windows' digest, not trained on silently.
    (tmp_path / "other.txt").write_text(CORPUS[::-1] * 4)
    r = script("--data", tmp_path / "other.txt", "--out", out, "--resume", out, "--steps", 4, "--seq-len", 16,
               "--batch-size", 2, "--hidden-size", 16, "--layers", 2, "--heads", 2, "--kv-heads", 1, "--head-dim", 8,
               "--intermediate-size", 32, "--no-progress")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: "), r.stderr
    assert "--data " in r.stderr and "differs from the run's data" in r.stderr, r.stderr


TINY_TARGET = ["--seq-len", 16, "--batch-size", 2, "--hidden-size", 16, "--layers", 2, "--heads", 2, "--kv-heads", 1,
               "--head-dim", 8, "--intermediate-size", 32]


def test_train_target_resumes_a_checkpoint_folder_or_through_a_link(tmp_path):
    """--resume RUN/checkpoint-<step> takes the run's tokenizer from the top of RUN; --out a link to the run
    resumed is resuming in place (no copy of its tokenizer onto itself); a checkpoint folder copied alone
    resumes with the tokenizer it holds, and one with no tokenizer in it or above it is one line, before
    --out is made."""
    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    run, data = tmp_path / "run", ["--data", tmp_path / "corpus.txt", *TINY_TARGET]
    rc, _, err = run_train([*data, "--tokenizer-from-corpus", "--vocab-size", 280, "--out", run, "--steps", 2],
                           train_target)
    assert rc == 0, err
    rc, res, err = run_train([*data, "--resume", ckpt(run), "--out", tmp_path / "b", "--steps", 3], train_target)
    assert rc == 0 and res["start"] == 2, err
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == (run / "tokenizer.json").read_bytes()
    (tmp_path / "link").symlink_to(run)
    rc, res, err = run_train([*data, "--resume", run, "--out", tmp_path / "link", "--steps", 3], train_target)
    assert rc == 0 and res["start"] == 2, err
    assert ckpt(run).name == "checkpoint-3"
    import shutil
    shutil.copytree(ckpt(run), tmp_path / "alone" / "checkpoint-3")
    alone = tmp_path / "alone"
    rc, res, err = run_train([*data, "--resume", alone / "checkpoint-3", "--out", tmp_path / "d", "--steps", 4],
                             train_target)
    assert rc == 0 and res["start"] == 3, err
    (alone / "checkpoint-3" / "tokenizer.json").unlink()
    rc, _, err = run_train([*data, "--resume", alone / "checkpoint-3", "--out", tmp_path / "c", "--steps", 4],
                           train_target)
    assert rc == 2 and err.count("\n") == 1 and f"no tokenizer.json in {alone / 'checkpoint-3'} or {alone} " in err, err
    assert not (tmp_path / "c").exists()


def test_train_target_resumed_takes_only_its_own_tokenizer(tmp_path):
    """A resumed run goes on with the tokenizer at the top of its --out: a --tokenizer given beside --resume
    must be that one (another was ignored without a word)."""
    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    run, data = tmp_path / "run", ["--data", tmp_path / "corpus.txt", *TINY_TARGET]
    rc, _, err = run_train([*data, "--tokenizer-from-corpus", "--vocab-size", 280, "--out", run, "--steps", 2],
                           train_target)
    assert rc == 0, err
    (tmp_path / "other.json").write_text("{}")
    resume = [*data, "--resume", run, "--out", run, "--steps", 3]
    rc, _, err = run_train([*resume, "--tokenizer", tmp_path / "other.json"], train_target)
    assert rc == 2 and err == (f"error: --tokenizer {tmp_path / 'other.json'}: differs from the resumed run's "
                               f"{run / 'tokenizer.json'}\n"), err
    (tmp_path / "same.json").write_bytes((run / "tokenizer.json").read_bytes())
    rc, res, err = run_train([*resume, "--tokenizer", tmp_path / "same.json"], train_target)
    assert rc == 0 and res["start"] == 2, err


def test_train_target_resumed_refuses_a_vocabulary_or_context_it_would_not_use(tmp_path):
    """A resumed run's tokenizer and config are its own: --tokenizer-from-corpus with another --vocab-size, or
    another --max-position-embeddings, changed nothing and exited 0; each is now refused in one line."""
    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    run, data = tmp_path / "run", ["--data", tmp_path / "corpus.txt", *TINY_TARGET]
    first = [*data, "--tokenizer-from-corpus", "--vocab-size", 280]
    rc, _, err = run_train([*first, "--out", run, "--steps", 2], train_target)
    assert rc == 0, err
    resume = ["--resume", run, "--out", run, "--steps", 3]
    rc, _, err = run_train([*data, "--tokenizer-from-corpus", "--vocab-size", 500, *resume], train_target)
    assert rc == 2 and err.startswith("error: --vocab-size 500: the resumed run's tokenizer ") and \
        "was trained to --vocab-size 280" in err, err
    rc, _, err = run_train([*first, "--max-position-embeddings", 999, *resume], train_target)
    assert rc == 2 and "--max-position-embeddings was 4096, now 999" in err, err
    rc, res, err = run_train([*first, *resume], train_target)
    assert rc == 0 and res["start"] == 2, err


def test_train_target_names_the_tokenizer_given_when_it_cannot_load(tmp_path):
    """A --tokenizer that is not a tokenizer was reported under its copy in --out (then removed)."""
    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    (tmp_path / "bad.json").write_text('{"version": "1.0", "model": 5}')
    out = tmp_path / "t"
    rc, _, err = run_train(["--data", tmp_path / "corpus.txt", *TINY_TARGET, "--tokenizer", tmp_path / "bad.json",
                            "--out", out, "--steps", 1], train_target)
    assert rc == 2 and err.startswith(f"error: {tmp_path / 'bad.json'}: cannot load tokenizer (") and \
        err.count("\n") == 1 and not out.exists(), err


def test_train_target_stopped_before_training_leaves_out_as_it_was(tmp_path):
    """Too little text for one window, found after the tokenizer was written: --out held tokenizer.json
    alone, and the same command with more text was refused ("already holds files")."""
    (tmp_path / "short.txt").write_text("def f(): pass\n")
    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    out = tmp_path / "t"
    flags = [*TINY_TARGET, "--tokenizer-from-corpus", "--vocab-size", 280, "--out", out, "--steps", 1]
    rc, _, err = run_train(["--data", tmp_path / "short.txt", *flags], train_target)
    assert rc == 2 and "fewer than one sequence" in err and not out.exists(), err
    out.mkdir()
    rc, _, err = run_train(["--data", tmp_path / "short.txt", *flags], train_target)
    assert rc == 2 and os.listdir(out) == [], err
    rc, _, err = run_train(["--data", tmp_path / "corpus.txt", *flags], train_target)
    assert rc == 0, err


def test_train_target_refuses_an_out_another_run_writes(tmp_path):
    """scripts/train_target.py holds --out's lock as train.py does: a second run on it is one line."""
    import fcntl

    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    out = tmp_path / "t"
    out.mkdir()
    flags = [*TINY_TARGET, "--tokenizer-from-corpus", "--vocab-size", 280, "--out", out, "--steps", 1]
    held = os.open(out, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # another run's
        rc, _, err = run_train(["--data", tmp_path / "corpus.txt", *flags], train_target)
    finally:
        os.close(held)
    assert rc == 2 and err == f"error: --out {out}: another run is writing it now; give each run its own --out\n"
    assert os.listdir(out) == []


def test_train_target_refuses_an_unwritable_out_before_any_work(tmp_path, monkeypatch):
    """An existing, empty --out that takes no files (a read-only filesystem; root writes through chmod, so
    the read-only mount is simulated) is one line before the tokenizer is trained."""
    from conftest import make_read_only

    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    out = tmp_path / "ro"
    out.mkdir()
    make_read_only(monkeypatch, out)
    monkeypatch.setattr(train_target, "train_bpe", lambda *a: pytest.fail("the tokenizer was trained first"))
    rc, _, err = run_train(["--data", tmp_path / "corpus.txt", *TINY_TARGET, "--tokenizer-from-corpus",
                            "--vocab-size", 280, "--out", out, "--steps", 2], train_target)
    assert rc == 2 and err == f"error: --out {out}: cannot write in {out} (Read-only file system)\n", err
    assert os.listdir(out) == []


def test_train_target_refuses_standard_output_as_out(tmp_path, monkeypatch):
    """--out -: refused in one line, as the file flags refuse it; it trained into a directory named -."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    rc, _, err = run_train(["--data", tmp_path / "corpus.txt", *TINY_TARGET, "--tokenizer-from-corpus",
                            "--vocab-size", 280, "--out", "-", "--steps", 1], train_target)
    assert rc == 2 and err == "error: --out -: standard output is not supported here; give a directory path\n", err
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("flags,needle", [
    # each used to train (0 layers, 0 heads, a tokenizer of 258 tokens) or end in a traceback
    (["--layers", 0], "--layers: invalid value 0 (valid: 1 to 1024)"),
    (["--hidden-size", -1], "--hidden-size: invalid value -1 (valid: 1 to 65536)"),
    (["--kv-heads", 0], "--kv-heads: invalid value 0"),
    (["--intermediate-size", 0], "--intermediate-size: invalid value 0"),
    (["--vocab-size", 100], "--vocab-size: invalid value 100 (valid: 258 to 10000000)"),
    (["--rope-theta", "nan"], "--rope-theta: invalid value nan"),
    # a config the loader would refuse to read back
    (["--rope-theta", 1e20], "--rope-theta: invalid value 1e+20 (valid: 1 to 1000000000000)"),
    (["--head-dim", 7], "--head-dim 7: must be even"),
    # read silently before: one tokenizer would have been ignored, or a flag changed nothing
    (["--tokenizer", "corpus.txt"], "give --tokenizer or --tokenizer-from-corpus, not both"),
    (["--no-tokenizer-from-corpus", "--tokenizer", "tok.json"],
     "--vocab-size 280: changes nothing with no --tokenizer-from-corpus"),
    (["--schedule", "constant", "--min-lr-frac", 0.1], "--min-lr-frac 0.1: changes nothing with --schedule constant"),
])
def test_train_target_refuses_bad_or_unused_flags_before_any_work(tmp_path, monkeypatch, flags, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus.txt").write_text(CORPUS * 4)
    (tmp_path / "tok.json").write_text("{}")
    rc, _, err = run_train(["--data", tmp_path / "corpus.txt", *TINY_TARGET, "--tokenizer-from-corpus",
                            "--vocab-size", 280, "--out", tmp_path / "t", "--steps", 1, *flags], train_target)
    assert rc == 2 and err.startswith(f"error: {needle}"), err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "t").exists()


@pytest.mark.parametrize("flags,named", [(["--markov", "none", "--no-confidence", "--markov-rank", 64], "--markov-rank"),
                                         (["--no-confidence", "--alpha-conf", 0.5], "--alpha-conf"),
                                         # the default's value, given: refused as well
                                         (["--no-confidence", "--confidence-with-markov"],
                                          "--confidence-with-markov"),
                                         (["--no-confidence", "--no-confidence-with-markov"],
                                          "--no-confidence-with-markov")])
def test_a_flag_the_drafter_has_no_use_for_is_refused(tiny_target, tmp_path, flags, named):
    """A head's flag given for a drafter without that head would train the very same drafter (a sweep over it
    would compare identical runs): refused, as --log-every without --wandb is."""
    ids = write_ids(tmp_path / "ids.jsonl", 2, 24, 64, seed=1)
    rc, _, err = run_train(["--target", tiny_target.path, "--data-ids", ids, "--out", tmp_path / "o", "--steps", 1,
                            *flags])
    assert rc == 2 and err.startswith(f"error: {named}") and "changes nothing with" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("flags,line", [
    # each used to train, exit 0: 63 anchors instead, a loss of 0, positions past the target's context
    (["--seq-len", 64, "--anchors-per-seq", 1000],
     "--anchors-per-seq 1000: a --seq-len 64 sequence has at most 63 anchors (--seq-len - 1)"),
    (["--seq-len", 24, "--anchors-per-seq", 24],
     "--anchors-per-seq 24: a --seq-len 24 sequence has at most 23 anchors (--seq-len - 1)"),
    (["--alpha-ce", 0, "--alpha-tv", 0, "--alpha-conf", 0],
     "--alpha-ce, --alpha-tv, --alpha-conf: every loss weight is 0, so nothing would be trained"),
    (["--no-confidence", "--alpha-ce", 0, "--alpha-tv", 0],
     "--alpha-ce, --alpha-tv (--no-confidence): every loss weight is 0, so nothing would be trained"),
    (["--seq-len", 17],
     "--seq-len 17: longer than the context of --target {target} (max_position_embeddings 16)"),
    (["--block-size", 16],  # its last slot had no label in any row: saved untrained, logged as accept 0.0
     "--block-size 16: a block's drafts follow its anchor within each --seq-len 16 sequence, so at most 15 "
     "(the slots past them are never trained)"),
])
def test_a_run_that_could_not_train_as_asked_is_refused(tiny_target, tmp_path, flags, line):
    """Flags that the run would have clamped, ignored or run past the target's context: one line naming them,
    exit 2, before any work (the target's context read from the config.json of a copy that says 16)."""
    from conftest import copy_target, edit_json

    target = copy_target(tiny_target.path, tmp_path / "t16")
    edit_json(target / "config.json", lambda c: c.update(max_position_embeddings=16))
    ids = write_ids(tmp_path / "ids.jsonl", 2, 24, 64, seed=1)
    rc, _, err = run_train(["--target", target, "--data-ids", ids, "--out", tmp_path / "o", "--steps", 1,
                            "--seq-len", 16, *SMALL[2:], *flags])
    assert rc == 2 and err == f"error: {line.format(target=target)}\n", err
    assert not (tmp_path / "o").exists()


def test_the_run_trains_at_the_bounds_it_refuses_past(tiny_target, tmp_path):
    """--anchors-per-seq --seq-len - 1, --seq-len the target's context (128) and one loss weight above 0
    train; DeepSpec's default 512 anchors are cut to a shorter --seq-len; --confidence-with-markov left out
    is on, saved as such, so a run saved with it (or before it could be left out) resumes."""
    ids = write_ids(tmp_path / "ids.jsonl", 4, 128, 64, seed=1)
    base = ["--target", tiny_target.path, "--data-ids", ids, "--alpha-tv", 0, "--alpha-conf", 0, *SMALL[2:]]
    rc, _, err = run_train([*base, "--out", tmp_path / "a", "--steps", 1, "--seq-len", 24,
                            "--anchors-per-seq", 23])
    assert rc == 0 and "sequences of 24 tokens, 23 anchors each" in err, err
    run = [*base, "--out", tmp_path / "b", "--steps", 2, "--seq-len", 128]
    rc, _, err = run_train([*run, "--stop-at", 1])
    assert rc == 0 and "sequences of 128 tokens, 127 anchors each" in err, err
    state = json.loads((tmp_path / "b" / "checkpoint-1" / "training_state.json").read_text())
    assert state["args"]["confidence_with_markov"] is True
    assert json.loads((tmp_path / "b" / "config.json").read_text())["confidence_head_with_markov"] is True
    rc, res, err = run_train([*run, "--resume", tmp_path / "b"])
    assert rc == 0 and res["start"] == 1, err
