"""The target: a pure-PyTorch Qwen3 dense decoder with a static KV cache written at per-row
positions (rollback is moving a length: a query at p reads only keys <= p). `capture=` returns the
drafter's features from the same pass; `ragged=` runs requests of different lengths flattened."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ModelArgs:
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128  # explicit in Qwen3: not hidden_size / num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 40960
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in float32, cast back, then scale, as Qwen3."""
    if x.dtype == weight.dtype == torch.float32 and x.device.type == "cpu":
        return weight * F.rms_norm(x, (x.shape[-1],), None, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_table(head_dim: int, theta: float, max_seq: int, device) -> torch.Tensor:
    """cos, sin for positions 0..max_seq-1: float32 [max_seq, 2, head_dim]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    freqs = torch.outer(torch.arange(max_seq, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin()), dim=1)


class Rope(NamedTuple):
    """RoPE at a forward's positions, made once for all layers; rotate_half's sign folded into sin."""
    cos: torch.Tensor
    sin: torch.Tensor

    @staticmethod
    def at(cos_sin: torch.Tensor, dtype: torch.dtype) -> "Rope":
        cos, sin = cos_sin[:, :, None, 0].to(dtype), cos_sin[:, :, None, 1].to(dtype)
        half = sin.shape[-1] // 2
        return Rope(cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, heads, hd]
        return x * self.cos + x.roll(x.shape[-1] // 2, -1) * self.sin


class KVCache(nn.Module):
    def __init__(self, max_batch: int, max_seq: int, kv_heads: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (max_batch, max_seq, kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def write(self, positions, k, v, rows=None):
        """k, v [B, T, kv_heads, hd] at positions [B, T] of rows 0..B-1, or of `rows` [B]."""
        if rows is None:
            rows = torch.arange(positions.shape[0], device=positions.device)
        index = (rows[:, None].expand_as(positions), positions)
        self.k.index_put_(index, k)
        self.v.index_put_(index, v)

    def read(self, batch: int, rows, length: int):
        """K, V [B, length, kv_heads, hd] of rows 0..batch-1 (a view) or `rows` (a copy)."""
        if rows is None:
            return self.k[:batch, :length], self.v[:batch, :length]
        return self.k[rows, :length], self.v[rows, :length]


def make_caches(layers, max_batch: int, max_seq: int, like: torch.Tensor):
    """Give each layer a cache, unless it has one of this size (compiled graphs hold the old tensors)."""
    kv = layers[0].self_attn.kv_cache
    if kv is not None and tuple(kv.k.shape[:2]) == (max_batch, max_seq) and kv.k.dtype == like.dtype:
        return False
    for layer in layers:
        a = layer.self_attn
        a.kv_cache = KVCache(max_batch, max_seq, a.n_kv, a.head_dim, like.dtype, like.device)
    return True


def attend(q, k, v, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Cache-free attention: q [B, Tq, H, hd] over k, v [B, Tk, Hkv, hd] -> [B, Tq, H*hd] under mask
    [B, Tq, Tk] (True = may attend), or causal."""
    B, Tq, H, hd = q.shape
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask[:, None] if mask is not None else None,
                                         is_causal=mask is None, enable_gqa=k.shape[2] != H)
    return out.transpose(1, 2).reshape(B, Tq, H * hd)


ATTEND_BUCKET = 64  # eager attention reads the filled cache prefix rounded up to this


def attended_length(end: torch.Tensor, max_seq: int) -> int:
    """Cache positions read when no query sees past `end`: compiled, all (a static shape); eager, the
    filled prefix rounded up to ATTEND_BUCKET."""
    if torch.compiler.is_compiling():
        return max_seq
    return min(max_seq, -(-int(end.max()) // ATTEND_BUCKET) * ATTEND_BUCKET)


def fold_gqa(device) -> bool:
    """CUDA: fold GQA into the query length (a mask with enable_gqa runs SDPA's math kernel)."""
    return torch.device(device).type == "cuda"


def cache_bias(allowed: torch.Tensor, group: int, dtype) -> torch.Tensor:
    """allowed [B, T, S] bool -> additive [B, 1, group*T, S], rows repeated per folded head."""
    B, T, S = allowed.shape
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    return bias[:, None, None].expand(B, 1, group, T, S).reshape(B, 1, group * T, S)


def attend_cached(q, k, v, bias) -> torch.Tensor:
    """q [B, T, H, hd] over cache k, v [B, S, Hkv, hd] under `cache_bias` -> [B, T, H*hd]; folded
    (bias rows g*T), head h reads K/V head h // g as g*T query rows."""
    B, T, H, hd = q.shape
    Hkv, g = k.shape[2], bias.shape[2] // T
    if g == 1:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=bias, enable_gqa=Hkv != H)
        return out.transpose(1, 2).reshape(B, T, H * hd)
    q = q.view(B, T, Hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * T, hd)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias)
    return out.view(B, Hkv, g, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, H * hd)


@dataclass
class Ragged:
    """Where N flattened tokens sit in a padded [R, W] layout (request r: slots 0..counts[r]-1), for
    attention (`pad`, `unpad`); tokens past sum(counts) land in spare slots nothing reads."""
    index: torch.Tensor  # [N] r * W + slot; padding R * W + i
    rows: torch.Tensor   # [N] the request of each token (padding: R - 1)
    slots: torch.Tensor  # [N] its slot (padding: 0)
    R: int
    W: int

    @staticmethod
    def build(counts: torch.Tensor, positions: torch.Tensor, num_tokens: int) -> "Ragged":
        R, W = positions.shape
        ends = torch.cumsum(counts, 0)
        i = torch.arange(num_tokens, device=counts.device)
        rows = torch.searchsorted(ends, i, right=True)
        real = rows < R
        rows = rows.clamp(max=R - 1)
        slots = torch.where(real, i - (ends - counts)[rows], 0)
        return Ragged(torch.where(real, rows * W + slots, R * W + i), rows, slots, R, W)

    def flatten(self, x):  # [R, W, ...] -> [1, N, ...]
        return x[self.rows, self.slots][None]

    def pad(self, x):  # [1, N, ...] -> [R, W, ...], zeros where no token is
        N, rest = x.shape[1], x.shape[2:]
        out = x.new_zeros((self.R * self.W + N, *rest)).index_copy(0, self.index, x[0])
        return out[:self.R * self.W].view(self.R, self.W, *rest)

    def unpad(self, x):  # [R, W, ...] -> [1, N, ...]; padding tokens read the last slot
        index = self.index.clamp(max=self.R * self.W - 1)
        return x.reshape(self.R * self.W, *x.shape[2:]).index_select(0, index)[None]


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = a.num_attention_heads, a.num_key_value_heads, a.head_dim
        self.q_proj = nn.Linear(a.hidden_size, self.n_heads * a.head_dim, bias=a.attention_bias)
        self.kv_proj = nn.Linear(a.hidden_size, 2 * self.n_kv * a.head_dim, bias=a.attention_bias)  # [k; v]
        self.o_proj = nn.Linear(self.n_heads * a.head_dim, a.hidden_size, bias=a.attention_bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.kv_cache: Optional[KVCache] = None
        self.attend = attend_cached  # attention over the cache; a backend may install another

    def project(self, x):
        """q_proj(x) and kv_proj(x); a backend may compute both in one pass over the weights."""
        return self.q_proj(x), self.kv_proj(x)

    def kv(self, x, rope: Rope, kv=None):
        """K (normed, rotated) and V of x [B, T, H] (or of its kv_proj output): [B, T, kv_heads, hd] each."""
        B, T, _ = x.shape
        k, v = (self.kv_proj(x) if kv is None else kv).view(B, T, 2 * self.n_kv, self.head_dim).chunk(2, dim=2)
        return rope(self.k_norm(k)), v

    def forward(self, x, rope: Rope, positions=None, mask=None, *, ragged: Optional[Ragged] = None,
                rows=None, prefix_kv=None, attention=None):
        """x [B, T, H] -> [B, T, H]: through the cache at `positions`; else over `prefix_kv` then its
        own keys under `mask` (drafter training); else cache-free causal."""
        B, T, _ = x.shape
        q, kv = self.project(x)
        q = rope(self.q_norm(q.view(B, T, self.n_heads, self.head_dim)))
        k, v = self.kv(x, rope, kv)
        if positions is None:
            if prefix_kv is not None:
                k, v = torch.cat([prefix_kv[0], k], 1), torch.cat([prefix_kv[1], v], 1)
            return self.o_proj(attend(q, k, v, mask))
        if ragged is not None:
            q, k, v = ragged.pad(q), ragged.pad(k), ragged.pad(v)  # [R, W, heads, hd]
        self.kv_cache.write(positions, k, v, rows)
        k, v = self.kv_cache.read(positions.shape[0], rows, mask.shape[-1])
        out = (attention or self.attend)(q, k, v, mask)
        return self.o_proj(ragged.unpad(out) if ragged is not None else out)


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)  # [gate; up]
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn, self.mlp = Attention(a), MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, rope, positions=None, mask=None, **kw):
        x = x + self.self_attn(self.input_layernorm(x), rope, positions, mask, **kw)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Qwen3 causal LM; parameter names are Hugging Face's without `model.` (k/v, gate/up fused)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_batch = self.max_seq = 0

    def setup_caches(self, max_batch: int, max_seq: int):
        """Static KV caches and the RoPE table, kept when asked again for the same size."""
        if make_caches(self.layers, max_batch, max_seq, self.embed_tokens.weight):
            self.max_batch, self.max_seq = max_batch, max_seq
            a = self.args
            self.register_buffer("rope", rope_table(a.head_dim, a.rope_theta, max_seq, self.embed_tokens.weight.device),
                                 persistent=False)

    def hidden(self, tokens, positions=None, *, capture: Sequence[int] = (), ragged=None, rows=None, index=None,
               mask=None, attention=None):
        """tokens [B, T] -> (normed hidden [B, T, H], features [B, T, len(capture)*H] or None): the
        outputs of layers `capture` (-1: embeddings). index [B]: one position per row."""
        dtype = self.embed_tokens.weight.dtype
        if positions is None:
            B, T = tokens.shape
            a = self.args
            table = rope_table(a.head_dim, a.rope_theta, T, tokens.device)
            rope = Rope.at(table[None].expand(B, T, *table.shape[1:]), dtype)
        else:  # RoPE and the mask once for every layer
            S = attended_length(positions + 1, self.max_seq)
            g = self.args.num_attention_heads // self.args.num_key_value_heads
            g = g if fold_gqa(positions.device) and attention is None else 1
            mask = cache_bias(positions[:, :, None] >= torch.arange(S, device=positions.device), g, dtype)
            rope = Rope.at(self.rope[ragged.flatten(positions) if ragged is not None else positions], dtype)
        x = self.embed_tokens(tokens)
        captured = {-1: x}
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, positions, mask, ragged=ragged, rows=rows, attention=attention)
            captured[i] = x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        if index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), index]
        return self.norm(x), features

    def forward(self, tokens, positions=None, *, capture: Sequence[int] = (), logits_index=None, ragged=None,
                rows=None, attention=None):
        """(logits [B, T, V], or [B, V] at `logits_index`; features), as `hidden`."""
        h, features = self.hidden(tokens, positions, capture=capture, ragged=ragged, rows=rows,
                                  index=logits_index, attention=attention)
        return self.lm_head(h), features
