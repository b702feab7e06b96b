/* Float32 linear layer y = x @ W^T + b for the CPU decode path, on AVX2 + FMA.
 *
 * Why not oneDNN or MKL: at decode sizes (x has one row per running sequence, 1 to a few dozen)
 * their GEMMs read the weights from DRAM in one pass and compute in another, and run at a third
 * of the CPU's FMA peak (docs/benchmarks.md). Here the weight is packed once into panels of 16
 * output columns, each panel contiguous over K ([ceil(N/16)][K][16], zero-padded), and every
 * panel is consumed in K-blocks of 128 (8 KB, resident in L1) by all row tiles of x before the
 * next block streams in, and the first row tile prefetches two blocks ahead (past a panel's end
 * that is the thread's next panel): the DRAM stream and the FMAs overlap over the whole call.
 *
 * The micro-kernel keeps a 6 x 16 tile of y in 12 ymm registers (6 rows x 2 vectors), broadcasts
 * one x value per row and multiplies it into 16 weights: 12 FMAs per 2 weight loads. Each output
 * sums its K products in order (one float32 FMA chain per output, carried through y between
 * K-blocks), so results differ from other GEMMs only in summation order.
 *
 * Wrapped by linear.py; built with the other kernels by build.py.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define NR 16   /* output columns per panel: two 8-float vectors */
#define MR 6    /* rows of x per register tile */
#define KB 128  /* K-block: 128 x 16 floats = 8 KB of panel */
#define PREFETCH 2  /* the first row tile prefetches the K-block this many blocks ahead */

#define ACC(r)                                                                   \
    __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = _mm256_setzero_ps();        \
    if (R > r && !first) {                                                       \
        c##r##0 = full ? _mm256_loadu_ps(y + r * ldy) : _mm256_maskload_ps(y + r * ldy, m0); \
        c##r##1 = full ? _mm256_loadu_ps(y + r * ldy + 8)                        \
                       : _mm256_maskload_ps(y + r * ldy + 8, m1);                \
    }
#define FMA(r)                                                                   \
    if (R > r) {                                                              \
        __m256 a = _mm256_broadcast_ss(x + r * ldx + k);                         \
        c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                               \
        c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                               \
    }
#define OUT(r)                                                                   \
    if (R > r && full) {                                                         \
        _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(c##r##0, bias0));            \
        _mm256_storeu_ps(y + r * ldy + 8, _mm256_add_ps(c##r##1, bias1));        \
    } else if (R > r) {                                                          \
        _mm256_maskstore_ps(y + r * ldy, m0, _mm256_add_ps(c##r##0, bias0));     \
        _mm256_maskstore_ps(y + r * ldy + 8, m1, _mm256_add_ps(c##r##1, bias1)); \
    }

/* One register tile: ROWS rows of x (stride ldx) times kl rows of a panel, added to the partial
 * sums already in y unless `first`; `bias0/1` are added by the caller's last K-block only.
 * Only the last panel of an N that is no multiple of 16 is `full == 0`: it loads and stores y
 * through the lane masks m0/m1 (masked moves are slow, so only there). */
#define TILE(ROWS)                                                                        \
    static void tile##ROWS(const float *x, int64_t ldx, const float *p, int64_t kl,       \
                           float *y, int64_t ldy, __m256i m0, __m256i m1, int full, int first, const float *pf, \
                           __m256 bias0, __m256 bias1) {                                  \
        enum { R = ROWS }; /* the ACC/FMA/OUT macros test R */                          \
        ACC(0) ACC(1) ACC(2) ACC(3) ACC(4) ACC(5)                                         \
        for (int64_t k = 0; k < kl; k++) {                                                \
            __m256 b0 = _mm256_load_ps(p + k * NR), b1 = _mm256_load_ps(p + k * NR + 8);  \
            if (pf) _mm_prefetch((const char *)(pf + k * NR), _MM_HINT_T0);             \
            FMA(0) FMA(1) FMA(2) FMA(3) FMA(4) FMA(5)                                     \
        }                                                                                 \
        OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)                                         \
    }
TILE(1) TILE(2) TILE(3) TILE(4) TILE(5) TILE(6)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t,
                        __m256i, __m256i, int, int, const float *, __m256, __m256);
static const tile_fn TILES[MR + 1] = {0, tile1, tile2, tile3, tile4, tile5, tile6};

/* Lane mask for the first `n` of 8 columns (n may be <= 0 or >= 8). */
static __m256i lanes(int64_t n) {
    const __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n > 8 ? 8 : n)), idx);
}

/* x [M, K] row-major, w packed as above for N outputs, bias [N] or NULL, y [M, N] row-major. */
void pagedserve_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                       const float *bias, float *y, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t pi = 0; pi < panels; pi++) {
        const int64_t col = pi * NR, ncols = N - col < NR ? N - col : NR;
        const __m256i m0 = lanes(ncols), m1 = lanes(ncols - 8);
        const __m256 zero = _mm256_setzero_ps();
        const float *panel = w + pi * K * NR;
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t kl = K - k0 < KB ? K - k0 : KB;
            const int last = k0 + kl == K;
            const __m256 bias0 = last && bias ? _mm256_maskload_ps(bias + col, m0) : zero;
            const __m256 bias1 = last && bias ? _mm256_maskload_ps(bias + col + 8, m1) : zero;
            for (int64_t m = 0; m < M; m += MR) {
                const int64_t rows = M - m < MR ? M - m : MR;
                const float *pf = m == 0 ? panel + (k0 + PREFETCH * KB) * NR : NULL;
                TILES[rows](x + m * K + k0, K, panel + k0 * NR, kl, y + m * N + col, N, m0, m1,
                            ncols == NR, k0 == 0, pf, bias0, bias1);
            }
        }
    }
}
