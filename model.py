"""The target: a pure-PyTorch Qwen3 dense decoder that loads Hugging Face checkpoints.

What is notable here:
- `ModelArgs.from_hf_config` reads every spelling of a Qwen3 `config.json` we know of and
  refuses by name what it does not implement (other architectures, rope scaling, sliding
  windows) instead of guessing.
- The KV cache is static, `(max_batch, max_seq)`, and written in place at per-row positions,
  so rows of one batch can sit at different lengths. Rollback is free: the caller just
  moves its length pointer, because a query at position p only ever reads keys at positions
  <= p, and every such key was written by a committed token.
- `forward(..., capture=layers)` also returns the drafter's context features: the residual
  stream after the requested decoder layers (before the final norm), concatenated. This is
  read off the same pass that computes the logits, so capture costs no extra forward.
- One layer loop (`Transformer.hidden`) serves every use: with `positions` it runs through the
  cache (prefill, verification); with `positions=None` it is cache-free and causal over 0..T-1
  (target pre-training, online capture for distillation); `Attention.forward` also takes
  prepended K/V for the drafter's packed training forward. `forward` is its lm_head.
- `forward(..., ragged=...)` runs a ragged batch: requests with different numbers of tokens
  flattened into one row, so the matrix multiplies cost what the real tokens cost; attention
  alone goes back to a padded per-request layout, where each token reads only its own
  request's cache and earlier tokens (see `Ragged`).
- Loading is strict: every tensor in the files must land in a parameter and every parameter
  must be loaded, else `UserError` names the first one that does not. Then, for inference, each
  layer's projections are fused (`Transformer.fuse_`): one [v; k; q] GEMM (and on CUDA one
  [gate; up] GEMM), the published parameters kept as views of the fused rows, so state_dict stays
  the checkpoint's.
- On CPU in float32 the GEMMs run on copies of each weight made once by `fuse_` (cpu_kernels.py's
  `dense`, `Dense`, `pack_weight`): on its few-row kernel (cpu_kernels.cpp), else (no kernel) from two rows
  on oneDNN's packed layout — MKL multiplies a handful of rows (verification, the drafter's block)
  at a fraction of a core's peak. `F.linear` is the reference.
- Per forward, not per layer: RoPE's cos/sin (`Rope`) and the attention mask (`cache_bias`, additive).
  Eager attention reads only the cache's filled prefix (rounded up to `ATTEND_BUCKET`); compiled, the
  whole cache (static shapes) — except on CPU's kernel and with an engine's Triton attention
  (`attention`, kernels.cached_attention_triton), which skip the keys no query may see. On CUDA, GQA is
  folded into the query length so that masked attention runs in a fused kernel, not SDPA's math one
  (the Triton attention takes the mask unfolded); on CPU in float32, a round's few
  query tokens attend on cpu_kernels.py's kernel, which reads only the keys some query may see
  (`attend_cached`). Each fast piece has its plain
  reference beside it (`apply_rope`, `attend`, the unfused projections), held to it by tests.
- The tokenizer, stop ids and chat template of a checkpoint directory are text.py's.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_kernels
from common import UserError, optional_file, read_json
from cpu_kernels import (Dense, column_major, column_major_, dense, pack_weight, packed_of, packed_rows,
                         packs_pay)


# ----------------------------------------------------------------------------------------
# Configuration

SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM",)


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
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)  # from config.json, if any

    @classmethod
    def from_hf_config(cls, cfg: dict, source: str = "config.json") -> "ModelArgs":
        """Build from a parsed Hugging Face `config.json`; `source` names the file in errors."""
        if not isinstance(cfg, dict):
            raise UserError(f"{source}: expected a JSON object")
        archs = cfg.get("architectures")
        model_type = cfg.get("model_type")
        if archs is not None:
            if not isinstance(archs, list) or not archs or not all(a in SUPPORTED_ARCHITECTURES for a in archs):
                raise UserError(
                    f"{source}: architectures {archs!r} not supported (supported: Qwen3ForCausalLM)")
        if model_type not in (None, "qwen3"):
            raise UserError(f"{source}: model_type {model_type!r} not supported (supported: qwen3)")
        shape = _read_layer_shape(cfg, source)
        return cls(**shape, eos_token_ids=_eos_ids(cfg.get("eos_token_id"), source, "eos_token_id", shape["vocab_size"]))

    @property
    def num_params(self) -> int:
        """Parameter count of the model these args describe (embedding and lm_head counted once if tied)."""
        return sum(p.numel() for p in Transformer(self, device="meta").parameters())


# What a config value may be (inclusive): far beyond any published Qwen3, short of what would hang
# building the model or exhaust memory before the memory check (`check_fits`) can say so.
LIMITS = {"vocab_size": (1, 10_000_000), "hidden_size": (1, 65_536), "intermediate_size": (1, 1_048_576),
          "num_hidden_layers": (1, 1_024), "num_attention_heads": (1, 1_024), "num_key_value_heads": (1, 1_024),
          "head_dim": (1, 4_096), "max_position_embeddings": (1, 10_485_760),
          "rope_theta": (1.0, 1e12), "rms_norm_eps": (1e-12, 0.1)}


def _req(cfg: dict, key: str, source: str, kind=int):
    """cfg[key]: an integer (or a finite number, kind=float) inside LIMITS[key]; else one line naming it."""
    if key not in cfg:
        raise UserError(f"{source}: missing key {key!r}")
    v, (lo, hi) = cfg[key], LIMITS[key]
    what = "an integer" if kind is int else "a number"
    if isinstance(v, bool) or not isinstance(v, (int,) if kind is int else (int, float)) or not lo <= v <= hi:
        raise UserError(f"{source}: key {key!r} must be {what} from {lo:g} to {hi:g}, got {v!r}")
    return kind(v)


def _read_layer_shape(cfg: dict, source: str) -> dict:
    """The fields a Qwen3 decoder layer stack needs; shared by the target and the drafter."""
    out = {k: _req(cfg, k, source) for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads")}
    if "head_dim" in cfg and cfg["head_dim"] is not None:
        out["head_dim"] = _req(cfg, "head_dim", source)
    else:  # older configs omit it; Qwen3's own default is hidden / heads
        if out["hidden_size"] % out["num_attention_heads"]:
            raise UserError(f"{source}: no head_dim and hidden_size is not a multiple of num_attention_heads")
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if out["head_dim"] % 2:  # RoPE rotates the two halves of each head
        raise UserError(f"{source}: head_dim must be even (RoPE rotates its two halves), got {out['head_dim']}"
                        + ("" if cfg.get("head_dim") is not None else " (hidden_size / num_attention_heads)"))
    if out["num_attention_heads"] % out["num_key_value_heads"]:
        raise UserError(
            f"{source}: num_attention_heads {out['num_attention_heads']} is not a multiple of "
            f"num_key_value_heads {out['num_key_value_heads']}")
    out["rms_norm_eps"] = _req(cfg, "rms_norm_eps", source, float) if "rms_norm_eps" in cfg else 1e-6
    # (missing: transformers' Qwen3Config default, so both read such a config alike)
    out["max_position_embeddings"] = _req(cfg, "max_position_embeddings", source) if "max_position_embeddings" in cfg else 32768

    # RoPE theta: top-level `rope_theta` (older files) or `rope_parameters.rope_theta` (newer).
    for key in ("rope_parameters", "rope_scaling"):
        r = cfg.get(key)
        if r is not None and not isinstance(r, dict):
            raise UserError(f"{source}: {key} must be an object, got {r!r}")
        for field in ("rope_type", "type"):  # both spellings read: either may name a scaling
            rope_type = (r or {}).get(field)
            if rope_type not in ("default", None):
                raise UserError(f"{source}: {key} {field} {rope_type!r} is not supported (only default RoPE)")
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out["rope_theta"] = _req(rope, "rope_theta", f"{source} rope_parameters", float)
        if "rope_theta" in cfg and cfg["rope_theta"] != rope["rope_theta"]:  # two spellings that disagree: no guess
            raise UserError(f"{source}: conflicting values for 'rope_theta': top-level {cfg['rope_theta']!r}, "
                            f"rope_parameters {rope['rope_theta']!r}")
    elif "rope_theta" in cfg:
        out["rope_theta"] = _req(cfg, "rope_theta", source, float)
    else:
        raise UserError(f"{source}: missing key 'rope_theta' (top-level or in rope_parameters)")

    for key in ("attention_bias", "tie_word_embeddings"):
        v = cfg.get(key, False)
        if not isinstance(v, bool):
            raise UserError(f"{source}: key {key!r} must be true or false, got {v!r}")
        out[key] = v
    quant = cfg.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise UserError(f"{source}: quantization_config ({method!r}): quantized checkpoints are not supported "
                        f"(use the unquantized one)")
    layer_types = cfg.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types)):
        raise UserError(f"{source}: layer_types other than full_attention are not supported")
    sliding = cfg.get("use_sliding_window", False)
    if sliding is not None and not isinstance(sliding, bool):  # "no", 0, {}: not read as a guess either way
        raise UserError(f"{source}: key 'use_sliding_window' must be true or false, got {sliding!r}")
    if sliding:
        raise UserError(f"{source}: use_sliding_window=true is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UserError(f"{source}: hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    return out


def _eos_ids(v, source: str, key: str, vocab_size: int) -> tuple[int, ...]:
    if v is None:
        return ()
    vals = v if isinstance(v, list) else [v]
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < vocab_size for x in vals):
        raise UserError(f"{source}: key {key!r} must be a token id below vocab_size {vocab_size} or a list of "
                        f"them, got {v!r}")
    return tuple(vals)


# ----------------------------------------------------------------------------------------
# Layers

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)) over the last dim, computed in float32 and cast back before the weight, as
    Qwen3 does. On CPU in float32, F.rms_norm and the weight: two calls instead of six, the same
    operations in the same order in the torch versions this project runs (tests/test_model.py holds
    its bits to the formula's); elsewhere its kernel may be a fused one, with other bits, so the
    formula runs."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and x.device.type == "cpu":
        return weight * F.rms_norm(x, (x.shape[-1],), None, eps)  # the weight may be one row per head
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a weight per feature (`rms_norm`)."""

    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_tables(head_dim: int, theta: float, max_seq: int, device) -> torch.Tensor:
    """cos/sin for positions 0..max_seq-1 in float32: [max_seq, 2, head_dim]."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_seq, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # rotate-half layout, as HF
    return torch.stack((emb.cos(), emb.sin()), dim=1)


def apply_rope(x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """The reference RoPE, as HF writes it: x [B, T, heads, hd]; cos_sin [B, T, 2, hd] (float32, cast to
    x's dtype). The layers use `Rope`, which tests/test_model.py holds to this bitwise."""
    cos = cos_sin[:, :, None, 0].to(x.dtype)
    sin = cos_sin[:, :, None, 1].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Rope(NamedTuple):
    """RoPE at a forward's positions, made once for all its layers (not once per layer and head kind):
    cos and sin [B, T, 1, hd] in the activations' dtype, `sin` with rotate_half's sign folded in
    (-sin on the first half), so that rotate_half(x) * sin == x.roll(hd / 2) * signed sin exactly:
    one roll instead of chunk, neg and cat."""
    cos: torch.Tensor
    sin: torch.Tensor

    @staticmethod
    def at(cos_sin: torch.Tensor, dtype: torch.dtype) -> "Rope":
        """From rope_tables rows cos_sin [B, T, 2, hd] (float32) for activations of `dtype`."""
        cos, sin = cos_sin[:, :, None, 0].to(dtype), cos_sin[:, :, None, 1].to(dtype)
        half = sin.shape[-1] // 2
        return Rope(cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads, hd] rotated."""
        return x * self.cos + x.roll(x.shape[-1] // 2, -1) * self.sin


class KVCache(nn.Module):
    """Static per-layer cache, [max_batch, max_seq, kv_heads, head_dim], written at per-row positions."""

    def __init__(self, max_batch: int, max_seq: int, kv_heads: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (max_batch, max_seq, kv_heads, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @staticmethod
    def kept(layers, max_batch: int, max_seq: int, like: torch.Tensor) -> bool:
        """Whether the layers' caches already are max_batch x max_seq in `like`'s dtype and device:
        setup_caches then keeps every buffer (a compiled graph holds them; with frozen weights the
        RoPE table is one of its constants, so new ones would recompile it)."""
        kv = layers[0].self_attn.kv_cache
        return (kv is not None and tuple(kv.k.shape[:2]) == (max_batch, max_seq)
                and kv.k.dtype == like.dtype and kv.k.device == like.device)

    def write(self, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: Optional[torch.Tensor] = None):
        """positions: [B, T]; k, v: [B, T, kv_heads, hd]. Writes cache rows 0..B-1, or `rows` [B]
        (a prefill into the rows that freed up)."""
        if rows is None:
            rows = torch.arange(positions.shape[0], device=positions.device)
        index = (rows[:, None].expand_as(positions), positions)
        self.k.index_put_(index, k)
        self.v.index_put_(index, v)

    def read(self, batch: int, rows: Optional[torch.Tensor], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, length, kv_heads, hd] of cache rows 0..batch-1 (a view), or of `rows` [B] (a copy),
        at positions 0..length-1."""
        if rows is None:
            return self.k[:batch, :length], self.v[:batch, :length]
        return self.k[rows, :length], self.v[rows, :length]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """q: [B, Tq, H, hd], k/v: [B, Tk, Hkv, hd], mask: [B, Tq, Tk] bool (True = may attend), or None
    for causal attention of q's T positions over k/v's same T (SDPA's is_causal, no mask in memory).

    Returns [B, Tq, H*hd]. GQA is handled by SDPA itself (no repeated K/V in memory). The training
    forwards' attention, and the reference `attend_cached` is tested against.
    """
    B, Tq, H, hd = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=mask[:, None] if mask is not None else None, is_causal=mask is None,
        enable_gqa=k.shape[2] != H)
    return out.transpose(1, 2).reshape(B, Tq, H * hd)


# Eager attention reads the cache up to the longest row's end rounded up to a multiple of this: a few
# shapes rather than one per length (kernels that plan per shape, like cuDNN's, plan each once), aligned
# for the fused kernels, and at most this many positions read in vain.
ATTEND_BUCKET = 64


def attended_length(end: torch.Tensor, max_seq: int) -> int:
    """How many cache positions a forward's attention reads, given `end`, the positions a query may read
    (< end) for every query (any shape). Under torch.compile: the whole cache (one static shape,
    no recompiles, CUDA graphs). Eager: the filled prefix, rounded up to ATTEND_BUCKET — one read of
    a device scalar (free on CPU); rounds the cache ends at max_seq."""
    if torch.compiler.is_compiling():
        return max_seq
    return min(max_seq, -(-int(end.max()) // ATTEND_BUCKET) * ATTEND_BUCKET)


def fold_gqa(device) -> bool:
    """Whether `attend_cached` folds GQA into the query length (on CUDA, see there) rather than leave it to
    SDPA's enable_gqa (elsewhere: CPU's flash kernel takes GQA with a mask, at the boolean mask's bits)."""
    return torch.device(device).type == "cuda"


def cache_bias(allowed: torch.Tensor, group: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask `attend_cached` takes, made once per forward: allowed [B, T, S] bool (True = may
    attend) -> [B, 1, group*T, S] of 0 / -inf in `dtype`, its rows repeated for the `group` query heads
    that share a K/V head when GQA is folded (`fold_gqa`; else group=1)."""
    B, T, S = allowed.shape
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
    if group == 1:
        return bias[:, None]
    return bias[:, None, None].expand(B, 1, group, T, S).reshape(B, 1, group * T, S)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Attention of q [B, T, H, hd] over cache rows k/v [B, S, Hkv, hd] under `cache_bias`'s additive
    bias -> [B, T, H*hd]; `attend` with the boolean mask is the reference.

    bias [B, 1, T, S]: SDPA's own GQA (`enable_gqa`). bias [B, 1, g*T, S] (g = H / Hkv): GQA folded
    into the query length — query head h reads K/V head h // g (as HF's repeat_interleave), so a
    group's g heads become g*T query rows of its K/V head: [B, Hkv, g*T, hd] queries against Hkv K/V
    heads, plain multi-head attention, no K/V copied. On CUDA a boolean mask with `enable_gqa` runs in
    SDPA's math kernel, which materialises every score (flash takes no mask, and the memory-efficient
    kernel took no GQA in the releases of mid-2026: pytorch#191085 adds it), whereas equal head counts
    and an additive mask in the query's dtype are what the memory-efficient and cuDNN kernels take.
    On CPU folding would change the flash kernel's blocking, and so the last bits, for nothing: it
    takes GQA with a mask as it is.

    On CPU in float32, up to cpu_kernels.ATTENTION_MAX_TOKENS query tokens (a round's
    forwards, short prompts) go to cpu_kernels.cached_attention instead (compiled: the op
    dspark::cached_attention, in graphs traced after cpu_kernels.prepare_graphs): SDPA's CPU kernel spent
    ~150 µs a layer on a verify's six tokens, ~1.6 ms of a 13.4 ms compiled round (BENCHMARKS.md). It
    reads only the keys some query may see, and a row's result does not depend on the tokens beside it
    or the keys past its own, so a verify's rows and one-token steps, eager and compiled, attend alike.
    """
    B, T, H, hd = q.shape
    Hkv = k.shape[2]
    g = bias.shape[2] // T
    if g == 1 and cpu_kernels.kernels_on() and cpu_kernels.attention_applies(q, bias):  # CPU float32, a few tokens
        return cpu_kernels.cached_attention(q, k, v, bias)
    if g == 1:
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias,
                                             enable_gqa=Hkv != H)
        return out.transpose(1, 2).reshape(B, T, H * hd)
    q = q.view(B, T, Hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(B, Hkv, g * T, hd)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias)
    return out.view(B, Hkv, g, T, hd).permute(0, 3, 1, 2, 4).reshape(B, T, H * hd)


@dataclass
class Ragged:
    """Where each of N flattened tokens sits in a padded [R, W] layout (R requests, W slots each).

    Request r owns slots 0 .. counts[r]-1 of its row, at positions[r, slot]. Everything
    token-wise (projections, norms, MLP, lm_head) runs on the N flattened tokens; attention
    scatters q/k/v into [R, W] (`pad`), writes the cache and attends per request there, and
    gathers back (`unpad`). Of the N tokens the first sum(counts) are real; the rest pad the
    batch up to a fixed bucket size (static shapes) and land in spare rows that nothing reads.
    Unused slots of a row are zeros written at positions past that row's last real token:
    queries never read keys beyond their own position, and the next round rewrites them.
    """
    index: torch.Tensor      # [N] long: r * W + slot for real tokens, R * W + i for padding
    rows: torch.Tensor       # [N] long: the request of each token (padding: clamped to R-1)
    slots: torch.Tensor      # [N] long: its slot in the request's row (padding: 0)
    R: int
    W: int

    @staticmethod
    def build(counts: torch.Tensor, positions: torch.Tensor, num_tokens: int) -> "Ragged":
        """counts [R] (0 .. W tokens per request), positions [R, W] (the padded layout's positions);
        num_tokens >= counts.sum() is the static size the flattened batch is padded to."""
        R, W = positions.shape
        ends = torch.cumsum(counts, 0)                        # [R]
        i = torch.arange(num_tokens, device=counts.device)    # [N]
        rows = torch.searchsorted(ends, i, right=True)        # request of each flat token
        real = rows < R
        rows = rows.clamp(max=R - 1)
        slots = torch.where(real, i - (ends - counts)[rows], 0)
        index = torch.where(real, rows * W + slots, R * W + i)
        return Ragged(index, rows, slots, R, W)

    def flatten(self, x: torch.Tensor) -> torch.Tensor:
        """[R, W, ...] -> [1, N, ...]: each token's entry (inputs: tokens, positions)."""
        return x[self.rows, self.slots][None]

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """[1, N, ...] flattened -> [R, W, ...] padded (zeros where no token is)."""
        N, rest = x.shape[1], x.shape[2:]
        out = x.new_zeros((self.R * self.W + N, *rest)).index_copy(0, self.index, x[0])
        return out[:self.R * self.W].view(self.R, self.W, *rest)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[R, W, ...] padded -> [1, N, ...] flattened (padding tokens read the last slot: their
        values are never used, so no zero row is appended to the whole output for them)."""
        index = self.index.clamp(max=self.R * self.W - 1)
        return x.reshape(self.R * self.W, *x.shape[2:]).index_select(0, index)[None]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, device=None):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        H, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(H, self.n_heads * self.head_dim, bias=bias, device=device)
        self.k_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=bias, device=device)
        self.v_proj = nn.Linear(H, self.n_kv * self.head_dim, bias=bias, device=device)
        self.o_proj = Dense(self.n_heads * self.head_dim, H, bias=bias, device=device)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, device=device)  # per head, before RoPE
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, device=device)
        self.kv_cache: Optional[KVCache] = None
        for name in ("vkq_weight", "vkq_bias", "kq_norm_weight"):  # fuse_(); not saved (state_dict has the views)
            self.register_buffer(name, None, persistent=False)
        self.vkq_packed = self.vk_packed = None  # fuse_(pack=True): pack_weight(vkq_weight), and of its [v; k] rows

    def fuse_(self, pack: bool = False):
        """For inference: one GEMM for q, k and v, and one norm for the k and q heads (and with `pack`,
        oneDNN's packed copies of the fused weight, of its [v; k] rows and of o_proj's: `dense`).

        The weight (and bias) of the three projections is one tensor, rows ordered [v; k; q]: the K/V
        the drafter's context rows need (`kv`) are then its leading rows — a slice at offset 0, which
        Inductor's frozen-weight GEMMs (compiling.compiled on CPU) read right, where they misread a
        slice further into the tensor — and the k and q heads, normed and rotated together, are
        adjacent. q/k/v_proj's parameters become views of its rows: the same memory, still the
        published names in state_dict (so saving, comparing with transformers and strict loading see
        the checkpoint's layout), and an in-place edit of either is seen by both. The two norms'
        weights are copied side by side, one row per head [Hkv + H, hd], so the norms must not change
        afterwards. Gradients would reach the fused tensor, not the parameters: a fused layer refuses a
        forward with grad (train an unfused model)."""
        if self.vkq_weight is not None:
            return
        if pack:
            self.o_proj.pack_()
        lins = (self.v_proj, self.k_proj, self.q_proj)
        weight = column_major(torch.cat([l.weight.detach() for l in lins]))
        bias = torch.cat([l.bias.detach() for l in lins]) if self.q_proj.bias is not None else None
        start = 0
        for l in lins:
            n = l.out_features
            l.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
            if bias is not None:
                l.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
            start += n
        self.vkq_weight, self.vkq_bias = weight, bias
        self.kq_norm_weight = torch.cat([self.k_norm.weight.detach().expand(self.n_kv, -1),
                                         self.q_norm.weight.detach().expand(self.n_heads, -1)])
        if pack:
            self.vkq_packed = pack_weight(weight)
            self.vk_packed = packed_rows(self.vkq_packed, weight, 2 * self.n_kv * self.head_dim)

    def _fused(self):
        if torch.is_grad_enabled() and self.q_proj.weight.requires_grad:
            raise RuntimeError("Attention.fuse_() is for inference: this layer's q/k/v weights are fused, and "
                               "gradients would not reach them (train a model loaded with fuse=False)")
        return self.vkq_weight, self.vkq_bias, self.kq_norm_weight

    def project(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, H] -> q [B, T, heads, hd], k and v [B, T, kv_heads, hd]: q and k normed per head
        and rotated, v as projected. Fused (`fuse_`): one GEMM, one norm and one RoPE over the k and q
        heads side by side; else the reference: three GEMMs, two norms, two RoPEs (bitwise the same on
        CPU in float32, tests/test_model.py)."""
        B, T, _ = x.shape
        H, Hkv, hd = self.n_heads, self.n_kv, self.head_dim
        if self.vkq_weight is None:
            q = rope(self.q_norm(self.q_proj(x).view(B, T, H, hd)))
            k = rope(self.k_norm(self.k_proj(x).view(B, T, Hkv, hd)))
            return q, k, self.v_proj(x).view(B, T, Hkv, hd)
        weight, bias, norm = self._fused()
        vkq = dense(x, weight, bias, packed_of(self, "vkq_packed")).view(B, T, 2 * Hkv + H, hd)
        kq = rope(rms_norm(vkq[:, :, Hkv:], norm, self.k_norm.eps))
        return kq[:, :, Hkv:], kq[:, :, :Hkv], vkq[:, :, :Hkv]

    def kv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V alone (the drafter's context rows): [B, T, kv_heads, hd] each, as `project` makes them."""
        B, T, _ = x.shape
        Hkv, hd = self.n_kv, self.head_dim
        if self.vkq_weight is None:
            return rope(self.k_norm(self.k_proj(x).view(B, T, Hkv, hd))), self.v_proj(x).view(B, T, Hkv, hd)
        weight, bias, norm = self._fused()
        rows = 2 * Hkv * hd  # the leading [v; k] rows
        vk = dense(x, weight[:rows], bias[:rows] if bias is not None else None,
                   packed_of(self, "vk_packed")).view(B, T, 2 * Hkv, hd)
        return rope(rms_norm(vk[:, :, Hkv:], norm[:Hkv], self.k_norm.eps)), vk[:, :, :Hkv]

    def forward(self, x: torch.Tensor, rope: Rope, positions: Optional[torch.Tensor] = None,
                mask: Optional[torch.Tensor] = None, *, ragged: Optional[Ragged] = None,
                rows: Optional[torch.Tensor] = None,
                prefix_kv: Optional[tuple[torch.Tensor, torch.Tensor]] = None, attention=None) -> torch.Tensor:
        """Self-attention of x [B, T, H] (its RoPE `rope`) -> [B, T, H], in one of three modes:

        - cache (`positions` [B, T]): K/V written into the cache at `positions`, in cache rows 0..B-1
          or `rows` [B]; attention over the cache's first S positions under `mask`, `cache_bias`'s
          additive [B, 1, g*T, S] (`attend_cached`, or `attention` with its signature: an engine's
          kernel set, kernels.cached_attention_triton). With `ragged`, x is [1, N, H] flattened tokens
          and positions/mask are the padded layout's [R, W], [R, 1, g*W, S].
        - prefix K/V (`prefix_kv` = (k, v), each [B, P, kv_heads, hd]): keys/values are the prefix
          then the block's own, under `mask` [B, T, P + T] bool; the cache is untouched (the drafter's
          training forward: context rows + packed blocks).
        - cache-free causal (neither): position t attends to 0..t of x itself (mask None); the cache
          is untouched (the target's training and online-capture forward).
        """
        q, k, v = self.project(x, rope)
        if positions is None:
            if prefix_kv is not None:
                k, v = torch.cat([prefix_kv[0], k], 1), torch.cat([prefix_kv[1], v], 1)  # [B, P + T, kv, hd]
            return self.o_proj(attend(q, k, v, mask))
        if ragged is not None:
            q, k, v = ragged.pad(q), ragged.pad(k), ragged.pad(v)  # [R, W, heads, hd]
        self.kv_cache.write(positions, k, v, rows)
        k, v = self.kv_cache.read(positions.shape[0], rows, mask.shape[-1])  # [B, S, kv, hd]
        out = (attention or attend_cached)(q, k, v, mask)
        return self.o_proj(ragged.unpad(out) if ragged is not None else out)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, device=None):
        super().__init__()
        H, I = args.hidden_size, args.intermediate_size
        self.gate_proj = Dense(H, I, bias=False, device=device)
        self.up_proj = Dense(H, I, bias=False, device=device)
        self.down_proj = Dense(I, H, bias=False, device=device)
        self.register_buffer("gate_up_weight", None, persistent=False)  # fuse_()
        self.gate_up_packed = None  # pack_()

    def fuse_(self):
        """For inference: one [gate; up] weight, one GEMM; gate/up_proj.weight become views of its rows
        (as `Attention.fuse_`), stored column-major where that pays (`column_major`). `DecoderLayer.fuse_`
        asks for it on CUDA and where the halves are packed: on this project's CPU (AMD EPYC, 1 thread)
        the fused GEMM, packed for oneDNN at a verify's rows and column-major for one row, cut bigram-35m's
        CPU time by 3% (speculative) and 5% (autoregressive) against the two halves; on MKL alone, before
        packing, it had been 1-2 ms per target forward slower at a verify's 5-6 rows (BENCHMARKS.md)."""
        if self.gate_up_weight is not None:
            return
        self.gate_up_weight = column_major(torch.cat([self.gate_proj.weight.detach(), self.up_proj.weight.detach()]))
        I = self.gate_proj.out_features
        self.gate_proj.weight = nn.Parameter(self.gate_up_weight[:I], requires_grad=False)
        self.up_proj.weight = nn.Parameter(self.gate_up_weight[I:], requires_grad=False)

    def pack_(self):
        """oneDNN's packed copies of the weights for `dense` (after `fuse_`, if it is to be fused)."""
        if self.gate_up_weight is not None:
            self.gate_up_packed = pack_weight(self.gate_up_weight)
        else:
            self.gate_proj.pack_()
            self.up_proj.pack_()
        self.down_proj.pack_()

    def forward(self, x):
        if self.gate_up_weight is None:  # the reference
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if torch.is_grad_enabled() and self.gate_proj.weight.requires_grad:
            raise RuntimeError("MLP.fuse_() is for inference: gradients would not reach the fused weights")
        gate, up = dense(x, self.gate_up_weight, None, packed_of(self, "gate_up_packed")).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, device=None):
        super().__init__()
        self.self_attn = Attention(args, device)
        self.mlp = MLP(args, device)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, device)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, device)

    def forward(self, x, rope: Rope, positions=None, mask=None, *, ragged: Optional[Ragged] = None, rows=None,
                prefix_kv=None, attention=None):
        """Pre-norm residual block over x [B, T, H]; the attention mode is `Attention.forward`'s."""
        x = x + self.self_attn(self.input_layernorm(x), rope, positions, mask, ragged=ragged, rows=rows,
                               prefix_kv=prefix_kv, attention=attention)
        return x + self.mlp(self.post_attention_layernorm(x))

    def fuse_(self, gate_up: Optional[bool] = None, pack: bool = False):
        """Fused projections for inference: QKV always; gate-up when asked, by default on CUDA and where
        the halves are packed (`MLP.fuse_`; not the small ones `pack_weight` leaves to MKL: on the demo
        pair's 768x256 halves fusing measured level to 4% slower); with `pack`, oneDNN's packed weights
        for `dense` too."""
        self.self_attn.fuse_(pack)
        packed_halves = pack and self.mlp.gate_proj.weight.numel() >= cpu_kernels.PACK_MIN_ELEMENTS
        if gate_up if gate_up is not None else (self.mlp.down_proj.weight.is_cuda or packed_halves):
            self.mlp.fuse_()
        if pack:
            self.mlp.pack_()


# ----------------------------------------------------------------------------------------
# The model

class Transformer(nn.Module):
    """Qwen3 causal LM. Parameter names follow Hugging Face's without the `model.` prefix."""

    def __init__(self, args: ModelArgs, device=None):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, device=device)
        self.layers = nn.ModuleList(DecoderLayer(args, device) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, device)
        self.lm_head = Dense(args.hidden_size, args.vocab_size, bias=False, device=device)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_batch = self.max_seq = 0

    def setup_caches(self, max_batch: int, max_seq: int):
        """Allocate the static KV caches and the RoPE table (once, or again to resize; asked for the
        size they have, keep them: KVCache.kept)."""
        w = self.embed_tokens.weight
        if KVCache.kept(self.layers, max_batch, max_seq, w):
            return
        self.max_batch, self.max_seq = max_batch, max_seq
        for layer in self.layers:
            a = layer.self_attn
            a.kv_cache = KVCache(max_batch, max_seq, a.n_kv, a.head_dim, w.dtype, w.device)
        self.register_buffer("rope", rope_tables(self.args.head_dim, self.args.rope_theta, max_seq, w.device),
                             persistent=False)

    def fuse_(self, gate_up: Optional[bool] = None, pack: Optional[bool] = None) -> "Transformer":
        """Fused projection weights for inference (`DecoderLayer.fuse_`): one QKV GEMM per layer, and one
        gate-up GEMM (default: on CUDA, and where its halves are packed); on CPU in float32 the weights
        with out >= in stored column-major (`column_major_`); and, where `packs_pay` (default) or `pack`,
        every GEMM weight of PACK_MIN_ELEMENTS or more packed for oneDNN (`dense`). Call once the
        weights are final (after loading or initialising, and after any move to another device or
        dtype, which would copy the views apart)."""
        pack = packs_pay(self) if pack is None else pack
        for layer in self.layers:
            layer.fuse_(gate_up, pack)
        column_major_(self)
        if pack:
            self.lm_head.pack_()
        return self

    def check_capture(self, capture: Sequence[int], source: str = "target_layer_ids"):
        """Layer ids a drafter may read: -1 (embeddings) .. L-2. The last layer is refused (docs/algorithm.md, "Target capture")."""
        L = self.args.num_hidden_layers
        for i in capture:
            if isinstance(i, bool) or not isinstance(i, int) or not (-1 <= i < L):
                raise UserError(f"{source}: layer id {i!r} is outside the capturable layers -1..{L - 2}")
            if i == L - 1:
                raise UserError(
                    f"{source}: layer id {i} is the target's last layer; drafters read layers before it")

    def hidden(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None, *, capture: Sequence[int] = (),
               ragged: Optional[Ragged] = None, rows: Optional[torch.Tensor] = None,
               index: Optional[torch.Tensor] = None, mask: Optional[torch.Tensor] = None, attention=None):
        """The decoder stack: tokens [B, T] (int64) -> (final-normed hidden states [B, T, H], features).

        positions [B, T]: through the KV cache (written at `positions`, in cache rows 0..B-1 or `rows`
        [B]). None: cache-free causal attention over positions 0..T-1, the cache untouched (target
        pre-training with grad, online capture for distillation under no_grad).
        features: [B, T, len(capture) * H] — outputs of the `capture` layers (-1 = embeddings),
        before the final norm — or None when `capture` is empty.
        With `ragged`, tokens are [1, N] flattened tokens and positions the padded layout's [R, W]
        (see `Ragged`); hidden states and features come back flattened too: [1, N, H], [1, N, F].
        index [B]: only that position of each row, [B, H] (selected before the norm, which is per token).
        mask [B, T, T] (cache-free only; True = may attend): instead of plain causal attention, e.g. causal
        within each document of a packed row (data.document_mask).
        attention (through the cache only): the attention over the cache in place of `attend_cached`, same
        signature (kernels.KernelSet.attention); it gets the mask unfolded (one row per token).
        """
        dtype = self.embed_tokens.weight.dtype
        if positions is None:
            B, T = tokens.shape
            table = getattr(self, "rope", None)
            if table is None or table.shape[0] < T:  # no cache table long enough: the same rows, computed
                a = self.args
                table = rope_tables(a.head_dim, a.rope_theta, T, tokens.device)
            rope = Rope.at(table[:T][None].expand(B, T, *table.shape[1:]), dtype)  # [B, T, 1, hd]
        else:  # RoPE and the mask once for every layer; the cache read up to the longest row's end
            assert mask is None, "mask: the cache-free mode's only"
            S = attended_length(positions + 1, self.max_seq)
            fold = fold_gqa(positions.device) and attention is None
            g = self.args.num_attention_heads // self.args.num_key_value_heads if fold else 1
            mask = cache_bias(positions[:, :, None] >= torch.arange(S, device=positions.device), g, dtype)
            rope = Rope.at(self.rope[ragged.flatten(positions) if ragged is not None else positions], dtype)
        x = self.embed_tokens(tokens)
        captured = {}
        if -1 in capture:
            captured[-1] = x
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, positions, mask, ragged=ragged, rows=rows, attention=attention)
            if i in capture:
                captured[i] = x
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        if index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), index]
        return self.norm(x), features

    def forward(self, tokens: torch.Tensor, positions: Optional[torch.Tensor] = None, *,
                capture: Sequence[int] = (), logits_index: Optional[torch.Tensor] = None,
                ragged: Optional[Ragged] = None, rows: Optional[torch.Tensor] = None, attention=None):
        """(logits, features): the lm_head over `hidden`'s states (arguments as there).

        logits: [B, T, V], or [B, V] at `logits_index` ([B], one position per row) when given.
        """
        h, features = self.hidden(tokens, positions, capture=capture, ragged=ragged, rows=rows, index=logits_index,
                                  attention=attention)
        return self.lm_head(h), features


# ----------------------------------------------------------------------------------------
# Real-shaped models with random weights (speed measurements without downloads)

PRESETS = {  # the published configs' shapes (Hugging Face Qwen/Qwen3-*/config.json)
    "qwen3-4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "qwen3-14b": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    # Not published: Qwen3's vocabulary and layout with toy layers (10M parameters, most of them the
    # embedding), so that a smoke test builds what a preset builds (scripts/device_run.py --dry-run).
    "qwen3-tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, tie_word_embeddings=False),
}


def init_random_(module: nn.Module, seed: int = 0, std: float = 0.02) -> nn.Module:
    """Fill a module in place: N(0, std) for matrices and embeddings, 1 for norms (named `*norm.weight`, or
    the weight of any norm module), 0 for biases. Then every submodule with an `init_()` method runs it (in
    module order): a new head that wants its own initialisation says so there, as this fill overwrites
    whatever its __init__ set."""
    device = next(module.parameters()).device
    if device.type == "meta":  # shapes only
        return module
    g = torch.Generator(device=device).manual_seed(seed)
    norms = {id(m.weight) for m in module.modules()
             if isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, RMSNorm)) and getattr(m, "weight", None) is not None}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight") or id(p) in norms:
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=g)
        for m in module.modules():
            if callable(getattr(m, "init_", None)):
                m.init_()
    return module


def random_target(preset: str, device="cpu", dtype=torch.bfloat16, seed: int = 0) -> Transformer:
    """A real-shaped Qwen3 (`PRESETS`) with random weights, allocated once on `device`."""
    if preset not in PRESETS:
        raise UserError(f"--random-init: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    args = ModelArgs(**PRESETS[preset])
    with torch.device("meta"):
        model = Transformer(args)
    model = model.to(dtype).to_empty(device=device)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return init_random_(model, seed).eval().requires_grad_(False).fuse_()


# ----------------------------------------------------------------------------------------
# Loading safetensors checkpoints

#: The dtypes a weight may be stored in; quantized formats (FP8, FP4) are refused by name.
WEIGHT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _shard_keys(path: str) -> set:
    """The tensor names in a safetensors file's header (the data is not read)."""
    from safetensors import safe_open
    from safetensors import SafetensorError

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            return set(f.keys())
    except (SafetensorError, OSError) as e:
        raise UserError(f"{path}: cannot read safetensors ({e})") from None


def safetensors_files(directory: str) -> list[str]:
    """The weight files of a checkpoint directory: one `model.safetensors`, or the shards that
    `model.safetensors.index.json` names — each holding exactly the tensors the index maps to it, and no
    other `model*.safetensors` beside them (a shard the index forgot would be dropped without a word)."""
    single = os.path.join(directory, "model.safetensors")
    index = os.path.join(directory, "model.safetensors.index.json")
    if optional_file(index):
        if os.path.lexists(single):  # transformers would read the one file, this loader the shards: say which
            raise UserError(f"{directory}: both model.safetensors and model.safetensors.index.json are there; "
                            f"which is the checkpoint is ambiguous (remove one)")
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise UserError(f"{index}: missing or empty 'weight_map'")
        bad = [(k, f) for k, f in weight_map.items() if not isinstance(f, str) or not f or os.path.basename(f) != f]
        if bad:
            raise UserError(f"{index}: weight_map[{bad[0][0]!r}] must be a shard file name in the directory, "
                            f"got {bad[0][1]!r}")
        files = sorted(set(weight_map.values()))
        for f in files:
            path = os.path.join(directory, f)
            if not os.path.isfile(path):
                raise UserError(f"{index}: shard {f!r} not found in {directory}")
            held = _shard_keys(path)
            absent = sorted(k for k, v in weight_map.items() if v == f and k not in held)
            if absent:
                raise UserError(f"{index}: maps tensor {absent[0]!r} to {f!r}, which does not hold it")
            unlisted = sorted(k for k in held if weight_map.get(k) != f)
            if unlisted:
                k = unlisted[0]
                where = "does not list it" if k not in weight_map else f"maps it to {weight_map[k]!r}"
                raise UserError(f"{path}: holds tensor {k!r}, but {index} {where}")
        # A shard of the index's own series it does not name (model-0000N-of-0000M.safetensors) would be dropped;
        # other files — a variant's shards (model.fp16-...), a consolidated copy — are not this checkpoint's,
        # and transformers leaves them too.
        stray = sorted(f for f in os.listdir(directory)
                       if re.fullmatch(r"model-\d+-of-\d+\.safetensors", f) and f not in weight_map.values())
        if stray:
            raise UserError(f"{os.path.join(directory, stray[0])}: a weight file that {index} does not name "
                            f"(its tensors would be left out; remove it or list them in the index)")
        return [os.path.join(directory, f) for f in files]
    if os.path.isfile(single):
        return [single]
    raise UserError(f"{directory}: no model.safetensors or model.safetensors.index.json")


def read_safetensors(files: Sequence[str], dtype: torch.dtype, device, rename=lambda k: k) -> dict:
    """Read every tensor of the files, converting them to `dtype` on `device`: each must be stored in
    one of `WEIGHT_DTYPES` and be finite after the conversion (a float32 weight beyond float16's range
    is refused here, naming it, not found as infinite logits later).

    `rename` maps a file key to a model key. Duplicate keys across shards are an error.
    """
    from safetensors import safe_open
    from safetensors import SafetensorError

    out = {}
    for path in files:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = rename(key)
                    if name in out:
                        raise UserError(f"{path}: tensor {key!r} appears twice in the checkpoint")
                    t = f.get_tensor(key)
                    if t.dtype not in WEIGHT_DTYPES:  # every weight of these models is a plain float
                        what = ("a quantized format (not supported: use the unquantized checkpoint)"
                                if t.is_floating_point() else "not a floating-point weight")
                        raise UserError(f"{path}: tensor {key!r} is {str(t.dtype).removeprefix('torch.')}, {what}")
                    v = t.to(device, dtype)
                    if not torch.isfinite(v).all():
                        if not torch.isfinite(t).all():
                            raise UserError(f"{path}: tensor {key!r} holds NaN or infinite values")
                        raise UserError(f"{path}: tensor {key!r} overflows {str(dtype).removeprefix('torch.')} "
                                        f"(largest magnitude {t.abs().max().item():.4g}): load it in a wider dtype")
                    out[name] = v
        except (SafetensorError, OSError) as e:
            raise UserError(f"{path}: cannot read safetensors ({e})") from None
    return out


def assign_strict(module: nn.Module, tensors: dict, source: str):
    """Load `tensors` into `module` (built on the meta device) with assign=True.

    Every tensor must match a parameter by name and shape and every parameter must be
    loaded, else one line names the first that does not. Tied parameters are loaded once.
    """
    params = dict(module.named_parameters())  # tied weights appear once, under the first name
    for name in sorted(tensors):
        if name not in params:
            raise UserError(f"{source}: tensor {name!r} in the checkpoint matches no parameter of the model")
        if tuple(tensors[name].shape) != tuple(params[name].shape):
            raise UserError(
                f"{source}: tensor {name!r} has shape {list(tensors[name].shape)}, "
                f"the model expects {list(params[name].shape)}")
    for name in params:
        if name not in tensors:
            raise UserError(f"{source}: parameter {name!r} is missing from the checkpoint")
    module.load_state_dict(tensors, strict=False, assign=True)


def load_target(directory: str, device="cpu", dtype=torch.float32, fuse: bool = True) -> Transformer:
    """Build the target on the meta device and assign the checkpoint's tensors (about one copy in memory).
    With `fuse` (inference) the projections are then fused (`Transformer.fuse_`), one layer at a time;
    fuse=False for a model to train."""
    if not os.path.isdir(directory):
        raise UserError(f"{directory}: target directory not found")
    args = ModelArgs.from_hf_config(read_json(os.path.join(directory, "config.json")),
                                    os.path.join(directory, "config.json"))
    files = safetensors_files(directory)
    tensors = read_safetensors(files, dtype, device, rename=lambda k: k.removeprefix("model."))
    source = files[0] if len(files) == 1 else os.path.join(directory, "model.safetensors.index.json")
    if args.tie_word_embeddings and "lm_head.weight" in tensors:
        # Some exports write the tied head too; it is used only as a check that it is tied.
        head = tensors.pop("lm_head.weight")
        emb = tensors.get("embed_tokens.weight")
        if emb is None:
            raise UserError(f"{source}: parameter 'embed_tokens.weight' is missing from the checkpoint (it holds "
                            f"'lm_head.weight', and tie_word_embeddings is true)")
        if head.shape != emb.shape or not torch.equal(head, emb):
            raise UserError(f"{source}: tie_word_embeddings is true but 'lm_head.weight' differs from the embedding")
    with torch.device("meta"):
        model = Transformer(args)
    assign_strict(model, tensors, source)
    tensors.clear()  # the parameters hold them now: fusing frees each layer's pieces as it goes
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    return model.fuse_() if fuse else model
