"""The target: a pure-PyTorch Qwen3 dense decoder with a static KV cache written at per-row
positions (rollback is moving a length: a query at p reads only keys <= p). `capture=` returns the
drafter's features from the same pass; `ragged=` runs requests of different lengths flattened.
On CPU in float32, support/cpu_kernels.py takes over the linear layers' forwards,
`Attention.project` and few-token attention (`cpu_kernels=False` at load, or
DSPARK_CPU_KERNELS=0, keeps this file's code)."""

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
    float32 = x.dtype == weight.dtype == torch.float32
    on_cpu = x.device.type == "cpu"
    if float32 and on_cpu:  # PyTorch's fused op
        normed = F.rms_norm(x, (x.shape[-1],), None, eps)
        return weight * normed
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)
    return weight * normed.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps)


def rope_table(head_dim: int, theta: float, max_seq: int, device) -> torch.Tensor:
    """cos, sin for positions 0..max_seq-1: float32 [max_seq, 2, head_dim]."""
    even = torch.arange(0, head_dim, 2, device=device).float()
    exponents = even / head_dim
    inv_freq = 1.0 / theta ** exponents  # [head_dim / 2]
    positions = torch.arange(max_seq, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)  # [max_seq, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [max_seq, head_dim]
    cos = emb.cos()
    sin = emb.sin()
    return torch.stack((cos, sin), dim=1)


class Rope(NamedTuple):
    """RoPE at a forward's positions, made once for all layers; rotate_half's sign is folded
    into sin."""
    cos: torch.Tensor
    sin: torch.Tensor

    @staticmethod
    def at(cos_sin: torch.Tensor, dtype: torch.dtype) -> "Rope":
        cos = cos_sin[:, :, 0].unsqueeze(2).to(dtype)  # [B, T, 1, hd]: the same for every head
        sin = cos_sin[:, :, 1].unsqueeze(2).to(dtype)
        half = sin.shape[-1] // 2
        first = -sin[..., :half]  # rotate_half(x) = [-x2, x1]: the sign moves onto sin
        second = sin[..., half:]
        signed_sin = torch.cat((first, second), dim=-1)
        return Rope(cos, signed_sin)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, heads, hd]
        half = x.shape[-1] // 2
        rotated = x.roll(half, -1)  # [x1, x2] -> [x2, x1]: rotate_half, its sign in sin
        return x * self.cos + rotated * self.sin


class KVCache(nn.Module):
    def __init__(self, max_batch: int, max_seq: int, kv_heads: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (max_batch, max_seq, kv_heads, head_dim)
        k = torch.zeros(shape, dtype=dtype, device=device)
        v = torch.zeros(shape, dtype=dtype, device=device)
        self.register_buffer("k", k, persistent=False)
        self.register_buffer("v", v, persistent=False)

    def write(self, positions, k, v, rows=None):
        """k, v [B, T, kv_heads, hd] at positions [B, T] of rows 0..B-1, or of `rows` [B]."""
        if rows is None:
            rows = torch.arange(positions.shape[0], device=positions.device)
        row_index = rows[:, None].expand_as(positions)  # [B, T]
        index = (row_index, positions)
        self.k.index_put_(index, k)
        self.v.index_put_(index, v)

    def read(self, batch: int, rows, length: int):
        """K, V [B, length, kv_heads, hd] of rows 0..batch-1 (a view) or `rows` (a copy)."""
        if rows is None:
            k = self.k[:batch, :length]
            v = self.v[:batch, :length]
        else:
            k = self.k[rows, :length]
            v = self.v[rows, :length]
        return k, v


def caches_fit(model: nn.Module, max_batch: int, max_seq: int, dtype: torch.dtype) -> bool:
    """Whether `model.layers` hold caches of this size and dtype (`make_caches` keeps them)."""
    kv = model.layers[0].self_attn.kv_cache
    if kv is None:
        return False
    same_size = tuple(kv.k.shape[:2]) == (max_batch, max_seq)
    return same_size and kv.k.dtype == dtype


def make_caches(model: nn.Module, args: ModelArgs, max_batch: int, max_seq: int,
                like: torch.Tensor):
    """Give each of `model.layers` a cache and `model` its RoPE table (`args`'), unless it has them at
    this size and dtype (compiled graphs hold the old tensors). True when it made new ones."""
    if caches_fit(model, max_batch, max_seq, like.dtype):
        return False
    for layer in model.layers:
        a = layer.self_attn
        a.kv_cache = KVCache(max_batch, max_seq, a.n_kv, a.head_dim, like.dtype, like.device)
    rope = rope_table(args.head_dim, args.rope_theta, max_seq, like.device)
    model.register_buffer("rope", rope, persistent=False)
    return True


def attend(q, k, v, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Cache-free attention: q [B, Tq, H, hd] over k, v [B, Tk, Hkv, hd] -> [B, Tq, H*hd] under
    mask [B, Tq, Tk] (True = may attend, or an additive bias), or causal."""
    B, Tq, H, hd = q.shape
    enable_gqa = k.shape[2] != H
    q = q.transpose(1, 2)  # [B, H, Tq, hd]
    k = k.transpose(1, 2)
    v = v.transpose(1, 2)
    attn_mask = None
    if mask is not None:
        attn_mask = mask[:, None]  # [B, 1, Tq, Tk]
    causal = mask is None
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=causal, enable_gqa=enable_gqa
    )
    out = out.transpose(1, 2)  # [B, Tq, H, hd]
    return out.reshape(B, Tq, H * hd)


ATTEND_BUCKET = 64  # eager attention reads the filled cache prefix rounded up to this


def attended_length(end: torch.Tensor, max_seq: int) -> int:
    """Cache positions read when no query sees past `end`: compiled, all (a static shape);
    eager, the filled prefix rounded up to ATTEND_BUCKET."""
    if torch.compiler.is_compiling():
        return max_seq
    filled = int(end.max())
    buckets = -(-filled // ATTEND_BUCKET)  # rounded up
    return min(max_seq, buckets * ATTEND_BUCKET)


def fold_gqa(device) -> bool:
    """CUDA: fold GQA into the query length (a mask with enable_gqa runs SDPA's math kernel)."""
    return torch.device(device).type == "cuda"


def cache_bias(allowed: torch.Tensor, group: int, dtype) -> torch.Tensor:
    """allowed [B, T, S] bool -> additive [B, 1, group*T, S], rows repeated per folded head."""
    B, T, S = allowed.shape
    bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    bias.masked_fill_(~allowed, float("-inf"))
    bias = bias[:, None, None]  # [B, 1, 1, T, S]
    bias = bias.expand(B, 1, group, T, S)
    return bias.reshape(B, 1, group * T, S)


def model_cache_bias(allowed: torch.Tensor, args: ModelArgs, dtype,
                     fold: bool = True) -> torch.Tensor:
    """`cache_bias` for a model of `args`, GQA folded where `fold_gqa` says (fold False: the caller's
    attention reads the bias unfolded)."""
    group = 1
    if fold and fold_gqa(allowed.device):
        group = args.num_attention_heads // args.num_key_value_heads
    return cache_bias(allowed, group, dtype)


def causal_cache_bias(positions: torch.Tensor, max_seq: int, args: ModelArgs, dtype,
                      fold: bool = True) -> torch.Tensor:
    """`model_cache_bias` of a pass through the cache at positions [B, T], each seeing the cache
    up to itself."""
    S = attended_length(positions + 1, max_seq)
    keys = torch.arange(S, device=positions.device)
    allowed = positions[:, :, None] >= keys  # [B, T, S]
    return model_cache_bias(allowed, args, dtype, fold=fold)


def attend_cached(q, k, v, bias) -> torch.Tensor:
    """q [B, T, H, hd] over cache k, v [B, S, Hkv, hd] under `cache_bias` -> [B, T, H*hd]; folded
    (bias rows g*T), head h reads K/V head h // g as g*T query rows."""
    B, T, H, hd = q.shape
    Hkv = k.shape[2]
    g = bias.shape[2] // T
    if g == 1:  # not folded: the cache-free attention under this bias
        return attend(q, k, v, bias[:, 0])
    k = k.transpose(1, 2)  # [B, Hkv, S, hd]
    v = v.transpose(1, 2)
    q = q.view(B, T, Hkv, g, hd)
    q = q.permute(0, 2, 3, 1, 4)  # [B, Hkv, g, T, hd]
    q = q.reshape(B, Hkv, g * T, hd)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    out = out.view(B, Hkv, g, T, hd)
    out = out.permute(0, 3, 1, 2, 4)  # [B, T, Hkv, g, hd]
    return out.reshape(B, T, H * hd)


@dataclass
class Ragged:
    """Where N flattened tokens sit in a padded [R, W] layout (request r: columns 0..counts[r]-1),
    for attention (`pad`, `unpad`); tokens past sum(counts) land in spare places nothing reads."""
    index: torch.Tensor    # [N] r * W + column; padding R * W + i
    rows: torch.Tensor     # [N] the request of each token (padding: R - 1)
    columns: torch.Tensor  # [N] its column (padding: 0)
    R: int
    W: int

    @staticmethod
    def build(counts: torch.Tensor, width: int, num_tokens: int) -> "Ragged":
        """counts [R]: each request's tokens, at most `width` (W); num_tokens: N, the flattened length."""
        R = counts.shape[0]
        W = width
        ends = torch.cumsum(counts, 0)
        i = torch.arange(num_tokens, device=counts.device)
        rows = torch.searchsorted(ends, i, right=True)
        real = rows < R
        rows = rows.clamp(max=R - 1)
        starts = ends - counts
        offsets = i - starts[rows]
        columns = torch.where(real, offsets, 0)
        padded = rows * W + columns
        spare = R * W + i
        index = torch.where(real, padded, spare)
        return Ragged(index, rows, columns, R, W)

    def flatten(self, x):  # [R, W, ...] -> [1, N, ...]
        tokens = x[self.rows, self.columns]  # [N, ...]
        return tokens[None]

    def pad(self, x):  # [1, N, ...] -> [R, W, ...], zeros where no token is
        N = x.shape[1]
        rest = x.shape[2:]
        size = self.R * self.W
        out = x.new_zeros((size + N, *rest))
        tokens = x[0]
        out = out.index_copy(0, self.index, tokens)
        filled = out[:size]
        return filled.view(self.R, self.W, *rest)

    def unpad(self, x):  # [R, W, ...] -> [1, N, ...]; padding tokens read the last slot
        size = self.R * self.W
        index = self.index.clamp(max=size - 1)
        flat = x.reshape(size, *x.shape[2:])  # [R*W, ...]
        tokens = flat.index_select(0, index)  # [N, ...]
        return tokens[None]


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, input_size: Optional[int] = None):
        super().__init__()
        self.n_heads = a.num_attention_heads
        self.n_kv = a.num_key_value_heads
        self.head_dim = a.head_dim
        q_size = self.n_heads * a.head_dim
        kv_size = 2 * self.n_kv * a.head_dim  # [k; v]
        bias = a.attention_bias
        if input_size is None:
            input_size = a.hidden_size  # the residual stream (Eagle3's layer reads 2H: [embedding; hidden])
        self.q_proj = nn.Linear(input_size, q_size, bias=bias)
        self.kv_proj = nn.Linear(input_size, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, a.hidden_size, bias=bias)
        self.q_norm = RMSNorm(a.head_dim, a.rms_norm_eps)  # per head, before RoPE
        self.k_norm = RMSNorm(a.head_dim, a.rms_norm_eps)
        self.kv_cache: Optional[KVCache] = None
        self.cache_attention = attend_cached  # a backend may install its own (`cpu_kernels.install`)

    def project(self, x):
        """q_proj(x) and kv_proj(x); a backend may compute both in one pass over the weights."""
        return self.q_proj(x), self.kv_proj(x)

    def qkv(self, x, rope: Rope):
        """q [B, T, heads, hd] and K, V [B, T, kv_heads, hd] of x, q and K normed and rotated."""
        B, T, _ = x.shape
        q, kv = self.project(x)
        q = q.view(B, T, self.n_heads, self.head_dim)
        q = self.q_norm(q)
        q = rope(q)
        k, v = self.kv(x, rope, kv)
        return q, k, v

    def kv(self, x, rope: Rope, kv=None):
        """K (normed, rotated) and V of x [B, T, H] (or of its kv_proj output `kv`):
        [B, T, kv_heads, hd] each."""
        B, T, _ = x.shape
        if kv is None:
            kv = self.kv_proj(x)
        kv = kv.view(B, T, 2 * self.n_kv, self.head_dim)
        k, v = kv.chunk(2, dim=2)
        k = self.k_norm(k)
        return rope(k), v

    def forward(
        self,
        x,
        rope: Rope,
        positions=None,
        mask=None,
        *,
        ragged: Optional[Ragged] = None,
        rows=None,
        prefix_kv=None,
        attention=None,
        slots=None,
    ):
        """x [B, T, H] -> [B, T, H]: through the cache at `positions` (its K/V written there, or at
        `slots`: a draft tree's); else over `prefix_kv` then its own keys under `mask` (drafter
        training); else cache-free causal."""
        q, k, v = self.qkv(x, rope)
        if positions is None:
            if prefix_kv is not None:
                prefix_k, prefix_v = prefix_kv
                k = torch.cat([prefix_k, k], 1)
                v = torch.cat([prefix_v, v], 1)
            out = attend(q, k, v, mask)
            return self.o_proj(out)
        if ragged is not None:  # [1, N, heads, hd] -> [R, W, heads, hd]
            q = ragged.pad(q)
            k = ragged.pad(k)
            v = ragged.pad(v)
        if slots is None:
            slots = positions
        self.kv_cache.write(slots, k, v, rows)
        batch = positions.shape[0]  # rows of the cache layout (R when ragged)
        length = mask.shape[-1]  # cache positions attended
        k, v = self.kv_cache.read(batch, rows, length)
        cache_attention = attention or self.cache_attention  # a kernel passed in wins
        out = cache_attention(q, k, v, mask)
        if ragged is not None:
            out = ragged.unpad(out)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        # gate and up fused: [gate; up]
        self.gate_up_proj = nn.Linear(a.hidden_size, 2 * a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        x = F.silu(gate) * up
        return self.down_proj(x)


class DecoderLayer(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, rope, positions=None, mask=None, **kw):
        residual = x
        x = self.input_layernorm(x)
        x = self.self_attn(x, rope, positions, mask, **kw)
        x = residual + x
        residual = x
        x = self.post_attention_layernorm(x)
        x = self.mlp(x)
        return residual + x


class Transformer(nn.Module):
    """Qwen3 causal LM; parameter names are Hugging Face's without `model.` (k/v and gate/up
    fused)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def setup_caches(self, max_batch: int, max_seq: int):
        """Static KV caches and the RoPE table, kept when asked again for the same size."""
        make_caches(self, self.args, max_batch, max_seq, self.embed_tokens.weight)

    @property
    def max_seq(self) -> int:
        """The positions a row of the caches holds."""
        return self.layers[0].self_attn.kv_cache.k.shape[1]

    def hidden(
        self,
        tokens,
        positions=None,
        *,
        capture: Sequence[int] = (),
        ragged=None,
        rows=None,
        index=None,
        mask=None,
        attention=None,
        tree_slots: Optional["TreeSlots"] = None,
    ):
        """tokens [B, T] -> (normed hidden [B, T, H], features [B, T, len(capture)*H] or None):
        the outputs of layers `capture` (-1: embeddings). index [B]: one token per row (into T).
        With `positions` [B, T] the pass goes through the KV cache (in cache `rows`, or 0 .. B-1),
        `mask` unread; `ragged`: the tokens are [1, N], flattened from positions' layout; `attention`:
        a kernel in place of the cache attention. Without, a cache-free pass: causal, or under `mask`.
        `tree_slots`: the tokens are a draft tree's nodes, at RoPE `positions` (the anchor's plus their
        depths) and cache slots of their own, each seeing the context and its ancestors."""
        a = self.args
        dtype = self.embed_tokens.weight.dtype
        slots = None  # a tree's cache slots
        if positions is None:
            B, T = tokens.shape
            table = rope_table(a.head_dim, a.rope_theta, T, tokens.device)  # [T, 2, hd]
            per_row = (B, T, *table.shape[1:])
            cos_sin = table[None].expand(per_row)  # [B, T, 2, hd]
        else:  # through the cache: RoPE and the additive mask (a bias) once for every layer
            fold = attention is None  # a kernel passed in folds GQA itself
            if tree_slots is None:
                mask = causal_cache_bias(positions, self.max_seq, a, dtype, fold=fold)
            else:
                slots = tree_slots.slots()
                S = attended_length(slots + 1, self.max_seq)
                keys = torch.arange(S, device=positions.device)
                allowed = tree_slots.visible(keys)  # [B, T, S]: the context and the node's ancestors
                mask = model_cache_bias(allowed, a, dtype, fold=fold)
            rope_positions = positions
            if ragged is not None:
                rope_positions = ragged.flatten(positions)  # [1, N]
            cos_sin = self.rope[rope_positions]  # [B, T, 2, hd] ([1, N, 2, hd] ragged)
        rope = Rope.at(cos_sin, dtype)
        x = self.embed_tokens(tokens)
        wanted = set(capture)  # only these layers' outputs are kept
        captured = {}
        if -1 in wanted:
            captured[-1] = x
        options = dict(ragged=ragged, rows=rows, attention=attention, slots=slots)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, positions, mask, **options)
            if i in wanted:
                captured[i] = x
        features = None
        if capture:
            outputs = [captured[i] for i in capture]
            features = torch.cat(outputs, dim=-1)  # [B, T, len(capture)*H]
        if index is not None:
            batch = torch.arange(x.shape[0], device=x.device)
            x = x[batch, index]  # [B, H]
        return self.norm(x), features

    def forward(self, tokens, positions=None, *, logits_index=None, **options):
        """(logits [B, T, V], or [B, V] at `logits_index`; features): `hidden` with its `options`."""
        h, features = self.hidden(tokens, positions, index=logits_index, **options)
        logits = self.lm_head(h)
        return logits, features

    def move_cache(self, source, destination):
        """Every layer's K/V at cache positions `source` [B, T] copied to `destination` [B, T] (all
        read before any is written): a draft tree's accepted path moved to consecutive positions."""
        rows = torch.arange(source.shape[0], device=source.device)
        rows = rows[:, None]  # [B, 1]
        for layer in self.layers:
            cache = layer.self_attn.kv_cache
            k = cache.k[rows, source]
            v = cache.v[rows, source]
            cache.k[rows, destination] = k
            cache.v[rows, destination] = v


class TreeSlots(NamedTuple):
    """Where the T nodes of a batch of draft trees sit in the target's cache: node j of row b at
    slot start[b] + j (its RoPE position is its depth's); node i sees every position before start[b]
    and the slots of its ancestors and itself."""
    start: torch.Tensor      # [B] the root's position (the anchor's)
    ancestors: torch.Tensor  # [B, T, T] bool: [b, i, j] node j is node i or an ancestor of it

    def slots(self) -> torch.Tensor:
        T = self.ancestors.shape[1]
        nodes = torch.arange(T, device=self.start.device)
        return self.start[:, None] + nodes  # [B, T]

    def visible(self, keys) -> torch.Tensor:
        """[B, T, S] bool over cache positions `keys` [S]."""
        B, T, _ = self.ancestors.shape
        offset = keys[None, :] - self.start[:, None]  # [B, S] a key's node index, if in the tree
        context = offset < 0
        inside = (offset >= 0) & (offset < T)
        S = keys.shape[0]
        node = offset.clamp(0, T - 1)
        node = node[:, None, :].expand(B, T, S)
        ancestor = self.ancestors.gather(2, node)
        in_tree = ancestor & inside[:, None, :]
        return context[:, None, :] | in_tree
