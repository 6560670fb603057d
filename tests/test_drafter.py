"""The drafter: checkpoint spellings, refusals, layouts, and the cached block forward
against a from-scratch reference of docs/algorithm.md ("The drafter").

Every checkpoint here is tiny and random (vocab 48, hidden 32), built offline by
`tests/drafters.py` once per module.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import re
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

torch.set_num_threads(1)

HERE = Path(__file__).resolve().parent
for _p in (str(HERE.parent), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from conftest import edit_config, edit_tensors  # noqa: E402
from drafters import make_drafter, make_target  # noqa: E402

import drafter as dm  # noqa: E402
import model  # noqa: E402
import speculate  # noqa: E402
import train  # noqa: E402
from support import checkpoint  # noqa: E402

V, H = 48, 32
MASK = V - 1
PROMPTS = [[3, 14, 15, 9, 26, 5, 35, 8, 9], [7, 21, 4]]  # two lengths: rows of one batch at different positions
TIMING = ("tokens_per_second", "prefill_seconds", "decode_seconds", "compile_seconds")
GREEDY = ("--temperature", "0")
SAMPLED = ("--temperature", "1.0", "--seed", "7")


# ----------------------------------------------------------------------------------------
# Fixtures and helpers

def file_name(name: str) -> str:
    """`name` as a directory name: each run of characters other than letters, digits and `_.=-` made one
    `_`, none left at either end."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name).strip("_")


class Checkpoints:
    """One target, plus drafters and alternative targets built on demand and cached by name."""

    def __init__(self, base: Path):
        self.base = base
        self.target = make_target(base / "target")
        self.prompts = str(base / "prompts.jsonl")
        with open(self.prompts, "w") as f:
            for p in PROMPTS:
                f.write(json.dumps({"prompt_ids": p}) + "\n")
        self._drafters, self._targets = {}, {}

    def drafter(self, name: str, target: str = None, **kw) -> str:
        name = file_name(name)
        if name not in self._drafters:
            self._drafters[name] = make_drafter(self.base / "drafters" / name, target or self.target, **kw)
        return self._drafters[name]

    def alt_target(self, name: str, **kw) -> str:
        name = file_name(name)
        if name not in self._targets:
            self._targets[name] = make_target(self.base / "targets" / name, **kw)
        return self._targets[name]


@pytest.fixture(scope="module")
def ck(tmp_path_factory) -> Checkpoints:
    return Checkpoints(tmp_path_factory.mktemp("drafter_ckpts"))


@pytest.fixture(scope="module")
def target(ck):
    return checkpoint.load_target(ck.target)


def run_drafter_captured(capsys, ck, drafter_dir, *extra, trace=None, prompts=True):
    """speculate.main on ck's target and `drafter_dir` (with prompts: ck's prompts file, batch size 2, 14 new
    tokens): (exit status, capsys's captured output)."""
    argv = ["--target", ck.target, "--drafter", drafter_dir]
    if prompts:
        argv += ["--prompts-file", ck.prompts, "--batch-size", "2", "--max-new-tokens", "14"]
    if trace is not None:
        argv += ["--trace-file", str(trace)]
    capsys.readouterr()
    rc = speculate.main(argv + list(extra))
    out = capsys.readouterr()
    return rc, out


def read_trace_untimed(path):
    """Trace lines with the summary's timing fields removed."""
    lines = []
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("summary"):
                for k in TIMING:
                    assert k in rec, f"summary lacks {k!r}"
                    rec.pop(k)
            lines.append(rec)
    return lines


def trace_of(capsys, ck, tmp_path, drafter_dir, mode, name="trace"):
    path = tmp_path / f"{name}.jsonl"
    rc, out = run_drafter_captured(capsys, ck, drafter_dir, *mode, trace=path)
    assert rc == 0, out.err
    return read_trace_untimed(path)


def assert_same_config(a: dm.DrafterConfig, b: dm.DrafterConfig):
    for f in dataclasses.fields(dm.DrafterConfig):
        assert getattr(a, f.name) == getattr(b, f.name), f"field {f.name}: {getattr(a, f.name)!r} != {getattr(b, f.name)!r}"
    assert a == b


def assert_same_weights(d1, d2):
    s1, s2 = d1.state_dict(), d2.state_dict()
    assert s1.keys() == s2.keys()
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k


def rounds_of(trace):
    return [r for r in trace if "round" in r]


# ----------------------------------------------------------------------------------------
# 1. Spellings

# The spellings of drafters.SPELLINGS that carry the Markov and confidence heads (z-lab's has none).
HEAD_SPELLINGS = ("deepspec", "dspark_config", "dspark_prefix", "specforge")


def spelling_drafter(ck, spelling, markov="vanilla", **kw):
    kw = dict(markov=markov, oracle_scale=5.0, seed=11, **kw)
    return ck.drafter(f"sp_{spelling}_{markov}_{sorted(kw.items())}", spelling=spelling, **kw)


@pytest.mark.parametrize("markov", list(dm.MARKOV_HEADS))
def test_spellings_resolve_to_the_same_config(ck, target, markov):
    loaded = {s: checkpoint.load_drafter(spelling_drafter(ck, s, markov), target) for s in HEAD_SPELLINGS}
    # The deepspec file without its embedding / lm_head copies is the same drafter too.
    loaded["deepspec_no_embeddings"] = checkpoint.load_drafter(
        spelling_drafter(ck, "deepspec", markov, with_embeddings=False), target)
    ref = loaded["deepspec"].cfg
    assert ref.layout == "dspark" and ref.block_size == 4 and ref.num_drafts == 4
    assert ref.markov_head_type == markov and ref.markov_rank == V
    assert ref.confidence_head and ref.confidence_with_markov
    assert ref.target_layer_ids == (0, 1) and ref.mask_token_id == MASK
    assert ref.layers.hidden_size == H and ref.layers.vocab_size == V and ref.layers.num_hidden_layers == 2
    for name, d in loaded.items():
        assert_same_config(d.cfg, ref)
        assert_same_weights(d, loaded["deepspec"])
        # Shared, not copied: the drafter uses the target's embedding and lm_head.
        assert d.target is target
        assert not any(n.startswith(("embed_tokens", "lm_head")) for n, _ in d.named_parameters())


def test_markov_head_type_is_read_as_deepspec_reads_it(ck, target):
    """DeepSpec lowercases markov_head_type: "Vanilla" is the vanilla head (it was an unknown type)."""
    d = ck.drafter("capitalised_markov_type", extra_config={"markov_head_type": "Vanilla"})
    loaded = checkpoint.load_drafter(d, target)
    assert loaded.cfg.markov_head_type == "vanilla"
    assert_same_weights(loaded, checkpoint.load_drafter(ck.drafter("capitalised_markov_type_ref"), target))


def test_embedding_copies_exported_in_bfloat16_are_the_targets(ck, target):
    """DeepSpec's copies of the target's embedding and lm_head, saved in bfloat16 beside a float32 target, are
    the target's weights rounded: the drafter loads in float32 as in bfloat16 (it was refused as "differs")."""
    d = ck.drafter("bf16_copies")
    edit_tensors(d, lambda w: w.update({k: w[k].bfloat16() for k in ("embed_tokens.weight", "lm_head.weight")}))
    reference = checkpoint.load_drafter(ck.drafter("bf16_copies_ref"), target)
    assert_same_weights(checkpoint.load_drafter(d, target), reference)
    # read in float16 too: the copy bfloat16 -> float16 and the target float32 -> float16 round apart
    half = checkpoint.load_target(ck.target, dtype=torch.float16)
    assert checkpoint.load_drafter(d, half, dtype=torch.float16).cfg == reference.cfg


@pytest.mark.parametrize("mode", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("markov", list(dm.MARKOV_HEADS))
def test_spellings_give_identical_traces(ck, capsys, tmp_path, markov, mode):
    traces = {s: trace_of(capsys, ck, tmp_path, spelling_drafter(ck, s, markov), mode, s) for s in HEAD_SPELLINGS}
    traces["deepspec_no_embeddings"] = trace_of(
        capsys, ck, tmp_path, spelling_drafter(ck, "deepspec", markov, with_embeddings=False), mode, "noemb")
    ref = traces["deepspec"]
    rounds = rounds_of(ref)
    assert rounds and all(len(r["draft"]) == 4 and len(r["confidence"]) == 4 for r in rounds)
    assert sum(1 for r in ref if "output_ids" in r) == len(PROMPTS)
    assert ref[-1]["summary"] is True
    if markov == "vanilla":  # the oracle chain makes some rounds accept drafts
        assert any(r["accepted"] >= 1 for r in rounds)
    for s, t in traces.items():
        assert t == ref, f"spelling {s} gives a different trace"


# ----------------------------------------------------------------------------------------
# 2. The weights decide what the config leaves open

OPEN_CASES = {
    # name: (spelling, keys dropped from config, builder options)
    "deepspec_with_markov": ("deepspec", ("markov_rank", "confidence_head_with_markov"), {}),
    "deepspec_without_markov": ("deepspec", ("markov_rank", "confidence_head_with_markov"),
                                {"confidence_with_markov": False}),
    "deepspec_rank8": ("deepspec", ("markov_rank", "confidence_head_with_markov"), {"oracle": False, "rank": 8}),
    "dspark_prefix": ("dspark_prefix", ("dspark_markov_rank", "dspark_confidence_head_with_markov"), {}),
}


@pytest.mark.parametrize("case", list(OPEN_CASES))
def test_weights_settle_what_config_leaves_open(ck, target, capsys, tmp_path, case):
    spelling, drop, kw = OPEN_CASES[case]
    kw = dict(spelling=spelling, oracle_scale=5.0, seed=12, **kw)
    full = ck.drafter(f"open_{case}_full", **kw)
    dropped = ck.drafter(f"open_{case}_dropped", drop_config=drop, **kw)
    with open(os.path.join(dropped, "config.json")) as f:
        raw = json.load(f)
    assert not any(k in raw for k in drop)
    d_full, d_dropped = checkpoint.load_drafter(full, target), checkpoint.load_drafter(dropped, target)
    assert_same_config(d_dropped.cfg, d_full.cfg)
    assert d_dropped.cfg.markov_rank == kw.get("rank", V)
    assert d_dropped.cfg.confidence_with_markov == kw.get("confidence_with_markov", True)
    for mode in (GREEDY, SAMPLED):
        assert trace_of(capsys, ck, tmp_path, dropped, mode, "dropped") == trace_of(capsys, ck, tmp_path, full, mode, "full")


# ----------------------------------------------------------------------------------------
# 3. Refusals

def _set_nested(section, key, value):
    def fn(cfg):
        cfg[section][key] = value
    return fn


def _add_tensor(name, shape):
    def fn(w):
        w[name] = torch.zeros(shape)
    return fn


def _drop_tensor(name):
    def fn(w):
        del w[name]
    return fn


def _perturb(name):
    def fn(w):
        w[name] = w[name].clone()
        w[name][3, 5] += 0.5
    return fn


# name: (builder options, config edit, tensor edit, alternative target options, message regex)
REFUSALS = {
    "markov_declared_without_weights": (
        dict(markov=None, confidence=False, extra_config={"markov_head_type": "vanilla"}), None, None, None,
        r"markov_head_type is 'vanilla'.*markov_w1"),
    "markov_declared_without_weights_specforge": (
        dict(spelling="specforge", markov=None, confidence=False),
        _set_nested("dflash_config", "markov_head_type", "gated"), None, None,
        r"markov_head_type is 'gated'.*markov_w1"),
    "confidence_enabled_without_weights": (
        dict(confidence=False, extra_config={"enable_confidence_head": True}), None, None, None,
        r"confidence head is enabled.*confidence_head\.proj\.weight"),
    "confidence_enabled_without_weights_specforge": (
        dict(spelling="specforge", confidence=False), _set_nested("dflash_config", "use_confidence_head", True),
        None, None, r"confidence head is enabled.*confidence_proj\.weight"),
    "markov_weights_undeclared": (
        dict(confidence=False, extra_config={"markov_head_type": None}), None, None, None,
        r"markov_w1\.weight.*Markov head.*markov_head_type"),
    "markov_weights_undeclared_specforge": (
        dict(spelling="specforge", confidence=False), _set_nested("dflash_config", "markov_head_type", None),
        None, None, r"markov_w1\.weight.*Markov head"),
    "confidence_weights_undeclared": (
        dict(extra_config={"enable_confidence_head": False}), None, None, None,
        r"confidence_head\.proj\.weight.*does not enable"),
    "confidence_weights_undeclared_dspark_config": (
        dict(spelling="dspark_config"), _set_nested("dspark_config", "enable_confidence_head", False), None, None,
        r"confidence_head\.proj\.weight.*does not enable"),
    "unknown_markov_head_type": (
        dict(extra_config={"markov_head_type": "lstm"}), None, None, None, r"unknown markov_head_type 'lstm'"),
    "markov_type_weights_mismatch": (  # gated declared, vanilla weights: gate_proj is missing
        dict(extra_config={"markov_head_type": "gated"}), None, None, None, r"markov_head\.gate_proj\.weight.*missing"),
    "markov_rank_disagrees": (
        dict(extra_config={"markov_rank": 256}), None, None, None, r"markov_rank is 256 but markov_w1 has rank 48"),
    "markov_rank_disagrees_specforge": (
        dict(spelling="specforge"), _set_nested("dflash_config", "markov_rank", 16), None, None,
        r"markov_rank is 16 but markov_w1 has rank 48"),
    "confidence_with_markov_declared_false": (
        dict(extra_config={"confidence_head_with_markov": False}), None, None, None,
        r"confidence_head_with_markov is False but confidence_head\.proj reads 80 features"),
    "confidence_with_markov_declared_true": (
        dict(confidence_with_markov=False, extra_config={"confidence_head_with_markov": True}), None, None, None,
        r"confidence_head_with_markov is True but confidence_head\.proj reads 32 features"),
    "confidence_with_markov_without_a_markov_head": (
        dict(markov=None, confidence_with_markov=False, extra_config={"confidence_head_with_markov": True}),
        None, None, None, r"confidence_head_with_markov is true but there is no Markov head"),
    "dflash_block_of_one": (
        dict(markov=None, confidence=False, block_size=1, extra_config={"architectures": ["DFlashDraftModel"]}),
        None, None, None, r"the DFlash layout needs block_size >= 2, got 1"),
    "conflicting_block_size": (
        dict(spelling="dspark_config", block_size=5, extra_config={"block_size": 4}), None, None, None,
        r"conflicting values for 'block_size'.*5.*4|conflicting values for 'block_size'.*4.*5"),
    "conflicting_markov_head_type_prefix": (
        dict(spelling="dspark_prefix", extra_config={"markov_head_type": "gated"}), None, None, None,
        r"conflicting values for 'markov_head_type'"),
    "conflicting_confidence_aliases": (
        dict(extra_config={"use_confidence_head": False}), None, None, None,
        r"conflicting values for 'enable_confidence_head'.*use_confidence_head"),
    "unknown_extra_tensor": (
        dict(), None, _add_tensor("layers.0.self_attn.rotary_emb.inv_freq", (8,)), None,
        r"'layers\.0\.self_attn\.rotary_emb\.inv_freq'.*matches no parameter"),
    "unknown_extra_top_tensor": (
        dict(), None, _add_tensor("eagle_fc.weight", (4, 4)), None, r"'eagle_fc\.weight'.*matches no parameter"),
    "missing_layer_tensor": (
        dict(), None, _drop_tensor("layers.1.mlp.up_proj.weight"), None, r"'layers\.1\.mlp\.up_proj\.weight'.*missing"),
    "no_target_layer_ids": (
        dict(drop_config=("target_layer_ids",)), None, None, None,
        r"config\.json: missing key 'target_layer_ids' \(or null; top-level, or in dspark_config or dflash_config\)"),
    "no_mask_token_id": (
        dict(drop_config=("mask_token_id",)), None, None, None, r"config\.json: missing key 'mask_token_id'"),
    "missing_fc": (
        dict(), None, _drop_tensor("fc.weight"), None, r"'fc\.weight'.*missing"),
    "wrong_layer_tensor_shape": (
        dict(), None, _add_tensor("layers.0.self_attn.q_norm.weight", (8,)), None,
        r"'layers\.0\.self_attn\.q_norm\.weight' has shape \[8\]"),
    "head_weight_under_two_spellings": (
        dict(), None, _add_tensor("markov_w1.weight", (V, V)), None,
        r"markov_w1\.weight' are two spellings of one weight"),
    "hidden_size_differs": (
        dict(with_embeddings=False), None, None, dict(hidden_size=48), r"config\.json: hidden_size 48 differs from the target's 32"),
    "vocab_size_differs": (
        dict(with_embeddings=False), None, None, dict(vocab_size=64), r"config\.json: vocab_size 64 differs from the target's 48"),
    "embeddings_copy_from_another_target": (
        dict(), None, None, dict(hidden_size=48), r"embed_tokens\.weight.*differs from the target"),
    "target_layer_is_last": (
        dict(target_layer_ids=(0, 2)), None, None, None, r"config\.json: target_layer_ids.*layer id 2 is the target's last layer"),
    "target_layer_out_of_range": (
        dict(target_layer_ids=(0, 7)), None, None, None, r"config\.json: target_layer_ids.*layer id 7 is outside"),
    "target_layer_negative": (
        dict(target_layer_ids=(-2, 0)), None, None, None, r"target_layer_ids.*layer id -2 is outside"),
    "embed_copy_differs": (
        dict(), None, _perturb("embed_tokens.weight"), None, r"'embed_tokens\.weight' differs from the target's"),
    "lm_head_copy_differs": (
        dict(), None, _perturb("lm_head.weight"), None, r"'lm_head\.weight' differs from the target's"),
    "unknown_architecture": (
        dict(extra_config={"architectures": ["EagleDraftModel"]}), None, None, None,
        r"architectures \['EagleDraftModel'\] is not a known drafter"),
    "no_architecture": (
        dict(extra_config={"architectures": []}), None, None, None, r"architectures \[\] is not a known drafter"),
    "unknown_projector_type": (
        dict(spelling="specforge"), _set_nested("dflash_config", "projector_type", "eagle3"), None, None,
        r"unknown projector_type 'eagle3'"),
    "dspark_projector_unshifted": (
        dict(spelling="specforge"), _set_nested("dflash_config", "shift_label", False), None, None,
        r"shift_label=false contradicts projector_type 'dspark'"),
    "dflash_layout_with_heads": (  # the layout guessed from the architecture: the refusal names the keys
        dict(extra_config={"architectures": ["DFlashDraftModel"]}), None, None, None,
        r"no key names the layout, so a DFlashDraftModel is read as z-lab's DFlash \(set projector_type "
        r"\"dspark\" or shift_label true .*\), and that layout has no Markov or confidence head"),
    "dflash_layout_said_with_heads": (
        dict(extra_config={"architectures": ["DFlashDraftModel"], "projector_type": "dflash"}), None, None, None,
        r"config\.json: the DFlash layout has no Markov or confidence head"),
    "mask_token_outside_vocab": (
        dict(extra_config={"mask_token_id": V}), None, None, None, r"'mask_token_id' must be an id below vocab_size 48"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refusals(ck, target, capsys, case):
    kw, cfg_edit, tensor_edit, alt, pattern = REFUSALS[case]
    tdir = ck.alt_target(f"alt_{sorted(alt.items())}", **alt) if alt else None
    d = ck.drafter(f"bad_{case}", target=tdir, **kw)
    if cfg_edit:
        edit_config(d, cfg_edit)
    if tensor_edit:
        edit_tensors(d, tensor_edit)
    with pytest.raises(checkpoint.UserError, match=pattern):
        checkpoint.load_drafter(d, target)

    rc, out = run_drafter_captured(capsys, ck, d, "--prompt-ids", "1,2,3", "--max-new-tokens", "4", prompts=False)
    assert rc != 0
    lines = out.err.splitlines()
    assert len(lines) == 1, out.err
    assert lines[0].startswith("error: "), out.err
    assert re.search(pattern, lines[0]), lines[0]
    assert "Traceback" not in out.err + out.out
    assert "drafter:" not in out.err


@pytest.mark.parametrize("key,on_disk", [("markov_head_type", "markov_w1.weight"),
                                         ("use_confidence_head", "confidence_proj.weight")])
def test_refusal_names_the_tensor_as_spelled_in_the_file(ck, target, key, on_disk):
    d = ck.drafter(f"bad_spelled_{key}", spelling="specforge", confidence=key == "use_confidence_head")
    edit_config(d, _set_nested("dflash_config", key, None if key == "markov_head_type" else False))
    with pytest.raises(checkpoint.UserError, match=re.escape(repr(on_disk))):
        checkpoint.load_drafter(d, target)


def test_refusals_name_the_file(ck, target):
    d = ck.drafter("bad_file_named", extra_config={"markov_head_type": "lstm"})
    with pytest.raises(checkpoint.UserError, match=re.escape(os.path.join(d, "config.json"))):
        checkpoint.load_drafter(d, target)
    d = ck.drafter("bad_tensor_file_named")
    edit_tensors(d, _drop_tensor("norm.weight"))
    with pytest.raises(checkpoint.UserError, match=re.escape(os.path.join(d, "model.safetensors"))):
        checkpoint.load_drafter(d, target)


# ----------------------------------------------------------------------------------------
# 4. The z-lab DFlash layout

@pytest.mark.parametrize("block_size", [3, 5])
def test_zlab_layout(ck, target, capsys, tmp_path, block_size):
    d = ck.drafter(f"zlab_b{block_size}", spelling="zlab", markov=None, confidence=False, block_size=block_size)
    cfg = checkpoint.load_drafter(d, target).cfg
    assert cfg.layout == "dflash"
    assert cfg.block_size == block_size and cfg.num_drafts == block_size - 1
    assert cfg.markov_head_type is None and cfg.markov_rank == 0
    assert not cfg.confidence_head and not cfg.confidence_with_markov
    assert cfg.target_layer_ids == (0, 1) and cfg.mask_token_id == MASK
    for mode in (GREEDY, SAMPLED):
        trace = trace_of(capsys, ck, tmp_path, d, mode, "zlab")
        rounds = rounds_of(trace)
        assert len(rounds) >= 2
        for r in rounds:
            assert len(r["draft"]) == block_size - 1
            assert r["confidence"] is None
            assert r["verified"] == block_size - 1 and 0 <= r["accepted"] <= block_size - 1
        assert len(trace[-1]["accept_rate_by_position"]) == block_size - 1


def test_zlab_shift_label_export_is_dspark_layout(ck, target):
    """A DFlashDraftModel whose dflash_config says shift_label is the DSpark layout (K drafts)."""
    d = ck.drafter("zlab_shift", spelling="zlab", markov=None, confidence=False, block_size=4)
    edit_config(d, _set_nested("dflash_config", "shift_label", True))
    cfg = checkpoint.load_drafter(d, target).cfg
    assert cfg.layout == "dspark" and cfg.num_drafts == 4


# ----------------------------------------------------------------------------------------
# 5. The cached drafter against a from-scratch reference of docs/algorithm.md ("The drafter")

def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    """Rotate-half RoPE: x [T, heads, hd] at integer positions pos [T]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = pos.to(torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], dim=-1)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * ang.cos() + torch.cat([-x2, x1], dim=-1) * ang.sin()


def reference_block(drafter, embed, lm_head, feats, anchor, a):
    """The drafter's (hidden, base logits) for one row, in float64, from its weights only.

    feats: [a, n*H] the target's captured features of committed positions 0..a-1; anchor: the
    token at position a. Nothing of the drafter's forward, cache or attention code is used.
    """
    cfg, A = drafter.cfg, drafter.cfg.layers
    W = {k: v.detach().to(torch.float64) for k, v in checkpoint.published(dict(drafter.named_parameters())).items()}
    assert not any(k.endswith(".bias") for k in W if k.startswith("layers.")), "reference assumes no attention bias"
    eps, theta = A.rms_norm_eps, A.rope_theta
    nh, nkv, hd = A.num_attention_heads, A.num_key_value_heads, A.head_dim
    S = cfg.block_size

    c = _rms(feats @ W["fc.weight"].T, W["hidden_norm.weight"], eps)  # [a, H]
    x = embed[torch.tensor([anchor] + [cfg.mask_token_id] * (S - 1))]  # [S, H]
    ctx_pos, blk_pos = torch.arange(a), torch.arange(a, a + S)
    for i in range(A.num_hidden_layers):
        p = f"layers.{i}."
        Wq, Wk, Wv, Wo = (W[p + f"self_attn.{n}_proj.weight"] for n in "qkvo")
        qn, kn = W[p + "self_attn.q_norm.weight"], W[p + "self_attn.k_norm.weight"]
        # Context rows: straight from the projection, no input_layernorm.
        k_ctx = _rope(_rms((c @ Wk.T).view(a, nkv, hd), kn, eps), ctx_pos, theta)
        v_ctx = (c @ Wv.T).view(a, nkv, hd)
        h = _rms(x, W[p + "input_layernorm.weight"], eps)
        q = _rope(_rms((h @ Wq.T).view(S, nh, hd), qn, eps), blk_pos, theta)
        k_blk = _rope(_rms((h @ Wk.T).view(S, nkv, hd), kn, eps), blk_pos, theta)
        v_blk = (h @ Wv.T).view(S, nkv, hd)
        k = torch.cat([k_ctx, k_blk]).repeat_interleave(nh // nkv, dim=1)  # GQA: head j reads kv head j // g
        v = torch.cat([v_ctx, v_blk]).repeat_interleave(nh // nkv, dim=1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), dim=-1)  # no mask at all
        x = x + torch.einsum("hqk,khd->qhd", att, v).reshape(S, nh * hd) @ Wo.T
        h2 = _rms(x, W[p + "post_attention_layernorm.weight"], eps)
        x = x + (F.silu(h2 @ W[p + "mlp.gate_proj.weight"].T) * (h2 @ W[p + "mlp.up_proj.weight"].T)) \
            @ W[p + "mlp.down_proj.weight"].T
    hidden = _rms(x, W["norm.weight"], eps)
    if cfg.layout == "dflash":
        hidden = hidden[1:]
    return hidden, hidden @ lm_head.T


@pytest.fixture(scope="module")
def hf_target(ck):
    import transformers
    return transformers.AutoModelForCausalLM.from_pretrained(ck.target, attn_implementation="eager").eval()


def hf_features(hf, tokens, layer_ids):
    """f_p = concat of the outputs of the given decoder layers (HF hidden_states[l + 1]), float64."""
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
    return torch.cat([out.hidden_states[l + 1][0] for l in layer_ids], dim=-1).double()


def engine_round(tgt, d, anchor, apos):
    """One greedy round of the real engine (`speculate.Engine.round`: draft, then verify); returns
    (drafts, accepted, next) from the round's packed record, read on the host."""
    B = anchor.shape[0]
    engine = speculate.Engine(tgt, d, batch_size=B, max_seq=tgt.max_seq)  # same size: the caches are kept
    packed, _, _ = engine.round(anchor, apos, torch.ones_like(anchor, dtype=torch.bool), None)
    assert packed.shape == (B, sum(engine.widths.values()))
    assert engine.widths["drafts"] == d.cfg.num_drafts
    rec = speculate.unpack(packed, engine.widths)
    return (torch.tensor([r.drafts for r in rec]), torch.tensor([r.accepted for r in rec]),
            torch.tensor([r.bonus for r in rec]))


REFERENCE_CASES = {
    "dspark_vanilla": dict(spelling="deepspec", markov="vanilla", oracle_scale=5.0, block_size=4, seed=21),
    "zlab_dflash": dict(spelling="zlab", markov=None, confidence=False, block_size=5, seed=22),
    # -1 = the embedding output; one draft layer; a shorter block.
    "dspark_embedding_layer": dict(spelling="deepspec", markov="vanilla", oracle_scale=5.0, block_size=3,
                                   num_layers=1, target_layer_ids=(-1, 1), seed=23),
}


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_cached_drafter_matches_reference(ck, hf_target, case):
    kw = REFERENCE_CASES[case]
    tgt = checkpoint.load_target(ck.target)  # private copy: its caches are resized here
    d = checkpoint.load_drafter(ck.drafter(f"ref_{case}", **kw), tgt)
    cfg = d.cfg
    embed, lm_head = tgt.embed_tokens.weight.double(), tgt.lm_head.weight.double()
    n_rounds, K = 12, cfg.num_drafts
    max_seq = max(map(len, PROMPTS)) + n_rounds * (K + 1) + cfg.block_size + 1
    tgt.setup_caches(len(PROMPTS), max_seq)
    d.setup_caches(len(PROMPTS), max_seq)
    accepted_seen = []
    with torch.inference_mode():
        anchor, apos = speculate.prefill(tgt, d, PROMPTS, 0.0, None, "cpu")
        committed = [list(p) + [int(t)] for p, t in zip(PROMPTS, anchor)]  # tokens at positions 0..a
        for rnd in range(n_rounds):
            hidden, base = d(anchor, apos)
            assert hidden.shape == (len(PROMPTS), K, H) and base.shape == (len(PROMPTS), K, V)
            refs = []
            for i in range(len(PROMPTS)):
                a = int(apos[i])
                assert len(committed[i]) == a + 1 and committed[i][a] == int(anchor[i])
                feats = hf_features(hf_target, committed[i][:a], cfg.target_layer_ids)
                ref_h, ref_u = reference_block(d, embed, lm_head, feats, committed[i][a], a)
                torch.testing.assert_close(hidden[i].double(), ref_h, atol=1e-4, rtol=0,
                                           msg=lambda m: f"round {rnd} row {i} hidden: {m}")
                torch.testing.assert_close(base[i].double(), ref_u, atol=1e-4, rtol=0,
                                           msg=lambda m: f"round {rnd} row {i} base logits: {m}")
                refs.append(ref_u)
            drafts, accepted, nxt = engine_round(tgt, d, anchor, apos)
            # The greedy chain (docs/algorithm.md, "Markov heads") from the reference's U (vanilla head: b_k = W2 W1[x_{k-1}]).
            for i in range(len(PROMPTS)):
                prev = int(anchor[i])
                for k in range(K):
                    z = refs[i][k].clone()
                    if cfg.markov_head_type == "vanilla":
                        mh = d.markov_head
                        z += mh.markov_w2.weight.double() @ mh.markov_w1.weight.double()[prev]
                    top2 = torch.topk(z, 2).values
                    if top2[0] - top2[1] > 1e-3:  # skip near-ties
                        assert int(drafts[i, k]) == int(torch.argmax(z)), f"round {rnd} row {i} slot {k}"
                    prev = int(drafts[i, k])
            for i in range(len(PROMPTS)):
                n = int(accepted[i])
                committed[i] += [int(t) for t in drafts[i, :n]] + [int(nxt[i])]
                accepted_seen.append(n)
            anchor, apos = nxt.clone(), (apos + accepted + 1).clone()
    assert len(accepted_seen) == n_rounds * len(PROMPTS)
    if cfg.layout == "dspark":
        assert max(accepted_seen) >= 2, accepted_seen
        assert min(accepted_seen) < K, "want rounds that reject too (rollback of stale rows)"


# ----------------------------------------------------------------------------------------
# 6. The resolved configuration is printed once at load

DESCRIBE_CASES = {
    "vanilla_conf_markov": (dict(spelling="specforge"), ["layout=dspark", "block_size=4", "drafts/round=4",
                                                         "markov=vanilla(r=48)", "confidence=on(+markov)",
                                                         "target_layer_ids=[0, 1]", "mask_token_id=47"]),
    "gated_conf_plain": (dict(markov="gated", confidence_with_markov=False, oracle=False, rank=8),
                         ["layout=dspark", "markov=gated(r=8)", "confidence=on "]),
    "no_heads": (dict(markov=None, confidence=False), ["layout=dspark", "markov=off", "confidence=off"]),
    "zlab": (dict(spelling="zlab", markov=None, confidence=False, block_size=5),
             ["layout=dflash", "block_size=5", "drafts/round=4", "markov=off", "confidence=off"]),
}


@pytest.mark.parametrize("case", list(DESCRIBE_CASES))
def test_resolved_config_printed_once(ck, capsys, case):
    kw, expected = DESCRIBE_CASES[case]
    d = ck.drafter(f"describe_{case}", **kw)
    rc, out = run_drafter_captured(capsys, ck, d, "--prompt-ids", "1,2,3", "--max-new-tokens", "6", "--num-samples",
                                   "3", prompts=False)
    assert rc == 0, out.err
    lines = [l for l in out.err.splitlines() if l.startswith("drafter:")]
    assert len(lines) == 1, out.err
    line = lines[0] + " "
    for e in expected:
        assert e in line, f"{e!r} not in {line!r}"


# ----------------------------------------------------------------------------------------
# A row that finishes first keeps running (inactive) rounds past its budget: the caches
# must leave room for them.

def test_batch_where_one_row_finishes_first(ck, capsys):
    d = ck.drafter("engine_bug", oracle_scale=5.0, seed=1)
    rng = random.Random(0)
    prompts = ck.base / "equal_len_prompts.jsonl"
    for _ in range(40):
        with open(prompts, "w") as f:
            for _ in range(2):
                f.write(json.dumps({"prompt_ids": [rng.randrange(V - 1) for _ in range(6)]}) + "\n")
        argv = ["--target", ck.target, "--drafter", d, "--prompts-file", str(prompts), "--batch-size", "2",
                "--max-new-tokens", str(rng.randrange(3, 20))]
        assert speculate.main(argv) == 0


# ----------------------------------------------------------------------------------------
# --calibration: STS temperatures divide the confidence logits, before the threshold.

def test_calibration_file_scales_confidence_logits(ck, capsys, tmp_path):
    d = ck.drafter("calibrated")
    base = tmp_path / "base.jsonl"
    # The temperatures act where a schedule reads the confidences: a threshold that admits everything.
    scheduled = ["--confidence-threshold", "1e-12"]
    rc, out = run_drafter_captured(capsys, ck, d, *scheduled, trace=base)
    assert rc == 0, out.err
    temps = [0.5, 1.0, 2.0, 4.0]
    cal = tmp_path / "sts.json"
    cal.write_text(json.dumps({"temperatures": temps}))
    scaled = tmp_path / "scaled.jsonl"
    rc, out = run_drafter_captured(capsys, ck, d, *scheduled, "--calibration", str(cal), trace=scaled)
    assert rc == 0, out.err
    r0, r1 = rounds_of(read_trace_untimed(base)), rounds_of(read_trace_untimed(scaled))
    # the summary names the file whose calibrated confidences the records hold
    assert read_trace_untimed(scaled)[-1]["calibration"] == str(cal)
    assert "calibration" not in read_trace_untimed(base)[-1]
    assert [r["draft"] for r in r0] == [r["draft"] for r in r1]  # greedy drafts do not depend on it
    for a, b in zip(r0, r1):
        for c, c_cal, t in zip(a["confidence"], b["confidence"], temps):
            logit = math.log(c / (1 - c))
            assert c_cal == pytest.approx(1 / (1 + math.exp(-logit / t)), rel=1e-4, abs=1e-6)
    for bad in ({"temperatures": [1.0, 2.0]}, {"temperatures": [1, 1, 0, 1]}, {"nothing": 1}, [1, 2]):
        cal.write_text(json.dumps(bad))
        rc, out = run_drafter_captured(capsys, ck, d, *scheduled, "--calibration", str(cal))
        assert rc != 0 and len(out.err.strip().splitlines()) == 1 and "sts.json" in out.err, out.err


def test_calibration_temperatures_move_with_the_drafter_and_are_not_saved():
    """The STS temperatures travel with .to() (a drafter moved after `calibrate` reads them on its own
    device) and stay out of the state dict (a checkpoint holds the head, not a run's calibration)."""
    from support.checkpoint import random_drafter, random_target

    target = random_target("qwen3-tiny", dtype=torch.float32)
    d = random_drafter(target, block_size=4, num_layers=1, rank=16)
    d.calibrate([0.5, 1.0, 2.0, 4.0])
    assert not any("temperature" in k for k in d.state_dict())
    d = d.to(torch.float64).to("meta")
    t = d.confidence_head.temperature
    assert t.device.type == "meta" and t.dtype == torch.float64


# ----------------------------------------------------------------------------------------
# What inference and training share: Markov head kinds, context K/V, confidence features.

def test_a_new_markov_head_is_one_class(ck, tmp_path, monkeypatch):
    """A head added to drafter.MARKOV_HEADS alone is loaded from a checkpoint that names it and decodes
    losslessly (docs/hacking.md): the checks, the chain, trees and training read the registry."""
    from torch import nn

    class ScaledMarkov(dm.VanillaMarkov):
        """b_k = σ(w · h_k) · W2 · W1[x_{k-1}]."""
        kind = "scaled"

        def __init__(self, H: int, V: int, r: int):
            super().__init__(H, V, r)
            self.scale_proj = nn.Linear(H, 1)

        def step(self, h, prev, state):
            bias, state = super().step(h, prev, state)
            return torch.sigmoid(self.scale_proj(h)) * bias, state

    monkeypatch.setitem(dm.MARKOV_HEADS, "scaled", ScaledMarkov)
    path = make_drafter(tmp_path / "scaled", ck.target, markov="scaled", oracle_scale=4.0, norm_scale=0.05)
    m = speculate.load(ck.target, path)
    assert m.drafter.markov_head.kind == "scaled"
    plain = speculate.load(ck.target)
    settings = dict(max_new_tokens=16, temperature=0.0)
    for tree_budget in (0, 6):
        got = speculate.generate(m, PROMPTS, tree_budget=tree_budget, **settings)
        want = speculate.generate(plain, PROMPTS, **settings)
        assert [c.output_ids for c in got] == [c.output_ids for c in want]


@pytest.mark.parametrize("markov", list(dm.MARKOV_HEADS))
def test_heads_shared_by_inference_and_training(ck, target, markov):
    """Each head says its kind (kernels test it, not the class name); commit_context caches exactly
    each layer's `Attention.kv` of the projected features; `confidence` is σ(confidence_logit / T),
    the logit training fits, with the Markov feature W1[prev] read by the same function."""
    d = checkpoint.load_drafter(ck.drafter(f"shared_{markov}", markov=markov, oracle=False, rank=8), target)
    assert d.markov_head.kind == markov == d.cfg.markov_head_type
    T = 5
    feats = torch.randn(1, T, 2 * H, generator=torch.Generator().manual_seed(0))
    d.setup_caches(1, 16)
    with torch.no_grad():
        d.commit_context(feats, torch.arange(T)[None])
        c = d.hidden_norm(d.fc(feats))
        for layer in d.layers:
            k, v = layer.self_attn.kv(c, model.Rope.at(d.rope[:T][None], c.dtype))
            cache = layer.self_attn.kv_cache
            assert torch.equal(cache.k[:, :T], k) and torch.equal(cache.v[:, :T], v)
        h, _ = d(torch.tensor([3]), torch.tensor([T]))
        prev = torch.tensor([[3, 1, 2, 4]])
        logit = d.confidence_logit(h, prev)
        assert logit.dtype == torch.float32 and logit.shape == (1, 4)
        features = torch.cat([h, d.markov_head.markov_w1(prev)], -1)  # [h ; W1[prev]]
        assert torch.equal(logit, d.confidence_head.proj(features).float()[..., 0])
        assert torch.equal(d.confidence(h, prev), torch.sigmoid(logit))
        d.calibrate([0.5, 1.0, 2.0, 4.0])
        assert torch.equal(d.confidence(h, prev), torch.sigmoid(logit / torch.tensor([0.5, 1.0, 2.0, 4.0])))
        assert torch.equal(train.head_outputs(d, h, prev)[1], logit)  # training reads the same logits, uncalibrated


@pytest.mark.parametrize("markov", list(dm.MARKOV_HEADS))
def test_each_markov_head_steps_on_rows(markov):
    """docs/hacking.md's contract, as the chain, the trees and training call a head: h [rows, H], prev [rows],
    the state one tensor [rows, ...] or None; each row its own, so a tree may reorder rows (a node takes its
    parent's) and get the same rows back, reordered."""
    torch.manual_seed(0)
    head = dm.MARKOV_HEADS[markov](H, V, 8).requires_grad_(False)
    rows = 5
    order = torch.tensor([3, 0, 4, 1, 2])
    state = None
    for _ in range(3):
        h = torch.randn(rows, H)
        prev = torch.randint(0, V, (rows,))
        reordered_state = None
        if state is not None:
            reordered_state = state[order]
        reordered_bias, reordered_next = head.step(h[order], prev[order], reordered_state)
        bias, state = head.step(h, prev, state)
        assert bias.shape == (rows, V) and torch.allclose(reordered_bias, bias[order], atol=1e-6)
        if state is not None:
            assert isinstance(state, torch.Tensor) and state.shape[0] == rows, type(state)
            assert torch.allclose(reordered_next, state[order], atol=1e-6)


def test_each_markov_head_steps_as_its_docstring_writes_it():
    """Each head's step against its formula written out with its weight matrices (vanilla: W2 W1[x]; gated:
    a sigmoid gate on W1[x] from [h ; W1[x]]; rnn: a state carried from step to step, zeros before the first)."""
    H, V, r = 6, 11, 4
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 3, H, generator=g)  # [B, steps, H]
    prev = torch.tensor([[1, 5, 9], [0, 10, 3]])
    heads = {}
    for kind, cls in dm.MARKOV_HEADS.items():
        torch.manual_seed(1)
        heads[kind] = cls(H, V, r)
    with torch.no_grad():
        vanilla = heads["vanilla"]
        W1, W2 = vanilla.markov_w1.weight, vanilla.markov_w2.weight
        for k in range(3):
            b, state = vanilla.step(h[:, k], prev[:, k], None)
            assert torch.allclose(b, W1[prev[:, k]] @ W2.T) and state is None

        gated = heads["gated"]
        W1, W2 = gated.markov_w1.weight, gated.markov_w2.weight
        Wg, bg = gated.gate_proj.weight, gated.gate_proj.bias
        for k in range(3):
            e = W1[prev[:, k]]
            gate = torch.sigmoid(torch.cat([h[:, k], e], -1) @ Wg.T + bg)
            b, _ = gated.step(h[:, k], prev[:, k], None)
            assert torch.allclose(b, (gate * e) @ W2.T, atol=1e-6)

        rnn = heads["rnn"]
        W1, W2 = rnn.markov_w1.weight, rnn.markov_w2.weight
        Wj, bj = rnn.joint_proj.weight, rnn.joint_proj.bias
        s = torch.zeros(2, r)
        state = None
        for k in range(3):
            e = W1[prev[:, k]]
            joint = torch.cat([s, e, h[:, k]], -1) @ Wj.T + bj
            gate, cand, out = joint[:, :r], joint[:, r:2 * r], joint[:, 2 * r:]
            want = torch.tanh(out) @ W2.T
            s = torch.sigmoid(gate) * s + (1 - torch.sigmoid(gate)) * torch.tanh(cand)
            b, state = rnn.step(h[:, k], prev[:, k], state)
            assert torch.allclose(b, want, atol=1e-6) and torch.allclose(state, s, atol=1e-6)


def test_a_new_markov_head_must_name_its_own_kind():
    """A new head subclassing VanillaMarkov without its own `kind` would inherit "vanilla", and kernels.py would
    run the vanilla Triton chain in place of its step: refused where the class is written."""
    with pytest.raises(TypeError, match="MLPMarkov: a Markov head names its own `kind`"):
        class MLPMarkov(dm.VanillaMarkov):
            def step(self, h, prev, state):
                return self.markov_w2(torch.relu(self.markov_w1(prev))), state

    class Named(dm.VanillaMarkov):
        kind = "mlp"
    assert Named.kind == "mlp"


# ----------------------------------------------------------------------------------------
# Eagle3 checkpoints (DeepSpec's Qwen3Eagle3Model): what loads, and one line for what does not

@pytest.fixture(scope="module")
def eagle3_target(tmp_path_factory):
    from drafters import make_target

    return make_target(tmp_path_factory.mktemp("eagle3_target") / "target", num_hidden_layers=4)


def test_an_eagle3_checkpoint_loads_as_deepspec_wrote_it(eagle3_target, tmp_path):
    from drafters import make_eagle3

    target = checkpoint.load_target(eagle3_target)
    d = checkpoint.load_drafter(make_eagle3(tmp_path / "e", eagle3_target, ttt_length=5), target)
    assert isinstance(d, dm.Eagle3Drafter) and d.cfg.layout == "eagle3" and d.cfg.num_drafts == 5
    assert d.cfg.target_layer_ids == (0, 1) and d.cfg.layers.num_hidden_layers == 1
    assert d.layers[0].self_attn.q_proj.weight.shape[1] == 2 * target.args.hidden_size  # [embedding; hidden]
    assert d.markov_head is None and d.confidence_head is None
    assert "layout=eagle3" in d.cfg.describe() and "drafts/round=5" in d.cfg.describe()


def test_an_engine_takes_back_an_eagle3_drafters_carried_state(eagle3_target, tmp_path):
    """Another engine of another size re-allocates the shared models' caches, the Eagle3 drafter's carried
    state among them; an engine used again takes all of its own back (its compiled graphs hold them) and
    decodes as before."""
    from drafters import make_eagle3

    target = checkpoint.load_target(eagle3_target)
    d = checkpoint.load_drafter(make_eagle3(tmp_path / "e", eagle3_target, ttt_length=4), target)
    prompts = [[5, 17, 33, 2, 8], [9, 1]]

    def run(engine):
        reqs = [speculate.Request(i, p) for i, p in enumerate(prompts)]
        engine.generate(reqs, 12)
        return [r.output_ids for r in reqs]

    with torch.inference_mode():
        first = speculate.Engine(target, d, batch_size=2, max_seq=64)
        expected = run(first)
        other = speculate.Engine(target, d, batch_size=3, max_seq=96)
        assert d.carried is other.held[1].carried and d.carried.shape[0] == 3
        got = run(first)
    assert got == expected
    assert speculate.caches(d).same(first.held[1])
    assert d.carried is first.held[1].carried and d.carried.shape[0] == 2


EAGLE3_BAD = {
    "no-ttt-length": (dict(drop_config=("ttt_length",)), "missing key 'ttt_length'"),
    "ttt-length-0": (dict(extra_config={"ttt_length": 0}), "'ttt_length' must be an integer from 1 to 256"),
    "two-layers": (dict(extra_config={"draft_num_hidden_layers": 2}), "an Eagle3 drafter has one layer"),
    "layers-true": (dict(extra_config={"draft_num_hidden_layers": True}), "an Eagle3 drafter has one layer"),
    "ids-unsorted": (dict(extra_config={"target_layer_ids": [1, 0]}), "must be strictly increasing"),
    "last-layer": (dict(target_layer_ids=(0, 3)), "layer id 3 is the target's last layer"),
    "other-target": (dict(extra_config={"num_target_layers": 36}), "it was built for another target"),
    "fc-width": (dict(extra_config={"target_layer_ids": [0, 1, 2]}), "'fc.weight' has shape"),
    "missing-tensor": (dict(drop=("layers.0.hidden_norm.weight",)), "'layers.0.hidden_norm.weight' is missing"),
    "extra-tensor": (dict(extra_tensors={"layers.0.gate.weight": torch.zeros(2)}), "'layers.0.gate.weight' in the "
                                                                                    "checkpoint matches no parameter"),
    "other-embedding": (dict(extra_tensors={"embed_tokens.weight": torch.zeros(48, 32)}), "differs from the target's"),
    # EAGLE-3's own layout (its int64 d2t map was refused as "not a floating-point weight")
    "draft-vocab": (dict(extra_config={"draft_vocab_size": 16},
                         extra_tensors={"d2t": torch.zeros(16, dtype=torch.long)}),
                    "'draft_vocab_size' 16: a reduced draft vocabulary (EAGLE-3's d2t/t2d maps) is not implemented"),
    # ... and its maps beside a config that leaves draft_vocab_size at the target's
    "vocab-maps": (dict(extra_tensors={"d2t": torch.zeros(64, dtype=torch.long)}),
                   "tensor 'd2t' is int64, an EAGLE-3 draft vocabulary map, not implemented"),
}


@pytest.mark.parametrize("case", list(EAGLE3_BAD))
def test_a_bad_eagle3_checkpoint_is_one_line(eagle3_target, tmp_path, case):
    from drafters import make_eagle3

    options, needle = EAGLE3_BAD[case]
    config = options.pop("drop_config", ())
    path = make_eagle3(tmp_path / "e", eagle3_target, **options)
    if config:
        cfg = json.loads((tmp_path / "e" / "config.json").read_text())
        for key in config:
            del cfg[key]
        (tmp_path / "e" / "config.json").write_text(json.dumps(cfg))
    target = checkpoint.load_target(eagle3_target)
    with pytest.raises(checkpoint.UserError) as e:
        checkpoint.load_drafter(path, target)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
