"""Triton versions of a round's hot steps, each with the signature and the results of its torch
reference: the Markov chain and sampled acceptance (sampling.py), the verification's attention over
the KV cache (model.attend_cached). `--kernels triton` picks them (`check_backend`); each falls back to
its reference where it cannot run (no triton, CPU tensors outside the interpreter, an unsupported
dtype or shape). Sums run in another order: tokens agree except at near-ties."""

from __future__ import annotations

import importlib.util
import os

import torch

from sampling import NO_FILTERS, Filters, filter_logits
from sampling import accept_sampled as accept_sampled_reference
from sampling import markov_chain as markov_chain_reference

HAVE_TRITON = importlib.util.find_spec("triton") is not None
triton = tl = None  # imported on first use: Triton picks interpreter or GPU when first imported
_TRITON_IMPORT_INTERPRET = None

TRITON_BLOCK_V = 128        # vocabulary entries per program of the chain
TRITON_ROWS_BLOCK_V = 1024  # ... of the verification passes (fewer tiles for the per-row reductions)
TRITON_BLOCK_R = 64         # Markov-rank chunk held in registers
TRITON_CHAIN_MAX_BATCH = 4  # the chain reads W2 once per row: measured faster at batch 1, slower at 16
_ROUND_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def _import_triton() -> bool:
    global triton, tl, _TRITON_IMPORT_INTERPRET, HAVE_TRITON
    if triton is None and HAVE_TRITON:
        try:
            import triton as _triton
            import triton.language as _tl
        except ImportError:
            HAVE_TRITON = False
            return False
        triton, tl = _triton, _tl
        probe = getattr(getattr(_tl, "standard", None), "sum", None)  # whoever imported first fixed the mode
        _TRITON_IMPORT_INTERPRET = (type(probe).__name__ == "InterpretedFunction" if probe is not None
                                    else _interpreting())
    return triton is not None


def _triton_ok(*tensors) -> bool:
    """Triton can run on these: CUDA tensors with GPU triton, or any with triton in interpreter mode."""
    if not HAVE_TRITON:
        return False
    if torch.compiler.is_compiling():
        return not _TRITON_IMPORT_INTERPRET and all(t.is_cuda for t in tensors)
    if not _import_triton():
        return False
    return _interpreting() if _TRITON_IMPORT_INTERPRET else all(t.is_cuda for t in tensors)


def _pow2(n: int) -> int:
    return max(2, 1 << (n - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def markov_chain(base_logits, hidden, anchor, markov, temperature: float, generator, noise=None, *,
                        filters: Filters = NO_FILTERS):
    """`sampling.markov_chain` for the vanilla head: per slot, tile keys (z/T - log E when sampled), then the
    row's best written where the next slot reads it."""
    B, K, V = base_logits.shape
    w1, w2 = (markov.markov_w1.weight, markov.markov_w2.weight) if getattr(markov, "kind", None) == "vanilla" \
        else (None, None)
    if (w1 is None or K == 0 or B > TRITON_CHAIN_MAX_BATCH or (filters.active and temperature != 0)
            or base_logits.dtype not in _ROUND_CODE or w2.dtype not in _ROUND_CODE or w1.dtype != w2.dtype
            or not _triton_ok(base_logits, anchor, w1, w2)):
        return markov_chain_reference(base_logits, hidden, anchor, markov, temperature, generator, noise,
                                      filters=filters)
    kern, dev, R = _kernels(), base_logits.device, w1.shape[1]
    u_all, w1c, w2c = base_logits.contiguous(), w1.contiguous(), w2.contiguous()
    sampled = temperature != 0
    chain = torch.empty((B, K + 1), dtype=torch.long, device=dev)  # [anchor, x_1 .. x_K]
    chain[:, 0] = anchor
    z = torch.empty((B, K, V) if sampled else (1, 1, 1), dtype=torch.float32, device=dev)
    n_tiles = _cdiv(V, TRITON_BLOCK_V)
    pval = torch.empty((B, n_tiles), dtype=torch.float32, device=dev)
    pidx = torch.empty((B, n_tiles), dtype=torch.int32, device=dev)
    noise = noise.contiguous() if noise is not None else None
    for k in range(K):
        if not sampled:
            nz, noise_off, s_noise = z, 0, 0
        elif noise is not None:
            nz, noise_off, s_noise = noise, k * noise.stride(1), noise.stride(0)
        else:  # the reference's draw order
            nz, noise_off, s_noise = torch.empty((B, V), device=dev).exponential_(1, generator=generator), 0, V
        kern["_markov_partial_kernel"][(B, n_tiles)](
            u_all, k * u_all.stride(1), u_all.stride(0), chain, K + 1, k, w1c, R, w2c, R, nz, noise_off, s_noise,
            z, k * V if sampled else 0, z.stride(0), pval, pidx, n_tiles, V, float(temperature) if sampled else 1.0,
            R=R, SAMPLED=sampled, BIAS_ROUND=_ROUND_CODE[w2.dtype],
            Z_ROUND=_ROUND_CODE[torch.promote_types(base_logits.dtype, w2.dtype)],
            BLOCK_V=TRITON_BLOCK_V, BLOCK_R=min(TRITON_BLOCK_R, _pow2(R)))
        kern["_markov_reduce_kernel"][(B,)](pval, pidx, n_tiles, chain, K + 1, k, BLOCK_T=_pow2(n_tiles), num_warps=8)
    return chain[:, 1:].contiguous(), (torch.softmax(z / temperature, dim=-1) if sampled else None)


def accept_sampled(drafts, q, target_logits, verify_len, temperature: float, generator, u=None, noise=None,
                          *, filters: Filters = NO_FILTERS):
    """`sampling.accept_sampled` in four passes, p never materialised; filters run in torch first (then T = 1)."""
    B, K = drafts.shape
    V, dev = target_logits.shape[-1], target_logits.device
    if not (_triton_ok(drafts, target_logits, verify_len, *([q] if K else [])) and target_logits.dtype in _ROUND_CODE):
        return accept_sampled_reference(drafts, q, target_logits, verify_len, temperature, generator, u, noise,
                                        filters=filters)
    if filters.active:
        target_logits, temperature = filter_logits(target_logits.float() / temperature, filters), 1.0
    u = torch.rand((B, K), generator=generator, device=dev) if u is None else u
    noise = torch.empty((B, V), device=dev).exponential_(1, generator=generator) if noise is None else noise
    kern, T = _kernels(), float(temperature)
    logits, n_tiles = target_logits.reshape(B * (K + 1), V), _cdiv(V, TRITON_ROWS_BLOCK_V)
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    qf = q.reshape(B * K, V).contiguous() if K else logits  # a pointer never read when K = 0
    d, vl = drafts.long().contiguous(), verify_len.long().contiguous()
    uf, nz = (u.float().contiguous() if K else logits), noise.float().contiguous()
    BLOCK_T = _pow2(n_tiles)
    pmax, psum = (torch.empty((B * (K + 1), n_tiles), dtype=torch.float32, device=dev) for _ in range(2))
    kern["_rows_softmax_partial_kernel"][(B * (K + 1), n_tiles)](logits, logits.stride(0), pmax, psum, n_tiles, V, T,
                                                                 BLOCK_V=TRITON_ROWS_BLOCK_V)
    n = torch.empty((B,), dtype=torch.long, device=dev)
    stat = torch.empty((B, 3), dtype=torch.float32, device=dev)
    kern["_verify_sampled_accept_kernel"][(B,)](pmax, psum, n_tiles, logits, logits.stride(0), d, qf, qf.stride(0),
                                                uf, vl, n, stat, K, T, BLOCK_J=_pow2(K + 1), BLOCK_T=BLOCK_T,
                                                num_warps=8)
    pval = torch.empty((B, n_tiles, 2), dtype=torch.float32, device=dev)
    pidx = torch.empty((B, n_tiles, 2), dtype=torch.int32, device=dev)
    rsum = torch.empty((B, n_tiles), dtype=torch.float32, device=dev)
    kern["_verify_sampled_race_kernel"][(B, n_tiles)](logits, logits.stride(0), qf, qf.stride(0), nz, nz.stride(0),
                                                      n, stat, pval, pidx, rsum, n_tiles, V, K, T,
                                                      HAS_Q=K > 0, BLOCK_V=TRITON_ROWS_BLOCK_V)
    nxt = torch.empty((B,), dtype=torch.long, device=dev)
    kern["_verify_sampled_pick_kernel"][(B,)](pval, pidx, rsum, stat, nxt, n_tiles, HAS_Q=K > 0, BLOCK_T=BLOCK_T)
    return n, nxt


TRITON_BLOCK_N = 64               # keys per step of the attention loop
TRITON_BLOCK_M = 64               # query rows per program at most
TRITON_ATTENTION_PROGRAMS = 256   # split the keys (flash-decoding) while there are fewer programs than this
TRITON_SPLIT_MIN_BLOCKS = 4       # ... each split at least this many blocks of keys


def attention_splits(programs: int, S: int) -> tuple[int, int]:
    """(splits, keys per split) of a cache of S keys for `programs` programs without splitting."""
    key_blocks = _cdiv(S, TRITON_BLOCK_N)
    splits = max(1, min(_cdiv(TRITON_ATTENTION_PROGRAMS, programs), key_blocks // TRITON_SPLIT_MIN_BLOCKS))
    split_keys = _cdiv(key_blocks, splits) * TRITON_BLOCK_N
    return _cdiv(S, split_keys), split_keys


def cached_attention(q, k, v, bias):
    """`model.attend_cached` as one kernel: a program per (batch row, K/V head, query block), online
    softmax in float32, key blocks no row may see skipped; a row that sees no key gives zeros."""
    B, T, H, hd = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    if not (_triton_ok(q, k, v, bias) and q.dtype in _ROUND_CODE and 16 <= hd <= 256 and hd & (hd - 1) == 0
            and H % Hkv == 0 and bias.shape[2] in (T, T * (H // Hkv)) and S > 0
            and not (_TRITON_IMPORT_INTERPRET and q.dtype == torch.bfloat16)):  # the interpreter's bf16 tl.dot is wrong
        import model
        return model.attend_cached(q, k, v, bias)
    G = H // Hkv
    q, k, v, bias = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v, bias))
    out = torch.empty((B, T, H * hd), dtype=q.dtype, device=q.device)
    BLOCK_M = min(TRITON_BLOCK_M, max(16, _pow2(T * G)))
    row_blocks = _cdiv(T * G, BLOCK_M)
    programs = B * Hkv * row_blocks
    splits, split_keys = attention_splits(programs, S)
    shape = (programs, splits, BLOCK_M) if splits > 1 else (1,)
    m, l = (torch.empty(shape, dtype=torch.float32, device=q.device) for _ in range(2))
    acc = torch.empty((*shape, hd) if splits > 1 else (1,), dtype=torch.float32, device=q.device)
    _kernels()["_cached_attention_kernel"][(B * Hkv, row_blocks, splits)](
        q, k, v, bias, out, m, l, acc, T, G, Hkv, H, q.stride(0), q.stride(1), q.stride(2), k.stride(0),
        k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), bias.stride(0), bias.stride(2),
        hd ** -0.5, S=S, HD=hd, BLOCK_M=BLOCK_M, BLOCK_N=TRITON_BLOCK_N, SPLIT_KEYS=split_keys, PARTIAL=splits > 1,
        IEEE=q.dtype == torch.float32)
    if splits == 1:
        return out
    top = m.amax(1, keepdim=True)  # combine the splits' softmax statistics
    w = torch.exp(m - torch.where(top == float("-inf"), 0.0, top))
    den = (w * l).sum(1)
    o = (w[..., None] * acc).sum(1) / torch.where(den > 0, den, 1.0)[..., None]
    o = o.view(B, Hkv, row_blocks * BLOCK_M, hd)[:, :, :T * G].reshape(B, Hkv, T, G, hd)
    return o.permute(0, 2, 1, 3, 4).reshape(B, T, H * hd).to(q.dtype)


# The kernel sources, made Triton kernels by `_build_triton_kernels` (tl is bound on first use).

def _round_to(x, CODE: tl.constexpr):
    """float32 x rounded (to nearest even) to bfloat16 (CODE 1) or float16 (CODE 2), kept as float32."""
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
    # R is a constexpr: Triton 3.6's interpreter cannot loop over a runtime bound.
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
    """One (batch row, K/V head, query block, key split): rows r = t * G + i (token t, head h * G + i);
    PARTIAL: the split's max, sum and weighted values go to m/l/acc."""
    pid = tl.program_id(0).to(tl.int64)  # int64: b * s_kb passes 2^31 at batch 64 and a 32k context
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


TRITON_SOURCES = ("_round_to", "_markov_partial_kernel", "_markov_reduce_kernel", "_rows_softmax_partial_kernel",
                  "_verify_sampled_accept_kernel", "_verify_sampled_race_kernel", "_verify_sampled_pick_kernel",
                  "_cached_attention_kernel")


def check_backend(name: str, device):
    """--kernels: "torch" (sampling.py's references), or "triton" (built now, before a graph traces them);
    RuntimeError where Triton cannot run."""
    if name == "torch":
        return
    if not _triton_ok(torch.empty(0, device=device)):
        raise RuntimeError("the Triton kernels need the triton package and a CUDA device (on cpu, Triton's "
                           "interpreter: TRITON_INTERPRET=1)")
    _build_triton_kernels()


_TRITON_KERNELS: dict = {}
_PLAIN = {name: globals()[name] for name in TRITON_SOURCES}


def _build_triton_kernels() -> dict:
    """triton.jit the kernel sources, once, in the mode triton was imported in (the kernels call
    `_round_to` by name, so the jitted helper replaces the module's)."""
    if not _TRITON_KERNELS and _import_triton():
        saved = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1" if _TRITON_IMPORT_INTERPRET else "0"  # read by triton.jit
        try:
            _TRITON_KERNELS.update({name: triton.jit(_PLAIN[name]) for name in TRITON_SOURCES})
            globals()["_round_to"] = _TRITON_KERNELS["_round_to"]
        finally:
            if saved is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = saved
    return _TRITON_KERNELS


def _kernels() -> dict:  # under torch.compile: what check_backend built (no imports inside a graph)
    return _TRITON_KERNELS if torch.compiler.is_compiling() else _build_triton_kernels()
