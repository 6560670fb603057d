// Kernels for the CPU (AVX2 + FMA, float32) at the shapes of a speculative round, where the libraries
// tune for more rows: a few-row GEMM (`panel_linear`) and attention of a few query tokens over the KV
// cache (`cached_attention`), each splitting its work over torch's threads (at::parallel_for) so that
// every output is computed by one thread exactly as with one thread: the same bits at any count.
// cpu_kernels.py builds this file against torch's headers and loads it as the operators
// dspark::panel_linear and dspark::cached_attention; `F.linear` and SDPA are the references they are
// tested against (tests/test_cpu_kernels.py).
//
// GEMM: y = x @ Wᵀ for a handful of rows (a verify's K+1 tokens, a drafter's block, one
// autoregressive token) against a large weight. The weight is stored once in panels of 16 output
// columns, P[N/16][K][16] (`cpu_kernels.panel_weight`): each panel is one contiguous stream of K*64
// bytes, read once per group of up to six rows of x, while those rows' 6 x 16 outputs stay in twelve
// AVX registers. Every output is one chain of fused multiply-adds over k = 0..K-1 in order, whatever
// the number of rows and however they are grouped, so a row's result does not depend on the rows
// computed beside it.
#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#include <optional>
#include <vector>

#include <sys/mman.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

static const long PANEL = 16;
static const long PREFETCH = 32;  // k steps ahead (2 KiB of the panel): at six rows better than 8 or 16, level with 64, 128

// Rows m = 0..M-1 of x (row stride ldx) times NP panels of 16 columns, panel q's step k at
// p + q * pstride + k * kstep (a weight's panels: kstep 16, pstride K * 16), into y (row stride ldy).
template <int M, int NP>
static void rows_x_panels(const float *x, long ldx, const float *p, long kstep, long pstride, long K, float *y,
                          long ldy) {
    __m256 acc[M * NP * 2];
#pragma GCC unroll 16
    for (int i = 0; i < M * NP * 2; i++) acc[i] = _mm256_setzero_ps();
    // Four k steps per loop turn: 4-15% faster at three to twelve rows (less loop overhead between
    // the FMAs), level at one, 3-9% slower at two; eight were no better than four.
#pragma GCC unroll 4
    for (long k = 0; k < K; k++) {
#pragma GCC unroll 16
        for (int q = 0; q < NP; q++) {
            const float *w = p + q * pstride + k * kstep;
            // A hint (never faults, even past the end), for groups of rows: alone, a row streams fast
            // enough for the hardware prefetcher, and with it one row measured 5-13% slower.
            if (M > 1) __builtin_prefetch(w + kstep * PREFETCH);
            __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 16
            for (int m = 0; m < M; m++) {
                __m256 xm = _mm256_broadcast_ss(x + m * ldx + k);
                acc[(m * NP + q) * 2] = _mm256_fmadd_ps(xm, w0, acc[(m * NP + q) * 2]);
                acc[(m * NP + q) * 2 + 1] = _mm256_fmadd_ps(xm, w1, acc[(m * NP + q) * 2 + 1]);
            }
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < M; m++) {
#pragma GCC unroll 16
        for (int q = 0; q < NP; q++) {
            _mm256_storeu_ps(y + m * ldy + q * PANEL, acc[(m * NP + q) * 2]);
            _mm256_storeu_ps(y + m * ldy + q * PANEL + 8, acc[(m * NP + q) * 2 + 1]);
        }
    }
}

typedef void (*block_fn)(const float *, long, const float *, long, long, long, float *, long);

// Groups of fewer rows take several panels at once, to keep up to twelve accumulators in flight.
static const block_fn WIDE[7] = {0, rows_x_panels<1, 6>, rows_x_panels<2, 3>, rows_x_panels<3, 2>,
                                 rows_x_panels<4, 1>, rows_x_panels<5, 1>, rows_x_panels<6, 1>};
static const int WIDE_PANELS[7] = {0, 6, 3, 2, 1, 1, 1};
static const block_fn ONE[7] = {0, rows_x_panels<1, 1>, rows_x_panels<2, 1>, rows_x_panels<3, 1>,
                                rows_x_panels<4, 1>, rows_x_panels<5, 1>, rows_x_panels<6, 1>};

// y [M, 16 * n_panels] (row stride ldy) = x [M, K] (row stride ldx) times the panels (rows_x_panels'
// kstep and pstride), rows in groups of six; a group of fewer rows takes several panels at once.
static void rows_x_all_panels(const float *x, long ldx, const float *p, long kstep, long pstride, long n_panels,
                              long K, float *y, long ldy, long M) {
    for (long m0 = 0; m0 < M; m0 += 6) {
        const int rows = (int)(M - m0 < 6 ? M - m0 : 6);
        const float *xs = x + m0 * ldx;
        float *ys = y + m0 * ldy;
        long q = 0;
        for (; q + WIDE_PANELS[rows] <= n_panels; q += WIDE_PANELS[rows])
            WIDE[rows](xs, ldx, p + q * pstride, kstep, pstride, K, ys + q * PANEL, ldy);
        for (; q < n_panels; q++)
            ONE[rows](xs, ldx, p + q * pstride, kstep, pstride, K, ys + q * PANEL, ldy);
    }
}

// Weight bytes a thread streams at least (below that, fewer threads): waking a thread costs a few µs.
static const long THREAD_MIN_BYTES = 256 << 10;

// x [M, K] row-major, panels [N/16, K, 16], y [M, N] row-major; N a multiple of 16. With torch's
// threads, each takes a range of panels (whole groups of six, so the panels are grouped as with one
// thread; each output is computed by one thread in the same order either way: same bits).
static void panel_linear(const float *x, const float *panels, float *y, long M, long K, long N) {
    const long n_panels = N / PANEL, min_panels = (THREAD_MIN_BYTES / (K * PANEL * 4) + 6) / 6 * 6;
    at::parallel_for(0, (n_panels + 5) / 6, (min_panels + 5) / 6, [&](int64_t g0, int64_t g1) {
        const long q0 = g0 * 6, q1 = g1 * 6 < n_panels ? g1 * 6 : n_panels;
        rows_x_all_panels(x, K, panels + q0 * K * PANEL, PANEL, K * PANEL, q1 - q0, K, y + q0 * PANEL, N, M);
    });
}

// ---------------------------------------------------------------------------------------------
// Attention of a few query tokens over the KV cache: per batch row and K/V head, the query rows that
// read that head (its GQA group's heads x the T tokens) are one small GEMM against the keys, a
// softmax per row, and one small GEMM against the values, both on rows_x_panels: K is transposed
// into panels of 16 keys, V is read in place (a key a step). Only keys 0..n-1 are read, n = one past
// the last key any query may see (the bias is -inf beyond), so a static cache costs what is filled.
// Every score is one FMA chain over the head dimension, every output one chain over the keys in
// order, the softmax's max and sum lane by lane over blocks of 8 keys; masked keys weigh exactly 0.
// So a query row's result is the same bits whatever other rows or tokens share the call, and however
// many masked keys the cache holds past its own (given finite K/V).

// exp(x) for 8 floats (Cephes' polynomial on x - n ln 2, about 1 ulp); exactly 0 below -87.3 (and for -inf)
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.33654f), hi = _mm256_set1_ps(88.37626f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

// 8 x 8 transpose in registers: rows r0..r7 become columns
static inline void transpose8(__m256 &r0, __m256 &r1, __m256 &r2, __m256 &r3, __m256 &r4, __m256 &r5, __m256 &r6,
                              __m256 &r7) {
    const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1), t2 = _mm256_unpacklo_ps(r2, r3),
                 t3 = _mm256_unpackhi_ps(r2, r3), t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
                 t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE),
                 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE),
                 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE),
                 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r0 = _mm256_permute2f128_ps(u0, u4, 0x20); r1 = _mm256_permute2f128_ps(u1, u5, 0x20);
    r2 = _mm256_permute2f128_ps(u2, u6, 0x20); r3 = _mm256_permute2f128_ps(u3, u7, 0x20);
    r4 = _mm256_permute2f128_ps(u0, u4, 0x31); r5 = _mm256_permute2f128_ps(u1, u5, 0x31);
    r6 = _mm256_permute2f128_ps(u2, u6, 0x31); r7 = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// keys kb[0..n-1] (row stride ks, hd floats each) into kT [ceil(n/16)][hd][16] (what lies past n is left)
static void keys_to_panels(const float *kb, long ks, long n, long hd, float *kT) {
    long j = 0;
    for (; j + 8 <= n; j += 8) {
        float *dst = kT + (j / PANEL) * hd * PANEL + j % PANEL;
        for (long c = 0; c < hd; c += 8) {
            __m256 x0 = _mm256_loadu_ps(kb + j * ks + c), x1 = _mm256_loadu_ps(kb + (j + 1) * ks + c),
                   x2 = _mm256_loadu_ps(kb + (j + 2) * ks + c), x3 = _mm256_loadu_ps(kb + (j + 3) * ks + c),
                   x4 = _mm256_loadu_ps(kb + (j + 4) * ks + c), x5 = _mm256_loadu_ps(kb + (j + 5) * ks + c),
                   x6 = _mm256_loadu_ps(kb + (j + 6) * ks + c), x7 = _mm256_loadu_ps(kb + (j + 7) * ks + c);
            transpose8(x0, x1, x2, x3, x4, x5, x6, x7);
            _mm256_storeu_ps(dst + (c + 0) * PANEL, x0); _mm256_storeu_ps(dst + (c + 1) * PANEL, x1);
            _mm256_storeu_ps(dst + (c + 2) * PANEL, x2); _mm256_storeu_ps(dst + (c + 3) * PANEL, x3);
            _mm256_storeu_ps(dst + (c + 4) * PANEL, x4); _mm256_storeu_ps(dst + (c + 5) * PANEL, x5);
            _mm256_storeu_ps(dst + (c + 6) * PANEL, x6); _mm256_storeu_ps(dst + (c + 7) * PANEL, x7);
        }
    }
    for (; j < n; j++)
        for (long c = 0; c < hd; c++) kT[(j / PANEL) * hd * PANEL + c * PANEL + j % PANEL] = kb[j * ks + c];
}

// Scores s[0..Sp-1] (q.k, n of them valid) -> softmax numerators in place: s * scale + bias, exactly -inf
// where the bias is -inf or past n, then exp(s - max). Returns 1 / their sum (0 when all are masked:
// the row's output is then 0, as SDPA's CPU kernel gives).
static float softmax_row(float *s, long Sp, long n, const float *bias, float scale) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale);
    __m256 vmax = ninf;
    for (long j = 0; j < Sp; j += 8) {
        __m256 b;
        if (j + 8 <= n) {
            b = _mm256_loadu_ps(bias + j);
        } else {
            float bb[8];
            for (int i = 0; i < 8; i++) bb[i] = j + i < n ? bias[j + i] : -INFINITY;
            b = _mm256_loadu_ps(bb);
        }
        const __m256 x = _mm256_blendv_ps(_mm256_fmadd_ps(_mm256_loadu_ps(s + j), vscale, b), ninf,
                                          _mm256_cmp_ps(b, ninf, _CMP_EQ_OQ));
        _mm256_storeu_ps(s + j, x);
        vmax = _mm256_max_ps(vmax, x);
    }
    float lanes[8], mx = -INFINITY, sum = 0.f;
    _mm256_storeu_ps(lanes, vmax);
    for (int i = 0; i < 8; i++) mx = lanes[i] > mx ? lanes[i] : mx;
    if (mx == -INFINITY) {
        for (long j = 0; j < Sp; j++) s[j] = 0.f;
        return 0.f;
    }
    const __m256 vm = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (long j = 0; j < Sp; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), vm));
        _mm256_storeu_ps(s + j, p);
        vsum = _mm256_add_ps(vsum, p);
    }
    _mm256_storeu_ps(lanes, vsum);
    for (int i = 0; i < 8; i++) sum += lanes[i];
    return 1.f / sum;
}

// out [B, T, H * hd] (contiguous) = softmax(q kᵀ * scale + bias) v per head, head h reading K/V head
// h / (H / Hkv). q [B, T, H, hd], k and v [B, S, Hkv, hd], bias [B, T, S] (0 / -inf, or any additive
// mask), each with the given element strides (b, t|s, head) and the innermost stride 1; hd % 16 == 0.
static void cached_attention(const float *q, const float *k, const float *v, const float *bias, float *out,
                                 long B, long T, long H, long Hkv, long S, long hd, long qb, long qt, long qh,
                                 long kb_, long ks, long kh_, long vb_, long vs, long vh_, long bb, long bt,
                                 float scale) {
    const long g = H / Hkv, R = g * T;  // the query rows of one K/V head: r = t * g + i
    std::vector<long> keys(B);  // per batch row, keys 0..n-1: past the last finite bias of every query token, nothing is read
    for (long b = 0; b < B; b++) {
        long n = 0;
        for (long t = 0; t < T; t++) {
            const float *bi = bias + b * bb + t * bt;
            long e = S;
            while (e > n && bi[e - 1] == -INFINITY) e--;
            n = e > n ? e : n;
        }
        keys[b] = n;
    }
    // With torch's threads, each takes whole (batch row, K/V head) pairs: a pair's rows are computed
    // by one thread as with one thread (same bits).
    at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> qc(R * hd), oc(R * hd), kT, sc, inv(R);
        for (long bh = i0; bh < i1; bh++) {
            const long b = bh / Hkv, h = bh % Hkv, n = keys[b], np = (n + PANEL - 1) / PANEL, Sp = np * PANEL;
            kT.resize(np * hd * PANEL);
            if (n % PANEL)  // the last panel's keys past n: zeros (keys_to_panels writes the rest)
                for (long c = 0; c < hd; c++)
                    for (long j = n % PANEL; j < PANEL; j++) kT[(np - 1) * hd * PANEL + c * PANEL + j] = 0.f;
            sc.resize(R * Sp);
            for (long t = 0; t < T; t++)
                for (long i = 0; i < g; i++) {
                    const float *qr = q + b * qb + t * qt + (h * g + i) * qh;
                    for (long c = 0; c < hd; c++) qc[(t * g + i) * hd + c] = qr[c];
                }
            keys_to_panels(k + b * kb_ + h * kh_, ks, n, hd, kT.data());
            rows_x_all_panels(qc.data(), hd, kT.data(), PANEL, hd * PANEL, np, hd, sc.data(), Sp, R);  // q.k
            for (long r = 0; r < R; r++) inv[r] = softmax_row(&sc[r * Sp], Sp, n, bias + b * bb + (r / g) * bt, scale);
            rows_x_all_panels(sc.data(), Sp, v + b * vb_ + h * vh_, vs, PANEL, hd / PANEL, n, oc.data(), hd, R);  // p.v
            for (long r = 0; r < R; r++) {
                float *o = out + ((b * T + r / g) * H + h * g + r % g) * hd;
                const __m256 vi = _mm256_set1_ps(inv[r]);
                for (long c = 0; c < hd; c += 8) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(&oc[r * hd + c]), vi));
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// The operators: shapes and layouts checked (a bad call raises RuntimeError, never reads out of
// bounds), outputs allocated, the kernels above called. No autograd (model never calls them with grad).

static at::Tensor panel_linear_op(const at::Tensor &x, const at::Tensor &panels, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(panels.dim() == 3 && panels.size(2) == PANEL && panels.scalar_type() == at::kFloat &&
                    panels.device().is_cpu() && panels.is_contiguous(),
                "panel_linear: panels ", panels.sizes(), " ", panels.scalar_type(), " on ", panels.device(),
                " are not a contiguous float32 CPU tensor [N/16, K, 16] (panel_weight's)");
    const long K = panels.size(1), N = panels.size(0) * PANEL;
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "panel_linear: x ", x.sizes(), " ", x.scalar_type(), " on ", x.device(), " does not fit a float32 CPU weight of ",
                N, "x", K);
    if (bias)
        TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat && bias->device().is_cpu(),
                    "panel_linear: bias ", bias->sizes(), " ", bias->scalar_type(), " is not a float32 CPU vector of ", N);
    const at::Tensor xc = x.contiguous();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    at::Tensor y = at::empty(shape, x.options());
    const long M = K ? xc.numel() / K : 0;
    if (M) {
        float *yp = y.data_ptr<float>();
        panel_linear(xc.data_ptr<float>(), panels.data_ptr<float>(), yp, M, K, N);
        if (bias) {
            const at::Tensor bc = bias->contiguous();
            const float *bp = bc.data_ptr<float>();
            for (long m = 0; m < M; m++)
                for (long n = 0; n < N; n++) yp[m * N + n] += bp[n];
        }
    }
    return y;
}

static at::Tensor cached_attention_op(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v,
                                      const at::Tensor &bias) {
    for (const at::Tensor *t : {&q, &k, &v, &bias})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->dim() == 4,
                    "cached_attention: every input must be a 4-D float32 CPU tensor, got ", t->sizes(), " ",
                    t->scalar_type(), " on ", t->device());
    const long B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3), S = k.size(1), Hkv = k.size(2);
    TORCH_CHECK(v.sizes() == k.sizes() && k.size(0) == B && k.size(3) == hd && Hkv > 0 && H % Hkv == 0 &&
                    hd % PANEL == 0 && bias.size(0) == B && bias.size(1) == 1 && bias.size(2) == T && bias.size(3) == S,
                "cached_attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", bias ", bias.sizes(),
                " are not [B, T, H, hd], [B, S, Hkv, hd] (H a multiple of Hkv, hd of 16) and [B, 1, T, S]");
    const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous(), kc = k.stride(3) == 1 ? k : k.contiguous(),
                     vc = v.stride(3) == 1 ? v : v.contiguous(), bc = bias.stride(3) == 1 ? bias : bias.contiguous();
    at::Tensor out = at::empty({B, T, H * hd}, q.options());
    if (out.numel()) {
        if (S == 0) {  // no keys: every row sees none
            float *o = out.data_ptr<float>();
            for (long i = 0; i < out.numel(); i++) o[i] = 0.f;
        } else {
            cached_attention(qc.data_ptr<float>(), kc.data_ptr<float>(), vc.data_ptr<float>(), bc.data_ptr<float>(),
                             out.data_ptr<float>(), B, T, H, Hkv, S, hd, qc.stride(0), qc.stride(1), qc.stride(2),
                             kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
                             bc.stride(0), bc.stride(2), 1.f / sqrtf((float)hd));
        }
    }
    return out;
}

// nbytes of fresh memory (uint8) on 2 MiB-aligned transparent huge pages where the kernel grants them
// (madvise(MADV_HUGEPAGE) is a hint: without it, 4 KiB pages), for the panels: streamed through 4 KiB
// pages, a weight costs a TLB walk per page and the hardware prefetchers stop at every page's end. On
// this project's CPU the target's 41 GEMMs at six rows took 6.2 ms a pass instead of 8.2 (one row:
// 4.5 instead of 4.9; BENCHMARKS.md). Unmapped when the last tensor viewing it is freed.
static at::Tensor huge_buffer_op(int64_t nbytes) {
    TORCH_CHECK(nbytes > 0, "huge_buffer: ", nbytes, " bytes");
    const int64_t huge = 2 << 20, size = (nbytes + huge - 1) / huge * huge + huge;  // room to align
    void *base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(base != MAP_FAILED, "huge_buffer: mmap of ", size, " bytes failed");
    char *aligned = reinterpret_cast<char *>((reinterpret_cast<uintptr_t>(base) + huge - 1) & ~uintptr_t(huge - 1));
    madvise(aligned, size - (aligned - static_cast<char *>(base)), MADV_HUGEPAGE);
    return at::from_blob(aligned, {nbytes}, [base, size](void *) { munmap(base, size); },
                         at::TensorOptions().dtype(at::kByte));
}

TORCH_LIBRARY(dspark, m) {
    m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
    m.def("cached_attention(Tensor q, Tensor k, Tensor v, Tensor bias) -> Tensor");
    m.def("huge_buffer(int nbytes) -> Tensor", &huge_buffer_op);
}

TORCH_LIBRARY_IMPL(dspark, CPU, m) {
    m.impl("panel_linear", panel_linear_op);
    m.impl("cached_attention", cached_attention_op);
}
