/* A whole decode step of a quantized decoder on the CPU: every layer, one call.
 *
 * Why: at batch 1 a step of a small model is a few hundred small kernels (30 layers x norm,
 * q/k/v, RoPE, store + attention, o, norm, gate/up, SiLU, down), each a Python call, a torch
 * allocation and an OpenMP fork/join. Their overhead, not the weights' bytes, was most of the
 * step. Here the step is one parallel region: the threads split each projection's output rows,
 * meet at a barrier where the next op needs all of its input (after q/k/v, attention, o, the
 * MLP's gate/up and down: 5 per layer), and repeat the cheap row-wise work (the norms, the
 * residual stream, the activations' int8 quantization: one [M, hidden] row block each)
 * on every thread rather than wait for one thread to do it.
 *
 * Each op is the code the separate kernels run (`parts.h`), on the same values in the same
 * order: the step's output is bit for bit the per-op fast mode's (quant.c's int8 activations,
 * ops.c's norms / RoPE / SiLU, attention.c's decode attention). Only how rows are dealt to
 * threads differs, and no result depends on that.
 *
 * Wrapped by model/fast_decode.py, which decides when a step takes this path.
 */
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parts.h"

#define QK 32
#define MAX_PARTS 4

/* One run of output rows of a quantized weight (quant.py's QuantizedWeight). */
typedef struct {
    int64_t kind, rows;
    const void *qs;
    const float *scales, *mins;
} ps_qpart;

/* A linear layer: its output rows as consecutive parts, and an optional bias [out]. */
typedef struct {
    int64_t num_parts;
    ps_qpart parts[MAX_PARTS];
    const float *bias;
} ps_qlinear;

typedef struct {
    const float *input_norm, *post_norm, *q_norm, *k_norm; /* q/k norms NULL: none */
    ps_qlinear qkv, o, gate_up, down;
    float *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
    int64_t window;           /* sliding window, 0: none */
} ps_layer;

typedef struct {
    int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate;
    int64_t num_blocks, block_size, max_positions;
    float eps, scale;
    const float *cos, *sin; /* RoPE tables [max_positions, head_dim], sin sign-folded */
    const float *final_norm;
    const ps_layer *layers;
} ps_model;

/* The step's sequences, one new token each. */
typedef struct {
    int64_t M;
    const int64_t *positions, *slots;
    const int32_t *block_tables, *seq_lens;
    int64_t bt_stride, bt_width;
} ps_batch;

/* A thread's share [lo, hi) of n rows, cut at multiples of `align`. */
static void share(int64_t n, int t, int T, int64_t align, int64_t *lo, int64_t *hi) {
    const int64_t units = (n + align - 1) / align;
    *lo = units * t / T * align;
    *hi = units * (t + 1) / T * align;
    if (*lo > n) *lo = n;
    if (*hi > n) *hi = n;
}

/* Rows n0 .. n1 of a linear layer for activation rows 0 .. M into y[m * ldy + n - n0]. */
static void linear_rows(const ps_qlinear *l, const qrows *x, int64_t M, int64_t n0, int64_t n1,
                        float *y, int64_t ldy) {
    int64_t offset = 0;
    for (int64_t p = 0; p < l->num_parts; p++) {
        const ps_qpart *part = &l->parts[p];
        const int64_t lo = n0 > offset ? n0 : offset;
        const int64_t hi = n1 < offset + part->rows ? n1 : offset + part->rows;
        if (lo < hi)
            ps_qlinear_range((int)part->kind, part->qs, part->scales, part->mins, x, 0, M,
                             lo - offset, hi - offset, l->bias ? l->bias + offset : NULL,
                             y + (lo - n0), ldy);
        offset += part->rows;
    }
}

/* A thread's own buffers: its copy of the residual stream and of the normed rows, the int8
 * activations of the projection at hand, and its slice of gate/up. */
typedef struct {
    float *residual, *x, *gate_up, *d, *s;
    int8_t *q;
} scratch;

/* x [M, K] (row stride ldx) quantized into the thread's buffers. */
static qrows quantize(scratch *w, const float *x, int64_t ldx, int64_t M, int64_t K) {
    ps_quantize_rows(x, ldx, M, K / QK, w->q, w->d, w->s);
    return (qrows){w->q, w->d, w->s, K / QK};
}

/* Buffers every thread reads: each op's output, written in row slices. */
typedef struct {
    float *qkv, *attn, *o, *act, *mlp;
} shared;

/* RoPE, K/V store and attention of the tasks (sequence, kv head) this thread owns: tasks are
 * dealt in contiguous runs of about equal context length. */
static void attention(const ps_model *m, const ps_layer *L, const ps_batch *b, const shared *sh,
                      int t, int T) {
    const int64_t hq = m->num_heads, hkv = m->num_kv_heads, D = m->head_dim;
    const int64_t group = hq / hkv, width = (hq + 2 * hkv) * D, row = hkv * D;
    int64_t total = 0, before = 0;
    for (int64_t i = 0; i < b->M; i++) total += b->seq_lens[i];
    for (int64_t task = 0; task < b->M * hkv; task++) {
        const int64_t i = task / hkv, g = task % hkv, weight = b->seq_lens[i];
        const int64_t owner = T * (2 * before + weight) / (2 * total * hkv);
        before += weight;
        if (owner != t) continue;
        float *qkv = sh->qkv + i * width;
        const float *cos = m->cos + b->positions[i] * D, *sin = m->sin + b->positions[i] * D;
        float *k = qkv + (hq + g) * D, *v = qkv + (hq + hkv + g) * D;
        ps_rotate_head(k, D / 2, cos, sin, L->k_norm, m->eps);
        for (int64_t j = 0; j < group; j++)
            ps_rotate_head(qkv + (g * group + j) * D, D / 2, cos, sin, L->q_norm, m->eps);
        if (b->slots[i] >= 0) {
            memcpy(L->k_cache + b->slots[i] * row + g * D, k, sizeof(float) * (size_t)D);
            memcpy(L->v_cache + b->slots[i] * row + g * D, v, sizeof(float) * (size_t)D);
        }
        ps_attend(qkv + g * group * D, sh->attn + i * hq * D + g * group * D,
                  b->block_tables + i * b->bt_stride, b->seq_lens[i], L->window, g, g + 1,
                  L->k_cache, L->v_cache, m->block_size, hkv, group, D, m->scale);
    }
}

/* One layer on thread t of T. `h`: the previous layer's MLP output (first layer: the
 * embeddings, which also start the residual stream). */
static void layer(const ps_model *m, const ps_layer *L, const ps_batch *b, const float *h,
                  int first, const shared *sh, scratch *w, int t, int T) {
    const int64_t M = b->M, H = m->hidden, I = m->intermediate;
    const int64_t width = (m->num_heads + 2 * m->num_kv_heads) * m->head_dim;
    const int64_t attn_width = m->num_heads * m->head_dim;
    int64_t lo, hi;
    if (first) memcpy(w->residual, h, sizeof(float) * (size_t)(M * H));
    ps_add_rms_norm_rows(h, H, first ? NULL : w->residual, H, L->input_norm, w->x, H, M, H,
                         m->eps);
    qrows x = quantize(w, w->x, H, M, H);
    share(width, t, T, 16, &lo, &hi);
    linear_rows(&L->qkv, &x, M, lo, hi, sh->qkv + lo, width);
#pragma omp barrier
    attention(m, L, b, sh, t, T);
#pragma omp barrier
    x = quantize(w, sh->attn, attn_width, M, attn_width);
    share(H, t, T, 16, &lo, &hi);
    linear_rows(&L->o, &x, M, lo, hi, sh->o + lo, H);
#pragma omp barrier
    ps_add_rms_norm_rows(sh->o, H, w->residual, H, L->post_norm, w->x, H, M, H, m->eps);
    x = quantize(w, w->x, H, M, H);
    share(I, t, T, 16, &lo, &hi);
    const int64_t n = hi - lo;
    if (n > 0) {  /* gate rows lo .. hi, then up rows I + lo .. I + hi, side by side */
        linear_rows(&L->gate_up, &x, M, lo, hi, w->gate_up, 2 * n);
        linear_rows(&L->gate_up, &x, M, I + lo, I + hi, w->gate_up + n, 2 * n);
        for (int64_t i = 0; i < M; i++)
            ps_silu_mul(w->gate_up + i * 2 * n, w->gate_up + i * 2 * n + n,
                        sh->act + i * I + lo, n);
    }
#pragma omp barrier
    x = quantize(w, sh->act, I, M, I);
    share(H, t, T, 16, &lo, &hi);
    linear_rows(&L->down, &x, M, lo, hi, sh->mlp + lo, H);
#pragma omp barrier
}

/* Whether the batch is safe to run: every position inside the RoPE tables, every slot -1 or
 * inside the cache, every seq_len at least 1 and within its block table, and the block ids a
 * sequence's attention reads inside the cache. 0, or -2 for a position, -3 for the rest. */
static int check(const ps_model *m, const ps_batch *b) {
    for (int64_t i = 0; i < b->M; i++) {
        if (b->positions[i] < 0 || b->positions[i] >= m->max_positions) return -2;
        if (b->slots[i] < -1 || b->slots[i] >= m->num_blocks * m->block_size) return -3;
        const int64_t len = b->seq_lens[i];
        if (len < 1 || len > b->bt_width * m->block_size) return -3;
        for (int64_t j = 0; j <= (len - 1) / m->block_size; j++) {
            const int32_t block = b->block_tables[i * b->bt_stride + j];
            if (block < 0 || block >= m->num_blocks) return -3;
        }
    }
    return 0;
}

/* h [M, hidden]: the step's embeddings -> out [M, hidden]: the final norm of the last layer's
 * residual stream, as the decoder's forward returns it. Writes the step's K/V into the caches.
 * Returns 0; -1 without memory for the buffers; -2 or -3 (nothing written) when `check`
 * rejects the batch. */
int pagedserve_decode_step(const ps_model *m, const float *h, float *out, int64_t M,
                           const int64_t *positions, const int64_t *slots,
                           const int32_t *block_tables, int64_t bt_stride, int64_t bt_width,
                           const int32_t *seq_lens, int num_threads) {
    const ps_batch b = {M, positions, slots, block_tables, seq_lens, bt_stride, bt_width};
    const int status = check(m, &b);
    if (status) return status;
    const int64_t H = m->hidden, I = m->intermediate, D = m->head_dim;
    const int64_t width = (m->num_heads + 2 * m->num_kv_heads) * D;
    int64_t k_max = H > m->num_heads * D ? H : m->num_heads * D;
    if (I > k_max) k_max = I;
    const int T = num_threads > 0 ? num_threads : 1;
    const int64_t slice = (I + 15) / 16 * 16 / T + 16; /* most gate/up rows a thread takes */
    const size_t shared_floats = (size_t)(M * (width + m->num_heads * D + H + I + H));
    const size_t own_floats = (size_t)(M * (2 * H + 2 * slice + 2 * (k_max / QK)));
    float *all = malloc(sizeof(float) * (shared_floats + T * own_floats));
    int8_t *q_all = malloc((size_t)(T * M * k_max));
    if (!all || !q_all) {
        free(all), free(q_all);
        return -1;
    }
    shared sh;
    sh.qkv = all;
    sh.attn = sh.qkv + M * width;
    sh.o = sh.attn + M * m->num_heads * D;
    sh.act = sh.o + M * H;
    sh.mlp = sh.act + M * I;
#pragma omp parallel num_threads(T)
    {
        const int t = omp_get_thread_num(), threads = omp_get_num_threads();
        float *mine = all + shared_floats + (size_t)t * own_floats;
        scratch w = {mine, mine + M * H, mine + 2 * M * H, mine + M * (2 * H + 2 * slice), NULL,
                     q_all + (size_t)t * M * k_max};
        w.s = w.d + M * (k_max / QK);
        for (int64_t l = 0; l < m->num_layers; l++)
            layer(m, &m->layers[l], &b, l ? sh.mlp : h, l == 0, &sh, &w, t, threads);
        if (t == 0)
            ps_add_rms_norm_rows(sh.mlp, H, w.residual, H, m->final_norm, out, H, M, H, m->eps);
    }
    free(all), free(q_all);
    return 0;
}
