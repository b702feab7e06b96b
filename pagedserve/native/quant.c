/* Linear layer y = x @ W^T + b on block-quantized weights, with int8-quantized activations.
 *
 * Why: a decode step at batch 1 streams every weight once, so its speed is bytes per weight.
 * The GGUF's 4-bit blocks are 0.6 bytes per weight against float32's 4; keeping them and
 * multiplying in integers (as llama.cpp does) makes the step several times cheaper in memory.
 *
 * Two weight layouts, one per kernel; quant.py repacks every GGUF type into one of them
 * without changing a value (each GGUF weight is exactly scale * q + min of these):
 *   q4  per 32 weights: 16 bytes of nibbles (byte j: weight j low, weight j + 16 high) and a
 *       float scale and min (arrays of their own, [N][K/32]); w = scale * q + min, q in 0..15.
 *       Q4_0 (min = -8 scale), Q4_1 and Q4_K (its 6-bit sub-block scales folded in).
 *   q8  per 32 weights: 32 signed bytes and two float scales, one per 16 ([N][K/16]);
 *       w = scale * q. Q8_0 (both scales equal) and Q6_K (its 16-weight sub-blocks).
 * The activations x are quantized per row and 32-block to int8 with d = max|x| / 127
 * (round to nearest even), and each block also keeps s = d * sum(q) for the q4 min term:
 *   sum_j w_j x_j ~ scale * d * sum_j q_j qx_j + min * s.
 * The integer dot of 32 bytes is one `dpbusd` with AVX-VNNI or AVX512-VNNI, else AVX2's
 * `maddubs` (u8 x s8 -> pairs of int16, which cannot saturate here: |q| <= 15 or 128) and
 * `madd` with ones; the q8 kernel moves the weight's signs onto x so that the weight operand is
 * unsigned. Each block's int32 sums become floats and are scaled into float accumulators.
 *
 * Work split: threads take contiguous ranges of output rows (weight rows); each weight block
 * is unpacked once for up to 4 activation rows. Activations are processed in chunks of 64 rows
 * so that a chunk stays in L2 while all weight rows pass over it.
 *
 * Wrapped by quant.py; built with the other kernels by build.py, once per instruction set.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>

#include "parts.h"
#include "simd.h"

#define QK 32      /* weights per block */
#define MR 4       /* activation rows per tile */
#define MCHUNK 64  /* activation rows kept in cache while the weights pass */

static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* One row of x [nb * 32] -> q [nb * 32] int8, d [nb], s [nb]. */
static void quantize_row(const float *x, int64_t nb, int8_t *q, float *d, float *s) {
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
        __m256i iv[4], sum = _mm256_setzero_si256();
        for (int i = 0; i < 4; i++) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], _mm256_set1_ps(id)),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            iv[i] = _mm256_cvtps_epi32(r);
            sum = _mm256_add_epi32(sum, iv[i]);
        }
        /* packs interleave 128-bit lanes; the permute restores element order */
        const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                             _mm256_packs_epi32(iv[2], iv[3]));
        _mm256_storeu_si256((__m256i *)(q + b * QK), _mm256_permutevar8x32_epi32(p, order));
        d[b] = db;
        s[b] = db * (float)hsum_epi32(sum);
    }
}

static inline __m256i unpack_q4(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

/* sum_b a[b] * c[b] */
static inline float dot_f32(const float *a, const float *c, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(c + i), acc);
    float sum = hsum(acc);
    for (; i < n; i++) sum += a[i] * c[i];
    return sum;
}

/* R rows of x (starting at row m) times weight row n -> y[m.., n] (stride ldy). */
#define Q4_TILE(ROWS)                                                                        \
    static void q4_tile##ROWS(const uint8_t *wq, const float *ws, const float *wm,          \
                              const qrows *x, int64_t m, float bias, float *y, int64_t ldy) { \
        enum { R = ROWS };                                                                   \
        const int64_t nb = x->nb;                                                            \
        __m256 acc[R];                                                                       \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                            \
        for (int64_t b = 0; b < nb; b++) {                                                   \
            const __m256i w = unpack_q4(wq + b * 16);                                        \
            const __m256 sw = _mm256_set1_ps(ws[b]);                                         \
            for (int r = 0; r < R; r++) {                                                    \
                const int64_t i = (m + r) * nb + b;                                          \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + i * QK));     \
                const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(w, xv));                        \
                acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(sw, _mm256_broadcast_ss(x->d + i)), \
                                         acc[r]);                                            \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < R; r++)                                                          \
            y[r * ldy] = hsum(acc[r]) + dot_f32(wm, x->s + (m + r) * nb, nb) + bias;         \
    }
Q4_TILE(1) Q4_TILE(2) Q4_TILE(3) Q4_TILE(4)

#define Q8_TILE(ROWS)                                                                        \
    static void q8_tile##ROWS(const int8_t *wq, const float *ws, const qrows *x, int64_t m, \
                              float bias, float *y, int64_t ldy) {                           \
        enum { R = ROWS };                                                                   \
        const int64_t nb = x->nb;                                                            \
        __m256 acc[R];                                                                       \
        for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();                            \
        for (int64_t b = 0; b < nb; b++) {                                                   \
            const __m256i w = _mm256_loadu_si256((const __m256i *)(wq + b * QK));            \
            const __m256i wabs = _mm256_sign_epi8(w, w);                                     \
            /* lanes 0-3 sum weights 0-15, lanes 4-7 weights 16-31 */                        \
            const __m256 sw = _mm256_set_m128(_mm_set1_ps(ws[2 * b + 1]),                    \
                                              _mm_set1_ps(ws[2 * b]));                       \
            for (int r = 0; r < R; r++) {                                                    \
                const int64_t i = (m + r) * nb + b;                                          \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(x->q + i * QK));     \
                const __m256 p = _mm256_cvtepi32_ps(dot_u8s8(wabs, _mm256_sign_epi8(xv, w))); \
                acc[r] = _mm256_fmadd_ps(p, _mm256_mul_ps(sw, _mm256_broadcast_ss(x->d + i)), \
                                         acc[r]);                                            \
            }                                                                                \
        }                                                                                    \
        for (int r = 0; r < R; r++) y[r * ldy] = hsum(acc[r]) + bias;                        \
    }
Q8_TILE(1) Q8_TILE(2) Q8_TILE(3) Q8_TILE(4)

typedef void (*q4_fn)(const uint8_t *, const float *, const float *, const qrows *, int64_t,
                      float, float *, int64_t);
typedef void (*q8_fn)(const int8_t *, const float *, const qrows *, int64_t, float, float *,
                      int64_t);
static const q4_fn Q4_TILES[MR + 1] = {0, q4_tile1, q4_tile2, q4_tile3, q4_tile4};
static const q8_fn Q8_TILES[MR + 1] = {0, q8_tile1, q8_tile2, q8_tile3, q8_tile4};

/* Weight row n times activation rows m0 .. m1, in tiles of up to MR rows (the same arithmetic
 * per activation row whatever the tiling), plus bias b, into yn[m * ldy]. */
static inline void weight_row(int kind, const void *w, const float *scales, const float *mins,
                              const qrows *x, int64_t m0, int64_t m1, int64_t n, float b,
                              float *yn, int64_t ldy) {
    const int64_t nb = x->nb;
    for (int64_t m = m0; m < m1; m += MR) {
        const int64_t rows = m1 - m < MR ? m1 - m : MR;
        if (kind == 0)
            Q4_TILES[rows]((const uint8_t *)w + n * nb * 16, scales + n * nb, mins + n * nb, x,
                           m, b, yn + m * ldy, ldy);
        else
            Q8_TILES[rows]((const int8_t *)w + n * nb * QK, scales + n * 2 * nb, x, m, b,
                           yn + m * ldy, ldy);
    }
}

void ps_quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t nb, int8_t *q, float *d,
                      float *s) {
    for (int64_t m = 0; m < M; m++)
        quantize_row(x + m * ldx, nb, q + m * nb * QK, d + m * nb, s + m * nb);
}

void ps_qlinear_range(int kind, const void *w, const float *scales, const float *mins,
                      const qrows *x, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                      const float *bias, float *y, int64_t ldy) {
    for (int64_t n = n0; n < n1; n++)
        weight_row(kind, w, scales, mins, x, m0, m1, n, bias ? bias[n] : 0.0f, y + (n - n0),
                   ldy);
}

/* kind 0: q4 (weights [N][K/2] bytes, scales and mins [N][K/32]); kind 1: q8 (weights
 * [N][K] int8, scales [N][K/16], mins NULL). x [M, K] row-major with K a multiple of 32,
 * bias [N] or NULL, y [M, N] with row stride ldy (a column range of a wider output).
 * Returns 0, or -1 when the scratch allocation fails. */
int pagedserve_qlinear(int kind, const float *x, int64_t M, int64_t K, const void *w,
                       const float *scales, const float *mins, int64_t N, const float *bias,
                       float *y, int64_t ldy, int num_threads) {
    const int64_t nb = K / QK;
    int8_t *xq = malloc((size_t)(M * K));
    float *xd = malloc(sizeof(float) * (size_t)(M * nb)), *xs = malloc(sizeof(float) * (size_t)(M * nb));
    if (!xq || !xd || !xs) {
        free(xq), free(xd), free(xs);
        return -1;
    }
    const qrows qx = {xq, xd, xs, nb};
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_row(x + m * K, nb, xq + m * K, xd + m * nb, xs + m * nb);
        for (int64_t m0 = 0; m0 < M; m0 += MCHUNK) {
            const int64_t m1 = M - m0 < MCHUNK ? M : m0 + MCHUNK;
#pragma omp for schedule(static)
            for (int64_t n = 0; n < N; n++)
                weight_row(kind, w, scales, mins, &qx, m0, m1, n, bias ? bias[n] : 0.0f, y + n,
                           ldy);
        }
    }
    free(xq), free(xd), free(xs);
    return 0;
}
