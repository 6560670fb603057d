"""Hot math of a speculative round, as plain-torch references.

Each function here has a fixed signature that a fast version (Triton, or a compiled fusion)
can later replace; the reference stays beside it and the tests hold the two equal.

Randomness: sampling uses the exponential race (argmax of p / E with E ~ Exp(1)), which
draws from p exactly and needs no host sync. Every sampled function takes its noise either
pre-drawn (`noise`, `u`: what the engine passes, drawn by `round_noise` outside any compiled
graph, so eager and compiled rounds see the same numbers) or from an explicit
`torch.Generator`, in a fixed order. Either way a seed makes a run repeatable.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch


class Filters(NamedTuple):
    """The sampling filters, applied after the temperature in this order (transformers' and vLLM's):
    top-k keeps the k most likely tokens (ties at the k-th value kept); top-p then keeps the most
    likely tokens whose probability, renormalised over what top-k left, adds up to at least p (the
    most likely token always stays); min-p then keeps the tokens at least min_p times as likely as
    the most likely one. The defaults switch each off. The engine applies the same filters to the
    target's and the drafter's distributions, so speculative sampling stays exact (docs/algorithm.md)."""
    top_k: int = 0       # 0: off
    top_p: float = 1.0   # 1.0: off
    min_p: float = 0.0   # 0.0: off

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


NO_FILTERS = Filters()


def filter_logits(z: torch.Tensor, f: Filters) -> torch.Tensor:
    """z [..., V] float32 logits already divided by the temperature -> z with -inf outside the kept set."""
    V = z.shape[-1]
    if 0 < f.top_k < V:
        kth = torch.topk(z, f.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if f.top_p < 1.0:
        # As transformers' TopPLogitsWarper: ascending order, drop the tokens whose cumulative
        # probability stays within 1 - p; the largest is never dropped.
        ordered, order = torch.sort(z, dim=-1, stable=True)
        cum = torch.softmax(ordered, dim=-1).cumsum(dim=-1)
        drop = cum <= 1 - f.top_p
        drop[..., -1] = False
        z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if f.min_p > 0.0:
        p = torch.softmax(z, dim=-1)
        z = z.masked_fill(p < f.min_p * p.amax(dim=-1, keepdim=True), float("-inf"))
    return z


def probs(logits: torch.Tensor, temperature: float, filters: Filters = NO_FILTERS) -> torch.Tensor:
    """softmax(logits / T) in float32, over the tokens the filters keep."""
    z = logits.float() / temperature
    return torch.softmax(filter_logits(z, filters) if filters.active else z, dim=-1)


def sample_from(p: torch.Tensor, generator: Optional[torch.Generator], noise: Optional[torch.Tensor] = None):
    """One id per row of p ([..., V], rows sum to 1) by the exponential race; noise ~ Exp(1), p's shape."""
    e = torch.empty_like(p).exponential_(1, generator=generator) if noise is None else noise
    return torch.argmax(p / e, dim=-1)


class Noise(NamedTuple):
    """All the randomness of one sampled round, in draw order."""
    chain: torch.Tensor  # [B, K, V] Exp(1): the Markov chain's exponential races
    u: torch.Tensor      # [B, K] uniforms of the acceptance tests
    bonus: torch.Tensor  # [B, V] Exp(1): the correction / bonus race


def round_noise(generator: Optional[torch.Generator], B: int, K: int, V: int, device) -> Noise:
    """A round's noise for B rows from one generator."""
    chain = torch.empty((B, K, V), device=device).exponential_(1, generator=generator)
    u = torch.rand((B, K), generator=generator, device=device)
    bonus = torch.empty((B, V), device=device).exponential_(1, generator=generator)
    return Noise(chain, u, bonus)


def rows_noise(generators: list, K: int, V: int, device) -> Noise:
    """One round's noise with every row's drawn from its own generator (its request's: so a request's
    samples do not depend on which rows it shares a batch with), in `round_noise`'s order; rows
    without a generator (free rows) get placeholders that nothing reads."""
    free = Noise(torch.ones((1, K, V), device=device), torch.zeros((1, K), device=device),
                 torch.ones((1, V), device=device))
    rows = [round_noise(g, 1, K, V, device) if g is not None else free for g in generators]
    return Noise(*(torch.cat(parts) for parts in zip(*rows)))


def sample(logits: torch.Tensor, temperature: float, generator: Optional[torch.Generator],
           noise: Optional[torch.Tensor] = None, *, filters: Filters = NO_FILTERS) -> torch.Tensor:
    """argmax at T=0 (which every filter keeps), else a draw from softmax(logits / T) over what the
    filters keep. logits [..., V] -> ids [...]. noise: the race's Exp(1) noise, logits' shape (else
    drawn from `generator`)."""
    if temperature == 0:
        return torch.argmax(logits, dim=-1)
    return sample_from(probs(logits, temperature, filters), generator, noise)


def markov_chain(base_logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor, markov,
                 temperature: float, generator: Optional[torch.Generator], noise: Optional[torch.Tensor] = None,
                 *, filters: Filters = NO_FILTERS):
    """The sequential stage (docs/algorithm.md, "Markov heads"): draft K tokens left to right.

    base_logits: [B, K, V] (U_k), hidden: [B, K, H] (h_k), anchor: [B] (x_0).
    markov: a head with `step(h_k, prev_token, state) -> (bias [B, V], state)`, or None
    (DFlash: every slot is drawn from its own U_k).
    Returns drafts [B, K] and q [B, K, V], the distributions the drafts were drawn from
    (None at T=0, where verification is greedy and needs no q). noise: Exp(1) [B, K, V] or None.
    filters: each slot's q is filtered before its draw, as the target's p is in verification.
    """
    B, K, V = base_logits.shape
    drafts, qs = [], []
    prev, state = anchor, None  # the anchor feeds slot 1; afterwards the token sampled at k-1
    for k in range(K):
        z = base_logits[:, k]
        if markov is not None:
            bias, state = markov.step(hidden[:, k], prev, state)
            z = z + bias
        if temperature == 0:
            x = torch.argmax(z, dim=-1)
        else:
            q = probs(z, temperature, filters)
            x = sample_from(q, generator, None if noise is None else noise[:, k])
            qs.append(q)
        drafts.append(x)
        prev = x
    return torch.stack(drafts, 1), (torch.stack(qs, 1) if qs else None)


def verify_greedy(drafts: torch.Tensor, target_logits: torch.Tensor, verify_len: torch.Tensor):
    """Greedy acceptance. drafts [B, K]; target_logits [B, K+1, V] at the anchor and each draft;
    verify_len [B] (ℓ ≤ K drafts sent to the target).

    Accept x_k while x_k == argmax p_{k-1} and k ≤ ℓ; the next token is argmax p_n.
    Returns accepted n [B] and the token committed after them [B].
    """
    B, K = drafts.shape
    best = torch.argmax(target_logits, dim=-1)  # [B, K+1]
    ok = (drafts == best[:, :K]) & (torch.arange(K, device=drafts.device) < verify_len[:, None])
    n = torch.cumprod(ok.long(), dim=1).sum(1)
    return n, best.gather(1, n[:, None])[:, 0]


def verify_sampled(drafts: torch.Tensor, q: torch.Tensor, target_logits: torch.Tensor,
                   verify_len: torch.Tensor, temperature: float, generator: Optional[torch.Generator],
                   u: Optional[torch.Tensor] = None, noise: Optional[torch.Tensor] = None,
                   *, filters: Filters = NO_FILTERS):
    """Lossless rejection sampling (docs/algorithm.md, "One round", accept).

    drafts [B, K], q [B, K, V] (the draft distributions), target_logits [B, K+1, V], verify_len [B].
    Accept x_k if u_k < min(1, p_{k-1}(x_k) / q_k(x_k)); at the first rejection k sample the
    correction from normalize(max(p_{k-1} - q_k, 0)); if all ℓ pass, the bonus from p_ℓ.
    Draws: u [B, K] first, then one exponential race over [B, V] (or the given u and noise).
    p is the target's distribution after `filters` (the q given must be filtered alike).
    Returns accepted n [B] and the committed correction or bonus token [B].
    """
    B, K = drafts.shape
    p = probs(target_logits, temperature, filters)  # [B, K+1, V]
    if u is None:
        u = torch.rand((B, K), generator=generator, device=drafts.device)
    if K:
        p_x = p[:, :K].gather(2, drafts[:, :, None])[:, :, 0]
        q_x = q.gather(2, drafts[:, :, None])[:, :, 0]
        ok = (u * q_x < p_x) & (torch.arange(K, device=drafts.device) < verify_len[:, None])
        n = torch.cumprod(ok.long(), dim=1).sum(1)
    else:
        n = torch.zeros(B, dtype=torch.long, device=drafts.device)
    p_n = p.gather(1, n[:, None, None].expand(B, 1, p.shape[-1]))[:, 0]  # [B, V]
    if K:
        rejected = n < verify_len
        q_n = q.gather(1, n.clamp(max=K - 1)[:, None, None].expand(B, 1, q.shape[-1]))[:, 0]
        residual = torch.clamp(p_n - q_n, min=0)
        mass = residual.sum(-1, keepdim=True)
        # A rejection has probability 0 when p == q; guard the division all the same.
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_n)
        p_n = torch.where(rejected[:, None], residual, p_n)
    return n, sample_from(p_n, generator, noise)


# ----------------------------------------------------------------------------------------
# Fast versions: Triton kernels behind the references' signatures
#
# What is here, and why it is shaped this way:
# - `markov_chain_triton`: the vanilla Markov step (z_k = U_k + W2·W1[x_{k-1}], docs/algorithm.md)
#   as two launches per slot. Pass 1, grid (B, V/BLOCK_V): each program forms the bias for one
#   V-tile from a W1 row and a W2 tile, adds U_k, and writes only the tile's best (value,
#   first index) to a tiny [B, tiles] buffer. Pass 2, grid (B,): reduce the tiles, first index
#   on ties (like torch.argmax), and write x_k straight into the chain's token buffer, where the
#   next slot's pass 1 reads it: no host sync, no [B, V] bias. The batch is the fastest grid
#   axis, so the programs that share a W2 tile run together and the tile comes from L2.
#   Greedy (T=0) never materialises z. Sampled: the key is z/T − log E, the exponential race in
#   log space (argmax q/E == argmax (z/T − log E), q = softmax(z/T)), so the draw needs neither
#   the row's max nor its sum and stays one pass; the kernel also writes z (float32) to a
#   [B, K, V] buffer, and q = softmax(z/T) for verification is one batched torch softmax after
#   the chain, off its sequential critical path.
# - `verify_greedy_triton`: per-(row, position, V-tile) partial argmax, then one program per
#   row that reduces the tiles for all K+1 positions and fuses the prefix-acceptance count and
#   the committed token.
# - `verify_sampled_triton`: partial softmax statistics (tile max, tile sum of exp), one program
#   per row for the acceptance test u·q(x) < p(x) and n, then one pass over the committed
#   position's row that races both p_n/E and max(p_n − q_n, 0)/E (and sums the residual), and a
#   last tiny pass that picks the correction (rejection with positive residual mass) or the bonus.
#
# Rounding follows the references: z is rounded to the dtype torch would give it (the bias to
# W2's dtype, then U + bias to their promoted dtype), so in bf16 the argmax sees the same
# rounded values. Accumulation order differs from torch's matmul and softmax, so values can
# differ in the last float bits: tokens agree except where two candidates are within that
# rounding (a measure-zero event for the sampled race; exact ties in exactly representable
# values resolve to the first index, as torch.argmax does). NaN logits are not handled like
# torch.argmax (which returns the NaN's index). Token ids are not range-checked (the reference's
# embedding would raise; here it would read out of bounds), to stay free of host syncs.
#
# When each runs: the *_triton functions run Triton on CUDA tensors, or on any tensors when
# triton was imported with TRITON_INTERPRET=1 and the variable is still set (Triton's CPU
# interpreter: the tests). Otherwise (no triton, CPU tensors without the interpreter, CPU
# tensors under torch.compile), for a head that is not the vanilla Markov head (gated, rnn,
# None), for K = 0 in the chain, or for dtypes other than float32/bfloat16/float16, they fall
# back to the reference of the same name, which gives the same results. An engine binds one set,
# `kernel_set("torch")` or `kernel_set("triton")`, when it is built.

import importlib.util
import os

# triton is imported on first use, not here: Triton decides "interpreter or GPU" for its own
# language functions when it is imported (from TRITON_INTERPRET), so a test that sets the
# variable after another module imported this one can still use the interpreter.
HAVE_TRITON = importlib.util.find_spec("triton") is not None
FAST_KERNELS = HAVE_TRITON and torch.cuda.is_available()
triton = tl = None  # set by _import_triton()
_TRITON_IMPORT_INTERPRET = None  # whether triton's language functions are the interpreter's


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _import_triton() -> bool:
    """Import triton (once); False when it is not installed."""
    global triton, tl, _TRITON_IMPORT_INTERPRET, HAVE_TRITON, FAST_KERNELS
    if triton is None and HAVE_TRITON:
        try:
            import triton as _triton
            import triton.language as _tl
        except ImportError:  # found but broken: behave as if absent
            HAVE_TRITON = FAST_KERNELS = False
            return False
        triton, tl = _triton, _tl
        # Whoever imported triton first fixed the mode; its language functions say which.
        probe = getattr(getattr(_tl, "standard", None), "sum", None)
        _TRITON_IMPORT_INTERPRET = (type(probe).__name__ == "InterpretedFunction" if probe is not None
                                    else _interpreting())
    return triton is not None


#: Tile sizes (module constants so the tests can shrink them to get many tiles from a small V).
TRITON_BLOCK_V = 128   # vocabulary entries per program
TRITON_BLOCK_R = 64    # Markov-rank chunk of the W1·W2 product held in registers at once

_ROUND_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _round_to(x, CODE: tl.constexpr):
    """float32 x rounded to bfloat16 (CODE 1) or float16 (CODE 2), kept as float32. bf16 by bits:
    round to nearest even (the interpreter's bf16 cast truncates, the GPU's rounds; this agrees)."""
    if CODE == 1:
        b = x.to(tl.uint32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
        x = b.to(tl.float32, bitcast=True)
    elif CODE == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


def _markov_partial_kernel(u_ptr, u_off, s_u, chain_ptr, s_chain, k, w1_ptr, s_w1, w2_ptr, s_w2,
                           noise_ptr, noise_off, s_noise, z_ptr, z_off, s_z, pval_ptr, pidx_ptr,
                           n_tiles, V, temperature, R: tl.constexpr,
                           SAMPLED: tl.constexpr, BIAS_ROUND: tl.constexpr, Z_ROUND: tl.constexpr,
                           BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr):
    """Pass 1 of a Markov step: one (row b, V-tile) -> that tile's best key and its first index."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    prev = tl.load(chain_ptr + b * s_chain + k).to(tl.int64)  # x_{k-1} (column 0: the anchor)
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    # R (the Markov rank, fixed per checkpoint) is a constexpr: the loop's bounds are known when the
    # kernel compiles (one specialisation per rank; the compiler may unroll), and Triton 3.6's
    # interpreter cannot iterate a range over a runtime scalar (3.9's can).
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        rmask = rs < R
        e = tl.load(w1_ptr + prev * s_w1 + rs, mask=rmask, other=0.0).to(tl.float32)
        w = tl.load(w2_ptr + cols.to(tl.int64)[:, None] * s_w2 + rs[None, :],
                    mask=cmask[:, None] & rmask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * e[None, :], axis=1)
    bias = _round_to(acc, BIAS_ROUND)
    u = tl.load(u_ptr + u_off + b * s_u + cols, mask=cmask, other=0.0).to(tl.float32)
    z = _round_to(u + bias, Z_ROUND)
    if SAMPLED:
        tl.store(z_ptr + z_off + b * s_z + cols, z, mask=cmask)
        noise = tl.load(noise_ptr + noise_off + b * s_noise + cols, mask=cmask, other=1.0)
        key = z / temperature - tl.log(noise)
    else:
        key = z
    key = tl.where(cmask, key, float("-inf"))
    best = tl.max(key, axis=0)
    idx = tl.min(tl.where(key == best, cols, 2147483647), axis=0)
    tl.store(pval_ptr + b * n_tiles + t, best)
    tl.store(pidx_ptr + b * n_tiles + t, idx)


def _markov_reduce_kernel(pval_ptr, pidx_ptr, n_tiles, chain_ptr, s_chain, k, BLOCK_T: tl.constexpr):
    """Pass 2: the row's best over its tiles (first index on ties) -> chain[b, k + 1] = x_k."""
    b = tl.program_id(0).to(tl.int64)
    ts = tl.arange(0, BLOCK_T)
    tmask = ts < n_tiles
    val = tl.load(pval_ptr + b * n_tiles + ts, mask=tmask, other=float("-inf"))
    idx = tl.load(pidx_ptr + b * n_tiles + ts, mask=tmask, other=2147483647)
    best = tl.max(val, axis=0)
    x = tl.min(tl.where(tmask & (val == best), idx, 2147483647), axis=0)
    tl.store(chain_ptr + b * s_chain + k + 1, x.to(tl.int64))


def _rows_argmax_partial_kernel(x_ptr, s_row, pval_ptr, pidx_ptr, n_tiles, V, BLOCK_V: tl.constexpr):
    """Per (row, V-tile) of a [rows, V] matrix: the tile's max and its first index."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    x = tl.load(x_ptr + row * s_row + cols, mask=cmask, other=float("-inf")).to(tl.float32)
    best = tl.max(x, axis=0)
    idx = tl.min(tl.where(cmask & (x == best), cols, 2147483647), axis=0)
    tl.store(pval_ptr + row * n_tiles + t, best)
    tl.store(pidx_ptr + row * n_tiles + t, idx)


def _verify_greedy_reduce_kernel(pval_ptr, pidx_ptr, n_tiles, drafts_ptr, vlen_ptr, n_ptr, next_ptr, K,
                                 BLOCK_J: tl.constexpr, BLOCK_T: tl.constexpr):
    """One row: argmax of each of the K+1 positions from its tiles, then n and the next token."""
    b = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, BLOCK_J)
    ts = tl.arange(0, BLOCK_T)
    m2 = (js[:, None] <= K) & (ts[None, :] < n_tiles)
    off = (b * (K + 1) + js[:, None]) * n_tiles + ts[None, :]
    val = tl.load(pval_ptr + off, mask=m2, other=float("-inf"))
    idx = tl.load(pidx_ptr + off, mask=m2, other=2147483647)
    rbest = tl.max(val, axis=1)
    best = tl.min(tl.where(m2 & (val == rbest[:, None]), idx, 2147483647), axis=1).to(tl.int64)  # [J]
    is_draft = js < K
    d = tl.load(drafts_ptr + b * K + js, mask=is_draft, other=-1)
    vl = tl.load(vlen_ptr + b)
    ok = (d == best) & (js < vl) & is_draft
    n = tl.min(tl.where(is_draft & (ok == 0), js, K), axis=0)  # leading accepted drafts
    nxt = tl.sum(tl.where(js == n, best, 0), axis=0)
    tl.store(n_ptr + b, n.to(tl.int64))
    tl.store(next_ptr + b, nxt.to(tl.int64))


def _rows_softmax_partial_kernel(x_ptr, s_row, pmax_ptr, psum_ptr, n_tiles, V, temperature,
                                 BLOCK_V: tl.constexpr):
    """Per (row, V-tile) of logits: max of x/T and the sum of exp(x/T − that max)."""
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    x = tl.load(x_ptr + row * s_row + cols, mask=cmask, other=0.0).to(tl.float32) / temperature
    x = tl.where(cmask, x, float("-inf"))
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.exp(x - m_safe), axis=0)
    tl.store(pmax_ptr + row * n_tiles + t, m)
    tl.store(psum_ptr + row * n_tiles + t, s)


def _verify_sampled_accept_kernel(pmax_ptr, psum_ptr, n_tiles, logits_ptr, s_lrow, drafts_ptr, q_ptr, s_qrow,
                                  u_ptr, vlen_ptr, n_ptr, stat_ptr, K, temperature,
                                  BLOCK_J: tl.constexpr, BLOCK_T: tl.constexpr):
    """One row: softmax max/sum of each position, the acceptance test u·q(x) < p(x), n, and the
    committed position's statistics (max, sum, rejected) for the last pass."""
    b = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, BLOCK_J)
    ts = tl.arange(0, BLOCK_T)
    m2 = (js[:, None] <= K) & (ts[None, :] < n_tiles)
    off = (b * (K + 1) + js[:, None]) * n_tiles + ts[None, :]
    tm = tl.load(pmax_ptr + off, mask=m2, other=float("-inf"))
    ts_ = tl.load(psum_ptr + off, mask=m2, other=0.0)
    M = tl.max(tm, axis=1)  # [J]
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    S = tl.sum(tl.where(m2 & (tm > float("-inf")), ts_ * tl.exp(tm - M_safe[:, None]), 0.0), axis=1)
    is_draft = js < K
    d = tl.load(drafts_ptr + b * K + js, mask=is_draft, other=0).to(tl.int64)
    lx = tl.load(logits_ptr + (b * (K + 1) + js) * s_lrow + d, mask=is_draft, other=0.0).to(tl.float32)
    p_x = tl.exp(lx / temperature - M_safe) / tl.where(S > 0, S, 1.0)  # S is 0 only on padding lanes
    q_x = tl.load(q_ptr + (b * K + js) * s_qrow + d, mask=is_draft, other=1.0).to(tl.float32)
    u = tl.load(u_ptr + b * K + js, mask=is_draft, other=1.0).to(tl.float32)
    vl = tl.load(vlen_ptr + b)
    ok = (u * q_x < p_x) & (js < vl) & is_draft
    n = tl.min(tl.where(is_draft & (ok == 0), js, K), axis=0)
    rejected = n < vl  # read only when K > 0
    tl.store(n_ptr + b, n.to(tl.int64))
    tl.store(stat_ptr + b * 3, tl.sum(tl.where(js == n, M_safe, 0.0), axis=0))
    tl.store(stat_ptr + b * 3 + 1, tl.sum(tl.where(js == n, S, 0.0), axis=0))
    tl.store(stat_ptr + b * 3 + 2, rejected.to(tl.float32))


def _verify_sampled_race_kernel(logits_ptr, s_lrow, q_ptr, s_qrow, noise_ptr, s_noise, n_ptr, stat_ptr,
                                pval_ptr, pidx_ptr, rsum_ptr, n_tiles, V, K, temperature,
                                HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per (row, V-tile) of the committed position n: the race of p_n/E (bonus) and of
    max(p_n − q_n, 0)/E (correction), and the tile's residual mass."""
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    cols = t * BLOCK_V + tl.arange(0, BLOCK_V)
    cmask = cols < V
    n = tl.load(n_ptr + b)
    M = tl.load(stat_ptr + b * 3)
    S = tl.load(stat_ptr + b * 3 + 1)
    x = tl.load(logits_ptr + (b * (K + 1) + n) * s_lrow + cols, mask=cmask, other=0.0).to(tl.float32)
    p = tl.exp(x / temperature - M) / S
    noise = tl.load(noise_ptr + b * s_noise + cols, mask=cmask, other=1.0)
    key_p = tl.where(cmask, p / noise, float("-inf"))
    best_p = tl.max(key_p, axis=0)
    idx_p = tl.min(tl.where(cmask & (key_p == best_p), cols, 2147483647), axis=0)
    tl.store(pval_ptr + (b * n_tiles + t) * 2, best_p)
    tl.store(pidx_ptr + (b * n_tiles + t) * 2, idx_p)
    if HAS_Q:
        nq = tl.minimum(n, K - 1)
        q = tl.load(q_ptr + (b * K + nq) * s_qrow + cols, mask=cmask, other=0.0).to(tl.float32)
        r = tl.where(cmask, tl.maximum(p - q, 0.0), 0.0)
        key_r = tl.where(cmask, r / noise, float("-inf"))
        best_r = tl.max(key_r, axis=0)
        idx_r = tl.min(tl.where(cmask & (key_r == best_r), cols, 2147483647), axis=0)
        tl.store(pval_ptr + (b * n_tiles + t) * 2 + 1, best_r)
        tl.store(pidx_ptr + (b * n_tiles + t) * 2 + 1, idx_r)
        tl.store(rsum_ptr + b * n_tiles + t, tl.sum(r, axis=0))


def _verify_sampled_pick_kernel(pval_ptr, pidx_ptr, rsum_ptr, stat_ptr, next_ptr, n_tiles,
                                HAS_Q: tl.constexpr, BLOCK_T: tl.constexpr):
    """One row: the correction's winner if rejected with positive residual mass, else the bonus's."""
    b = tl.program_id(0).to(tl.int64)
    ts = tl.arange(0, BLOCK_T)
    tmask = ts < n_tiles
    vp = tl.load(pval_ptr + (b * n_tiles + ts) * 2, mask=tmask, other=float("-inf"))
    ip = tl.load(pidx_ptr + (b * n_tiles + ts) * 2, mask=tmask, other=2147483647)
    bp = tl.max(vp, axis=0)
    xp = tl.min(tl.where(tmask & (vp == bp), ip, 2147483647), axis=0)
    x = xp
    if HAS_Q:
        vr = tl.load(pval_ptr + (b * n_tiles + ts) * 2 + 1, mask=tmask, other=float("-inf"))
        ir = tl.load(pidx_ptr + (b * n_tiles + ts) * 2 + 1, mask=tmask, other=2147483647)
        br = tl.max(vr, axis=0)
        xr = tl.min(tl.where(tmask & (vr == br), ir, 2147483647), axis=0)
        mass = tl.sum(tl.load(rsum_ptr + b * n_tiles + ts, mask=tmask, other=0.0), axis=0)
        rejected = tl.load(stat_ptr + b * 3 + 2) > 0.5
        x = tl.where(rejected & (mass > 0), xr, xp)
    tl.store(next_ptr + b, x.to(tl.int64))


def _cached_attention_kernel(q_ptr, k_ptr, v_ptr, bias_ptr, out_ptr, m_ptr, l_ptr, acc_ptr, T, G, HKV, H,
                             s_qb, s_qt, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_bb, s_bt, scale,
                             S: tl.constexpr, HD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             SPLIT_KEYS: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr):
    """One (batch row, K/V head, block of query rows, split of the keys): the rows r = t * G + i
    (token t, head h * G + i) against keys z * SPLIT_KEYS .. (z + 1) * SPLIT_KEYS - 1 block by block,
    online softmax in float32. A block of keys none of these rows may see (its bias all -inf: past the
    filled prefix) is skipped without reading its K or V. PARTIAL: the split's running max, sum and
    weighted values go to m/l/acc for `cached_attention_triton` to combine; else (one split) the
    output. S, the cache length, is a constexpr like the Markov rank (one specialisation per length:
    a compiled graph's is fixed, eager's a multiple of model.ATTEND_BUCKET), and the loop's bounds
    constexprs, for Triton 3.6's interpreter. IEEE (float32 inputs): full-precision products, not the
    TF32 that tl.dot takes for float32 on a GPU by default."""
    pid = tl.program_id(0)
    b = pid // HKV
    h = pid % HKV
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T * G
    t = rows // G
    head = h * G + rows % G
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + b * s_qb + t[:, None] * s_qt + head[:, None] * s_qh + d[None, :], mask=rmask[:, None],
                other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    for j in range(0, SPLIT_KEYS, BLOCK_N):
        cols = tl.program_id(2) * SPLIT_KEYS + j + tl.arange(0, BLOCK_N)
        cmask = cols < S
        bias = tl.load(bias_ptr + b * s_bb + t[:, None] * s_bt + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                       other=float("-inf")).to(tl.float32)
        if tl.max(tl.max(bias, axis=1), axis=0) > float("-inf"):
            kb = tl.load(k_ptr + b * s_kb + cols[:, None] * s_ks + h * s_kh + d[None, :], mask=cmask[:, None], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(kb), input_precision="ieee") * scale + bias
            else:
                s = tl.dot(q, tl.trans(kb)).to(tl.float32) * scale + bias
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet: p = 0
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vb = tl.load(v_ptr + b * s_vb + cols[:, None] * s_vs + h * s_vh + d[None, :], mask=cmask[:, None], other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb).to(tl.float32)
            m_i = m_new
    if PARTIAL:
        at = ((pid * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) + tl.program_id(2)) * BLOCK_M
        tl.store(m_ptr + at + tl.arange(0, BLOCK_M), m_i)
        tl.store(l_ptr + at + tl.arange(0, BLOCK_M), l_i)
        tl.store(acc_ptr + (at + tl.arange(0, BLOCK_M))[:, None] * HD + d[None, :], acc)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row that may see no key: zeros
        tl.store(out_ptr + ((b * T + t[:, None]) * H + head[:, None]) * HD + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=rmask[:, None])


_TRITON_SOURCES = ("_round_to", "_markov_partial_kernel", "_markov_reduce_kernel", "_rows_argmax_partial_kernel",
                   "_verify_greedy_reduce_kernel", "_rows_softmax_partial_kernel",
                   "_verify_sampled_accept_kernel", "_verify_sampled_race_kernel", "_verify_sampled_pick_kernel",
                   "_cached_attention_kernel")
_PLAIN = {name: globals()[name] for name in _TRITON_SOURCES}
_TRITON_KERNELS: dict = {}  # the jitted kernels, once built


def _build_triton_kernels() -> dict:
    """Wrap the kernel sources with triton.jit, once, in the mode triton was imported in (the
    kernels call `_round_to` by name, so the jitted helper becomes the module global)."""
    if not _TRITON_KERNELS and _import_triton():
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if _TRITON_IMPORT_INTERPRET else "0"  # read by triton.jit
        try:
            built = {name: triton.jit(_PLAIN[name]) for name in _TRITON_SOURCES}
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
        globals()["_round_to"] = built["_round_to"]
        _TRITON_KERNELS.update(built)
    return _TRITON_KERNELS


def _kernels() -> dict:
    # Under torch.compile: what `kernel_set("triton")` built when the engine was made (no imports
    # or environment reads inside a graph).
    return _TRITON_KERNELS if torch.compiler.is_compiling() else _build_triton_kernels()


def _triton_ok(*tensors) -> bool:
    """Triton can run on these: CUDA tensors with GPU triton, or any tensors with triton imported
    in interpreter mode (TRITON_INTERPRET=1 set before triton was first imported, and still set)."""
    if not HAVE_TRITON:
        return False
    if torch.compiler.is_compiling():
        return FAST_KERNELS and not _TRITON_IMPORT_INTERPRET and all(t.is_cuda for t in tensors)
    if not _import_triton():
        return False
    if _TRITON_IMPORT_INTERPRET:  # triton reads the variable again while launching: it must still be set
        return _interpreting()
    return all(t.is_cuda for t in tensors)


def _is_vanilla_markov(markov) -> bool:
    """The vanilla head only (b = W2·W1[x]): the gated and rnn biases also depend on h or a state."""
    return getattr(markov, "kind", None) == "vanilla"


def _pow2(n: int) -> int:
    """The next power of two >= n, at least 2 (block sizes for tl.arange)."""
    p = 2
    while p < n:
        p *= 2
    return p


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def markov_chain_triton(base_logits: torch.Tensor, hidden: torch.Tensor, anchor: torch.Tensor, markov,
                        temperature: float, generator: Optional[torch.Generator],
                        noise: Optional[torch.Tensor] = None, *, filters: Filters = NO_FILTERS):
    """`markov_chain` with Triton Markov steps for the vanilla head (see the section comment).

    Same arguments, same results (drafts [B, K] int64; q [B, K, V] float32 or None at T=0), and
    the same draws from `generator` when noise is None (one [B, V] Exp(1) tensor per slot, in
    slot order). Falls back to `markov_chain` for other heads (gated, rnn, None), K = 0,
    unsupported dtypes, sampling filters (top-k/top-p/min-p need the whole row of each slot before
    its draw), or when Triton cannot run on these tensors.
    """
    B, K, V = base_logits.shape
    if not (_triton_ok(base_logits, anchor) and _is_vanilla_markov(markov) and K > 0) or (
            filters.active and temperature != 0):
        return markov_chain(base_logits, hidden, anchor, markov, temperature, generator, noise, filters=filters)
    w1, w2 = markov.markov_w1.weight, markov.markov_w2.weight
    R = w1.shape[1]
    if (base_logits.dtype not in _ROUND_CODE or w2.dtype not in _ROUND_CODE or w1.dtype != w2.dtype
            or tuple(w2.shape) != (V, R) or not _triton_ok(w1, w2)):
        return markov_chain(base_logits, hidden, anchor, markov, temperature, generator, noise)
    kern = _kernels()
    dev = base_logits.device
    u_all = base_logits if base_logits.stride(-1) == 1 else base_logits.contiguous()
    w1c, w2c = w1.contiguous(), w2.contiguous()
    z_dtype = torch.promote_types(base_logits.dtype, w2.dtype)
    sampled = temperature != 0
    chain = torch.empty((B, K + 1), dtype=torch.long, device=dev)  # [anchor, x_1 .. x_K]
    chain[:, 0] = anchor
    z = torch.empty((B, K, V) if sampled else (1, 1, 1), dtype=torch.float32, device=dev)
    BLOCK_V = TRITON_BLOCK_V
    BLOCK_R = min(TRITON_BLOCK_R, _pow2(R))
    n_tiles = _cdiv(V, BLOCK_V)
    pval = torch.empty((B, n_tiles), dtype=torch.float32, device=dev)
    pidx = torch.empty((B, n_tiles), dtype=torch.int32, device=dev)
    if noise is not None and noise.stride(-1) != 1:
        noise = noise.contiguous()
    for k in range(K):
        if not sampled:
            nz, noise_off, s_noise = z, 0, 0  # unused
        elif noise is not None:
            nz, noise_off, s_noise = noise, k * noise.stride(1), noise.stride(0)
        else:  # the reference's draw: empty_like(q [B, V] float32).exponential_(1, generator)
            nz = torch.empty((B, V), dtype=torch.float32, device=dev).exponential_(1, generator=generator)
            noise_off, s_noise = 0, V
        kern["_markov_partial_kernel"][(B, n_tiles)](
            u_all, k * u_all.stride(1), u_all.stride(0), chain, K + 1, k, w1c, R, w2c, R,
            nz, noise_off, s_noise, z, k * V if sampled else 0, z.stride(0), pval, pidx,
            n_tiles, V, float(temperature) if sampled else 1.0, R=R,
            SAMPLED=sampled, BIAS_ROUND=_ROUND_CODE[w2.dtype], Z_ROUND=_ROUND_CODE[z_dtype],
            BLOCK_V=BLOCK_V, BLOCK_R=BLOCK_R)
        kern["_markov_reduce_kernel"][(B,)](pval, pidx, n_tiles, chain, K + 1, k, BLOCK_T=_pow2(n_tiles))
    drafts = chain[:, 1:].contiguous()
    return drafts, (torch.softmax(z / temperature, dim=-1) if sampled else None)


def verify_greedy_triton(drafts: torch.Tensor, target_logits: torch.Tensor, verify_len: torch.Tensor):
    """`verify_greedy` as two Triton passes: tile argmax of every position, then per row the
    reduction fused with the acceptance count. Same arguments and results (int64 n and token)."""
    B, K = drafts.shape
    V = target_logits.shape[-1]
    if not (_triton_ok(drafts, target_logits, verify_len) and target_logits.dtype in _ROUND_CODE):
        return verify_greedy(drafts, target_logits, verify_len)
    kern = _kernels()
    dev = target_logits.device
    logits = target_logits.reshape(B * (K + 1), V)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    d = drafts.to(torch.long).contiguous()
    vl = verify_len.to(torch.long).contiguous()
    BLOCK_V = TRITON_BLOCK_V
    n_tiles = _cdiv(V, BLOCK_V)
    pval = torch.empty((B * (K + 1), n_tiles), dtype=torch.float32, device=dev)
    pidx = torch.empty((B * (K + 1), n_tiles), dtype=torch.int32, device=dev)
    kern["_rows_argmax_partial_kernel"][(B * (K + 1), n_tiles)](logits, logits.stride(0), pval, pidx, n_tiles, V,
                                                                BLOCK_V=BLOCK_V)
    n = torch.empty((B,), dtype=torch.long, device=dev)
    nxt = torch.empty((B,), dtype=torch.long, device=dev)
    kern["_verify_greedy_reduce_kernel"][(B,)](pval, pidx, n_tiles, d, vl, n, nxt, K,
                                               BLOCK_J=_pow2(K + 1), BLOCK_T=_pow2(n_tiles))
    return n, nxt


def verify_sampled_triton(drafts: torch.Tensor, q: Optional[torch.Tensor], target_logits: torch.Tensor,
                          verify_len: torch.Tensor, temperature: float, generator: Optional[torch.Generator],
                          u: Optional[torch.Tensor] = None, noise: Optional[torch.Tensor] = None,
                          *, filters: Filters = NO_FILTERS):
    """`verify_sampled` in four Triton passes (see the section comment); p = softmax(logits/T) is
    never materialised. Same arguments, same draws when u/noise are None (u [B, K] first, then
    one [B, V] Exp(1) race), same results up to float rounding at near-ties. With sampling filters
    the logits are divided by T and filtered in torch first (the kernels then see -inf outside the
    kept set, at T = 1)."""
    B, K = drafts.shape
    V = target_logits.shape[-1]
    dev = target_logits.device
    tensors = [drafts, target_logits, verify_len] + ([q] if K else [])
    if not (_triton_ok(*tensors) and target_logits.dtype in _ROUND_CODE):
        return verify_sampled(drafts, q, target_logits, verify_len, temperature, generator, u, noise, filters=filters)
    if filters.active:
        target_logits, temperature = filter_logits(target_logits.float() / temperature, filters), 1.0
    if u is None:
        u = torch.rand((B, K), generator=generator, device=dev)
    if noise is None:
        noise = torch.empty((B, V), dtype=torch.float32, device=dev).exponential_(1, generator=generator)
    kern = _kernels()
    T = float(temperature)
    logits = target_logits.reshape(B * (K + 1), V)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    qf = q.reshape(B * K, V).contiguous() if K else logits  # dummy pointer when K = 0 (never read)
    d = drafts.to(torch.long).contiguous()
    vl = verify_len.to(torch.long).contiguous()
    uf = u.float().contiguous() if K else logits
    nz = noise.float().contiguous()
    BLOCK_V = TRITON_BLOCK_V
    n_tiles = _cdiv(V, BLOCK_V)
    BLOCK_T = _pow2(n_tiles)
    pmax = torch.empty((B * (K + 1), n_tiles), dtype=torch.float32, device=dev)
    psum = torch.empty((B * (K + 1), n_tiles), dtype=torch.float32, device=dev)
    kern["_rows_softmax_partial_kernel"][(B * (K + 1), n_tiles)](logits, logits.stride(0), pmax, psum, n_tiles, V, T,
                                                                 BLOCK_V=BLOCK_V)
    n = torch.empty((B,), dtype=torch.long, device=dev)
    stat = torch.empty((B, 3), dtype=torch.float32, device=dev)
    kern["_verify_sampled_accept_kernel"][(B,)](pmax, psum, n_tiles, logits, logits.stride(0), d, qf, qf.stride(0),
                                                uf, vl, n, stat, K, T, BLOCK_J=_pow2(K + 1), BLOCK_T=BLOCK_T)
    pval = torch.empty((B, n_tiles, 2), dtype=torch.float32, device=dev)
    pidx = torch.empty((B, n_tiles, 2), dtype=torch.int32, device=dev)
    rsum = torch.empty((B, n_tiles), dtype=torch.float32, device=dev)
    kern["_verify_sampled_race_kernel"][(B, n_tiles)](logits, logits.stride(0), qf, qf.stride(0), nz, nz.stride(0),
                                                      n, stat, pval, pidx, rsum, n_tiles, V, K, T,
                                                      HAS_Q=K > 0, BLOCK_V=BLOCK_V)
    nxt = torch.empty((B,), dtype=torch.long, device=dev)
    kern["_verify_sampled_pick_kernel"][(B,)](pval, pidx, rsum, stat, nxt, n_tiles, HAS_Q=K > 0, BLOCK_T=BLOCK_T)
    return n, nxt


#: Key positions per step of `cached_attention_triton`'s loop (a module constant so the tests can
#: shrink it to get many blocks from a short cache); query rows per program at most; the programs it
#: aims for, splitting the keys when batch rows x K/V heads give fewer (each split at least
#: TRITON_SPLIT_MIN_BLOCKS blocks of keys).
TRITON_BLOCK_N = 64
TRITON_BLOCK_M = 64
TRITON_ATTENTION_PROGRAMS = 256
TRITON_SPLIT_MIN_BLOCKS = 4


def attention_splits(programs: int, S: int) -> tuple[int, int]:
    """How `cached_attention_triton` splits a cache of S keys when it has `programs` (batch rows x K/V
    heads x row blocks) without splitting: (splits, keys per split, a multiple of TRITON_BLOCK_N)."""
    key_blocks = _cdiv(S, TRITON_BLOCK_N)
    splits = max(1, min(_cdiv(TRITON_ATTENTION_PROGRAMS, programs), key_blocks // TRITON_SPLIT_MIN_BLOCKS))
    split_keys = _cdiv(key_blocks, splits) * TRITON_BLOCK_N
    return _cdiv(S, split_keys), split_keys


def cached_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`model.attend_cached` as one Triton kernel: q [B, T, H, hd] over the cache's k, v [B, S, Hkv, hd]
    under its additive bias [B, 1, R, S] (R = T, or g*T with GQA folded: row t is token t's mask either
    way) -> [B, T, H*hd] in q's dtype. One program per (batch row, K/V head, up to TRITON_BLOCK_M of
    its query rows) — the GQA group's heads read each K/V block once — with an online softmax in
    float32, skipping every block of TRITON_BLOCK_N keys that none of its rows may see: a compiled
    graph's static cache costs what is filled, not its whole length (SDPA reads all S keys). Where
    those programs are fewer than TRITON_ATTENTION_PROGRAMS (batch 1: one per K/V head), the keys are
    split among more, each split's softmax statistics combined after (flash-decoding). A row that may
    see no key gives zeros. Falls back to `model.attend_cached` where the kernel cannot run (no Triton
    for these tensors, hd not a power of two in 16..256, another dtype). Not yet timed on a GPU:
    tests/test_triton.py --device does."""
    B, T, H, hd = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if not (_triton_ok(q, k, v, bias) and q.dtype in _ROUND_CODE and 16 <= hd <= 256 and hd & (hd - 1) == 0
            and H % Hkv == 0 and bias.shape[2] in (T, T * (H // Hkv)) and S > 0):
        import model  # the reference (model imports nothing of this module)
        return model.attend_cached(q, k, v, bias)
    G = H // Hkv
    q, k, v, bias = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, bias))
    out = torch.empty((B, T, H * hd), dtype=q.dtype, device=q.device)
    BLOCK_M, BLOCK_N = min(TRITON_BLOCK_M, max(16, _pow2(T * G))), TRITON_BLOCK_N
    row_blocks = _cdiv(T * G, BLOCK_M)
    programs = B * Hkv * row_blocks
    splits, split_keys = attention_splits(programs, S)
    if splits > 1:  # each split's running max, sum and weighted values, combined below
        m = torch.empty((programs, splits, BLOCK_M), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty((programs, splits, BLOCK_M, hd), dtype=torch.float32, device=q.device)
    else:  # unused (PARTIAL off), but tensors of their own: no argument aliases the output
        m, l, acc = (torch.empty(1, dtype=torch.float32, device=q.device) for _ in range(3))
    _kernels()["_cached_attention_kernel"][(B * Hkv, row_blocks, splits)](
        q, k, v, bias, out, m, l, acc, T, G, Hkv, H, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), bias.stride(0), bias.stride(2),
        hd ** -0.5, S=S, HD=hd, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLIT_KEYS=split_keys, PARTIAL=splits > 1,
        IEEE=q.dtype == torch.float32)
    if splits == 1:
        return out
    top = m.amax(1, keepdim=True)
    w = torch.exp(m - torch.where(top == float("-inf"), 0.0, top))        # [P, splits, BLOCK_M]; 0 for -inf
    den = (w * l).sum(1)                                                   # [P, BLOCK_M]
    o = (w[..., None] * acc).sum(1) / torch.where(den > 0, den, 1.0)[..., None]  # rows that see nothing: 0
    o = o.view(B, Hkv, row_blocks * BLOCK_M, hd)[:, :, :T * G].reshape(B, Hkv, T, G, hd)
    return o.permute(0, 2, 1, 3, 4).reshape(B, T, H * hd).to(q.dtype)


# The kernel sets an engine binds once, when it is built

class KernelSet(NamedTuple):
    """The round's hot math, one implementation each (same signatures and results). `attention`: the
    verification's attention over the KV cache (`model.attend_cached`'s signature), None for the
    model's own."""
    markov_chain: Callable
    verify_greedy: Callable
    verify_sampled: Callable
    attention: Optional[Callable] = None


TORCH = KernelSet(markov_chain, verify_greedy, verify_sampled)
TRITON = KernelSet(markov_chain_triton, verify_greedy_triton, verify_sampled_triton, cached_attention_triton)


def kernel_set(name: str, device) -> KernelSet:
    """"torch" (the references) or "triton"; the Triton kernels are built here, before any graph
    traces them. Raises RuntimeError when Triton cannot run on `device` (no triton, or cpu outside
    Triton's interpreter)."""
    if name == "torch":
        return TORCH
    if name != "triton":
        raise ValueError(f"unknown kernel set {name!r}")
    if not _triton_ok(torch.empty(0, device=device)):
        raise RuntimeError("the Triton kernels need the triton package and a CUDA device (on cpu, Triton's "
                           "interpreter: TRITON_INTERPRET=1)")
    _build_triton_kernels()
    return TRITON

