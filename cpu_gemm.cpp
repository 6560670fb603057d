// y = x @ Wᵀ on one CPU core (AVX2 + FMA, float32), for the products of a speculative round: a
// handful of rows (a verify's K+1 tokens, a drafter's block, one autoregressive token) against a
// large weight. cpu_gemm.py builds this file with the system's C++ compiler and calls it through
// ctypes (`cpu_gemm.panel_linear`); `F.linear` is the reference it is tested against.
//
// The weight is stored once in panels of 16 output columns, P[N/16][K][16] (`cpu_gemm.panel_weight`):
// each panel is one contiguous stream of K*64 bytes, read once per group of up to six rows of x,
// while those rows' 6 x 16 outputs stay in twelve AVX registers. Every output is one chain of fused
// multiply-adds over k = 0..K-1 in order, whatever the number of rows and however they are grouped,
// so a row's result does not depend on the rows computed beside it.
#include <immintrin.h>
#include <stddef.h>

static const long PANEL = 16;
static const long PREFETCH = 32;  // k steps ahead (2 KiB of the panel): at six rows better than 8 or 16, level with 64, 128

// Rows m = 0..M-1 of x (row stride ldx) times NP consecutive panels starting at p, into y (row stride ldy).
template <int M, int NP>
static void rows_x_panels(const float *x, long ldx, const float *p, long K, float *y, long ldy) {
    __m256 acc[M * NP * 2];
#pragma GCC unroll 16
    for (int i = 0; i < M * NP * 2; i++) acc[i] = _mm256_setzero_ps();
    // Four k steps per loop turn: 4-15% faster at three to twelve rows (less loop overhead between
    // the FMAs), level at one, 3-9% slower at two; eight were no better than four.
#pragma GCC unroll 4
    for (long k = 0; k < K; k++) {
#pragma GCC unroll 16
        for (int q = 0; q < NP; q++) {
            const float *w = p + (size_t)q * K * PANEL + k * PANEL;
            // A hint (never faults, even past the end), for groups of rows: alone, a row streams fast
            // enough for the hardware prefetcher, and with it one row measured 5-13% slower.
            if (M > 1) __builtin_prefetch(w + PANEL * PREFETCH);
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

typedef void (*block_fn)(const float *, long, const float *, long, float *, long);

// Groups of fewer rows take several panels at once, to keep up to twelve accumulators in flight.
static const block_fn WIDE[7] = {0, rows_x_panels<1, 6>, rows_x_panels<2, 3>, rows_x_panels<3, 2>,
                                 rows_x_panels<4, 1>, rows_x_panels<5, 1>, rows_x_panels<6, 1>};
static const int WIDE_PANELS[7] = {0, 6, 3, 2, 1, 1, 1};
static const block_fn ONE[7] = {0, rows_x_panels<1, 1>, rows_x_panels<2, 1>, rows_x_panels<3, 1>,
                                rows_x_panels<4, 1>, rows_x_panels<5, 1>, rows_x_panels<6, 1>};

// x [M, K] row-major, panels [N/16, K, 16], y [M, N] row-major; N a multiple of 16.
extern "C" void panel_linear(const float *x, const float *panels, float *y, long M, long K, long N) {
    const long n_panels = N / PANEL;
    for (long m0 = 0; m0 < M; m0 += 6) {
        const int rows = (int)(M - m0 < 6 ? M - m0 : 6);
        const float *xs = x + m0 * K;
        float *ys = y + m0 * N;
        long q = 0;
        for (; q + WIDE_PANELS[rows] <= n_panels; q += WIDE_PANELS[rows])
            WIDE[rows](xs, K, panels + q * K * PANEL, K, ys + q * PANEL, N);
        for (; q < n_panels; q++)
            ONE[rows](xs, K, panels + q * K * PANEL, K, ys + q * PANEL, N);
    }
}
