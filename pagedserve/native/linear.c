/* Float32 linear layer y = x @ W^T + b for the CPU decode path, on AVX2 + FMA.
 *
 * Why not oneDNN or MKL: at decode sizes (x has one row per running sequence, 1 to a few dozen)
 * their GEMMs read the weights from DRAM in one pass and compute in another, and run at a third
 * of the CPU's FMA peak (docs/benchmarks.md). Here the weight is packed once into panels of 24
 * output columns, each panel contiguous over K ([ceil(N/24)][K][24], zero-padded), and every
 * panel is consumed in K-blocks of 128 (12 KB, resident in L1) by all row tiles of x before the
 * next block streams in, and the first row tile prefetches two blocks ahead (past a panel's end
 * that is the thread's next panel): the DRAM stream and the FMAs overlap over the whole call.
 *
 * The micro-kernel keeps a 4 x 24 tile of y in 12 ymm registers (4 rows x 3 vectors), broadcasts
 * one x value per row and multiplies it into 24 weights: 12 FMAs per 3 weight loads and 4
 * broadcasts, which keeps both FMA pipes busy (a 6 x 16 tile ran ~20% slower here). Each output
 * sums its K products in order (one float32 FMA chain per output, carried through y between
 * K-blocks), so results differ from other GEMMs only in summation order, and not with the
 * thread count.
 *
 * Wrapped by linear.py; built with the other kernels by build.py.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#define NV 3          /* 8-float vectors per panel row */
#define NR (8 * NV)   /* output columns per panel */
#define MR 4          /* rows of x per register tile */
#define KB 128        /* K-block: 128 x 24 floats = 12 KB of panel */
#define PREFETCH 2    /* the first row tile prefetches the K-block this many blocks ahead */

/* What a tile needs to know about its panel's output columns: all NR real (`full`), or the
 * lane masks of the real ones (the last panel of an N that is no multiple of NR; masked moves
 * are slow, so only there), and the bias to add on the last K-block (zero before). */
typedef struct {
    int full;
    __m256i mask[NV];
    __m256 bias[NV];
} columns;

static inline __m256 load_y(const float *y, const columns *c, int v) {
    return c->full ? _mm256_loadu_ps(y + 8 * v) : _mm256_maskload_ps(y + 8 * v, c->mask[v]);
}

static inline void store_y(float *y, const columns *c, int v, __m256 value) {
    value = _mm256_add_ps(value, c->bias[v]);
    if (c->full)
        _mm256_storeu_ps(y + 8 * v, value);
    else
        _mm256_maskstore_ps(y + 8 * v, c->mask[v], value);
}

#define ACC(r)                                                                     \
    __m256 c##r##0 = _mm256_setzero_ps(), c##r##1 = c##r##0, c##r##2 = c##r##0;   \
    if (R > r && !first) {                                                         \
        c##r##0 = load_y(y + r * ldy, c, 0);                                       \
        c##r##1 = load_y(y + r * ldy, c, 1);                                       \
        c##r##2 = load_y(y + r * ldy, c, 2);                                       \
    }
#define FMA(r)                                                                     \
    if (R > r) {                                                                   \
        const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);                     \
        c##r##0 = _mm256_fmadd_ps(a, b0, c##r##0);                                 \
        c##r##1 = _mm256_fmadd_ps(a, b1, c##r##1);                                 \
        c##r##2 = _mm256_fmadd_ps(a, b2, c##r##2);                                 \
    }
#define OUT(r)                                                                     \
    if (R > r) {                                                                   \
        store_y(y + r * ldy, c, 0, c##r##0);                                       \
        store_y(y + r * ldy, c, 1, c##r##1);                                       \
        store_y(y + r * ldy, c, 2, c##r##2);                                       \
    }

/* One register tile: ROWS rows of x (stride ldx) times kl rows of a panel, added to the partial
 * sums already in y unless `first`. `pf`, when set, is prefetched one line per k. */
#define TILE(ROWS)                                                                           \
    static void tile##ROWS(const float *x, int64_t ldx, const float *p, int64_t kl, float *y, \
                           int64_t ldy, const columns *c, int first, const float *pf) {      \
        enum { R = ROWS }; /* the ACC/FMA/OUT macros test R */                               \
        ACC(0) ACC(1) ACC(2) ACC(3)                                                          \
        for (int64_t k = 0; k < kl; k++) {                                                   \
            const __m256 b0 = _mm256_load_ps(p + k * NR), b1 = _mm256_load_ps(p + k * NR + 8), \
                         b2 = _mm256_load_ps(p + k * NR + 16);                               \
            if (pf) _mm_prefetch((const char *)(pf + k * NR), _MM_HINT_T0);                  \
            FMA(0) FMA(1) FMA(2) FMA(3)                                                      \
        }                                                                                    \
        OUT(0) OUT(1) OUT(2) OUT(3)                                                          \
    }
TILE(1) TILE(2) TILE(3) TILE(4)

typedef void (*tile_fn)(const float *, int64_t, const float *, int64_t, float *, int64_t,
                        const columns *, int, const float *);
static const tile_fn TILES[MR + 1] = {0, tile1, tile2, tile3, tile4};

/* The columns of panel pi; the bias only when `with_bias` (the last K-block). */
static columns panel_columns(int64_t pi, int64_t N, const float *bias, int with_bias) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const int64_t col = pi * NR, ncols = N - col < NR ? N - col : NR;
    columns c;
    c.full = ncols == NR;
    for (int v = 0; v < NV; v++) {
        const int64_t n = ncols - 8 * v;
        c.mask[v] = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n < 0 ? 0 : n > 8 ? 8 : n)), lane);
        c.bias[v] = bias && with_bias ? _mm256_maskload_ps(bias + col + 8 * v, c.mask[v])
                                      : _mm256_setzero_ps();
    }
    return c;
}

/* x [M, K] row-major, w packed as above for N outputs, bias [N] or NULL, y [M, N] row-major. */
void pagedserve_linear(const float *x, int64_t M, int64_t K, const float *w, int64_t N,
                       const float *bias, float *y, int num_threads) {
    const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int64_t pi = 0; pi < panels; pi++) {
        const float *panel = w + pi * K * NR;
        for (int64_t k0 = 0; k0 < K; k0 += KB) {
            const int64_t kl = K - k0 < KB ? K - k0 : KB;
            const columns c = panel_columns(pi, N, bias, k0 + kl == K);
            for (int64_t m = 0; m < M; m += MR) {
                const int64_t rows = M - m < MR ? M - m : MR;
                const float *pf = m == 0 ? panel + (k0 + PREFETCH * KB) * NR : NULL;
                TILES[rows](x + m * K + k0, K, panel + k0 * NR, kl, y + m * N + pi * NR, N, &c,
                            k0 == 0, pf);
            }
        }
    }
}
