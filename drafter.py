"""The DSpark / DFlash block drafter: context projection, block forward, Markov and confidence heads.
Context K/V are cached once, when committed; the block's own K/V follow them, so one masked attention
covers [context; block]. The embedding and lm_head are the target's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from model import (
    DecoderLayer,
    ModelArgs,
    RMSNorm,
    Rope,
    Transformer,
    attended_length,
    cache_bias,
    fold_gqa,
    make_caches,
    rope_table,
)


@dataclass
class DrafterConfig:
    layers: ModelArgs  # the drafter's decoder layers (num_hidden_layers = its depth)
    block_size: int  # K for the DSpark layout, B for the DFlash layout
    target_layer_ids: tuple[int, ...]  # target layers whose outputs form the context feature
    mask_token_id: int  # fills the block slots after the anchor
    layout: str  # "dspark" (shift label: K slots, K drafts) or "dflash" (B slots, B-1 drafts)
    markov_head_type: Optional[str]  # None, "vanilla", "gated" or "rnn"
    markov_rank: int  # r; 0 without a Markov head
    confidence_head: bool  # predicts P(x_k accepted | earlier accepted)
    confidence_with_markov: bool  # the confidence head also reads W1[x_{k-1}]
    num_target_layers: Optional[int] = None  # the target depth it was built for, when its config says

    @property
    def num_slots(self) -> int:
        return self.block_size

    @property
    def num_drafts(self) -> int:
        return self.block_size if self.layout == "dspark" else self.block_size - 1

    def describe(self) -> str:
        heads = f"markov={self.markov_head_type or 'off'}" + (f"(r={self.markov_rank})" if self.markov_head_type else "")
        conf = "off" if not self.confidence_head else "on(+markov)" if self.confidence_with_markov else "on"
        return (f"drafter: layout={self.layout} block_size={self.block_size} drafts/round={self.num_drafts} "
                f"layers={self.layers.num_hidden_layers} target_layer_ids={list(self.target_layer_ids)} "
                f"mask_token_id={self.mask_token_id} {heads} confidence={conf}")


# Markov heads: b_k = step(h_k, x_{k-1}, state), added to the block's logits U_k slot by slot

class VanillaMarkov(nn.Module):
    """b_k = W2 · W1[x_{k-1}]. A new head subclasses it, names its `kind`, and joins MARKOV_HEADS."""
    kind = "vanilla"  # kernels.py has a Triton chain for this kind only

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "kind" not in vars(cls):  # an inherited "vanilla" would pick the vanilla kernel
            raise TypeError(f"{cls.__name__}: a Markov head names its own `kind`")

    def __init__(self, H: int, V: int, r: int):
        super().__init__()
        self.markov_w1 = nn.Embedding(V, r)
        self.markov_w2 = nn.Linear(r, V, bias=False)

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
        return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e), state


class RNNMarkov(VanillaMarkov):
    """A gated recurrent state: joint_proj([s ; W1[x] ; h]) -> gate, candidate, output."""
    kind = "rnn"

    def __init__(self, H: int, V: int, r: int):
        super().__init__(H, V, r)
        self.joint_proj = nn.Linear(2 * r + H, 3 * r)

    def step(self, h, prev, state):
        e = self.markov_w1(prev)
        state = torch.zeros_like(e) if state is None else state
        gate, cand, out = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state


MARKOV_HEADS = {"vanilla": VanillaMarkov, "gated": GatedMarkov, "rnn": RNNMarkov}


class ConfidenceHead(nn.Module):
    """c_k = σ(w · [h_k ; W1[x_{k-1}]] + b) (the Markov feature when the checkpoint has it)."""

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)
        self.temperature: Optional[torch.Tensor] = None  # [K], Sequential Temperature Scaling

    def forward(self, features):  # the logit, float32 [..., K]
        return self.proj(features).float()[..., 0]


class Drafter(nn.Module):
    """Parameter names follow DeepSpec's checkpoints (k/v and gate/up fused as the target's)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg, a = cfg, cfg.layers
        self.fc = nn.Linear(len(cfg.target_layer_ids) * a.hidden_size, a.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.markov_head = (MARKOV_HEADS[cfg.markov_head_type](a.hidden_size, a.vocab_size, cfg.markov_rank)
                            if cfg.markov_head_type else None)
        width = a.hidden_size + (cfg.markov_rank if cfg.confidence_with_markov else 0)
        self.confidence_head = ConfidenceHead(width) if cfg.confidence_head else None
        self._target = [None]  # the target's embedding and lm_head, kept out of this module's parameters

    @property
    def target(self) -> Transformer:
        return self._target[0]

    def attach(self, target: Transformer):
        self._target[0] = target

    def setup_caches(self, max_batch: int, max_seq: int):
        if make_caches(self.layers, max_batch, max_seq, self.fc.weight):
            a = self.cfg.layers
            self.register_buffer("rope", rope_table(a.head_dim, a.rope_theta, max_seq, self.fc.weight.device),
                                 persistent=False)

    def commit_context(self, features, positions, rows=None):
        """Cache every layer's K/V of projected features [B, T, n*H] at positions [B, T]."""
        c = self.hidden_norm(self.fc(features))
        rope = Rope.at(self.rope[positions], c.dtype)
        for layer in self.layers:
            layer.self_attn.kv_cache.write(positions, *layer.self_attn.kv(c, rope), rows)

    def forward(self, anchor, anchor_pos):
        """anchor [B] at anchor_pos [B] over context < anchor_pos -> hidden [B, K, H], logits U [B, K, V]."""
        cfg, S, B = self.cfg, self.cfg.num_slots, anchor.shape[0]
        tokens = torch.full((B, S), cfg.mask_token_id, dtype=torch.long, device=anchor.device)
        tokens[:, 0] = anchor
        positions = anchor_pos[:, None] + torch.arange(S, device=anchor.device)
        x = self.target.embed_tokens(tokens)
        rope = Rope.at(self.rope[positions], x.dtype)
        # Non-causal: every block row sees the context and the whole block.
        end = anchor_pos + S
        L = attended_length(end, self.layers[0].self_attn.kv_cache.k.shape[1])
        g = cfg.layers.num_attention_heads // cfg.layers.num_key_value_heads if fold_gqa(anchor.device) else 1
        mask = cache_bias((torch.arange(L, device=anchor.device) < end[:, None])[:, None, :].expand(B, S, L), g,
                          x.dtype)
        for layer in self.layers:
            x = layer(x, rope, positions, mask)
        h = self.norm(x)
        if cfg.layout == "dflash":
            h = h[:, 1:]  # slot 0 (the anchor's) drafts nothing
        return h, self.target.lm_head(h)

    def calibrate(self, temperatures):
        """Divide draft k's confidence logit by temperatures[k] from now on (STS)."""
        self.confidence_head.temperature = torch.tensor(temperatures, dtype=torch.float32, device=self.fc.weight.device)

    def confidence_logit(self, hidden, prev_tokens) -> Optional[torch.Tensor]:
        """float32 [..., K], before any temperature; prev_tokens = [x_0 .. x_{K-1}]."""
        if self.confidence_head is None:
            return None
        if self.cfg.confidence_with_markov:
            hidden = torch.cat([hidden, self.markov_head.markov_w1(prev_tokens)], dim=-1)
        return self.confidence_head(hidden)

    def confidence(self, hidden, prev_tokens) -> Optional[torch.Tensor]:
        """c_k = σ(logit / T_k) [B, K], T the STS temperatures if any; None without a head."""
        logit = self.confidence_logit(hidden, prev_tokens)
        t = self.confidence_head.temperature if logit is not None else None
        return None if logit is None else torch.sigmoid(logit if t is None else logit / t)
