/* Linear layer y = x @ W^T + b on block-quantized weights, with int8-quantized activations.
 *
 * Why: a decode step at batch 1 streams every weight once, so its speed is bytes per weight.
 * The GGUF's 4-bit blocks are 0.6 bytes per weight against float32's 4; keeping them and
 * multiplying in integers (as llama.cpp does) makes the step several times cheaper in memory.
 * At 16 sequences the same step is compute-bound, so the layout below is the one that needs
 * the fewest instructions per product.
 *
 * Two kinds of weight, each exactly scale * q + min (q4) or scale * q (q8) of the GGUF's
 * values (gguf_blocks.py repacks every type without changing one):
 *   q4  4-bit q in 0..15, a float scale and min per 32 weights. Q4_0 (min = -8 scale), Q4_1
 *       and Q4_K (its 6-bit sub-block scales folded in).
 *   q8  signed 8-bit q, a float scale per 16 weights. Q8_0 (two equal scales per 32) and Q6_K.
 * quant.py lays both out in groups of 16 weight rows (the last group padded with zero rows),
 * block by block, so that one 64-byte load is 4 consecutive weights of each of the 16 rows:
 *   q4  per (group, block of 32): 4 chunks of 64 bytes; chunk c, byte 4r + t holds weight
 *       4c + t of row r in its low nibble and weight 16 + 4c + t in its high nibble;
 *       scales and mins float [groups][blocks][16].
 *   q8  per (group, block): 8 chunks of 64 bytes; chunk j, byte 4r + t = q + 128 (unsigned)
 *       of weight 4j + t of row r; scales float [groups][2 * blocks][16].
 * The activations x are quantized per row and 32-block to int8 with d = max|x| / 127 (round
 * to nearest even); each block also keeps s = d * sum(q) (for the q4 min) and, per half of 16,
 * c = -128 * sum(q) (for q8's +128 offset). One `dpbusd` (unsigned weight bytes times a
 * broadcast of 4 signed activation bytes) then adds 4 products into each of 16 rows' int32
 * lanes (AVX512-VNNI; 8 rows with 256-bit AVX-VNNI; AVX2 does the same with `maddubs` +
 * `madd`, on q8 moving the weight's sign onto x, as it cannot take 255 x 127 in pairs). A
 * block's int32 sums become floats once per block and row: y += scale * d * sum + min * s.
 * The float work per block is per 16 outputs, not per output, which is what made the
 * earlier one-row-at-a-time layout compute-bound at 16 activation rows.
 *
 * Work split: threads take groups of weight rows; a group's weights are read once per tile of
 * MR activation rows (from L1 after the first). Activations are processed in chunks of 64
 * rows so that a chunk stays in L2 while all weight rows pass over it. Every output is the
 * same sequence of float operations whatever the tiling or thread count.
 *
 * Wrapped by quant.py; built with the other kernels by build.py, once per instruction set.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parts.h"
#include "simd.h"

#define QK 32      /* weights per block */
#define GR 16      /* weight rows per group */
#define MCHUNK 64  /* activation rows kept in cache while the weights pass */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
/* 16 rows per vector */
#define LANES 16
#define MR 8
typedef __m512i vint;
typedef __m512 vflt;
static inline vint vi_load(const void *p) { return _mm512_loadu_si512(p); }
static inline vint vi_lo4(vint w) { return _mm512_and_si512(w, _mm512_set1_epi8(0x0F)); }
static inline vint vi_hi4(vint w) {
    return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(0x0F));
}
static inline vint vi_set1(int32_t v) { return _mm512_set1_epi32(v); }
static inline vint vi_zero(void) { return _mm512_setzero_si512(); }
static inline vint dot4(vint acc, vint u, int32_t s) {
    return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(s));
}
static inline vflt vf_load(const float *p) { return _mm512_loadu_ps(p); }
static inline vflt vf_set1(float v) { return _mm512_set1_ps(v); }
static inline vflt vf_zero(void) { return _mm512_setzero_ps(); }
static inline vflt vf_cvt(vint v) { return _mm512_cvtepi32_ps(v); }
static inline vflt vf_mul(vflt a, vflt b) { return _mm512_mul_ps(a, b); }
static inline vflt vf_add(vflt a, vflt b) { return _mm512_add_ps(a, b); }
static inline vflt vf_fmadd(vflt a, vflt b, vflt c) { return _mm512_fmadd_ps(a, b, c); }
static inline void vf_store(float *p, vflt v) { _mm512_storeu_ps(p, v); }
#define VNNI 1
#else
/* 8 rows per vector: a group is two halves */
#define LANES 8
#define MR 4
typedef __m256i vint;
typedef __m256 vflt;
static inline vint vi_load(const void *p) { return _mm256_loadu_si256((const __m256i *)p); }
static inline vint vi_lo4(vint w) { return _mm256_and_si256(w, _mm256_set1_epi8(0x0F)); }
static inline vint vi_hi4(vint w) {
    return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(0x0F));
}
static inline vint vi_set1(int32_t v) { return _mm256_set1_epi32(v); }
static inline vint vi_zero(void) { return _mm256_setzero_si256(); }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define VNNI 1
static inline vint dot4(vint acc, vint u, int32_t s) {
    return _mm256_dpbusd_epi32(acc, u, _mm256_set1_epi32(s));
}
#elif defined(__AVXVNNI__)
#define VNNI 1
static inline vint dot4(vint acc, vint u, int32_t s) {
    return _mm256_dpbusd_avx_epi32(acc, u, _mm256_set1_epi32(s));
}
#else
#define VNNI 0
static inline vint dot4(vint acc, vint u, int32_t s) {
    const __m256i pairs = _mm256_maddubs_epi16(u, _mm256_set1_epi32(s));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
#endif
static inline vflt vf_load(const float *p) { return _mm256_loadu_ps(p); }
static inline vflt vf_set1(float v) { return _mm256_set1_ps(v); }
static inline vflt vf_zero(void) { return _mm256_setzero_ps(); }
static inline vflt vf_cvt(vint v) { return _mm256_cvtepi32_ps(v); }
static inline vflt vf_mul(vflt a, vflt b) { return _mm256_mul_ps(a, b); }
static inline vflt vf_add(vflt a, vflt b) { return _mm256_add_ps(a, b); }
static inline vflt vf_fmadd(vflt a, vflt b, vflt c) { return _mm256_fmadd_ps(a, b, c); }
static inline void vf_store(float *p, vflt v) { _mm256_storeu_ps(p, v); }
#endif

/* One row of x [nb * 32] -> q [nb * 32] int8, d [nb], s [nb], c [2 * nb]. */
static void quantize_row(const float *x, int64_t nb, int8_t *q, float *d, float *s,
                         int32_t *c) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QK;
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; i++) {
            v[i] = _mm256_loadu_ps(xb + 8 * i);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        const float m = hmax(amax), db = m / 127.0f, id = m > 0.0f ? 127.0f / m : 0.0f;
        __m256i iv[4];
        for (int i = 0; i < 4; i++) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            iv[i] = _mm256_cvtps_epi32(r);
        }
        /* packs interleave 128-bit lanes; the permute restores element order */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                             _mm256_packs_epi32(iv[2], iv[3]));
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(p, order));
        const int lo = hsum_epi32(_mm256_add_epi32(iv[0], iv[1]));
        const int hi = hsum_epi32(_mm256_add_epi32(iv[2], iv[3]));
        d[b] = db;
        s[b] = db * (float)(lo + hi);
        c[2 * b] = -128 * lo;
        c[2 * b + 1] = -128 * hi;
    }
}

/* The 4 activation bytes of row m, block b, starting at weight 4j, as one int32. */
static inline int32_t x4(const qrows *x, int64_t m, int64_t b, int j) {
    int32_t v;
    memcpy(&v, x->q + (m * x->nb + b) * QK + 4 * j, 4);
    return v;
}

/* R activation rows from m, times the LANES weight rows of one group's half (`wq`, `ws`,
 * `wm` already point at its block 0 and its lanes) -> acc[r]. The chunk loop is outermost in
 * a block so that each weight vector is loaded once for the R rows. */
static inline __attribute__((always_inline)) void q4_tile(const uint8_t *wq, const float *ws,
                                                          const float *wm, const qrows *x,
                                                          int64_t m, const int R, vflt *acc) {
    vint iacc[MR];
    for (int r = 0; r < R; r++) acc[r] = vf_zero();
    for (int64_t b = 0; b < x->nb; b++) {
        const uint8_t *wb = wq + b * 4 * 64;
        for (int r = 0; r < R; r++) iacc[r] = vi_zero();
        #pragma GCC unroll 8
        for (int ch = 0; ch < 4; ch++) {
            const vint w = vi_load(wb + ch * 64);
            const vint lo = vi_lo4(w), hi = vi_hi4(w);
            for (int r = 0; r < R; r++)
                iacc[r] = dot4(dot4(iacc[r], lo, x4(x, m + r, b, ch)), hi,
                               x4(x, m + r, b, ch + 4));
        }
        const vflt sc = vf_load(ws + b * GR), mn = vf_load(wm + b * GR);
        for (int r = 0; r < R; r++) {
            const int64_t i = (m + r) * x->nb + b;
            acc[r] = vf_fmadd(vf_cvt(iacc[r]), vf_mul(sc, vf_set1(x->d[i])), acc[r]);
            acc[r] = vf_fmadd(mn, vf_set1(x->s[i]), acc[r]);
        }
    }
}

static inline __attribute__((always_inline)) void q8_tile(const uint8_t *wq, const float *ws,
                                                          const qrows *x, int64_t m,
                                                          const int R, vflt *acc) {
    vint iacc[MR];
    for (int r = 0; r < R; r++) acc[r] = vf_zero();
    for (int64_t b = 0; b < x->nb; b++) {
        const uint8_t *wb = wq + b * 8 * 64;
        #pragma GCC unroll 8
        for (int half = 0; half < 2; half++) {
            for (int r = 0; r < R; r++)
                iacc[r] = VNNI ? vi_set1(x->c[((m + r) * x->nb + b) * 2 + half]) : vi_zero();
            #pragma GCC unroll 8
            for (int j = 4 * half; j < 4 * half + 4; j++) {
                const vint w = vi_load(wb + j * 64);
#if VNNI
                for (int r = 0; r < R; r++) iacc[r] = dot4(iacc[r], w, x4(x, m + r, b, j));
#else
                /* q = byte - 128; |q| unsigned, x with q's sign */
                const vint sw = _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80));
                const vint aw = _mm256_abs_epi8(sw);
                for (int r = 0; r < R; r++) {
                    const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(x4(x, m + r, b, j)), sw);
                    iacc[r] = _mm256_add_epi32(iacc[r], _mm256_madd_epi16(
                        _mm256_maddubs_epi16(aw, xs), _mm256_set1_epi16(1)));
                }
#endif
            }
            const vflt sc = vf_load(ws + (2 * b + half) * GR);
            for (int r = 0; r < R; r++)
                acc[r] = vf_fmadd(vf_cvt(iacc[r]), vf_mul(sc, vf_set1(x->d[(m + r) * x->nb + b])),
                                  acc[r]);
        }
    }
}

/* acc (lanes of weight rows n .. n + LANES) + bias into y[n - n0] for the lanes in n0 .. n1. */
static inline void store_lanes(vflt acc, int64_t n, int64_t n0, int64_t n1, const float *bias,
                               float *y) {
    if (n >= n0 && n + LANES <= n1) {
        if (bias) acc = vf_add(acc, vf_load(bias + n));
        vf_store(y + (n - n0), acc);
        return;
    }
    float tmp[LANES];
    vf_store(tmp, acc);
    for (int64_t l = n < n0 ? n0 - n : 0; l < LANES && n + l < n1; l++)
        y[n + l - n0] = tmp[l] + (bias ? bias[n + l] : 0.0f);
}

#define TILE_CASE(R)                                                                         \
    case R:                                                                                  \
        if (kind == 0) q4_tile(wq, ws, wm, x, m, R, acc);                                    \
        else q8_tile(wq, ws, x, m, R, acc);                                                  \
        break;

/* Weight rows n0 .. n1 (a range of one part) times activation rows m0 .. m1. */
void ps_qlinear_range(int kind, const void *w, const float *scales, const float *mins,
                      const qrows *x, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                      const float *bias, float *y, int64_t ldy) {
    const int64_t nb = x->nb, chunks = kind == 0 ? 4 : 8, nscales = kind == 0 ? nb : 2 * nb;
    for (int64_t g = n0 / GR; g * GR < n1; g++) {
        for (int h = 0; h < GR / LANES; h++) {
            const int64_t n = g * GR + h * LANES;
            if (n + LANES <= n0 || n >= n1) continue;
            const uint8_t *wq = (const uint8_t *)w + g * nb * chunks * 64 + h * LANES * 4;
            const float *ws = scales + g * nscales * GR + h * LANES;
            const float *wm = mins ? mins + g * nb * GR + h * LANES : NULL;
            for (int64_t m = m0; m < m1; m += MR) {
                const int rows = m1 - m < MR ? (int)(m1 - m) : MR;
                vflt acc[MR];
                switch (rows) {
                    TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4)
#if MR > 4
                    TILE_CASE(5) TILE_CASE(6) TILE_CASE(7) TILE_CASE(8)
#endif
                }
                for (int r = 0; r < rows; r++)
                    store_lanes(acc[r], n, n0, n1, bias, y + (m + r) * ldy);
            }
        }
    }
}

void ps_quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t nb, int8_t *q, float *d,
                      float *s, int32_t *c) {
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * ldx, nb, q + m * nb * QK, d + m * nb, s + m * nb, c + m * 2 * nb);
}

/* kind 0: q4, kind 1: q8, laid out as above (N weight rows in ceil(N / 16) groups).
 * x [M, K] row-major with K a multiple of 32, bias [N] or NULL, y [M, N] with row stride
 * ldy (a column range of a wider output). Returns 0, or -1 when the scratch allocation
 * fails. */
int pagedserve_qlinear(int kind, const float *x, int64_t M, int64_t K, const void *w,
                       const float *scales, const float *mins, int64_t N, const float *bias,
                       float *y, int64_t ldy, int num_threads) {
    const int64_t nb = K / QK, groups = (N + GR - 1) / GR;
    int8_t *xq = malloc((size_t)(M * K) + 1);
    float *xd = malloc(sizeof(float) * (size_t)(M * nb) + 1);
    float *xs = malloc(sizeof(float) * (size_t)(M * nb) + 1);
    int32_t *xc = malloc(sizeof(int32_t) * (size_t)(2 * M * nb) + 1);
    if (!xq || !xd || !xs || !xc) {
        free(xq), free(xd), free(xs), free(xc);
        return -1;
    }
    const qrows qx = {xq, xd, xs, xc, nb};
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row(x + m * K, nb, xq + m * K, xd + m * nb, xs + m * nb, xc + m * 2 * nb);
        for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
            const int64_t m1 = M - m0 < MCHUNK ? M : m0 + MCHUNK;
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t n0 = g * GR, n1 = n0 + GR < N ? n0 + GR : N;
                ps_qlinear_range(kind, w, scales, mins, &qx, m0, m1, n0, n1, bias, y + n0, ldy);
            }
        }
    }
    free(xq), free(xd), free(xs), free(xc);
    return 0;
}
