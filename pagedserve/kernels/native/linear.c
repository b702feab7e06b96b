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
 * broadcasts, which keeps both FMA pipes busy (a 6 x 16 tile was slower: docs/benchmarks.md,
 * "Native CPU kernels: 2x reached"). Each output
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
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

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
 * ran 48 KB ahead, a whole L1, and were evicted before use (the sizes timed: docs/benchmarks.md,
 * "Issue 17 on the Intel AVX-512 / AMX box", native/linear.c). */
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

#if defined(__AVX512BF16__)
/* bfloat16 weights and activations, y = x @ W^T + b rounded to bfloat16, on AMX-BF16 tiles (the
 * avx512 build; the tile functions are compiled for amx-tile/amx-bf16 by attribute and run
 * only after `pagedserve_linear_bf16_init` got the kernel's permission for the tile state,
 * which it refuses on CPUs without AMX).
 *
 * Why: oneDNN's bfloat16 GEMMs behind `torch.mm` stream the weights slower in a decode step
 * than our float32 kernel above streams twice the bytes. That kernel's panels in bfloat16 pairs
 * with AVX512-BF16 `vdpbf16ps` were tried first and lost at 16 rows: that instruction retires
 * at about half the rate of float32 FMAs, so the decode step's GEMMs were compute-bound and
 * behind F.linear; widening the pairs to float32 for FMAs only tied with F.linear, and both
 * stayed behind oneDNN's prepacked AMX (docs/benchmarks.md, "Issue 17 on the Intel AVX-512 /
 * AMX box", the native bfloat16 GEMM). One `tdpbf16ps` multiplies a 16-row tile
 * of x by 32 x 16 of the weight (8192 products), so this kernel is bound by the weight stream
 * alone at 1 and at 16 rows. Software prefetches of the B tiles changed nothing measurable.
 *
 * Layout: the weight is packed once into panels of 48 output columns over pairs of K,
 * [ceil(N/48)][pairs][48][2] bfloat16 with pairs = ceil(K/32) * 16 (zero-padded), which is AMX's
 * B operand as it is: 16 pairs x 16 columns of a panel are one B tile (64 bytes a row, stride
 * 192). x is copied once per call into a zero-padded scratch of 16-row groups and K rounded up
 * to 32 (the A tiles; padding adds zero products). Per panel and 16-row group three float32 C
 * tiles (48 columns) accumulate over K in tile steps, in order; they are then stored to a
 * float32 scratch, the bias added in float32, and rounded once to bfloat16 (nearest even) into
 * the rows and columns that exist. One thread per panel: the thread count changes nothing.
 * Products of bfloat16 values are exact in float32; `tdpbf16ps` treats subnormal inputs as
 * zero and flushes subnormal sums. */
#define TK 16  /* pairs of K per tile step (32 bfloat16: a 64-byte tile row) */
#define TM 16  /* rows of x per A tile */
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16")))

int pagedserve_linear_bf16_panel(void) { return NR; }

/* Asks Linux for this process's AMX tile state (XTILEDATA, feature 18): 0 when granted. */
int pagedserve_linear_bf16_init(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18) == 0 ? 0 : -1;
}

static inline __m512 bf16_widen(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* Palette 1, every tile 16 rows x 64 bytes (tiles 0-2: C, 3: A, 4-6: B). A constant in memory:
 * gcc 12 drops stores to a local configuration before `ldtilecfg` as dead. */
static const struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TILE_CONFIG = {
    .palette = 1,
    .bytes = {64, 64, 64, 64, 64, 64, 64},
    .rows = {TM, TM, TM, TM, TM, TM, TM},
};

AMX_TARGET static void configure_tiles(void) { _tile_loadconfig(&TILE_CONFIG); }

/* C tiles 0-2 := the 16-row group at `a` (row stride lda bytes) times a panel's `pairs`. */
AMX_TARGET static void panel_tiles(const uint16_t *a, int64_t lda, const uint16_t *panel,
                                   int64_t pairs) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    for (int64_t k = 0; k < pairs; k += TK) {
        const uint16_t *b = panel + k * 2 * NR;
        _tile_loadd(3, a + 2 * k, lda);
        _tile_loadd(4, b, 2 * NR * 2);
        _tile_loadd(5, b + 2 * VW, 2 * NR * 2);
        _tile_loadd(6, b + 4 * VW, 2 * NR * 2);
        _tile_dpbf16ps(0, 3, 4);
        _tile_dpbf16ps(1, 3, 5);
        _tile_dpbf16ps(2, 3, 6);
    }
}

AMX_TARGET static void store_tiles(float *out) {
    _tile_stored(0, out, NR * 4);
    _tile_stored(1, out + VW, NR * 4);
    _tile_stored(2, out + 2 * VW, NR * 4);
}

AMX_TARGET static void release_tiles(void) { _tile_release(); }

/* Rows [0, rows) of out [TM][NR] float32 plus the bias, as bfloat16 into y (row stride ldy),
 * only the panel's real columns. */
static void write_rows(const float *out, int64_t rows, const uint16_t *bias, int64_t col,
                       int64_t ncols, uint16_t *y, int64_t ldy) {
    for (int v = 0; v < NV; v++) {
        const int64_t n = ncols - VW * v;
        if (n <= 0) break;
        const __mmask16 mask = first_lanes(n > VW ? VW : n);
        const __m512 b = bias ? bf16_widen(_mm256_maskz_loadu_epi16(mask, bias + col + VW * v))
                              : _mm512_setzero_ps();
        for (int64_t r = 0; r < rows; r++) {
            const __m512 sum = _mm512_add_ps(_mm512_load_ps(out + r * NR + VW * v), b);
            _mm256_mask_storeu_epi16(y + r * ldy + VW * v, mask, (__m256i)_mm512_cvtneps_pbh(sum));
        }
    }
}

/* x [M, K] bfloat16 row-major, w packed as above for N outputs and K, bias [N] bfloat16 or
 * NULL, y [M, N] bfloat16 row-major. Returns 0, or -1 when the padded copy of x cannot be
 * had. Call only after `pagedserve_linear_bf16_init` returned 0. */
int pagedserve_linear_bf16(const uint16_t *x, int64_t M, int64_t K, const uint16_t *w,
                           int64_t N, const uint16_t *bias, uint16_t *y, int num_threads) {
    if (M <= 0 || N <= 0) return 0;
    const int64_t panels = (N + NR - 1) / NR, pairs = (K + 2 * TK - 1) / (2 * TK) * TK;
    const int64_t groups = (M + TM - 1) / TM, lda = 2 * pairs; /* elements per padded row */
    uint16_t *a = aligned_alloc(64, (size_t)(groups * TM * lda) * 2);
    if (!a) return -1;
    memset(a, 0, (size_t)(groups * TM * lda) * 2);
    for (int64_t m = 0; m < M; m++) memcpy(a + m * lda, x + m * K, (size_t)K * 2);
#pragma omp parallel num_threads(num_threads)
    {
        float out[TM * NR] __attribute__((aligned(64)));
        configure_tiles(); /* the tile configuration is per thread */
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < panels; pi++) {
            const int64_t col = pi * NR, ncols = N - col < NR ? N - col : NR;
            for (int64_t g = 0; g < groups; g++) {
                panel_tiles(a + g * TM * lda, lda * 2, w + pi * pairs * 2 * NR, pairs);
                store_tiles(out);
                const int64_t rows = M - g * TM < TM ? M - g * TM : TM;
                write_rows(out, rows, bias, col, ncols, y + g * TM * N + col, N);
            }
        }
        release_tiles();
    }
    free(a);
    return 0;
}
#endif
