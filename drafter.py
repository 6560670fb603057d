"""The DSpark / DFlash block drafter (docs/algorithm.md: the drafter, Markov heads, confidence head, checkpoints).

What is notable here:
- `resolve_config` reads every checkpoint spelling of §7 — top-level keys, nested
  `dspark_config` / `dflash_config`, `dspark_<key>`, `use_confidence_head` ==
  `enable_confidence_head` — and lets the weights settle what the config leaves open (Markov
  rank, whether the confidence head reads the Markov feature, whether the file carries its
  own embedding). Where config and weights disagree it stops and says so: a head that
  silently disappears is the failure engines hit most.
- The context rows (projected target features) get their per-layer K/V computed once, when
  committed, into a static cache. The block's own K/V are written into the same cache at
  the block positions a..a+slots-1, which are never context rows yet, so one masked
  attention over the cache covers `[context ; block]` without concatenation.
- Two slot layouts: DSpark "shift label" (K slots, K drafts: slot k-1 predicts a+k) and
  z-lab DFlash (B slots, B-1 drafts: slot j >= 1 predicts a+j, slot 0 unused).
- Training shares the layers and heads: `train_forward` packs many blocks of a sequence under
  `block_mask`, reading context rows as prepended K/V built by the same `context_kv` that fills
  the cache; `head_outputs` teacher-forces the Markov heads' own `step()`; the confidence
  features come from `confidence_logit` in both.
- The embedding and lm_head are always the target's (one copy in memory); a copy in the
  drafter file is checked to be identical and then dropped.
- Loading fuses the layers' projections as the target's (`Drafter.fuse_`, model.py); training
  builds an unfused drafter, whose gradients reach the published parameters.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn as nn

from common import UserError, read_json, save_tensors, write_json
from cpu_kernels import Dense, column_major_, packs_pay
from model import (LIMITS, DecoderLayer, KVCache, ModelArgs, RMSNorm, Rope, Transformer, _read_layer_shape,
                   assign_strict, attended_length, cache_bias, fold_gqa, read_safetensors, rope_tables,
                   safetensors_files)

MARKOV_TYPES = ("vanilla", "gated", "rnn")
MAX_BLOCK = 256  # slots per block: published drafters use 7 (DSpark) and 16 (DFlash)


@dataclass
class DrafterConfig:
    layers: ModelArgs  # shape of the drafter's decoder layers (num_hidden_layers = drafter depth)
    block_size: int  # K for the DSpark layout, B for the DFlash layout
    target_layer_ids: tuple[int, ...]  # target layers whose outputs form the context feature
    mask_token_id: int  # fills the block slots after the anchor
    layout: str  # "dspark" (shift label: K slots, K drafts) or "dflash" (B slots, B-1 drafts)
    markov_head_type: Optional[str]  # None, "vanilla", "gated" or "rnn"
    markov_rank: int  # r; 0 without a Markov head
    confidence_head: bool  # predicts P(x_k accepted | earlier accepted)
    confidence_with_markov: bool  # the confidence head also reads W1[x_{k-1}]
    num_target_layers: Optional[int] = None  # the target's depth it was built for, when its config says

    @property
    def num_slots(self) -> int:
        return self.block_size

    @property
    def num_drafts(self) -> int:
        return self.block_size if self.layout == "dspark" else self.block_size - 1

    def describe(self) -> str:
        heads = f"markov={self.markov_head_type or 'off'}" + (f"(r={self.markov_rank})" if self.markov_head_type else "")
        conf = "off" if not self.confidence_head else ("on(+markov)" if self.confidence_with_markov else "on")
        return (f"drafter: layout={self.layout} block_size={self.block_size} drafts/round={self.num_drafts} "
                f"layers={self.layers.num_hidden_layers} target_layer_ids={list(self.target_layer_ids)} "
                f"mask_token_id={self.mask_token_id} {heads} confidence={conf}")


# ----------------------------------------------------------------------------------------
# Config resolution (docs/algorithm.md, "Checkpoints")

# Weight spellings of the heads, mapped to this module's parameter names.
_RENAMES = {
    "markov_w1.weight": "markov_head.markov_w1.weight",
    "markov_w2.weight": "markov_head.markov_w2.weight",
    "confidence_proj.weight": "confidence_head.proj.weight",
    "confidence_proj.bias": "confidence_head.proj.bias",
}


def _lookup(cfg: dict, key: str, source: str, aliases: tuple[str, ...] = ()):
    """The value of `key` wherever a spelling puts it; conflicting values are an error."""
    for nested in ("dspark_config", "dflash_config"):
        if nested in cfg and not isinstance(cfg[nested], dict):
            raise UserError(f"{source}: {nested!r} must be an object, got {cfg[nested]!r}")
    found = {}
    for name in (key, *aliases):
        for where, d, k in (("dspark_config", cfg.get("dspark_config"), name),
                            ("dflash_config", cfg.get("dflash_config"), name),
                            ("top-level", cfg, f"dspark_{name}"),
                            ("top-level", cfg, name)):
            if isinstance(d, dict) and k in d:
                found[f"{where} {k!r}"] = d[k]
    values = list(found.values())
    if any(type(v) is not type(values[0]) or v != values[0] for v in values[1:]):  # 4 and 4.0 disagree
        raise UserError(f"{source}: conflicting values for {key!r}: " +
                              ", ".join(f"{w}={v!r}" for w, v in found.items()))
    return values[0] if values else None


def _check_bool(v, key, source):
    if v is not None and not isinstance(v, bool):
        raise UserError(f"{source}: key {key!r} must be true or false, got {v!r}")
    return v


def resolve_config(cfg: dict, tensors: dict, source: str, weights_source: str,
                   spelled: Optional[dict] = None) -> DrafterConfig:
    """Resolve the drafter config from `config.json` (parsed) and the weights' names and shapes.

    `tensors` maps (already renamed) weight names to tensors; only names and shapes are read.
    `spelled` maps those names back to the file's own, for messages.
    """
    spelled = spelled or {}
    if not isinstance(cfg, dict):
        raise UserError(f"{source}: expected a JSON object")
    archs = cfg.get("architectures")
    if not isinstance(archs, list):
        raise UserError(f"{source}: 'architectures' must be a list naming the drafter (e.g. [\"Qwen3DSparkModel\"]), "
                        f"got {archs!r}")
    arch = archs[0] if len(archs) == 1 else None
    if arch not in ("Qwen3DSparkModel", "DFlashDraftModel"):
        raise UserError(f"{source}: architectures {archs!r} is not a known drafter "
                              "(Qwen3DSparkModel or DFlashDraftModel)")
    layers = ModelArgs(**_read_layer_shape(cfg, source))

    block_size = _lookup(cfg, "block_size", source)
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 1 <= block_size <= MAX_BLOCK:
        raise UserError(f"{source}: 'block_size' must be an integer from 1 to {MAX_BLOCK}, got {block_size!r}")
    target_layer_ids = _lookup(cfg, "target_layer_ids", source)
    if not isinstance(target_layer_ids, list) or not target_layer_ids or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in target_layer_ids):
        raise UserError(f"{source}: 'target_layer_ids' must be a non-empty list of layer ids, got {target_layer_ids!r}")
    if len(set(target_layer_ids)) != len(target_layer_ids):
        raise UserError(f"{source}: 'target_layer_ids' {target_layer_ids} names a layer twice")
    mask_token_id = _lookup(cfg, "mask_token_id", source)
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, int) or not 0 <= mask_token_id < layers.vocab_size:
        raise UserError(f"{source}: 'mask_token_id' must be an id below vocab_size {layers.vocab_size}, got {mask_token_id!r}")
    num_target_layers = _lookup(cfg, "num_target_layers", source)
    if num_target_layers is not None and (isinstance(num_target_layers, bool) or not isinstance(num_target_layers, int)
                                          or not 1 <= num_target_layers <= LIMITS["num_hidden_layers"][1]):
        raise UserError(f"{source}: 'num_target_layers' must be a layer count, got {num_target_layers!r}")

    # Layout: DeepSpec's Qwen3DSparkModel is always "shift label"; a z-lab DFlashDraftModel is
    # the DFlash layout unless its dflash_config says it is a DSpark export.
    shift_label = _check_bool(_lookup(cfg, "shift_label", source), "shift_label", source)
    projector = _lookup(cfg, "projector_type", source)
    if projector not in (None, "dspark", "dflash"):
        raise UserError(f"{source}: unknown projector_type {projector!r}")
    if arch == "Qwen3DSparkModel":
        layout = "dspark"
        if shift_label is False:
            raise UserError(f"{source}: shift_label=false contradicts architecture Qwen3DSparkModel")
        if projector == "dflash":
            raise UserError(f"{source}: projector_type 'dflash' contradicts architecture Qwen3DSparkModel (the DSpark layout)")
    elif projector == "dspark" and shift_label is False:
        raise UserError(f"{source}: shift_label=false contradicts projector_type 'dspark' (the DSpark layout)")
    elif projector == "dflash" and shift_label:
        raise UserError(f"{source}: shift_label=true contradicts projector_type 'dflash' (the DFlash layout)")
    else:
        layout = "dspark" if (shift_label or projector == "dspark") else "dflash"
    if layout == "dflash" and block_size < 2:
        raise UserError(f"{source}: the DFlash layout needs block_size >= 2, got {block_size}")

    # Markov head: declared by markov_head_type; its weights must be exactly that type's.
    mtype = _lookup(cfg, "markov_head_type", source)
    if mtype in ("none", "None", ""):
        mtype = None
    if mtype is not None and mtype not in MARKOV_TYPES:
        raise UserError(f"{source}: unknown markov_head_type {mtype!r} (known: {', '.join(MARKOV_TYPES)})")
    has_markov = any(k.startswith("markov_head.") for k in tensors)
    if mtype is not None and "markov_head.markov_w1.weight" not in tensors:
        raise UserError(f"{weights_source}: markov_head_type is {mtype!r} but the weights have no "
                              "markov_w1 (markov_head.markov_w1.weight or markov_w1.weight)")
    if mtype is None and has_markov:
        first = sorted(k for k in tensors if k.startswith("markov_head."))[0]
        raise UserError(f"{weights_source}: tensor {spelled.get(first, first)!r} belongs to a Markov head, but "
                              f"{source} declares none (markov_head_type)")
    rank = 0
    if mtype is None:  # a rank with no head: the head the config describes is not there, say so
        declared = _lookup(cfg, "markov_rank", source)
        if isinstance(declared, bool) or declared not in (None, 0):
            raise UserError(f"{source}: markov_rank is {declared!r} but markov_head_type declares no Markov head "
                            f"(and the weights have none)")
    else:
        w1 = tensors["markov_head.markov_w1.weight"]
        if w1.ndim != 2 or w1.shape[1] < 1:
            raise UserError(f"{weights_source}: tensor {spelled.get('markov_head.markov_w1.weight', 'markov_w1')!r} "
                            f"has shape {list(w1.shape)}, the Markov head expects [vocab_size, rank >= 1]")
        rank = w1.shape[1]
        declared = _lookup(cfg, "markov_rank", source)
        if declared is not None and (isinstance(declared, bool) or not isinstance(declared, int) or declared != rank):
            raise UserError(f"{source}: markov_rank is {declared!r} but markov_w1 has rank {rank}")

    # The width the heads' shapes are read against (before they are: a wrong hidden_size is named as such).
    norm = tensors.get("norm.weight")
    if norm is not None and list(norm.shape) != [layers.hidden_size]:
        raise UserError(f"{source}: hidden_size is {layers.hidden_size} but tensor "
                        f"{spelled.get('norm.weight', 'norm.weight')!r} has shape {list(norm.shape)}")

    # Confidence head.
    conf = _check_bool(_lookup(cfg, "enable_confidence_head", source, aliases=("use_confidence_head",)),
                       "enable_confidence_head", source)
    has_conf = "confidence_head.proj.weight" in tensors
    declared_with_markov = _check_bool(_lookup(cfg, "confidence_head_with_markov", source),
                                       "confidence_head_with_markov", source)
    if conf and not has_conf:
        raise UserError(f"{weights_source}: the confidence head is enabled in {source} but the weights "
                              "have no confidence_head.proj.weight (or confidence_proj.weight)")
    if has_conf and not conf:
        name = spelled.get("confidence_head.proj.weight", "confidence_head.proj.weight")
        raise UserError(f"{weights_source}: tensor {name!r} belongs to a confidence "
                              f"head, but {source} does not enable one (enable_confidence_head / use_confidence_head)")
    with_markov = False
    if conf:
        proj = tensors["confidence_head.proj.weight"]
        if proj.ndim != 2:
            name = spelled.get("confidence_head.proj.weight", "confidence_head.proj.weight")
            raise UserError(f"{weights_source}: tensor {name!r} has shape {list(proj.shape)}, the confidence head "
                            f"expects [1, features]")
        width = proj.shape[-1]
        by_weights = width == layers.hidden_size + rank and rank > 0
        if declared_with_markov and mtype is None:
            raise UserError(f"{source}: confidence_head_with_markov is true but there is no Markov head")
        if declared_with_markov is not None and declared_with_markov != by_weights:
            raise UserError(f"{source}: confidence_head_with_markov is {declared_with_markov} but confidence_head.proj "
                                  f"reads {width} features (hidden {layers.hidden_size}, markov rank {rank})")
        with_markov = by_weights
    if layout == "dflash" and (mtype or conf):
        raise UserError(f"{source}: the z-lab DFlash layout has no Markov or confidence head")

    return DrafterConfig(layers=layers, block_size=block_size, target_layer_ids=tuple(target_layer_ids),
                         mask_token_id=mask_token_id, layout=layout, markov_head_type=mtype, markov_rank=rank,
                         confidence_head=bool(conf), confidence_with_markov=with_markov,
                         num_target_layers=num_target_layers)


# ----------------------------------------------------------------------------------------
# Heads

class VanillaMarkov(nn.Module):
    """b_k = W2 · W1[x_{k-1}].

    A new head subclasses this one (keeping `markov_w1`, which the loader reads the rank from and the
    confidence head reads W1[x] from), names its own `kind`, and is listed in MARKOV_HEADS and
    MARKOV_TYPES (and train.py's --markov). `kind` is what code that treats one head type specially
    tests (kernels.py runs its Triton chain for "vanilla" only), so a subclass must set its own."""
    kind = "vanilla"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kind" not in vars(cls):  # an inherited "vanilla" would send the new head to the vanilla kernel
            raise TypeError(f"{cls.__name__}: a Markov head names its own `kind` (it would inherit "
                            f"{cls.kind!r} and run as that head where one kind is treated specially)")

    def __init__(self, H: int, V: int, r: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(V, r)
        self.markov_w2 = Dense(r, V, bias=False)

    def step(self, h, prev, state):
        return self.markov_w2(self.markov_w1(prev)), state


class GatedMarkov(VanillaMarkov):
    """g = σ(W_g [h_k ; W1[x_{k-1}]] + b_g); b_k = W2 · (g ⊙ W1[x_{k-1}])."""
    kind = "gated"

    def __init__(self, H: int, V: int, r: int):
        super().__init__(H, V, r)
        self.gate_proj = nn.Linear(H + r, r)

    def step(self, h, prev, state):
        e = self.markov_w1(prev)
        g = torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1)))
        return self.markov_w2(g * e), state


class RNNMarkov(VanillaMarkov):
    """A gated recurrent state over the chain: joint_proj([s ; W1[x] ; h]) -> gate, candidate, output."""
    kind = "rnn"

    def __init__(self, H: int, V: int, r: int):
        super().__init__(H, V, r)
        self.joint_proj = nn.Linear(2 * r + H, 3 * r)

    def step(self, h, prev, state):
        e = self.markov_w1(prev)
        if state is None:
            state = torch.zeros_like(e)  # s_0 = 0
        gate, cand, out = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state


MARKOV_HEADS = {"vanilla": VanillaMarkov, "gated": GatedMarkov, "rnn": RNNMarkov}


class ConfidenceHead(nn.Module):
    """c_k = σ(w · [h_k ; W1[x_{k-1}]] + b), the Markov feature only when the checkpoint has it
    (`Drafter.confidence_logit` builds the features, for inference and training alike)."""

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)
        self.temperature: Optional[torch.Tensor] = None  # [K], Sequential Temperature Scaling (docs/algorithm.md)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """The logit w · features + b, float32 [..., K]; `Drafter.confidence` applies the temperature."""
        return self.proj(features).float()[..., 0]


def block_mask(anchors: torch.Tensor, seq_len: int, K: int, doc: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The packed training mask [B, N*K, seq_len + N*K] (True = may attend).

    Query rows are the N blocks' K slots (block i = rows i*K .. i*K+K-1, anchor anchors[:, i]).
    Key columns are the context rows 0..seq_len-1, then the same N*K block rows. A block row sees
    context row p iff p < its anchor (and, for packed documents doc [B, seq_len], p is in the
    anchor's document), and every row of its own block (bidirectional), nothing else: what the
    inference mask over the cache lets one block see.
    """
    B, N = anchors.shape
    dev = anchors.device
    block_of = torch.arange(N * K, device=dev) // K  # [N*K]
    anchor_of = anchors[:, block_of]  # [B, N*K]
    context = torch.arange(seq_len, device=dev)[None, None, :] < anchor_of[:, :, None]  # [B, N*K, T]
    if doc is not None:
        context = context & (doc[:, None, :] == doc.gather(1, anchor_of)[:, :, None])
    own = (block_of[:, None] == block_of[None, :]).expand(B, N * K, N * K)
    return torch.cat([context, own], dim=-1)


def context_kv(attention, c: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's K/V of context rows c [B, T, H] (projected target features) at their `rope`:
    k = RoPE(k_norm(k_proj c)), v = v_proj c, each [B, T, kv_heads, hd]. Context rows enter attention
    straight from the projection — no input_layernorm, no MLP — in the cache and in training alike."""
    return attention.kv(c, rope)


# ----------------------------------------------------------------------------------------
# The drafter

class Drafter(nn.Module):
    """Parameter names follow DeepSpec's checkpoint layout; embedding and lm_head are the target's."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        a = cfg.layers
        n = len(cfg.target_layer_ids)
        self.fc = Dense(n * a.hidden_size, a.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.markov_head = (MARKOV_HEADS[cfg.markov_head_type](a.hidden_size, a.vocab_size, cfg.markov_rank)
                            if cfg.markov_head_type else None)
        self.confidence_head = (ConfidenceHead(a.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0))
                                if cfg.confidence_head else None)
        # Shared with the target at `attach`; kept out of this module's parameters.
        self._target = [None]

    @property
    def target(self) -> Transformer:
        return self._target[0]

    def attach(self, target: Transformer):
        """Use the target's embedding and lm_head, and check that the two models fit."""
        t, a = target.args, self.cfg.layers
        if a.vocab_size != t.vocab_size:
            raise UserError(f"drafter vocab_size {a.vocab_size} differs from the target's {t.vocab_size}")
        if a.hidden_size != t.hidden_size:
            raise UserError(f"drafter hidden_size {a.hidden_size} differs from the target's {t.hidden_size}")
        if self.cfg.num_target_layers is not None and self.cfg.num_target_layers != t.num_hidden_layers:
            raise UserError(f"drafter num_target_layers {self.cfg.num_target_layers} differs from the target's "
                            f"num_hidden_layers {t.num_hidden_layers}: it was built for another target")
        target.check_capture(self.cfg.target_layer_ids, "drafter target_layer_ids")
        self._target[0] = target

    def fuse_(self, gate_up: Optional[bool] = None, pack: Optional[bool] = None) -> "Drafter":
        """Fused (and packed) projection weights for inference, as `Transformer.fuse_` (the same decoder
        layers; the context projection and the Markov head's output too)."""
        pack = packs_pay(self) if pack is None else pack
        for layer in self.layers:
            layer.fuse_(gate_up, pack)
        column_major_(self)
        if pack:
            for lin in (self.fc, getattr(self.markov_head, "markov_w2", None)):
                if lin is not None:
                    lin.pack_()
        return self

    def setup_caches(self, max_batch: int, max_seq: int):
        """As Transformer.setup_caches: static context caches and RoPE, kept when the size is unchanged."""
        w = self.fc.weight
        if KVCache.kept(self.layers, max_batch, max_seq, w):
            return
        for layer in self.layers:
            at = layer.self_attn
            at.kv_cache = KVCache(max_batch, max_seq, at.n_kv, at.head_dim, w.dtype, w.device)
        a = self.cfg.layers
        self.register_buffer("rope", rope_tables(a.head_dim, a.rope_theta, max_seq, w.device), persistent=False)

    def commit_context(self, features: torch.Tensor, positions: torch.Tensor, rows: Optional[torch.Tensor] = None):
        """Project captured target features ([B, T, n*H]) and cache every layer's context K/V at
        positions [B, T], in cache rows 0..B-1 or `rows` [B]."""
        c = self.hidden_norm(self.fc(features))  # [B, T, H]
        rope = Rope.at(self.rope[positions], c.dtype)
        for layer in self.layers:
            layer.self_attn.kv_cache.write(positions, *context_kv(layer.self_attn, c, rope), rows)

    def forward(self, anchor: torch.Tensor, anchor_pos: torch.Tensor):
        """The block forward: anchor [B] at positions anchor_pos [B], context rows < anchor_pos.

        Returns the final-normed hidden states of the drafting slots [B, K, H] and their
        base logits U [B, K, V] (K = num_drafts).
        """
        cfg = self.cfg
        S = cfg.num_slots
        B = anchor.shape[0]
        tokens = torch.full((B, S), cfg.mask_token_id, dtype=torch.long, device=anchor.device)
        tokens[:, 0] = anchor
        positions = anchor_pos[:, None] + torch.arange(S, device=anchor.device)  # [B, S]
        x = self.target.embed_tokens(tokens)
        rope = Rope.at(self.rope[positions], x.dtype)
        # Non-causal: every block row sees all context rows (< a) and all block rows (a .. a+S-1). RoPE
        # and the mask are made once for every layer, the cache read up to the longest row's block end.
        a = self.cfg.layers
        end = anchor_pos + S
        L = attended_length(end, self.layers[0].self_attn.kv_cache.k.shape[1])
        g = a.num_attention_heads // a.num_key_value_heads if fold_gqa(anchor.device) else 1
        mask = cache_bias((torch.arange(L, device=anchor.device) < end[:, None])[:, None, :].expand(B, S, L), g,
                          x.dtype)  # [B, 1, g*S or S, L]
        for layer in self.layers:  # the block's K/V go into the cache at a..a+S-1, beside the context's
            x = layer(x, rope, positions, mask)
        h = self.norm(x)
        if cfg.layout == "dflash":
            h = h[:, 1:]  # slot 0 (the anchor's) is unused in the DFlash layout
        return h, self.target.lm_head(h)

    def train_forward(self, features: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                      doc: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The packed training forward (DSpark layout): features [B, T, n*H] (the target's capture of
        tokens [B, T]), anchors [B, N], doc [B, T] the document of each token of packed rows (or None).
        Returns the final-normed hidden states [B, N, K, H] of every block.

        Block i is [x_a, m, .., m] at positions a..a+K-1 (a = anchors[:, i]); all N blocks run as one
        [B, N*K] batch whose attention reads the whole sequence's context rows as prepended K/V under
        `block_mask`, so each block sees what `forward` sees after `commit_context` of rows < a (of its
        own document).
        """
        cfg, a = self.cfg, self.cfg.layers
        K = cfg.num_slots
        B, T = tokens.shape
        N = anchors.shape[1]
        dev = tokens.device
        table = rope_tables(a.head_dim, a.rope_theta, T + K, dev)
        dtype = self.fc.weight.dtype
        rope_ctx = Rope.at(table[:T][None].expand(B, T, 2, a.head_dim), dtype)  # context rows at 0..T-1
        block_pos = (anchors[:, :, None] + torch.arange(K, device=dev)).view(B, N * K)  # slots at a..a+K-1
        rope_blk = Rope.at(table[block_pos], dtype)  # [B, N*K, 1, hd]
        block_tokens = torch.full((B, N, K), cfg.mask_token_id, dtype=torch.long, device=dev)
        block_tokens[:, :, 0] = tokens.gather(1, anchors)  # [x_a, m, .., m]
        x = self.target.embed_tokens(block_tokens.view(B, N * K))
        c = self.hidden_norm(self.fc(features))  # [B, T, H]
        mask = block_mask(anchors, T, K, doc)
        for layer in self.layers:
            x = layer(x, rope_blk, mask=mask, prefix_kv=context_kv(layer.self_attn, c, rope_ctx))
        return self.norm(x).view(B, N, K, -1)

    def head_outputs(self, h: torch.Tensor, prev: torch.Tensor):
        """Training: draft logits z = U + b with the Markov chain teacher-forced, and the confidence logits.

        h [..., K, H]; prev [..., K] = [x_a, labels[:-1]]. Returns (z [..., K, V], confidence logits
        [..., K] float32 or None). The chain runs through the head's own `step()`, slot by slot, as
        kernels.markov_chain runs it at inference.
        """
        U = self.target.lm_head(h)
        head = self.markov_head
        if head is not None:
            biases, state = [], None
            for j in range(h.shape[-2]):
                b, state = head.step(h[..., j, :], prev[..., j], state)
                biases.append(b)
            U = U + torch.stack(biases, dim=-2)
        return U, self.confidence_logit(h, prev)

    def calibrate(self, temperatures):
        """Divide the confidence logit of draft k by temperatures[k] from now on."""
        self.confidence_head.temperature = torch.tensor(temperatures, dtype=torch.float32, device=self.fc.weight.device)

    def confidence_logit(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """w · [h_k ; W1[x_{k-1}]] + b (or w · h_k + b) for every slot, float32 [..., K], before any
        temperature: hidden [..., K, H], prev_tokens [..., K] = [x_0, x_1 .. x_{K-1}]. None without a head.
        Training fits these logits; inference reads `confidence`."""
        if self.confidence_head is None:
            return None
        x = (torch.cat([hidden, self.markov_head.markov_w1(prev_tokens)], dim=-1) if self.cfg.confidence_with_markov
             else hidden)
        return self.confidence_head(x)

    def confidence(self, hidden: torch.Tensor, prev_tokens: torch.Tensor) -> Optional[torch.Tensor]:
        """c_k = σ(logit / T_k) for every slot [B, K] (T: the STS temperatures of `calibrate`, if any).
        None without a head."""
        logit = self.confidence_logit(hidden, prev_tokens)
        if logit is None:
            return None
        t = self.confidence_head.temperature
        return torch.sigmoid(logit if t is None else logit / t)


def random_drafter(target: Transformer, block_size: int = 7, num_layers: int = 5, markov: Optional[str] = "vanilla",
                   rank: int = 256, confidence: bool = True, seed: int = 1) -> Drafter:
    """A DSpark drafter shaped like the published ones (block 7, 5 layers, r=256) with random
    weights, attached to `target` and on its device and dtype."""
    from model import init_random_

    t = target.args
    L = t.num_hidden_layers
    ids = tuple(sorted({1 + (L - 4) * i // 4 for i in range(5)}))  # 1, 9, 17, 25, 33 at 36 layers, as published
    layers = ModelArgs(**{f.name: getattr(t, f.name) for f in fields(ModelArgs)})
    layers.num_hidden_layers = num_layers
    cfg = DrafterConfig(layers=layers, block_size=block_size, target_layer_ids=ids, mask_token_id=t.vocab_size - 1,
                        layout="dspark", markov_head_type=markov, markov_rank=rank if markov else 0,
                        confidence_head=confidence, confidence_with_markov=confidence and markov is not None)
    w = target.embed_tokens.weight
    with torch.device("meta"):
        drafter = Drafter(cfg)
    drafter = init_random_(drafter.to(w.dtype).to_empty(device=w.device), seed)
    drafter.attach(target)
    return drafter.eval().requires_grad_(False).fuse_()


def load_drafter(directory: str, target: Transformer, device="cpu", dtype=torch.float32) -> Drafter:
    """Load any drafter spelling (docs/algorithm.md, "Checkpoints") and attach it to `target`."""
    if not os.path.isdir(directory):
        raise UserError(f"{directory}: drafter directory not found")
    cfg_path = os.path.join(directory, "config.json")
    raw = read_json(cfg_path)
    files = safetensors_files(directory)
    source = files[0] if len(files) == 1 else os.path.join(directory, "model.safetensors.index.json")
    spelled = {}

    def rename(key):
        name = _RENAMES.get(key.removeprefix("model."), key.removeprefix("model."))
        spelled[name] = key
        return name

    tensors = read_safetensors(files, dtype, device, rename=rename)
    cfg = resolve_config(raw, tensors, cfg_path, source, spelled)
    # The target's embedding and lm_head are used; a copy in the file must be identical.
    for name, param in (("embed_tokens.weight", target.embed_tokens.weight), ("lm_head.weight", target.lm_head.weight)):
        if name in tensors:
            t = tensors.pop(name)
            if t.shape != param.shape or not torch.equal(t.to(param.device, param.dtype), param):
                raise UserError(f"{source}: drafter tensor {name!r} differs from the target's; "
                                      "drafters share the target's embedding and lm_head")
    with torch.device("meta"):
        drafter = Drafter(cfg)
    assign_strict(drafter, tensors, source)
    tensors.clear()
    drafter.attach(target)
    return drafter.eval().requires_grad_(False).fuse_()


# ----------------------------------------------------------------------------------------
# Writing a checkpoint in DeepSpec's layout (train.py)

def _raw_tensor(directory: str, names: tuple) -> Optional[torch.Tensor]:
    """The first of `names` in a checkpoint directory's files, in the file's own dtype."""
    from safetensors import safe_open

    for path in safetensors_files(directory):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in names:
                if name in f.keys():
                    return f.get_tensor(name)
    return None


def drafter_config_json(target_dir: str, cfg: DrafterConfig, num_anchors: int) -> dict:
    """DeepSpec's drafter config.json: the target's config with the drafter's depth and keys."""
    tcfg = read_json(os.path.join(target_dir, "config.json"))
    out = {k: v for k, v in tcfg.items() if k not in ("architectures", "auto_map", "dtype", "torch_dtype")}
    D = cfg.layers.num_hidden_layers
    out.update(architectures=["Qwen3DSparkModel"], num_target_layers=tcfg["num_hidden_layers"], num_hidden_layers=D,
               layer_types=["full_attention"] * D, tie_word_embeddings=False, torch_dtype="float32",
               block_size=cfg.block_size, target_layer_ids=list(cfg.target_layer_ids), mask_token_id=cfg.mask_token_id,
               num_anchors=num_anchors, markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
               enable_confidence_head=cfg.confidence_head,
               confidence_head_with_markov=cfg.confidence_with_markov)
    return out


def save_drafter(out: str, drafter: Drafter, target_dir: str, num_anchors: int, step: Optional[int] = None):
    """config.json + model.safetensors in DeepSpec's layout, with copies of the target's embedding and lm_head
    (in the target file's dtype, so `load_drafter`'s equality check holds at any load dtype)."""
    os.makedirs(out, exist_ok=True)
    tensors = {k: v.float() for k, v in drafter.state_dict().items()}
    emb = _raw_tensor(target_dir, ("model.embed_tokens.weight", "embed_tokens.weight"))
    head = _raw_tensor(target_dir, ("lm_head.weight", "model.lm_head.weight"))
    tensors["embed_tokens.weight"] = emb
    tensors["lm_head.weight"] = head if head is not None else emb.clone()  # tied target
    save_tensors(os.path.join(out, "model.safetensors"), tensors, step=step)
    write_json(os.path.join(out, "config.json"), drafter_config_json(target_dir, drafter.cfg, num_anchors))


def load_drafter_weights(drafter: Drafter, directory: str, target_dir: str, num_anchors: int):
    """train.py --resume: a drafter's float32 weights from a previous run's model.safetensors (the same config)."""
    cfg_path = os.path.join(directory, "config.json")
    saved, now = read_json(cfg_path), drafter_config_json(target_dir, drafter.cfg, num_anchors)
    for k in ("block_size", "num_hidden_layers", "target_layer_ids", "mask_token_id", "markov_head_type",
              "markov_rank", "enable_confidence_head", "confidence_head_with_markov", "hidden_size", "vocab_size"):
        if saved.get(k) != now[k]:
            raise UserError(f"{cfg_path}: {k} is {saved.get(k)!r}, the flags give {now[k]!r}")
    files = safetensors_files(directory)
    tensors = read_safetensors(files, torch.float32, drafter.fc.weight.device)
    tensors.pop("embed_tokens.weight", None)
    tensors.pop("lm_head.weight", None)
    params = dict(drafter.named_parameters())
    with torch.device("meta"):
        probe = Drafter(drafter.cfg)
    assign_strict(probe, tensors, files[0])  # names and shapes, one line for the first misfit
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(tensors[name])
