/* Float32 linear layer y = x @ W^T + b for the CPU decode path, on AVX2 + FMA or AVX-512.
 *
 * Why not oneDNN or MKL: at decode sizes (x has one row per running sequence, 1 to a few dozen)
 * their GEMMs read the weights from DRAM in one pass and compute in another, and run at a third
 * of the CPU's FMA peak (docs/benchmarks.md). Here the weight is packed once into panels of 24
 * output columns, each panel contiguous over K ([ceil(N/24)][K][24], zero-padded), and every
 * panel is consumed in K-blocks (128 rows, 12 KB, resident in L1) by all row tiles of x before the
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
 * With AVX-512 (the avx512 build) the vectors are 16 floats wide and a panel 48 columns: the
 * same tile of 4 rows x 3 vectors, twice the products per instruction. The panel width is the
 * library's (`pagedserve_linear_panel`), which linear.py packs for.
 *
 * Wrapped by linear.py; built with the other kernels by build.py.
 */
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define VW 16         /* floats per vector */
typedef __m512 vec;
typedef __mmask16 lanes;
#define V_ZERO() _mm512_setzero_ps()
#define V_LOAD(p) _mm512_load_ps(p)
#define V_LOADU(p) _mm512_loadu_ps(p)
#define V_MASKLOAD(p, m) _mm512_maskz_loadu_ps(m, p)
#define V_STOREU(p, v) _mm512_storeu_ps(p, v)
#define V_MASKSTORE(p, m, v) _mm512_mask_storeu_ps(p, m, v)
#define V_BCAST(p) _mm512_set1_ps(*(p))
#define V_FMADD(a, b, c) _mm512_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm512_add_ps(a, b)
static inline lanes first_lanes(int64_t n) { return (lanes)((1u << n) - 1u); }
#else
#define VW 8
typedef __m256 vec;
typedef __m256i lanes;
#define V_ZERO() _mm256_setzero_ps()
#define V_LOAD(p) _mm256_load_ps(p)
#define V_LOADU(p) _mm256_loadu_ps(p)
#define V_MASKLOAD(p, m) _mm256_maskload_ps(p, m)
#define V_STOREU(p, v) _mm256_storeu_ps(p, v)
#define V_MASKSTORE(p, m, v) _mm256_maskstore_ps(p, m, v)
#define V_BCAST(p) _mm256_broadcast_ss(p)
#define V_FMADD(a, b, c) _mm256_fmadd_ps(a, b, c)
#define V_ADD(a, b) _mm256_add_ps(a, b)
static inline lanes first_lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#endif
#define NV 3          /* vectors per panel row */
#define NR (VW * NV)  /* output columns per panel */
#define MR 4          /* rows of x per register tile */
#if VW == 16
/* K-block: 32 x 48 floats = 6 KB of panel. The prefetches then run 12 KB ahead; with 128 they
 * ran 48 KB ahead, a whole L1, and were evicted before use (decode step GEMMs at 16 rows,
 * 538 MB of weights: 37.8 ms with 128, 35.5 with 64, 32.5 with 32, 32.4 with 16). */
#define KB 32
#else
#define KB 128        /* K-block: 128 x 24 floats = 12 KB of panel */
#endif
#define PREFETCH 2    /* the first row tile prefetches the K-block this many blocks ahead */

/* What a tile needs to know about its panel's output columns: all NR real (`full`), or the
 * lane masks of the real ones (the last panel of an N that is no multiple of NR; masked moves
 * are slow, so only there), and the bias to add on the last K-block (zero before). */
typedef struct {
    int full;
    lanes mask[NV];
    vec bias[NV];
} columns;

static inline vec load_y(const float *y, const columns *c, int v) {
    return c->full ? V_LOADU(y + VW * v) : V_MASKLOAD(y + VW * v, c->mask[v]);
}

static inline void store_y(float *y, const columns *c, int v, vec value) {
    value = V_ADD(value, c->bias[v]);
    if (c->full)
        V_STOREU(y + VW * v, value);
    else
        V_MASKSTORE(y + VW * v, c->mask[v], value);
}

int pagedserve_linear_panel(void) { return NR; }

#define ACC(r)                                                                     \
    vec c##r##0 = V_ZERO(), c##r##1 = c##r##0, c##r##2 = c##r##0;                  \
    if (R > r && !first) {                                                         \
        c##r##0 = load_y(y + r * ldy, c, 0);                                       \
        c##r##1 = load_y(y + r * ldy, c, 1);                                       \
        c##r##2 = load_y(y + r * ldy, c, 2);                                       \
    }
#define FMA(r)                                                                     \
    if (R > r) {                                                                   \
        const vec a = V_BCAST(x + r * ldx + k);                                    \
        c##r##0 = V_FMADD(a, b0, c##r##0);                                         \
        c##r##1 = V_FMADD(a, b1, c##r##1);                                         \
        c##r##2 = V_FMADD(a, b2, c##r##2);                                         \
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
            const vec b0 = V_LOAD(p + k * NR), b1 = V_LOAD(p + k * NR + VW),                 \
                      b2 = V_LOAD(p + k * NR + 2 * VW);                                      \
            if (pf) _mm_prefetch((const char *)(pf + k * NR), _MM_HINT_T0);                  \
            if (pf && VW == 16) { /* a 48-column row is 3 lines */                          \
                _mm_prefetch((const char *)(pf + k * NR + 16), _MM_HINT_T0);                 \
                _mm_prefetch((const char *)(pf + k * NR + 32), _MM_HINT_T0);                 \
            }                                                                                \
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
    const int64_t col = pi * NR, ncols = N - col < NR ? N - col : NR;
    columns c;
    c.full = ncols == NR;
    for (int v = 0; v < NV; v++) {
        const int64_t n = ncols - VW * v;
        c.mask[v] = first_lanes(n < 0 ? 0 : n > VW ? VW : n);
        c.bias[v] = bias && with_bias ? V_MASKLOAD(bias + col + VW * v, c.mask[v]) : V_ZERO();
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
