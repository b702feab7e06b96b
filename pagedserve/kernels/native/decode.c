/* A whole decode step of a quantized decoder on the CPU: every layer, one call.
 *
 * Why: at batch 1 a step of a small model is a few hundred small kernels (30 layers x norm,
 * q/k/v, RoPE, store + attention, o, norm, gate/up, SiLU, down), each a Python call, a torch
 * allocation and an OpenMP fork/join. Their overhead, not the weights' bytes, was most of the
 * step. Here the step is one parallel region.
 *
 * Each op's work is cut into chunks (32 weight rows of a projection, one (sequence, kv head)
 * of attention), which the threads claim as they go, each starting at its own share and then
 * taking what is left. No thread waits for another at a barrier: on a shared machine a thread
 * is often descheduled for milliseconds, and a step has 5 such meeting points per layer (150
 * for the default model), so barriers made two threads far slower than one under load. A
 * thread that finds a chunk claimed but not done spins for about twice its own last chunk's
 * time, then computes that chunk itself: a descheduled thread costs the others one chunk of
 * work, never its whole absence. Duplicates write identical bytes, and nothing a chunk reads is
 * ever written again during the step (each layer has its own output buffers, and RoPE works on
 * a thread's copy of the heads), so a late thread that finishes a chunk already done changes
 * nothing. The only join is the region's end.
 *
 * The row-wise work between projections (the residual stream, the norms, the activations'
 * int8 quantization: one [M, hidden] block) is repeated by every thread on its own copy.
 *
 * Each op is the code the separate kernels run (`parts.h`), on the same values in the same
 * order: the step's output is bit for bit the per-op fast mode's (quant.c's int8 activations,
 * ops.c's norms / RoPE / SiLU, attention.c's decode attention), whichever thread computes a
 * chunk.
 *
 * Wrapped by model/fast_decode.py, which decides when a step takes this path and owns the
 * workspace (`pagedserve_decode_workspace` bytes, reused across steps).
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <x86intrin.h>

#include "parts.h"

#define QK 32
#define MAX_PARTS 4
#define ROWS 32                 /* weight rows per projection chunk */
#define MIN_PATIENCE 20000      /* TSC ticks to wait for a claimed chunk, at least */

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

enum { FREE = 0, CLAIMED = 1, DONE = 2 };
enum { QKV, ATTN, O, GATE_UP, DOWN, OPS }; /* a layer's ops, in order */

/* Sizes of everything the step lays out in its workspace. */
typedef struct {
    int64_t M, T, H, I, D, hq, hkv, width, attn_width, k_max;
    int64_t chunks[OPS], layer_chunks, layer_floats;
} plan;

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

static plan make_plan(const ps_model *m, int64_t M, int64_t T) {
    plan p = {M, T, m->hidden, m->intermediate, m->head_dim, m->num_heads, m->num_kv_heads};
    p.width = (p.hq + 2 * p.hkv) * p.D;
    p.attn_width = p.hq * p.D;
    p.k_max = p.H > p.attn_width ? p.H : p.attn_width;
    if (p.I > p.k_max) p.k_max = p.I;
    p.chunks[QKV] = ceil_div(p.width, ROWS);
    p.chunks[ATTN] = M * p.hkv;
    p.chunks[O] = ceil_div(p.H, ROWS);
    p.chunks[GATE_UP] = ceil_div(p.I, ROWS);
    p.chunks[DOWN] = ceil_div(p.H, ROWS);
    p.layer_chunks = 0;
    for (int i = 0; i < OPS; i++) p.layer_chunks += p.chunks[i];
    /* qkv, attention out, o out, SiLU(gate) * up, down out */
    p.layer_floats = M * (p.width + p.attn_width + p.H + p.I + p.H);
    return p;
}

/* A thread's own buffers: its copy of the residual stream and of the normed rows, the int8
 * activations of the projection at hand, one chunk of gate/up, RoPE'd heads of one task. */
typedef struct {
    float *residual, *x, *gate_up, *heads, *d, *s;
    int32_t *c;
    int8_t *q;
} scratch;

/* In floats (4 bytes), the int32 and int8 parts included. */
static int64_t scratch_floats(const plan *p) {
    return p->M * (2 * p->H + 2 * ROWS + 4 * (p->k_max / QK)) + (p->hq / p->hkv + 1) * p->D
           + p->M * p->k_max / 4 + 16;
}

/* Workspace: per layer its output buffers, then every chunk's state, then each thread's
 * scratch. */
static int64_t workspace_bytes(const plan *p, int64_t layers) {
    return 4 * (layers * p->layer_floats + p->T * scratch_floats(p))
           + 4 * (layers * p->layer_chunks + p->M) + 64;
}

/* One layer's output buffers. */
typedef struct {
    float *qkv, *attn, *o, *act, *mlp;
} outputs;

static outputs layer_outputs(const plan *p, float *base, int64_t layer) {
    outputs b;
    b.qkv = base + layer * p->layer_floats;
    b.attn = b.qkv + p->M * p->width;
    b.o = b.attn + p->M * p->attn_width;
    b.act = b.o + p->M * p->H;
    b.mlp = b.act + p->M * p->I;
    return b;
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

/* What every chunk of an op needs. `input` (M rows of k floats, row stride k) is quantized
 * into the thread's scratch before its first chunk: a thread that finds every chunk done
 * skips that too. */
typedef struct op op;
typedef void (*chunk_fn)(const op *o, int64_t c);
struct op {
    chunk_fn run;
    const ps_model *m;
    const ps_layer *L;
    const ps_batch *b;
    const plan *p;
    const outputs *out;
    scratch *w;
    const float *input;
    int64_t k;
    qrows x;
};

static void qkv_chunk(const op *o, int64_t c) {
    const int64_t n0 = c * ROWS, n1 = n0 + ROWS < o->p->width ? n0 + ROWS : o->p->width;
    linear_rows(&o->L->qkv, &o->x, o->p->M, n0, n1, o->out->qkv + n0, o->p->width);
}

static void o_chunk(const op *o, int64_t c) {
    const int64_t n0 = c * ROWS, n1 = n0 + ROWS < o->p->H ? n0 + ROWS : o->p->H;
    linear_rows(&o->L->o, &o->x, o->p->M, n0, n1, o->out->o + n0, o->p->H);
}

static void down_chunk(const op *o, int64_t c) {
    const int64_t n0 = c * ROWS, n1 = n0 + ROWS < o->p->H ? n0 + ROWS : o->p->H;
    linear_rows(&o->L->down, &o->x, o->p->M, n0, n1, o->out->mlp + n0, o->p->H);
}

/* Gate rows lo .. hi and up rows I + lo .. I + hi side by side, then SiLU(gate) * up. */
static void gate_up_chunk(const op *o, int64_t c) {
    const int64_t I = o->p->I, lo = c * ROWS, hi = lo + ROWS < I ? lo + ROWS : I, n = hi - lo;
    float *gu = o->w->gate_up;
    linear_rows(&o->L->gate_up, &o->x, o->p->M, lo, hi, gu, 2 * n);
    linear_rows(&o->L->gate_up, &o->x, o->p->M, I + lo, I + hi, gu + n, 2 * n);
    for (int64_t i = 0; i < o->p->M; i++)
        ps_silu_mul(gu + i * 2 * n, gu + i * 2 * n + n, o->out->act + i * I + lo, n);
}

/* Sequence i, kv head g: RoPE on a copy of its k head and query heads, the new K/V row
 * stored in its slot, then its decode attention. */
static void attention_chunk(const op *o, int64_t c) {
    const plan *p = o->p;
    const ps_model *m = o->m;
    const ps_layer *L = o->L;
    const ps_batch *b = o->b;
    const int64_t i = c / p->hkv, g = c % p->hkv, D = p->D, group = p->hq / p->hkv;
    const float *qkv = o->out->qkv + i * p->width;
    const float *cos = m->cos + b->positions[i] * D, *sin = m->sin + b->positions[i] * D;
    float *q = o->w->heads, *k = q + group * D;
    memcpy(q, qkv + g * group * D, sizeof(float) * (size_t)(group * D));
    memcpy(k, qkv + (p->hq + g) * D, sizeof(float) * (size_t)D);
    ps_rotate_head(k, D / 2, cos, sin, L->k_norm, m->eps);
    for (int64_t j = 0; j < group; j++)
        ps_rotate_head(q + j * D, D / 2, cos, sin, L->q_norm, m->eps);
    if (b->slots[i] >= 0) {
        const int64_t row = b->slots[i] * p->hkv * D + g * D;
        memcpy(L->k_cache + row, k, sizeof(float) * (size_t)D);
        memcpy(L->v_cache + row, qkv + (p->hq + p->hkv + g) * D, sizeof(float) * (size_t)D);
    }
    ps_attend(q, o->out->attn + i * p->attn_width + g * group * D,
              b->block_tables + i * b->bt_stride, b->seq_lens[i], L->window, g, g + 1,
              L->k_cache, L->v_cache, m->block_size, p->hkv, group, D, m->scale);
}

static void compute(op *o, int64_t c, int *ready) {
    if (!*ready && o->input) {
        ps_quantize_rows(o->input, o->k, o->p->M, o->k / QK, o->w->q, o->w->d, o->w->s,
                         o->w->c);
        o->x = (qrows){o->w->q, o->w->d, o->w->s, o->w->c, o->k / QK};
    }
    *ready = 1;
    o->run(o, c);
}

/* Every chunk of the op done, by this thread or another: first the ones nobody has claimed,
 * from this thread's share onwards, then any still running elsewhere, waited for up to twice
 * this thread's own last chunk time and then computed here. */
static void run_op(op *o, int32_t *state, int64_t n, int t, int T) {
    int ready = 0;
    uint64_t patience = MIN_PATIENCE;
    const int64_t start = n * t / T;
    for (int64_t j = 0; j < n; j++) {
        const int64_t c = (start + j) % n;
        int32_t expected = FREE;
        if (__atomic_load_n(&state[c], __ATOMIC_ACQUIRE) != FREE ||
            !__atomic_compare_exchange_n(&state[c], &expected, CLAIMED, 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        const uint64_t t0 = __rdtsc();
        compute(o, c, &ready);
        const uint64_t took = 2 * (__rdtsc() - t0);
        if (took > patience) patience = took;
        __atomic_store_n(&state[c], DONE, __ATOMIC_RELEASE);
    }
    for (int64_t j = 0; j < n; j++) {
        const int64_t c = (start + j) % n;
        if (__atomic_load_n(&state[c], __ATOMIC_ACQUIRE) == DONE) continue;
        const uint64_t t0 = __rdtsc();
        while (__atomic_load_n(&state[c], __ATOMIC_ACQUIRE) != DONE && __rdtsc() - t0 < patience)
            _mm_pause();
        if (__atomic_load_n(&state[c], __ATOMIC_ACQUIRE) == DONE) continue;
        compute(o, c, &ready);
        __atomic_store_n(&state[c], DONE, __ATOMIC_RELEASE);
    }
}

/* One layer on thread t of T. `h`: the previous layer's MLP output (first layer: the
 * embeddings, which also start the residual stream). */
static void layer(const ps_model *m, const ps_batch *b, const plan *p, int64_t l,
                  const float *h, float *buffers, int32_t *states, scratch *w, int t, int T) {
    const ps_layer *L = &m->layers[l];
    const int64_t M = p->M, H = p->H;
    const outputs out = layer_outputs(p, buffers, l);
    int32_t *state = states + l * p->layer_chunks;
    if (l == 0) memcpy(w->residual, h, sizeof(float) * (size_t)(M * H));
    ps_add_rms_norm_rows(h, H, l ? w->residual : NULL, H, L->input_norm, w->x, H, M, H, m->eps);
    op o = {qkv_chunk, m, L, b, p, &out, w, w->x, H};
    run_op(&o, state, p->chunks[QKV], t, T);
    state += p->chunks[QKV];
    o.run = attention_chunk, o.input = NULL;
    run_op(&o, state, p->chunks[ATTN], t, T);
    state += p->chunks[ATTN];
    o.run = o_chunk, o.input = out.attn, o.k = p->attn_width;
    run_op(&o, state, p->chunks[O], t, T);
    state += p->chunks[O];
    ps_add_rms_norm_rows(out.o, H, w->residual, H, L->post_norm, w->x, H, M, H, m->eps);
    o.run = gate_up_chunk, o.input = w->x, o.k = H;
    run_op(&o, state, p->chunks[GATE_UP], t, T);
    state += p->chunks[GATE_UP];
    o.run = down_chunk, o.input = out.act, o.k = p->I;
    run_op(&o, state, p->chunks[DOWN], t, T);
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

/* Bytes of workspace a step of M sequences on num_threads threads needs. */
int64_t pagedserve_decode_workspace(const ps_model *m, int64_t M, int num_threads) {
    const plan p = make_plan(m, M, num_threads > 0 ? num_threads : 1);
    return workspace_bytes(&p, m->num_layers);
}

/* h [M, hidden]: the step's embeddings -> out [M, hidden]: the final norm of the last layer's
 * residual stream, as the decoder's forward returns it. Writes the step's K/V into the caches.
 * workspace: pagedserve_decode_workspace(m, M, num_threads) bytes, 64-byte aligned.
 * Returns 0, or -2 / -3 (nothing written) when `check` rejects the batch. */
int pagedserve_decode_step(const ps_model *m, const float *h, float *out, int64_t M,
                           const int64_t *positions, const int64_t *slots,
                           const int32_t *block_tables, int64_t bt_stride, int64_t bt_width,
                           const int32_t *seq_lens, void *workspace, int num_threads) {
    const ps_batch b = {M, positions, slots, block_tables, seq_lens, bt_stride, bt_width};
    const int status = check(m, &b);
    if (status) return status;
    const int T = num_threads > 0 ? num_threads : 1;
    const plan p = make_plan(m, M, T);
    float *buffers = workspace;
    int32_t *states = (int32_t *)(buffers + m->num_layers * p.layer_floats);
    const int64_t num_states = m->num_layers * p.layer_chunks + M;
    float *scratches = (float *)(states + num_states);
    memset(states, 0, sizeof(int32_t) * (size_t)num_states);
    int32_t *final_state = states + m->num_layers * p.layer_chunks;
#pragma omp parallel num_threads(T)
    {
        const int t = omp_get_thread_num(), threads = omp_get_num_threads();
        float *mine = scratches + (int64_t)t * scratch_floats(&p);
        scratch w;
        w.residual = mine;
        w.x = w.residual + M * p.H;
        w.gate_up = w.x + M * p.H;
        w.d = w.gate_up + M * 2 * ROWS;
        w.s = w.d + M * (p.k_max / QK);
        w.c = (int32_t *)(w.s + M * (p.k_max / QK));
        w.heads = (float *)(w.c + 2 * M * (p.k_max / QK));
        w.q = (int8_t *)(w.heads + (p.hq / p.hkv + 1) * p.D);
        const float *h_in = h;
        for (int64_t l = 0; l < m->num_layers; l++) {
            if (__atomic_load_n(&final_state[M - 1], __ATOMIC_ACQUIRE) == DONE) break;
            layer(m, &b, &p, l, h_in, buffers, states, &w, t, threads);
            h_in = layer_outputs(&p, buffers, l).mlp;
        }
        /* the final norm, a row at a time, by whoever gets there first */
        for (int64_t i = 0; i < M; i++) {
            int32_t expected = FREE;
            if (__atomic_compare_exchange_n(&final_state[i], &expected, CLAIMED, 0,
                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                ps_add_rms_norm_rows(h_in + i * p.H, p.H, w.residual + i * p.H, p.H,
                                     m->final_norm, out + i * p.H, p.H, 1, p.H, m->eps);
                __atomic_store_n(&final_state[i], DONE, __ATOMIC_RELEASE);
            }
        }
    }
    return 0;
}
