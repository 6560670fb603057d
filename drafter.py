"""The drafters. The DSpark / DFlash block drafter: context projection, block forward, Markov and
confidence heads; context K/V are cached once, when committed, and the block's own K/V follow them,
so one masked attention covers [context; block]. The Eagle3 drafter (the paper's autoregressive
baseline): one layer stepped once per draft, carrying its hidden state. Both use the target's
embedding and lm_head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

from model import (
    Attention,
    DecoderLayer,
    ModelArgs,
    RMSNorm,
    Rope,
    Transformer,
    attend,
    attended_length,
    causal_cache_bias,
    make_caches,
    model_cache_bias,
)


@dataclass
class DrafterConfig:
    layers: ModelArgs  # the drafter's decoder layers (num_hidden_layers = its depth)
    block_size: int  # slots: K for the DSpark layout, K + 1 for DFlash's, the chain's length for Eagle3
    target_layer_ids: tuple[int, ...]  # target layers whose outputs form the context feature
    mask_token_id: int  # fills the block slots after the anchor
    layout: str  # "dspark" (shift label: K slots, K drafts), "dflash" (K + 1 slots, K drafts), "eagle3"
    markov_head_type: Optional[str]  # None, "vanilla", "gated" or "rnn"
    markov_rank: int  # r; 0 without a Markov head
    confidence_head: bool  # predicts P(x_k accepted | earlier accepted)
    confidence_with_markov: bool  # the confidence head also reads W1[x_{k-1}]
    num_target_layers: Optional[int] = None  # the target depth it was built for, if known

    @property
    def num_drafts(self) -> int:
        if self.layout == "dflash":
            return self.block_size - 1  # slot 0 holds the anchor
        return self.block_size

    def describe(self, num_drafts: Optional[int] = None) -> str:
        """One line for a program's start; num_drafts: an Eagle3 run's --draft-length, where given."""
        if self.layout == "eagle3":
            drafts = num_drafts or self.num_drafts
            return (
                f"drafter: layout=eagle3 (one-token steps) drafts/round={drafts} "
                f"layers={self.layers.num_hidden_layers} target_layer_ids={list(self.target_layer_ids)}"
            )
        heads = f"markov={self.markov_head_type or 'off'}"
        if self.markov_head_type:
            heads += f"(r={self.markov_rank})"
        if not self.confidence_head:
            conf = "off"
        elif self.confidence_with_markov:
            conf = "on(+markov)"
        else:
            conf = "on"
        return (
            f"drafter: layout={self.layout} block_size={self.block_size} "
            f"drafts/round={self.num_drafts} layers={self.layers.num_hidden_layers} "
            f"target_layer_ids={list(self.target_layer_ids)} mask_token_id={self.mask_token_id} "
            f"{heads} confidence={conf}"
        )


# Markov heads: b_k = step(h_k, x_{k-1}, state), added to the block's logits U_k slot by slot

class VanillaMarkov(nn.Module):
    """b_k = W2 · W1[x_{k-1}]. A new head subclasses it, names its `kind`, and joins
    MARKOV_HEADS. `step` runs on rows: h [rows, H], prev [rows], state [rows, ...] or None ->
    (bias [rows, V], state), the state one tensor (a draft tree gathers it by parent)."""
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
        gate_input = torch.cat([h, e], dim=-1)
        g = torch.sigmoid(self.gate_proj(gate_input))
        return self.markov_w2(g * e), state


class RNNMarkov(VanillaMarkov):
    """A gated recurrent state s along the chain: [g ; c ; o] = joint_proj([s ; W1[x_{k-1}] ; h_k]);
    b_k = W2 · tanh(o), and s becomes σ(g) ⊙ s + (1 − σ(g)) ⊙ tanh(c) (zeros before the first step)."""
    kind = "rnn"

    def __init__(self, H: int, V: int, r: int):
        super().__init__(H, V, r)
        self.joint_proj = nn.Linear(2 * r + H, 3 * r)

    def step(self, h, prev, state):
        e = self.markov_w1(prev)
        if state is None:
            state = torch.zeros_like(e)
        joint = self.joint_proj(torch.cat([state, e, h], dim=-1))
        gate, cand, out = joint.chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1 - gate) * torch.tanh(cand)
        return self.markov_w2(torch.tanh(out)), state


MARKOV_HEADS = {"vanilla": VanillaMarkov, "gated": GatedMarkov, "rnn": RNNMarkov}


class ConfidenceHead(nn.Module):
    """The confidence logit w · [h_k ; W1[x_{k-1}]] + b (the Markov feature when the checkpoint has it);
    Drafter.confidence makes it c_k = σ(logit / T_k) with the calibrated `temperature`."""

    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)
        # [K], Sequential Temperature Scaling (`calibrate`): a buffer, so that .to() moves it, not saved
        self.register_buffer("temperature", None, persistent=False)

    def forward(self, features):  # the logit, float32 [..., K]
        return self.proj(features).float()[..., 0]


class DrafterBase(nn.Module):
    """What both drafters share: the projection of the target's captured features (`fc`), the
    target's embedding and lm_head, read through `target` and kept out of the drafter's parameters,
    and the layers' caches with their RoPE table."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.cfg = cfg
        self._target = [None]  # in a list: an attribute would make the target a submodule
        a = cfg.layers
        context_size = len(cfg.target_layer_ids) * a.hidden_size  # captured layers, concatenated
        self.fc = nn.Linear(context_size, a.hidden_size, bias=False)

    @property
    def target(self) -> Transformer:
        return self._target[0]

    def attach(self, target: Transformer):
        self._target[0] = target

    def setup_caches(self, max_batch: int, max_seq: int) -> bool:
        """Caches for max_batch rows of max_seq positions; True when new ones were made."""
        return make_caches(self, self.cfg.layers, max_batch, max_seq, self.fc.weight)

    @property
    def max_seq(self) -> int:
        """The positions a row of the caches holds."""
        return self.layers[0].self_attn.kv_cache.k.shape[1]


class Drafter(DrafterBase):
    """Parameter names follow DeepSpec's checkpoints (k/v and gate/up fused as the target's)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        a = cfg.layers
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        if cfg.markov_head_type:
            head = MARKOV_HEADS[cfg.markov_head_type]
            self.markov_head = head(a.hidden_size, a.vocab_size, cfg.markov_rank)
        else:
            self.markov_head = None
        width = a.hidden_size
        if cfg.confidence_with_markov:
            width += cfg.markov_rank
        if cfg.confidence_head:
            self.confidence_head = ConfidenceHead(width)
        else:
            self.confidence_head = None

    def context(self, features):
        """The target's captured features [B, T, n*H] projected to what a block attends to [B, T, H]."""
        return self.hidden_norm(self.fc(features))

    def commit_context(self, features, positions, following=None, last=None, rows=None):
        """Cache every layer's K/V of projected features [B, T, n*H] at positions [B, T]. `following`
        and `last` (the tokens after them, each row's last committed one) are read by Eagle3's only."""
        c = self.context(features)
        rope = Rope.at(self.rope[positions], c.dtype)
        for layer in self.layers:
            k, v = layer.self_attn.kv(c, rope)
            layer.self_attn.kv_cache.write(positions, k, v, rows)

    def forward(self, anchor, anchor_pos):
        """anchor [B] at anchor_pos [B] over context < anchor_pos -> hidden [B, K, H],
        logits U [B, K, V]."""
        cfg = self.cfg
        S = cfg.block_size
        B = anchor.shape[0]
        device = anchor.device
        tokens = torch.full((B, S), cfg.mask_token_id, dtype=torch.long, device=device)
        tokens[:, 0] = anchor
        positions = anchor_pos[:, None] + torch.arange(S, device=device)  # [B, S]
        x = self.target.embed_tokens(tokens)
        rope = Rope.at(self.rope[positions], x.dtype)
        # Non-causal: every block row sees the context and the whole block.
        end = anchor_pos + S
        attended = attended_length(end, self.max_seq)  # the cache positions the block reads
        allowed = torch.arange(attended, device=device) < end[:, None]  # [B, attended]
        allowed = allowed[:, None, :].expand(B, S, attended)
        bias = model_cache_bias(allowed, cfg.layers, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, positions, bias)
        h = self.norm(x)
        if cfg.layout == "dflash":
            h = h[:, 1:]  # slot 0 (the anchor's) drafts nothing
        return h, self.target.lm_head(h)

    def calibrate(self, temperatures):
        """Divide draft k's confidence logit by temperatures[k] from now on (STS)."""
        device = self.fc.weight.device
        t = torch.tensor(temperatures, dtype=torch.float32, device=device)  # [K]
        self.confidence_head.temperature = t

    def confidence_logit(self, hidden, prev_tokens) -> Optional[torch.Tensor]:
        """float32 [..., K], before any temperature; prev_tokens = [x_0 .. x_{K-1}]."""
        if self.confidence_head is None:
            return None
        if self.cfg.confidence_with_markov:
            hidden = torch.cat([hidden, self.markov_head.markov_w1(prev_tokens)], dim=-1)
        return self.confidence_head(hidden)

    def confidence(self, hidden, prev_tokens, slot: Optional[int] = None) -> Optional[torch.Tensor]:
        """c_k = σ(logit / T_k) [B, K], T the STS temperatures if any; None without a head. With
        `slot`, every row of hidden [B, M, H] is that block position's (a tree's nodes at one depth),
        each after its own prev_tokens [B, M], and T is that position's."""
        logit = self.confidence_logit(hidden, prev_tokens)
        if logit is None:
            return None
        t = self.confidence_head.temperature
        if t is not None:
            if slot is not None:
                t = t[slot]
            logit = logit / t
        return torch.sigmoid(logit)


class Eagle3Layer(DecoderLayer):
    """Eagle3's layer: attention reads [input_layernorm(embedding); hidden_norm(h)], 2H wide, and
    adds to h; then Qwen3's MLP."""

    def __init__(self, a: ModelArgs):
        super().__init__(a)
        self.self_attn = Attention(a, input_size=2 * a.hidden_size)
        self.hidden_norm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def attention_input(self, h, embedded):
        """The attention's input, [input_layernorm(embedded); hidden_norm(h)]: [B, T, 2H]."""
        return torch.cat([self.input_layernorm(embedded), self.hidden_norm(h)], dim=-1)

    def forward(self, h, embedded, rope, positions, mask, rows=None):
        x = self.attention_input(h, embedded)
        h = h + self.self_attn(x, rope, positions, mask, rows=rows)
        return h + self.mlp(self.post_attention_layernorm(h))

    def unrolled(self, h, embedded, rope, mask, past=None):
        """Training's cache-free pass (DeepSpec's training-time test): h [B, T, H] and the embedded
        next tokens, attending to `past` (the earlier passes' K, V [B, S, kv_heads, hd]) and then
        their own K/V under mask [B, T, S + T] -> (the new h, un-normed; the K, V so far)."""
        a = self.self_attn
        x = self.attention_input(h, embedded)
        q, k, v = a.qkv(x, rope)
        if past is not None:  # the earlier passes' keys first, as `mask` orders them
            k = torch.cat([past[0], k], dim=1)
            v = torch.cat([past[1], v], dim=1)
        out = attend(q, k, v, mask)
        h = h + a.o_proj(out)
        h = h + self.mlp(self.post_attention_layernorm(h))
        return h, (k, v)


class Eagle3Drafter(DrafterBase):
    """DeepSpec's Eagle3 (its parameter names; k/v and gate/up fused). Position i reads the target's
    features there, fc(f_i), and the next token x_{i+1}, at RoPE position i; its output h_i, normed
    and through the lm_head, drafts x_{i+2}. Drafting, a step reads the previous step's un-normed h
    instead of features. `carried` holds each row's h at its last committed position."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__(cfg)
        a = cfg.layers
        self.layers = nn.ModuleList([Eagle3Layer(a)])
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.markov_head = None
        self.confidence_head = None

    def setup_caches(self, max_batch: int, max_seq: int) -> bool:
        made = super().setup_caches(max_batch, max_seq)
        if made:
            # Not a buffer, and handed to the draft graph as an input (speculate.draft's `carried`): the
            # compiled CPU round freezes what a graph reads of a module without writing it, and the
            # draft graph reads what the verify graph writes here.
            self.carried = self.fc.weight.new_zeros((max_batch, self.cfg.layers.hidden_size))
        return made

    def extend(self, h, tokens, positions, rows=None):
        """The layer over h [B, T, H] and the next tokens [B, T] at positions [B, T], through the
        cache (each position sees the cache up to itself) -> the new h [B, T, H], un-normed."""
        embedded = self.target.embed_tokens(tokens)
        rope = Rope.at(self.rope[positions], h.dtype)
        bias = causal_cache_bias(positions, self.max_seq, self.cfg.layers, h.dtype)
        return self.layers[0](h, embedded, rope, positions, bias, rows=rows)

    def commit_context(self, features, positions, following, last, rows=None):
        """Positions [B, T] committed: their features [B, T, n*H] and the tokens after them,
        `following` [B, T], rebuild the cache there; `carried` takes the h at each row's `last` [B]
        (an index into T)."""
        h = self.extend(self.fc(features), following, positions, rows)
        batch = torch.arange(h.shape[0], device=h.device)
        carried = h[batch, last]  # [B, H]
        if rows is None:
            rows = batch
        self.carried.index_copy_(0, rows, carried)

    def step(self, h, tokens, positions):
        """One drafting step: h [B, H] and the draft just drawn, tokens [B], at positions [B]."""
        h = self.extend(h[:, None], tokens[:, None], positions[:, None])
        return h[:, 0]

    def logits(self, h):
        return self.target.lm_head(self.norm(h))
