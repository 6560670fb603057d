"""Triton versions of a round's hot steps, each with the signature and the results of its torch
reference: the Markov chain and sampled acceptance (sampling.py), the verification's attention over
the KV cache (model.attend_cached). Under `--kernels triton`, `speculate.draft` and `verify` call
them, and `check_backend` (at the edge) builds them. Each falls back to its reference where it
cannot run (no triton, CPU tensors outside the interpreter, an unsupported dtype or shape; the
chain also under sampling filters, and with a Markov head other than vanilla, or none). Sums run
in another order: tokens agree except at near-ties."""

from __future__ import annotations

import importlib.util
import os

import torch

import model
import sampling  # the references, looked up at each call: a version patched there is the fallback too
from sampling import NO_FILTERS, Filters, filter_logits

HAVE_TRITON = importlib.util.find_spec("triton") is not None
triton = tl = None  # imported on first use: Triton picks interpreter or GPU when first imported
_TRITON_IMPORT_INTERPRET = None

TRITON_BLOCK_V = 128        # vocabulary entries per program of the chain
TRITON_ROWS_BLOCK_V = 1024  # ... of the verification passes (fewer tiles for the per-row reductions)
TRITON_BLOCK_R = 64         # Markov-rank chunk held in registers
TRITON_CHAIN_MAX_BATCH = 4  # the chain reads W2 once a row (grows with B): above this, the reference
# the dtypes the kernels take, each with `_round_to`'s code: 0 float32 (kept), 1 bfloat16, 2 float16
_ROUND_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _interpreting() -> bool:
    value = os.environ.get("TRITON_INTERPRET", "0").strip().lower()
    return value in ("1", "true", "on", "yes")


def _import_triton() -> bool:
    global triton, tl, _TRITON_IMPORT_INTERPRET, HAVE_TRITON
    if triton is None and HAVE_TRITON:
        try:
            import triton as _triton
            import triton.language as _tl
        except ImportError:
            HAVE_TRITON = False
            return False
        triton = _triton
        tl = _tl
        # whoever imported triton first fixed the mode: under the interpreter its language functions
        # are InterpretedFunctions, whatever TRITON_INTERPRET says now
        standard = getattr(_tl, "standard", None)
        probe = getattr(standard, "sum", None)
        if probe is not None:
            _TRITON_IMPORT_INTERPRET = type(probe).__name__ == "InterpretedFunction"
        else:
            _TRITON_IMPORT_INTERPRET = _interpreting()
    return triton is not None


def _triton_ok(x) -> bool:
    """Triton can run on x's device (a call's tensors share one): CUDA with GPU triton, any in interpreter mode."""
    if not HAVE_TRITON:
        return False
    if torch.compiler.is_compiling():
        return not _TRITON_IMPORT_INTERPRET and x.is_cuda
    if not _import_triton():
        return False
    if _TRITON_IMPORT_INTERPRET:
        return _interpreting()
    return x.is_cuda


def _pow2(n: int) -> int:
    return max(2, 1 << (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _unit_stride(x):
    """x, or a copy of it where its last dimension is strided (the kernels read rows densely)."""
    if x.stride(-1) == 1:
        return x
    return x.contiguous()


def markov_chain(base_logits, hidden, anchor, markov, temperature: float, noise, *,
                 filters: Filters = NO_FILTERS):
    """`sampling.markov_chain` for the vanilla head: per slot, tile keys (z/T - log E when sampled), then the
    row's best written where the next slot reads it. z/T - log E is log(q/E) up to a constant of the row,
    so its argmax is the reference's exponential race; the bias and z are rounded to the dtypes torch
    gives them (W2's, and U + bias's)."""
    B, K, V = base_logits.shape
    w1 = w2 = None
    if getattr(markov, "kind", None) == "vanilla":
        w1 = markov.markov_w1.weight
        w2 = markov.markov_w2.weight
    if (w1 is None
            or B > TRITON_CHAIN_MAX_BATCH
            or filters.active
            or base_logits.dtype not in _ROUND_CODE
            or w2.dtype not in _ROUND_CODE
            or not _triton_ok(base_logits)):
        return sampling.markov_chain(base_logits, hidden, anchor, markov, temperature, noise,
                                     filters=filters)
    kern = _kernels()
    dev = base_logits.device
    R = w1.shape[1]
    base = base_logits.contiguous()
    w1c = w1.contiguous()
    w2c = w2.contiguous()
    sampled = temperature != 0
    chain = torch.empty((B, K + 1), dtype=torch.long, device=dev)  # [anchor, x_1 .. x_K]
    chain[:, 0] = anchor
    z_shape = (1, 1, 1)  # greedy: z is a pointer never written
    if sampled:
        z_shape = (B, K, V)
    z = torch.empty(z_shape, dtype=torch.float32, device=dev)
    n_tiles = _cdiv(V, TRITON_BLOCK_V)
    pval = torch.empty((B, n_tiles), dtype=torch.float32, device=dev)
    pidx = torch.empty((B, n_tiles), dtype=torch.int32, device=dev)
    if sampled:
        noise = noise.contiguous()
    z_dtype = torch.promote_types(base_logits.dtype, w2.dtype)  # the reference's z = U + bias
    bias_round = _ROUND_CODE[w2.dtype]
    z_round = _ROUND_CODE[z_dtype]
    BLOCK_R = min(TRITON_BLOCK_R, _pow2(R))
    BLOCK_T = _pow2(n_tiles)
    row_grid = (B,)
    tile_grid = (B, n_tiles)
    for k in range(K):
        base_k = base[:, k]  # [B, V] views: the kernel reads rows at their stride
        z_k = z  # greedy: z and the noise are pointers never written or read
        noise_k = z
        if sampled:
            z_k = z[:, k]
            noise_k = noise[:, k]
        kern["_markov_partial_kernel"][tile_grid](
            base_k, base_k.stride(0),
            chain, chain.stride(0), k,
            w1c, w1c.stride(0),
            w2c, w2c.stride(0),
            noise_k, noise_k.stride(0),
            z_k, z_k.stride(0),
            pval, pidx,
            n_tiles, V,
            float(temperature),
            R=R,
            SAMPLED=sampled,
            BIAS_ROUND=bias_round,
            Z_ROUND=z_round,
            BLOCK_V=TRITON_BLOCK_V,
            BLOCK_R=BLOCK_R)
        kern["_markov_reduce_kernel"][row_grid](
            pval, pidx, n_tiles,
            chain, chain.stride(0), k,
            BLOCK_T=BLOCK_T,
            num_warps=8)
    drafts = chain[:, 1:].contiguous()
    if not sampled:
        return drafts, None
    q = torch.softmax(z / temperature, dim=-1)
    return drafts, q


def accept_sampled(drafts, q, target_logits, verify_len, temperature: float, u, noise, *,
                   filters: Filters = NO_FILTERS):
    """`sampling.accept_sampled` in four passes, p never materialised; filters run in torch first (then T = 1)."""
    B, K = drafts.shape
    V = target_logits.shape[-1]
    dev = target_logits.device
    if not (_triton_ok(target_logits) and target_logits.dtype in _ROUND_CODE):
        return sampling.accept_sampled(drafts, q, target_logits, verify_len, temperature,
                                       u, noise, filters=filters)
    if filters.active:
        target_logits = filter_logits(target_logits.float() / temperature, filters)
        temperature = 1.0
    kern = _kernels()
    T = float(temperature)
    rows = B * (K + 1)
    logits = _unit_stride(target_logits.reshape(rows, V))
    qf = logits  # K = 0: q and u are pointers never read
    uf = logits
    if K:
        qf = q.reshape(B * K, V).contiguous()
        uf = u.float().contiguous()
    d = drafts.long().contiguous()
    vl = verify_len.long().contiguous()
    nz = noise.float().contiguous()
    n_tiles = _cdiv(V, TRITON_ROWS_BLOCK_V)
    BLOCK_J = _pow2(K + 1)
    BLOCK_T = _pow2(n_tiles)
    has_q = K > 0
    row_grid = (B,)  # a program per batch row
    tile_grid = (B, n_tiles)  # ... per batch row and V-tile
    position_grid = (rows, n_tiles)  # ... per row of logits and V-tile
    # 1. each position's max and sum of exp, per V-tile
    pmax = torch.empty((rows, n_tiles), dtype=torch.float32, device=dev)
    psum = torch.empty((rows, n_tiles), dtype=torch.float32, device=dev)
    kern["_rows_softmax_partial_kernel"][position_grid](
        logits, logits.stride(0),
        pmax, psum,
        n_tiles, V,
        T,
        BLOCK_V=TRITON_ROWS_BLOCK_V)
    # 2. the drafts' acceptance: n, and the committed position's statistics
    n = torch.empty((B,), dtype=torch.long, device=dev)
    stat = torch.empty((B, 3), dtype=torch.float32, device=dev)
    kern["_verify_sampled_accept_kernel"][row_grid](
        pmax, psum, n_tiles,
        logits, logits.stride(0),
        d,
        qf, qf.stride(0),
        uf, vl,
        n, stat,
        K, T,
        BLOCK_J=BLOCK_J,
        BLOCK_T=BLOCK_T,
        num_warps=8)
    # 3. the bonus's and the correction's race, per V-tile
    pval = torch.empty((B, n_tiles, 2), dtype=torch.float32, device=dev)
    pidx = torch.empty((B, n_tiles, 2), dtype=torch.int32, device=dev)
    rsum = torch.empty((B, n_tiles), dtype=torch.float32, device=dev)
    kern["_verify_sampled_race_kernel"][tile_grid](
        logits, logits.stride(0),
        qf, qf.stride(0),
        nz, nz.stride(0),
        n, stat,
        pval, pidx, rsum,
        n_tiles, V, K,
        T,
        HAS_Q=has_q,
        BLOCK_V=TRITON_ROWS_BLOCK_V)
    # 4. the next token
    next_token = torch.empty((B,), dtype=torch.long, device=dev)
    kern["_verify_sampled_pick_kernel"][row_grid](
        pval, pidx, rsum, stat,
        next_token,
        n_tiles,
        HAS_Q=has_q,
        BLOCK_T=BLOCK_T)
    return n, next_token


TRITON_BLOCK_N = 64               # keys per step of the attention loop
TRITON_BLOCK_M = 64               # query rows per program at most
TRITON_ATTENTION_PROGRAMS = 256   # split the keys (flash-decoding) while there are fewer programs than this
TRITON_SPLIT_MIN_BLOCKS = 4       # ... each split at least this many blocks of keys


def attention_splits(programs: int, S: int) -> tuple[int, int]:
    """(splits, keys per split) of a cache of S keys, `programs` being the grid before any split."""
    key_blocks = _cdiv(S, TRITON_BLOCK_N)
    fill = _cdiv(TRITON_ATTENTION_PROGRAMS, programs)  # splits to reach the target programs
    most = key_blocks // TRITON_SPLIT_MIN_BLOCKS        # ... that leave each split enough blocks
    splits = max(1, min(fill, most))
    split_keys = _cdiv(key_blocks, splits) * TRITON_BLOCK_N
    splits = _cdiv(S, split_keys)  # rounding split_keys up can leave fewer
    return splits, split_keys


def cached_attention(q, k, v, bias):
    """`model.attend_cached` as one kernel: q [B, T, H, hd] over k, v [B, S, Hkv, hd] under `model.cache_bias`
    [B, 1, T or G*T, S], -> [B, T, H*hd]. A program per (batch row, K/V head, block of query rows, split of
    the keys); its rows are t*G + i (token t, head h*G + i), and it reads bias rows 0..T-1 only (folded
    rows repeat them per head). Online softmax in float32, key blocks no row may see skipped; a row
    that sees no key gives zeros."""
    B, T, H, hd = q.shape
    S = k.shape[1]
    Hkv = k.shape[2]
    if not (_triton_ok(q)
            and q.dtype in _ROUND_CODE
            and 16 <= hd <= 256
            and hd & (hd - 1) == 0
            # the interpreter's bf16 tl.dot is wrong
            and not (_TRITON_IMPORT_INTERPRET and q.dtype == torch.bfloat16)):
        return model.attend_cached(q, k, v, bias)
    G = H // Hkv
    q = _unit_stride(q)
    k = _unit_stride(k)
    v = _unit_stride(v)
    bias = _unit_stride(bias)
    out = torch.empty((B, T, H * hd), dtype=q.dtype, device=q.device)
    rows = T * G  # query rows per (batch row, K/V head)
    BLOCK_M = min(TRITON_BLOCK_M, max(16, _pow2(rows)))
    row_blocks = _cdiv(rows, BLOCK_M)
    programs = B * Hkv * row_blocks
    splits, split_keys = attention_splits(programs, S)
    partial = splits > 1
    shape = (1,)  # without splits: m, l and acc are pointers never written
    acc_shape = (1,)
    if partial:
        shape = (programs, splits, BLOCK_M)
        acc_shape = (*shape, hd)
    m = torch.empty(shape, dtype=torch.float32, device=q.device)
    l = torch.empty(shape, dtype=torch.float32, device=q.device)
    acc = torch.empty(acc_shape, dtype=torch.float32, device=q.device)
    scale = hd ** -0.5
    ieee = q.dtype == torch.float32  # float32 inputs: tl.dot in full float32 precision
    grid = (B * Hkv, row_blocks, splits)
    _kernels()["_cached_attention_kernel"][grid](
        q, k, v, bias,
        out, m, l, acc,
        T, G, Hkv, H,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        bias.stride(0), bias.stride(2),
        scale,
        S=S,
        HD=hd,
        BLOCK_M=BLOCK_M,
        BLOCK_N=TRITON_BLOCK_N,
        SPLIT_KEYS=split_keys,
        PARTIAL=partial,
        IEEE=ieee)
    if not partial:
        return out
    # combine the splits' softmax statistics
    top = m.amax(1, keepdim=True)
    top_safe = torch.where(top == float("-inf"), 0.0, top)
    w = torch.exp(m - top_safe)
    den = (w * l).sum(1)
    o = (w[..., None] * acc).sum(1)
    den_safe = torch.where(den > 0, den, 1.0)
    o = o / den_safe[..., None]
    o = o.view(B, Hkv, row_blocks * BLOCK_M, hd)
    o = o[:, :, :rows]  # the last block's padding rows dropped
    o = o.reshape(B, Hkv, T, G, hd)
    o = o.permute(0, 2, 1, 3, 4)
    o = o.reshape(B, T, H * hd)
    return o.to(q.dtype)


# The kernel sources, made Triton kernels by `_build_triton_kernels` (tl is bound on first use).
# A launch passes a Python float as fp32, but a kernel inside a torch.compile graph gets it as fp64:
# each kernel makes its float arguments fp32 first, so both compute alike (and fp32 loop state stays fp32).

def _round_to(x, CODE: tl.constexpr):
    """float32 x rounded (to nearest even) to bfloat16 (CODE 1) or float16 (CODE 2), kept as float32."""
    if CODE == 1:
        b = x.to(tl.uint32, bitcast=True)
        lsb = (b >> 16) & 1  # ties go to the even bfloat16
        b = ((b + 0x7FFF + lsb) >> 16) << 16
        x = b.to(tl.float32, bitcast=True)
    elif CODE == 2:
        x = x.to(tl.float16).to(tl.float32)
    return x


def _first_max(values, indices, mask):
    """The largest of `values` where `mask` holds, and the first of `indices` there holding it (as
    torch.argmax picks among ties)."""
    values = tl.where(mask, values, float("-inf"))
    best = tl.max(values, axis=0)
    is_best = mask & (values == best)
    candidates = tl.where(is_best, indices, 2147483647)
    return best, tl.min(candidates, axis=0)


def _markov_partial_kernel(base_ptr, s_base,
                           chain_ptr, s_chain, k,
                           w1_ptr, s_w1,
                           w2_ptr, s_w2,
                           noise_ptr, s_noise,
                           z_ptr, s_z,
                           pval_ptr, pidx_ptr,
                           n_tiles, V,
                           temperature,
                           R: tl.constexpr,
                           SAMPLED: tl.constexpr,
                           BIAS_ROUND: tl.constexpr,
                           Z_ROUND: tl.constexpr,
                           BLOCK_V: tl.constexpr,
                           BLOCK_R: tl.constexpr):
    """Pass 1 of a Markov step: one (row b, V-tile) -> that tile's best key and its first index."""
    temperature = tl.cast(temperature, tl.float32)
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    tile_start = t * BLOCK_V
    cols = tile_start + tl.arange(0, BLOCK_V)
    cmask = cols < V
    prev_ptr = chain_ptr + b * s_chain + k
    prev = tl.load(prev_ptr).to(tl.int64)  # chain[b, k]: the anchor at k = 0, else the last draft
    # the tile's bias W2 · W1[x_{k-1}], BLOCK_R ranks at a time
    e_row = w1_ptr + prev * s_w1
    w_rows = w2_ptr + cols.to(tl.int64)[:, None] * s_w2
    acc = tl.zeros((BLOCK_V,), dtype=tl.float32)
    # R is a constexpr: Triton's interpreter, in some versions, cannot loop over a runtime bound.
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        rmask = rs < R
        e = tl.load(e_row + rs, mask=rmask, other=0.0).to(tl.float32)
        w_ptrs = w_rows + rs[None, :]
        w_mask = cmask[:, None] & rmask[None, :]
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        acc += tl.sum(w * e[None, :], axis=1)
    bias = _round_to(acc, BIAS_ROUND)
    base_row = base_ptr + b * s_base
    base = tl.load(base_row + cols, mask=cmask, other=0.0).to(tl.float32)
    z = _round_to(base + bias, Z_ROUND)
    if SAMPLED:
        z_row = z_ptr + b * s_z
        tl.store(z_row + cols, z, mask=cmask)
        noise_row = noise_ptr + b * s_noise
        noise = tl.load(noise_row + cols, mask=cmask, other=1.0)
        key = z / temperature - tl.log(noise)
    else:
        key = z
    best, idx = _first_max(key, cols, cmask)
    tile = b * n_tiles + t
    tl.store(pval_ptr + tile, best)
    tl.store(pidx_ptr + tile, idx)


def _markov_reduce_kernel(pval_ptr, pidx_ptr, n_tiles,
                          chain_ptr, s_chain, k,
                          BLOCK_T: tl.constexpr):
    """Pass 2: the row's best over its tiles (first index on ties) -> chain[b, k + 1], this step's
    draft."""
    b = tl.program_id(0).to(tl.int64)
    ts = tl.arange(0, BLOCK_T)
    tmask = ts < n_tiles
    tiles = b * n_tiles + ts
    val = tl.load(pval_ptr + tiles, mask=tmask)
    idx = tl.load(pidx_ptr + tiles, mask=tmask)
    _, x = _first_max(val, idx, tmask)
    x_ptr = chain_ptr + b * s_chain + k + 1
    tl.store(x_ptr, x.to(tl.int64))


def _rows_softmax_partial_kernel(x_ptr, s_row,
                                 pmax_ptr, psum_ptr,
                                 n_tiles, V,
                                 temperature,
                                 BLOCK_V: tl.constexpr):
    """Per (row, V-tile) of logits: max of x/T and the sum of exp(x/T − that max)."""
    temperature = tl.cast(temperature, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    tile_start = t * BLOCK_V
    cols = tile_start + tl.arange(0, BLOCK_V)
    cmask = cols < V
    row_ptr = x_ptr + row * s_row
    x = tl.load(row_ptr + cols, mask=cmask, other=0.0)
    x = x.to(tl.float32) / temperature
    x = tl.where(cmask, x, float("-inf"))
    m = tl.max(x, axis=0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    numerator = tl.exp(x - m_safe)
    s = tl.sum(numerator, axis=0)
    tile = row * n_tiles + t
    tl.store(pmax_ptr + tile, m)
    tl.store(psum_ptr + tile, s)


def _verify_sampled_accept_kernel(pmax_ptr, psum_ptr, n_tiles,
                                  logits_ptr, s_lrow,
                                  drafts_ptr,
                                  q_ptr, s_qrow,
                                  u_ptr, vlen_ptr,
                                  n_ptr, stat_ptr,
                                  K, temperature,
                                  BLOCK_J: tl.constexpr,
                                  BLOCK_T: tl.constexpr):
    """One row: softmax max/sum of each position, the acceptance test u·q(x) < p(x), n, and the
    committed position's statistics (max, sum, rejected) for passes 3 and 4 (race, pick)."""
    temperature = tl.cast(temperature, tl.float32)
    b = tl.program_id(0).to(tl.int64)
    js = tl.arange(0, BLOCK_J)  # positions 0 .. K; drafts at 0 .. K - 1
    ts = tl.arange(0, BLOCK_T)
    rows = b * (K + 1) + js  # the positions' rows of logits
    # each position's max M and sum S, from its tiles'
    tiles = rows[:, None] * n_tiles + ts[None, :]
    is_position = js[:, None] <= K
    is_tile = ts[None, :] < n_tiles
    tile_mask = is_position & is_tile
    tile_max = tl.load(pmax_ptr + tiles, mask=tile_mask, other=float("-inf"))
    tile_sum = tl.load(psum_ptr + tiles, mask=tile_mask, other=0.0)
    M = tl.max(tile_max, axis=1)  # [J]
    M_safe = tl.where(M == float("-inf"), 0.0, M)
    counted = tile_mask & (tile_max > float("-inf"))
    tile_scale = tl.exp(tile_max - M_safe[:, None])
    rescaled = tile_sum * tile_scale
    S = tl.sum(tl.where(counted, rescaled, 0.0), axis=1)
    # each draft x: p(x), q(x) and the test
    is_draft = js < K
    draft_at = b * K + js  # the drafts' places in drafts and u, and their rows of q
    drafted = tl.load(drafts_ptr + draft_at, mask=is_draft, other=0).to(tl.int64)
    lx_ptrs = logits_ptr + rows * s_lrow + drafted
    lx = tl.load(lx_ptrs, mask=is_draft, other=0.0).to(tl.float32)
    S_safe = tl.where(S > 0, S, 1.0)  # S is 0 only on padding lanes
    numerator = tl.exp(lx / temperature - M_safe)
    p_x = numerator / S_safe
    q_x_ptrs = q_ptr + draft_at * s_qrow + drafted
    q_x = tl.load(q_x_ptrs, mask=is_draft, other=1.0).to(tl.float32)
    u = tl.load(u_ptr + draft_at, mask=is_draft, other=1.0).to(tl.float32)
    vl = tl.load(vlen_ptr + b)
    accepted = u * q_x < p_x
    verified = js < vl
    ok = accepted & verified & is_draft
    stops = is_draft & (ok == 0)  # a draft that fails the test or is not verified
    candidates = tl.where(stops, js, K)
    n = tl.min(candidates, axis=0)  # the first stop, else K: sampling.prefix_length(ok)
    rejected = n < vl  # read only when K > 0
    tl.store(n_ptr + b, n.to(tl.int64))
    # the committed position n's statistics
    at_n = js == n
    M_n = tl.sum(tl.where(at_n, M_safe, 0.0), axis=0)
    S_n = tl.sum(tl.where(at_n, S, 0.0), axis=0)
    stat = stat_ptr + b * 3  # the row's (max, sum, rejected), read by the race and the pick
    tl.store(stat, M_n)
    tl.store(stat + 1, S_n)
    tl.store(stat + 2, rejected.to(tl.float32))


def _verify_sampled_race_kernel(logits_ptr, s_lrow,
                                q_ptr, s_qrow,
                                noise_ptr, s_noise,
                                n_ptr, stat_ptr,
                                pval_ptr, pidx_ptr, rsum_ptr,
                                n_tiles, V, K,
                                temperature,
                                HAS_Q: tl.constexpr,
                                BLOCK_V: tl.constexpr):
    """Per (row, V-tile) of the committed position n: the race of p_n/E (bonus) and of
    max(p_n − q_{n+1}, 0)/E (correction; q's column n), and the tile's residual mass."""
    temperature = tl.cast(temperature, tl.float32)
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1)
    tile_start = t * BLOCK_V
    cols = tile_start + tl.arange(0, BLOCK_V)
    cmask = cols < V
    n = tl.load(n_ptr + b)
    stat = stat_ptr + b * 3
    M = tl.load(stat)
    S = tl.load(stat + 1)
    row = b * (K + 1) + n  # the committed position's row of logits
    x_row = logits_ptr + row * s_lrow
    x = tl.load(x_row + cols, mask=cmask, other=0.0).to(tl.float32)
    numerator = tl.exp(x / temperature - M)
    p = numerator / S
    noise_row = noise_ptr + b * s_noise
    noise = tl.load(noise_row + cols, mask=cmask, other=1.0)
    tile = b * n_tiles + t
    pair = tile * 2  # the tile's (bonus, correction) winners
    best_p, idx_p = _first_max(p / noise, cols, cmask)
    tl.store(pval_ptr + pair, best_p)
    tl.store(pidx_ptr + pair, idx_p)
    if HAS_Q:
        nq = tl.minimum(n, K - 1)  # n = K: nothing rejected, the residual unread
        q_row = q_ptr + (b * K + nq) * s_qrow
        q = tl.load(q_row + cols, mask=cmask, other=0.0).to(tl.float32)
        residual = tl.maximum(p - q, 0.0)
        r = tl.where(cmask, residual, 0.0)
        best_r, idx_r = _first_max(r / noise, cols, cmask)
        mass = tl.sum(r, axis=0)
        tl.store(pval_ptr + pair + 1, best_r)
        tl.store(pidx_ptr + pair + 1, idx_r)
        tl.store(rsum_ptr + tile, mass)


def _verify_sampled_pick_kernel(pval_ptr, pidx_ptr, rsum_ptr, stat_ptr,
                                next_ptr,
                                n_tiles,
                                HAS_Q: tl.constexpr,
                                BLOCK_T: tl.constexpr):
    """One row: the correction's winner if rejected with positive residual mass, else the bonus's."""
    b = tl.program_id(0).to(tl.int64)
    ts = tl.arange(0, BLOCK_T)
    tmask = ts < n_tiles
    tiles = b * n_tiles + ts
    pairs = tiles * 2  # the tiles' (bonus, correction) winners
    val_p = tl.load(pval_ptr + pairs, mask=tmask)
    idx_p = tl.load(pidx_ptr + pairs, mask=tmask)
    _, x_p = _first_max(val_p, idx_p, tmask)
    x = x_p
    if HAS_Q:
        val_r = tl.load(pval_ptr + pairs + 1, mask=tmask)
        idx_r = tl.load(pidx_ptr + pairs + 1, mask=tmask)
        _, x_r = _first_max(val_r, idx_r, tmask)
        tile_mass = tl.load(rsum_ptr + tiles, mask=tmask, other=0.0)
        mass = tl.sum(tile_mass, axis=0)
        rejected_ptr = stat_ptr + b * 3 + 2
        rejected = tl.load(rejected_ptr) > 0.5
        corrected = rejected & (mass > 0)
        x = tl.where(corrected, x_r, x_p)
    tl.store(next_ptr + b, x.to(tl.int64))


def _cached_attention_kernel(q_ptr, k_ptr, v_ptr, bias_ptr,
                             out_ptr, m_ptr, l_ptr, acc_ptr,
                             T, G, HKV, H,
                             s_qb, s_qt, s_qh,
                             s_kb, s_ks, s_kh,
                             s_vb, s_vs, s_vh,
                             s_bb, s_bt,
                             scale,
                             S: tl.constexpr,  # a constexpr for the interpreter, as R is (the loop over keys)
                             HD: tl.constexpr,
                             BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr,
                             SPLIT_KEYS: tl.constexpr,
                             PARTIAL: tl.constexpr,
                             IEEE: tl.constexpr):
    """One (batch row, K/V head, query block, key split): rows r = t * G + i (token t, head h * G + i);
    PARTIAL: the split's max, sum and weighted values go to m/l/acc."""
    # int64: b * s_kb passes 2^31 at batch 64 and a 32k context
    pid = tl.program_id(0).to(tl.int64)
    b = pid // HKV
    h = pid % HKV
    block = tl.program_id(1)
    split = tl.program_id(2)
    first_row = block * BLOCK_M
    rows = first_row + tl.arange(0, BLOCK_M)[:, None]  # [BLOCK_M, 1]
    rmask = rows < T * G
    t = rows // G
    head = h * G + rows % G
    d = tl.arange(0, HD)[None, :]  # [1, HD]
    q_rows = q_ptr + b * s_qb + t * s_qt + head * s_qh
    q = tl.load(q_rows + d, mask=rmask, other=0.0)
    # the rows of the bias, and the K/V head: the same for every key block
    bias_rows = bias_ptr + b * s_bb + t * s_bt
    k_head = k_ptr + b * s_kb + h * s_kh
    v_head = v_ptr + b * s_vb + h * s_vh
    scale = tl.cast(scale, tl.float32)
    first_key = split * SPLIT_KEYS
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HD], tl.float32)
    for j in range(0, SPLIT_KEYS, BLOCK_N):
        cols = first_key + j + tl.arange(0, BLOCK_N)
        cmask = cols < S
        bias_ptrs = bias_rows + cols[None, :]
        bias_mask = rmask & cmask[None, :]
        bias = tl.load(bias_ptrs, mask=bias_mask, other=float("-inf")).to(tl.float32)
        block_max = tl.max(tl.max(bias, axis=1), axis=0)
        if block_max > float("-inf"):  # else no row may see this block
            kv_mask = cmask[:, None]
            k_ptrs = k_head + cols[:, None] * s_ks + d
            kb = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            if IEEE:
                qk = tl.dot(q, tl.trans(kb), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(kb)).to(tl.float32)
            s = qk * scale + bias
            m_ij = tl.max(s, axis=1)
            m_new = tl.maximum(m_i, m_ij)
            # a row that sees nothing yet: p = 0
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_use)
            p = tl.exp(s - m_use[:, None])
            l_ij = tl.sum(p, axis=1)
            l_i = l_i * alpha + l_ij
            v_ptrs = v_head + cols[:, None] * s_vs + d
            vb = tl.load(v_ptrs, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None]
            if IEEE:
                acc += tl.dot(p, vb, input_precision="ieee")
            else:
                acc += tl.dot(p.to(vb.dtype), vb).to(tl.float32)
            m_i = m_new
    if PARTIAL:
        program = pid * tl.num_programs(1) + block
        at = (program * tl.num_programs(2) + split) * BLOCK_M
        slots = at + tl.arange(0, BLOCK_M)  # the split's rows of m, l and acc
        tl.store(m_ptr + slots, m_i)
        tl.store(l_ptr + slots, l_i)
        acc_ptrs = acc_ptr + slots[:, None] * HD + d
        tl.store(acc_ptrs, acc)
    else:
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # a row that may see no key: zeros
        out = acc / l_safe[:, None]
        out_rows = (b * T + t) * H + head  # out as [B * T * H, HD]
        out_ptrs = out_ptr + out_rows * HD + d
        out = out.to(out_ptr.dtype.element_ty)
        tl.store(out_ptrs, out, mask=rmask)


TRITON_SOURCES = ("_round_to", "_first_max", "_markov_partial_kernel", "_markov_reduce_kernel",
                  "_rows_softmax_partial_kernel", "_verify_sampled_accept_kernel",
                  "_verify_sampled_race_kernel", "_verify_sampled_pick_kernel",
                  "_cached_attention_kernel")


def check_backend(name: str, device):
    """--kernels: "torch" (the references in sampling.py and model.py), or "triton" (built now, before a
    graph traces them); RuntimeError where Triton cannot run."""
    if name == "torch":
        return
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is available")
    if not _triton_ok(torch.empty(0, device=device)):
        late = _interpreting() and _TRITON_IMPORT_INTERPRET is False and torch.device(device).type == "cpu"
        if late:  # triton was imported (by torch, building a model) before TRITON_INTERPRET=1 was set
            raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported, which fixes its mode: "
                               "set it before importing torch")
        raise RuntimeError("the Triton kernels need the triton package and a CUDA device "
                           "(on cpu, Triton's interpreter: TRITON_INTERPRET=1)")
    _build_triton_kernels()


_TRITON_KERNELS: dict = {}
_PLAIN = {name: globals()[name] for name in TRITON_SOURCES}


def _build_triton_kernels() -> dict:
    """triton.jit the kernel sources, once, in the mode triton was imported in (the kernels call
    their helpers by name, so the jitted sources replace the module's)."""
    if not _TRITON_KERNELS and _import_triton():
        saved = os.environ.get("TRITON_INTERPRET")
        interpret = "0"
        if _TRITON_IMPORT_INTERPRET:
            interpret = "1"
        os.environ["TRITON_INTERPRET"] = interpret  # read by triton.jit
        try:
            jitted = {name: triton.jit(_PLAIN[name]) for name in TRITON_SOURCES}
            _TRITON_KERNELS.update(jitted)
            globals().update(jitted)
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
    return _TRITON_KERNELS


def _kernels() -> dict:
    if torch.compiler.is_compiling():  # what check_backend built (no imports inside a graph)
        return _TRITON_KERNELS
    return _build_triton_kernels()
