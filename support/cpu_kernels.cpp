// CPU kernels (float32, AVX2 + FMA, AVX-512 where the CPU has it) for a speculative round's few rows:
// a GEMM against a weight stored in panels (`panel_linear`) and attention of a few query tokens over
// the KV cache (`cached_attention`); F.linear and SDPA are their references. Every GEMM output is one
// chain of FMAs over k in order, so its bits depend on neither the other rows, the blocking, the
// thread nor the vector width.
#include <immintrin.h>
#include <sys/mman.h>

#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

namespace {

constexpr long PANEL = 16;     // output columns per panel: a weight [N, K] is stored as panels [N/16][K][16]
constexpr long KB = 256;       // k steps per block, when more than one tile's rows read the panels
// How far ahead a tile prefetches: 64 k steps (4 KiB of a panel), or past its own panels when it reads several.
template <int NP>
long prefetch(long kstep, long pstride) {
    return NP > 1 ? std::max(NP * pstride, 64 * kstep) : 64 * kstep;
}

// A register tile: rows 0..MR-1 of x times NP panels (panel j's step k at p + j * pstride + k * kstep)
// over k = 0..kn-1 into y, from 0 when `first`, else continuing y's chains; one pass serves all MR rows.
using tile_fn = void (*)(const float *, long, const float *, long, long, long, float *, long, bool);

template <int MR, int NP>
void tile_avx2(const float *x, long ldx, const float *p, long kstep, long pstride, long kn, float *y, long ldy,
               bool first) {
    __m256 acc[MR * NP * 2];
#pragma GCC unroll 32
    for (int i = 0; i < MR * NP * 2; i++)
        acc[i] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(y + (i / (2 * NP)) * ldy + (i % (2 * NP)) * 8);
    const long pf = prefetch<NP>(kstep, pstride);
#pragma GCC unroll 4
    for (long k = 0; k < kn; k++) {
#pragma GCC unroll 8
        for (int j = 0; j < NP; j++) {
            const float *w = p + j * pstride + k * kstep;
            __builtin_prefetch(w + pf);
            const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
#pragma GCC unroll 8
            for (int m = 0; m < MR; m++) {
                const __m256 xm = _mm256_broadcast_ss(x + m * ldx + k);
                acc[(m * NP + j) * 2] = _mm256_fmadd_ps(xm, w0, acc[(m * NP + j) * 2]);
                acc[(m * NP + j) * 2 + 1] = _mm256_fmadd_ps(xm, w1, acc[(m * NP + j) * 2 + 1]);
            }
        }
    }
#pragma GCC unroll 32
    for (int i = 0; i < MR * NP * 2; i++) _mm256_storeu_ps(y + (i / (2 * NP)) * ldy + (i % (2 * NP)) * 8, acc[i]);
}

#pragma GCC push_options
#pragma GCC target("avx512f")
template <int MR, int NP>
void tile_avx512(const float *x, long ldx, const float *p, long kstep, long pstride, long kn, float *y, long ldy,
                 bool first) {
    __m512 acc[MR * NP];
#pragma GCC unroll 32
    for (int i = 0; i < MR * NP; i++)
        acc[i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(y + (i / NP) * ldy + (i % NP) * PANEL);
    const long pf = prefetch<NP>(kstep, pstride);
#pragma GCC unroll 4
    for (long k = 0; k < kn; k++) {
        __m512 w[NP];
#pragma GCC unroll 8
        for (int j = 0; j < NP; j++) {
            w[j] = _mm512_loadu_ps(p + j * pstride + k * kstep);
            __builtin_prefetch(p + j * pstride + k * kstep + pf);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MR; m++) {
            const __m512 xm = _mm512_set1_ps(x[m * ldx + k]);
#pragma GCC unroll 8
            for (int j = 0; j < NP; j++) acc[m * NP + j] = _mm512_fmadd_ps(xm, w[j], acc[m * NP + j]);
        }
    }
#pragma GCC unroll 32
    for (int i = 0; i < MR * NP; i++) _mm512_storeu_ps(y + (i / NP) * ldy + (i % NP) * PANEL, acc[i]);
}
#pragma GCC pop_options

// Per ISA and rows r in a group: the tile taking np[r] panels at once (filling the registers), and the
// one-panel tile for a weight's last panels.
struct Tiles {
    int max_rows;
    long cb;  // panels per column block, a multiple of every np
    tile_fn wide[9], one[9];
    int np[9];
};

const Tiles AVX2 = {
    6, 6,  // 16 ymm registers: 12 accumulators
    {nullptr, tile_avx2<1, 6>, tile_avx2<2, 3>, tile_avx2<3, 2>, tile_avx2<4, 1>, tile_avx2<5, 1>, tile_avx2<6, 1>},
    {nullptr, tile_avx2<1, 1>, tile_avx2<2, 1>, tile_avx2<3, 1>, tile_avx2<4, 1>, tile_avx2<5, 1>, tile_avx2<6, 1>},
    {0, 6, 3, 2, 1, 1, 1}};

const Tiles AVX512 = {
    8, 12,  // 32 zmm registers: up to 24 accumulators, so a verify's 8 rows share one pass
    {nullptr, tile_avx512<1, 6>, tile_avx512<2, 4>, tile_avx512<3, 4>, tile_avx512<4, 3>, tile_avx512<5, 3>,
     tile_avx512<6, 3>, tile_avx512<7, 3>, tile_avx512<8, 3>},
    {nullptr, tile_avx512<1, 1>, tile_avx512<2, 1>, tile_avx512<3, 1>, tile_avx512<4, 1>, tile_avx512<5, 1>,
     tile_avx512<6, 1>, tile_avx512<7, 1>, tile_avx512<8, 1>},
    {0, 6, 4, 4, 3, 3, 3, 3, 3}};

// AVX-512 where the CPU (and OS) have it, unless DSPARK_CPU_KERNELS=avx2 asks for the AVX2 path.
const Tiles &tiles() {
    static const Tiles &t = [] () -> const Tiles & {
        const char *e = getenv("DSPARK_CPU_KERNELS");
        return (!e || strcasecmp(e, "avx2") != 0) && __builtin_cpu_supports("avx512f") ? AVX512 : AVX2;
    }();
    return t;
}

// y [M, 16 * n_panels] = x [M, K] times the panels: column blocks of t.cb panels, each read once for all
// rows, in k-blocks of KB steps (kept in cache) while more than one tile's rows share them.
static void gemm(const Tiles &t, const float *x, long ldx, const float *p, long kstep, long pstride, long n_panels,
                 long K, float *y, long ldy, long M) {
    for (long c0 = 0; c0 < n_panels; c0 += t.cb) {
        const long cn = std::min(t.cb, n_panels - c0);
        const long kb = M <= t.max_rows ? K : KB;
        for (long k0 = 0; k0 < K; k0 += kb) {
            const long kn = std::min(kb, K - k0);
            for (long m0 = 0; m0 < M; m0 += t.max_rows) {
                const int r = (int)std::min<long>(t.max_rows, M - m0);
                const float *xs = x + m0 * ldx + k0, *ps = p + c0 * pstride + k0 * kstep;
                float *ys = y + m0 * ldy + c0 * PANEL;
                long q = 0;
                for (; q + t.np[r] <= cn; q += t.np[r])
                    t.wide[r](xs, ldx, ps + q * pstride, kstep, pstride, kn, ys + q * PANEL, ldy, k0 == 0);
                for (; q < cn; q++)
                    t.one[r](xs, ldx, ps + q * pstride, kstep, pstride, kn, ys + q * PANEL, ldy, k0 == 0);
            }
        }
        if (K == 0)
            for (long m = 0; m < M; m++) memset(y + m * ldy + c0 * PANEL, 0, cn * PANEL * sizeof(float));
    }
}

// ---------------------------------------------------------------------------------------------
// Attention of a few query tokens over the KV cache: per batch row and K/V head, its GQA group's query
// rows times the keys (transposed into panels), a softmax per row, times the values: two `gemm`s over
// keys 0..n-1 only, n one past the last key any query may see. Masked keys weigh exactly 0, so a row's
// result depends on neither the other rows nor the masked keys past its own.

// exp(x) for 8 floats (Cephes' polynomial on x - n ln 2, about 1 ulp); exactly 0 below -87.3 (and -inf)
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

// keys kb[0..n-1] (row stride ks, hd floats each) into kT [ceil(n/16)][hd][16] (what lies past n is left)
static void keys_to_panels(const float *kb, long ks, long n, long hd, float *kT) {
    long j = 0;
    for (; j + 4 <= n; j += 4)  // 4 x 4 blocks transposed in registers
        for (long c = 0; c < hd; c += 4) {
            __m128 r0 = _mm_loadu_ps(kb + j * ks + c), r1 = _mm_loadu_ps(kb + (j + 1) * ks + c),
                   r2 = _mm_loadu_ps(kb + (j + 2) * ks + c), r3 = _mm_loadu_ps(kb + (j + 3) * ks + c);
            _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
            float *dst = kT + (j / PANEL) * hd * PANEL + c * PANEL + j % PANEL;
            _mm_storeu_ps(dst, r0), _mm_storeu_ps(dst + PANEL, r1), _mm_storeu_ps(dst + 2 * PANEL, r2),
                _mm_storeu_ps(dst + 3 * PANEL, r3);
        }
    for (; j < n; j++)
        for (long c = 0; c < hd; c++) kT[(j / PANEL) * hd * PANEL + c * PANEL + j % PANEL] = kb[j * ks + c];
}

// Scores s[0..Sp-1] -> softmax numerators exp(s * scale + bias - max) in place; returns 1 / their sum,
// or 0 when every key is masked (the row's output is then 0, as SDPA's CPU kernel gives).
static float softmax_row(float *s, long Sp, const float *bias, float scale) {
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    __m256 vmax = ninf, vsum = _mm256_setzero_ps();
    __m256 vnan = _mm256_setzero_ps();  // a NaN score (max_ps drops NaN): the row is NaN, as SDPA's
    for (long j = 0; j < Sp; j += 8) {
        const __m256 b = _mm256_loadu_ps(bias + j);
        const __m256 x = _mm256_blendv_ps(_mm256_fmadd_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(scale), b), ninf,
                                          _mm256_cmp_ps(b, ninf, _CMP_EQ_OQ));
        _mm256_storeu_ps(s + j, x);
        vmax = _mm256_max_ps(vmax, x);
        vnan = _mm256_or_ps(vnan, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    }
    if (_mm256_movemask_ps(vnan)) return NAN;
    float lanes[8], mx = -INFINITY, sum = 0.f;
    _mm256_storeu_ps(lanes, vmax);
    for (float l : lanes) mx = std::max(mx, l);
    for (long j = 0; j < Sp; j += 8) {  // all masked: 0 (exp(-inf - -inf) would be NaN)
        const __m256 e =
            mx == -INFINITY ? _mm256_setzero_ps() : exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), _mm256_set1_ps(mx)));
        _mm256_storeu_ps(s + j, e);
        vsum = _mm256_add_ps(vsum, e);
    }
    _mm256_storeu_ps(lanes, vsum);
    for (float l : lanes) sum += l;
    return mx == -INFINITY ? 0.f : 1.f / sum;
}

// out [B, T, H * hd] = softmax(q kᵀ / sqrt(hd) + bias) v per head (GQA); q [B, T, H, hd], k and v
// [B, S, Hkv, hd], bias [B, 1, T, S], each with stride 1 in its last dimension; hd % 16 == 0.
static void attention(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &bias,
                      float *out) {
    const Tiles &t = tiles();
    const long B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3), S = k.size(1), Hkv = k.size(2);
    const long g = H / Hkv, R = g * T;  // the query rows of one K/V head: r = i * g + j (token i, head h*g + j)
    const long qb = q.stride(0), qt = q.stride(1), qh = q.stride(2), kb = k.stride(0), ks = k.stride(1),
               kh = k.stride(2), vb = v.stride(0), vs = v.stride(1), vh = v.stride(2), bb = bias.stride(0),
               bt = bias.stride(2);
    const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(),
                *bp = bias.data_ptr<float>();
    const float scale = 1.f / std::sqrt((float)hd);
    std::vector<long> keys(B);  // per batch row: keys 0..n-1, up to the last finite bias of any token
    for (long b = 0; b < B; b++) {
        long n = 0;
        for (long i = 0; i < T; i++) {
            const float *bi = bp + b * bb + i * bt;
            long e = S;
            while (e > n && bi[e - 1] == -INFINITY) e--;
            n = std::max(n, e);
        }
        keys[b] = n;
    }
    // Threads take whole (batch row, K/V head) pairs.
    at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
        std::vector<float> qc(R * hd), oc(R * hd), kT, sc, bpad, inv(R);
        for (long bh = i0; bh < i1; bh++) {
            const long b = bh / Hkv, h = bh % Hkv, n = keys[b], np = (n + PANEL - 1) / PANEL, Sp = np * PANEL;
            for (long r = 0; r < R; r++)
                memcpy(&qc[r * hd], qp + b * qb + (r / g) * qt + (h * g + r % g) * qh, hd * sizeof(float));
            kT.resize(np * hd * PANEL);
            if (np) memset(&kT[(np - 1) * hd * PANEL], 0, hd * PANEL * sizeof(float));  // keys past n: 0
            keys_to_panels(kp + b * kb + h * kh, ks, n, hd, kT.data());
            sc.resize(R * Sp);
            bpad.assign(T * Sp, -INFINITY);  // the tokens' biases over keys 0..Sp-1, -inf past n
            for (long i = 0; i < T; i++) memcpy(&bpad[i * Sp], bp + b * bb + i * bt, n * sizeof(float));
            gemm(t, qc.data(), hd, kT.data(), PANEL, hd * PANEL, np, hd, sc.data(), Sp, R);  // q.k
            for (long r = 0; r < R; r++) inv[r] = softmax_row(&sc[r * Sp], Sp, &bpad[(r / g) * Sp], scale);
            gemm(t, sc.data(), Sp, vp + b * vb + h * vh, vs, PANEL, hd / PANEL, n, oc.data(), hd, R);  // p.v
            for (long r = 0; r < R; r++) {
                float *o = out + ((b * T + r / g) * H + h * g + r % g) * hd;
                for (long c = 0; c < hd; c++) o[c] = oc[r * hd + c] * inv[r];
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// The operators: shapes checked (a bad call raises RuntimeError, never reads out of bounds).

// Memory for panels, cut from 64 MiB blocks on transparent huge pages (a weight streamed through 4 KiB
// pages costs a TLB walk per page); a block lives as long as any tensor cut from it.
static at::Tensor panel_memory(long nbytes) {
    static std::mutex mu;
    static at::Tensor *block = new at::Tensor();  // never destroyed: the process may end in any order
    static long used = 0;
    const long huge = 2 << 20, block_bytes = 64 << 20;
    std::lock_guard<std::mutex> lock(mu);
    if (!block->defined() || used + nbytes > block->numel()) {
        const long want = std::max(nbytes, block_bytes), size = want + huge;  // room to align
        void *base = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        TORCH_CHECK(base != MAP_FAILED, "panels: mmap of ", size, " bytes failed");
        char *aligned = (char *)(((uintptr_t)base + huge - 1) & ~uintptr_t(huge - 1));
        madvise(aligned, want, MADV_HUGEPAGE);
        *block = at::from_blob(aligned, {want}, [base, size](void *) { munmap(base, size); }, at::kByte);
        used = 0;
    }
    used += nbytes;
    return block->narrow(0, used - nbytes, nbytes);
}

// [N, K] -> panels [N/16, K, 16] (panel q: rows 16q..16q+15, k-major), on huge pages.
at::Tensor panels_op(const at::Tensor &w) {
    TORCH_CHECK(w.dim() == 2 && w.size(0) % PANEL == 0 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
                "panels: weight ", w.sizes(), " ", w.scalar_type(), " is not a float32 CPU [N, K] with N % 16 == 0");
    const long N = w.size(0), K = w.size(1);
    at::Tensor out = panel_memory((N * K * 4 + 63) / 64 * 64).narrow(0, 0, N * K * 4).view(at::kFloat);
    return out.view({N / PANEL, K, PANEL}).copy_(w.reshape({N / PANEL, PANEL, K}).transpose(1, 2));
}

at::Tensor panel_linear_op(const at::Tensor &x, const at::Tensor &panels, const std::optional<at::Tensor> &bias) {
    TORCH_CHECK(panels.dim() == 3 && panels.size(2) == PANEL && panels.scalar_type() == at::kFloat &&
                    panels.device().is_cpu() && panels.is_contiguous(),
                "panel_linear: panels ", panels.sizes(), " are not a contiguous float32 CPU tensor [N/16, K, 16]");
    const long K = panels.size(1), N = panels.size(0) * PANEL;
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "panel_linear: x ", x.sizes(), " ", x.scalar_type(), " does not fit a float32 CPU weight of ", N, "x",
                K);
    TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat &&
                          bias->device().is_cpu()),
                "panel_linear: bias is not a float32 CPU vector of ", N);
    const at::Tensor xc = x.contiguous();
    std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
    shape.back() = N;
    at::Tensor y = at::empty(shape, x.options());
    const long M = N ? y.numel() / N : 0;
    if (M == 0) return y;
    const Tiles &t = tiles();
    const float *xp = xc.data_ptr<float>(), *pp = panels.data_ptr<float>();
    float *yp = y.data_ptr<float>();
    const at::Tensor bc = bias ? bias->contiguous() : at::Tensor();
    const float *bp = bias ? bc.data_ptr<float>() : nullptr;
    // Threads take whole column blocks, at least 256 KiB of weight each (waking one costs a few µs).
    const long blocks = (N / PANEL + t.cb - 1) / t.cb, grain = 1 + (256 << 10) / (K * PANEL * 4 * t.cb + 1);
    at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
        const long q0 = b0 * t.cb, q1 = std::min(b1 * t.cb, N / PANEL);
        gemm(t, xp, K, pp + q0 * K * PANEL, PANEL, K * PANEL, q1 - q0, K, yp + q0 * PANEL, N, M);
        for (long m = 0; bp && m < M; m++)  // + bias, after the chain
            for (long n = q0 * PANEL; n < q1 * PANEL; n++) yp[m * N + n] += bp[n];
    });
    return y;
}

at::Tensor cached_attention_op(const at::Tensor &q, const at::Tensor &k, const at::Tensor &v, const at::Tensor &bias) {
    for (const at::Tensor *a : {&q, &k, &v, &bias})
        TORCH_CHECK(a->scalar_type() == at::kFloat && a->device().is_cpu() && a->dim() == 4,
                    "cached_attention: every input must be a 4-D float32 CPU tensor, got ", a->sizes(), " ",
                    a->scalar_type());
    const long B = q.size(0), T = q.size(1), H = q.size(2), hd = q.size(3), Hkv = k.size(2);
    TORCH_CHECK(v.sizes() == k.sizes() && k.size(0) == B && k.size(3) == hd && Hkv > 0 && H % Hkv == 0 &&
                    hd % PANEL == 0 && bias.size(0) == B && bias.size(1) == 1 && bias.size(2) == T &&
                    bias.size(3) == k.size(1),
                "cached_attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", bias ", bias.sizes(),
                " are not [B, T, H, hd], [B, S, Hkv, hd] (H a multiple of Hkv, hd of 16) and [B, 1, T, S]");
    auto inner = [](const at::Tensor &a) { return a.stride(3) == 1 ? a : a.contiguous(); };
    const long S = k.size(1);
    at::Tensor out = S ? at::empty({B, T, H * hd}, q.options()) : at::zeros({B, T, H * hd}, q.options());
    if (out.numel() && S) attention(inner(q), inner(k), inner(v), inner(bias), out.data_ptr<float>());
    return out;
}

}  // namespace

TORCH_LIBRARY(dspark, m) {
    m.def("panel_linear(Tensor x, Tensor panels, Tensor? bias) -> Tensor");
    m.def("cached_attention(Tensor q, Tensor k, Tensor v, Tensor bias) -> Tensor");
    m.def("panels(Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(dspark, CPU, m) {
    m.impl("panel_linear", panel_linear_op);
    m.impl("cached_attention", cached_attention_op);
    m.impl("panels", panels_op);
}
