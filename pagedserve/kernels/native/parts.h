/* The kernels' building blocks that another source composes (decode.c builds a whole decode
 * step from them). Each is the exact code the file's own entry point runs, so a composition
 * computes bit for bit what the separate calls compute. No threading inside: the caller
 * splits the work. */
#ifndef PAGEDSERVE_PARTS_H
#define PAGEDSERVE_PARTS_H

#include <stdint.h>

/* quant.c: activations quantized to int8 per 32-block: row r, block b at q + (r * nb + b) * 32,
 * with scale d[r * nb + b], d * sum(q) in s[r * nb + b] and -128 * sum(q) of its two halves
 * of 16 in c[(r * nb + b) * 2 + 0/1]. */
typedef struct {
    const int8_t *q;
    const float *d, *s;
    const int32_t *c;
    int64_t nb;
} qrows;

/* Rows 0 .. M of x (row stride ldx, nb blocks of 32 each) quantized into q, d, s, c. */
void ps_quantize_rows(const float *x, int64_t ldx, int64_t M, int64_t nb, int8_t *q, float *d,
                      float *s, int32_t *c);

/* y[m * ldy + n - n0] = x_m . w_n (+ bias[n]) for activation rows m0 .. m1 and weight rows
 * n0 .. n1 of one weight (kind 0: q4, 1: q8; layouts as in quant.c, in groups of 16 rows;
 * bias NULL: none). A range that starts or ends inside a group computes the whole group. */
void ps_qlinear_range(int kind, const void *w, const float *scales, const float *mins,
                      const qrows *x, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                      const float *bias, float *y, int64_t ldy);

/* ops.c: rows of n floats: out = RMSNorm(residual + x) * w with the sum written to residual
 * first (residual NULL: out = RMSNorm(x) * w). */
void ps_add_rms_norm_rows(const float *x, int64_t ldx, float *residual, int64_t ldres,
                          const float *w, float *out, int64_t ldout, int64_t rows, int64_t n,
                          float eps);

/* One head of 2 * half floats in place: RMSNorm by w (NULL: none), then RoPE by this token's
 * cos / sin_signed rows. */
void ps_rotate_head(float *x, int64_t half, const float *cos, const float *sin, const float *w,
                    float eps);

/* out[i] = silu(gate[i]) * up[i], i < n. */
void ps_silu_mul(const float *gate, const float *up, float *out, int64_t n);

/* attention.c: decode attention of one sequence's kv heads h0 .. h1 (q, out: its query head
 * h0 * group, heads contiguous) over its first seq_len cached tokens (the last `window` of
 * them when window > 0). Caches [*, block_size, num_kv_heads, dim]. */
void ps_attend(const float *q, float *out, const int32_t *block_table, int64_t seq_len,
               int64_t window, int64_t h0, int64_t h1, const float *k_cache,
               const float *v_cache, int64_t block_size, int64_t num_kv_heads, int64_t group,
               int64_t dim, float scale);

#endif
