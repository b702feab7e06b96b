/* Paged decode attention for the CPU, on AVX2 + FMA: float32 arithmetic over float32 or
 * bfloat16 caches.
 *
 * Why: the PyTorch reference gathers every decode's context out of the paged cache into a
 * padded [S, L, H, D] copy (index_select), then runs SDPA with a padding mask: at decode sizes
 * the copies, the mask and the per-op dispatch cost more than the arithmetic. Here each decode
 * reads its K/V rows in place through its block table, and never a row at or past its seq_len
 * (stale and null-block rows may hold NaN, and 0 * NaN would survive a zero probability).
 *
 * Decode attention streams every context's K and V from memory once per layer (on the CPU
 * engine, 30 layers of them fit no cache), so the work is laid out for the memory. A task is a
 * sequence's kv heads h0..h1, usually all of them: it reads whole cache rows (a token's kv heads
 * are adjacent), which the hardware prefetchers follow within a block; one kv head's slice of
 * every row per task read at half that bandwidth. Only with too few sequences to keep the
 * threads busy are the kv heads split over tasks. The tasks are dealt to the threads in
 * contiguous runs of about equal token counts, so each thread knows what it reads next: while a
 * chunk computes, the next chunk's rows (the next task's first, at a task's end) are
 * prefetched, a few per score tile. Blocks are scattered, so without that the memory sat idle
 * during the arithmetic and the arithmetic during the misses (a third more time per layer).
 *
 * Within a task, tokens go in chunks of CHUNK; per kv head, the chunk's scores for its G query
 * heads (8 tokens per register tile, reduced with horizontal adds), then one online-softmax step
 * per query head (running max m, running sum l, the accumulator rescaled by exp(m_old - m_new)),
 * then the probabilities times V, with up to 4 heads' accumulator slices held in registers while
 * a V slice is loaded once for all of them. Everything is float32; bfloat16 cache rows (the
 * cache of a `--dtype bfloat16` model) are widened exactly as they are loaded, and each
 * function below that touches them comes in two copies (`bf16` a constant from
 * `decode_task_f32` / `_bf16`, which the compiler propagates: inlined, or cloned per value),
 * so the float32 path runs as fast as before it (forcing everything inline was slower;
 * docs/benchmarks.md, "Native CPU kernels: tuning notes"). Each kv head's result comes
 * from one thread, in token order, whatever the split: it does not depend on the thread count.
 *
 * The same call first stores the step's new K/V rows into their slots (slot -1: skipped), a
 * row copy per token that costs less than torch's index_copy_ dispatch at decode sizes.
 *
 * Wrapped by attention.py; built with the other kernels by build.py.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "parts.h"
#include "simd.h"

#define CHUNK 16       /* tokens per online-softmax step and per prefetch step */
#define TILE 8         /* tokens per score register tile */
#define HEADS 4        /* query heads whose accumulators stay in registers during P x V */
#define MAX_GROUP 16   /* query heads per kv head (the Python wrapper enforces both limits) */
#define MAX_DIM 256
#define STATE (MAX_GROUP * MAX_DIM)  /* floats of query and of accumulator state per task */

/* 8 cache values from element i of p (float32, or bfloat16 when `bf16`) as floats. */
static inline __m256 load8(const void *p, int64_t i, const int bf16) {
    if (bf16) {
        const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    return _mm256_loadu_ps((const float *)p + i);
}

/* exp(x) for the softmax, where x <= 0: 0 below -87 and for NaN (-inf - -inf, a head whose
 * running max is still -inf), so such a term drops out instead of poisoning the sums. */
static inline __m256 exp_nonpositive(__m256 x) {
    const __m256 valid = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    return _mm256_and_ps(exp256(x), valid);
}

/* Dot products of one query row q [dim] with the 8 key rows at kv + off[0..8): lane i holds
 * q . k_i. Eight independent FMA chains, then a horizontal-add tree that leaves the eight sums
 * in order in one vector. */
static inline __attribute__((always_inline)) __m256 score_tile(const float *q, const void *kv,
                                                               const int64_t *off, int64_t dim,
                                                               const int bf16) {
    __m256 a[TILE];
    for (int i = 0; i < TILE; i++) a[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int i = 0; i < TILE; i++)
            a[i] = _mm256_fmadd_ps(qv, load8(kv, off[i] + d, bf16), a[i]);
    }
    const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20),
                         _mm256_permute2f128_ps(h0, h1, 0x31));
}

/* acc[j][d, d + 8 * SLICES) = acc * corr[j] + sum_t p[j][t] v_t[d, d + 8 * SLICES) for H query
 * heads (p rows CHUNK apart) over the n value rows at v + off[t]. The H x SLICES accumulators
 * stay in registers over the chunk: each V slice is loaded once for all the heads, and there are
 * enough independent FMA chains (8 or more in the main tiles) to hide the FMA latency. Called
 * with constant H and SLICES, so the loops over them unroll. */
static inline __attribute__((always_inline)) void pv_tile(
    float *acc, const float *p, const float *corr, const void *v, const int64_t *off,
    int64_t n, int64_t dim, int64_t d, const int H, const int SLICES, const int bf16) {
    __m256 a[HEADS * 8];
    for (int j = 0; j < H; j++)
        for (int i = 0; i < SLICES; i++)
            a[j * SLICES + i] = _mm256_mul_ps(_mm256_loadu_ps(acc + j * dim + d + 8 * i),
                                              _mm256_set1_ps(corr[j]));
    for (int64_t t = 0; t < n; t++) {
        __m256 pj[HEADS];
        for (int j = 0; j < H; j++) pj[j] = _mm256_broadcast_ss(p + j * CHUNK + t);
        for (int i = 0; i < SLICES; i++) {
            const __m256 vv = load8(v, off[t] + d + 8 * i, bf16);
            for (int j = 0; j < H; j++)
                a[j * SLICES + i] = _mm256_fmadd_ps(pj[j], vv, a[j * SLICES + i]);
        }
    }
    for (int j = 0; j < H; j++)
        for (int i = 0; i < SLICES; i++)
            _mm256_storeu_ps(acc + j * dim + d + 8 * i, a[j * SLICES + i]);
}

/* P x V for H (constant) heads over all of dim: register tiles of 4 slices (2 for H = 4, whose
 * 8 accumulators suffice), then of 2 and 1 slices for what remains of dim. */
static inline __attribute__((always_inline)) void accumulate_heads(
    float *acc, const float *p, const float *corr, const void *v, const int64_t *off,
    int64_t n, int64_t dim, const int H, const int bf16) {
    int64_t d = 0;
    if (H == 1)
        for (; d + 64 <= dim; d += 64) pv_tile(acc, p, corr, v, off, n, dim, d, H, 8, bf16);
    if (H < 4)
        for (; d + 32 <= dim; d += 32) pv_tile(acc, p, corr, v, off, n, dim, d, H, 4, bf16);
    for (; d + 16 <= dim; d += 16) pv_tile(acc, p, corr, v, off, n, dim, d, H, 2, bf16);
    for (; d < dim; d += 8) pv_tile(acc, p, corr, v, off, n, dim, d, H, 1, bf16);
}

/* P x V for `heads` (1 to HEADS) heads: dispatch to the constant-H variants. */
static void accumulate(
    float *acc, const float *p, const float *corr, int heads, const void *v,
    const int64_t *off, int64_t n, int64_t dim, const int bf16) {
    switch (heads) {
    case 1: accumulate_heads(acc, p, corr, v, off, n, dim, 1, bf16); break;
    case 2: accumulate_heads(acc, p, corr, v, off, n, dim, 2, bf16); break;
    case 3: accumulate_heads(acc, p, corr, v, off, n, dim, 3, bf16); break;
    default: accumulate_heads(acc, p, corr, v, off, n, dim, 4, bf16); break;
    }
}

/* The cache geometry and head shape of one call. */
typedef struct {
    int64_t block_size, num_kv_heads, group, dim;
} shape;

/* Kv heads h0 .. h1 of one sequence; q and out point at its query head h0 * group. */
typedef struct {
    const float *q;
    float *out;
    const int32_t *block_table;
    int64_t first, seq_len, h0, h1;  /* attends to tokens first .. seq_len - 1 */
} task;

/* Up to CHUNK consecutive tokens of a sequence: the cache offset of each token's row (all kv
 * heads). Entries past n repeat the last real row, so a full register tile can always load. */
typedef struct {
    int64_t off[CHUNK];
    int64_t n;
} chunk;

/* The rows of tokens start .. start + CHUNK (clipped to seq_len) of a block table into c. */
static void load_chunk(chunk *c, const int32_t *block_table, int64_t seq_len, int64_t start,
                       const shape *sh) {
    const int64_t n = seq_len - start < CHUNK ? seq_len - start : CHUNK;
    const int64_t row = sh->num_kv_heads * sh->dim;
    int64_t block = start / sh->block_size, pos = start % sh->block_size;
    for (int64_t t = 0; t < n; t++) {
        c->off[t] = ((int64_t)block_table[block] * sh->block_size + pos) * row;
        if (++pos == sh->block_size) {
            block++;
            pos = 0;
        }
    }
    for (int64_t t = n; t < CHUNK; t++) c->off[t] = c->off[n - 1];
    c->n = n;
}

/* The rows of the chunk that comes next (len elements of esize bytes from k / v + offset),
 * `step` rows a call. */
typedef struct {
    const char *k, *v;
    const chunk *c;  /* NULL: nothing comes next */
    int64_t next, step, len, esize;
} prefetcher;

static void prefetch_some(prefetcher *p) {
    if (!p->c) return;
    const int64_t end = p->next + p->step < p->c->n ? p->next + p->step : p->c->n;
    for (; p->next < end; p->next++)
        for (int64_t d = 0; d < p->len * p->esize; d += 64) {
            _mm_prefetch(p->k + p->c->off[p->next] * p->esize + d, _MM_HINT_T0);
            _mm_prefetch(p->v + p->c->off[p->next] * p->esize + d, _MM_HINT_T0);
        }
}

/* Scores of chunk c's tokens for the group's heads into s [group][CHUNK] (k: the kv head's
 * slice of the cache), then the online softmax step: s becomes the probabilities relative to
 * the new running max, and corr the factor that rescales what was accumulated under the old
 * one. Tokens past c->n score -inf (probability 0). Each score tile also moves the prefetcher
 * on. */
static void softmax_chunk(
    const float *q, const void *k, const chunk *c, const shape *sh, float *s, float *m,
    float *l, float *corr, prefetcher *pf, const int bf16) {
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    const int64_t n = c->n, dim = sh->dim;
    for (int64_t g = 0; g < sh->group; g++) {
        float *sg = s + g * CHUNK;
        __m256 mx = neg_inf;
        for (int64_t t = 0; t < n; t += TILE) {
            const __m256 real = _mm256_cmp_ps(lane, _mm256_set1_ps((float)(n - t)), _CMP_LT_OQ);
            const __m256 sc = _mm256_blendv_ps(
                neg_inf, score_tile(q + g * dim, k, c->off + t, dim, bf16), real);
            _mm256_storeu_ps(sg + t, sc);
            mx = _mm256_max_ps(mx, sc);
            prefetch_some(pf);
        }
        const float chunk_max = hmax(mx), m_new = m[g] > chunk_max ? m[g] : chunk_max;
        /* 0 on the first chunk (m = -inf) */
        corr[g] = _mm256_cvtss_f32(exp_nonpositive(_mm256_set1_ps(m[g] - m_new)));
        m[g] = m_new;
        const __m256 mv = _mm256_set1_ps(m_new);
        __m256 sum = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t += TILE) {
            const __m256 p = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
            _mm256_storeu_ps(sg + t, p);
            sum = _mm256_add_ps(sum, p);
        }
        l[g] = l[g] * corr[g] + hsum(sum);
    }
}

/* Point pf at `ahead` (rows from kv head h0, h1 - h0 heads wide), spread over all the score
 * tiles of a chunk of n tokens for kv_heads kv heads: the more thinly the prefetches are spread,
 * the better they overlapped the arithmetic (in bursts, they queue up like demand misses). */
static void aim(prefetcher *pf, const void *k_cache, const void *v_cache, const chunk *ahead,
                int64_t h0, int64_t h1, int64_t n, int64_t kv_heads, const shape *sh,
                int64_t esize) {
    const int64_t calls = kv_heads * sh->group * ((n + TILE - 1) / TILE);
    *pf = (prefetcher){(const char *)k_cache + h0 * sh->dim * esize,
                       (const char *)v_cache + h0 * sh->dim * esize, ahead, 0,
                       (ahead->n + calls - 1) / calls, (h1 - h0) * sh->dim, esize};
}

/* One task: out rows of its query heads = softmax(q K^T) V over its sequence's cached tokens
 * first .. seq_len - 1. `next`: the task this thread runs next (or NULL), prefetched at the
 * end. */
static inline __attribute__((always_inline)) void decode_task(
    const task *tk, const task *next, const void *k_cache, const void *v_cache,
    const shape *sh, float scale, const int bf16) {
    const int64_t esize = bf16 ? 2 : 4;
    const int64_t group = sh->group, dim = sh->dim, kv_heads = tk->h1 - tk->h0;
    const int64_t heads = kv_heads * group;
    float qs[STATE], acc[STATE], m[STATE / 8], l[STATE / 8];
    float s[MAX_GROUP * CHUNK], corr[MAX_GROUP];
    chunk chunks[2];
    for (int64_t i = 0; i < heads * dim; i++) {
        qs[i] = tk->q[i] * scale;
        acc[i] = 0.0f;
    }
    for (int64_t j = 0; j < heads; j++) {
        m[j] = -INFINITY;
        l[j] = 0.0f;
    }
    load_chunk(&chunks[0], tk->block_table, tk->seq_len, tk->first, sh);
    for (int64_t start = tk->first, i = 0; start < tk->seq_len; start += CHUNK, i ^= 1) {
        const chunk *c = &chunks[i];
        chunk *ahead = &chunks[i ^ 1];
        prefetcher pf = {0};
        if (start + CHUNK < tk->seq_len) {
            load_chunk(ahead, tk->block_table, tk->seq_len, start + CHUNK, sh);
            aim(&pf, k_cache, v_cache, ahead, tk->h0, tk->h1, c->n, kv_heads, sh, esize);
        } else if (next) {
            load_chunk(ahead, next->block_table, next->seq_len, next->first, sh);
            aim(&pf, k_cache, v_cache, ahead, next->h0, next->h1, c->n, kv_heads, sh, esize);
        }
        for (int64_t h = tk->h0; h < tk->h1; h++) {
            const int64_t j = (h - tk->h0) * group;
            softmax_chunk(qs + j * dim, (const char *)k_cache + h * dim * esize, c, sh, s, m + j,
                          l + j, corr, &pf, bf16);
            for (int64_t g = 0; g < group; g += HEADS) {
                const int n_heads = (int)(group - g < HEADS ? group - g : HEADS);
                accumulate(acc + (j + g) * dim, s + g * CHUNK, corr + g, n_heads,
                           (const char *)v_cache + h * dim * esize, c->off, c->n, dim, bf16);
            }
        }
    }
    for (int64_t j = 0; j < heads; j++) {
        const float inv = 1.0f / l[j];
        for (int64_t i = 0; i < dim; i++) tk->out[j * dim + i] = acc[j * dim + i] * inv;
    }
}

static void decode_task_f32(const task *tk, const task *next, const void *k_cache,
                            const void *v_cache, const shape *sh, float scale) {
    decode_task(tk, next, k_cache, v_cache, sh, scale, 0);
}

static void decode_task_bf16(const task *tk, const task *next, const void *k_cache,
                             const void *v_cache, const shape *sh, float scale) {
    decode_task(tk, next, k_cache, v_cache, sh, scale, 1);
}

/* Kv heads per task: as many as fit a task's state, but few enough for at least two tasks per
 * thread, so that few sequences still keep the threads busy. */
static int64_t heads_per_task(const shape *sh, int64_t num_seqs, int64_t num_threads) {
    int64_t per = STATE / (sh->group * sh->dim);
    if (per > sh->num_kv_heads) per = sh->num_kv_heads;
    while (per > 1 && num_seqs * ((sh->num_kv_heads + per - 1) / per) < 2 * num_threads) per--;
    return per;
}

/* The first token a query at position seq_len - 1 sees: its sliding window's (0: none). */
static inline int64_t window_start(int64_t seq_len, int64_t window) {
    return window > 0 && seq_len > window ? seq_len - window : 0;
}

void ps_attend(const float *q, float *out, const int32_t *block_table, int64_t seq_len,
               int64_t window, int64_t h0, int64_t h1, const float *k_cache,
               const float *v_cache, int64_t block_size, int64_t num_kv_heads, int64_t group,
               int64_t dim, float scale) {
    const shape sh = {block_size, num_kv_heads, group, dim};
    const task tk = {q, out, block_table, window_start(seq_len, window), seq_len, h0, h1};
    decode_task_f32(&tk, NULL, k_cache, v_cache, &sh, scale);
}

/* Decode attention of the first num_seqs rows of q [*, num_heads, head_dim] (token stride
 * q_stride, heads contiguous) into out (same shape, contiguous), as described at the top. */
static void paged_decode(const float *q, int64_t q_stride, const void *k_cache,
                         const void *v_cache, const int32_t *block_tables, int64_t bt_stride,
                         const int32_t *seq_lens, int64_t num_seqs, const shape *sh,
                         float scale, int64_t window, float *out, int num_threads, int bf16) {
    if (num_seqs == 0) return;
    void (*const run)(const task *, const task *, const void *, const void *, const shape *,
                      float) = bf16 ? decode_task_bf16 : decode_task_f32;
    const int64_t per = heads_per_task(sh, num_seqs, num_threads);
    const int64_t parts = (sh->num_kv_heads + per - 1) / per, num_tasks = num_seqs * parts;
    const int64_t row = sh->num_kv_heads * sh->group * sh->dim;
    int64_t total = 0;
    for (int64_t s = 0; s < num_seqs; s++)
        total += (seq_lens[s] - window_start(seq_lens[s], window)) * sh->num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t threads = omp_get_num_threads(), me = omp_get_thread_num();
        task mine[2];
        int have = 0;
        int64_t before = 0;  /* weight (tokens x kv heads) of the tasks before w */
        for (int64_t w = 0; w < num_tasks; w++) {
            const int64_t seq = w / parts, h0 = w % parts * per;
            const int64_t h1 = h0 + per < sh->num_kv_heads ? h0 + per : sh->num_kv_heads;
            const int64_t first_token = window_start(seq_lens[seq], window);
            const int64_t weight = (seq_lens[seq] - first_token) * (h1 - h0);
            const int64_t owner = threads * (2 * before + weight) / (2 * total);
            before += weight;
            if (owner != me) continue;
            const int64_t first = h0 * sh->group * sh->dim;
            mine[have] = (task){q + seq * q_stride + first, out + seq * row + first,
                                block_tables + seq * bt_stride, first_token, seq_lens[seq], h0,
                                h1};
            if (have) {
                run(&mine[0], &mine[1], k_cache, v_cache, sh, scale);
                mine[0] = mine[1];
            }
            have = 1;
        }
        if (have) run(&mine[0], NULL, k_cache, v_cache, sh, scale);
    }
}

/* Row t of k and v ([row] elements of esize bytes each, token strides k_stride / v_stride in
 * elements) into cache row slots[t] of k_cache / v_cache; rows with slot -1 are skipped. */
static void store_rows(const char *k, int64_t k_stride, const char *v, int64_t v_stride,
                       const int64_t *slots, int64_t num_tokens, int64_t row, char *k_cache,
                       char *v_cache, int64_t esize) {
    const size_t bytes = (size_t)(row * esize);
    for (int64_t t = 0; t < num_tokens; t++) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row * esize, k + t * k_stride * esize, bytes);
        memcpy(v_cache + slots[t] * row * esize, v + t * v_stride * esize, bytes);
    }
}

/* One layer's step: the new rows k / v [num_tokens, num_kv_heads, head_dim] (token strides
 * k_stride / v_stride) into their cache slots, then the decode attention of the first num_seqs
 * sequences (whose new token is among those rows). One call, not two: at decode sizes a
 * ctypes call costs as much as the store itself.
 * caches [num_blocks, block_size, num_kv_heads, head_dim] contiguous; block_tables
 * [num_seqs, *] with row stride bt_stride; seq_lens [num_seqs] >= 1; out [num_seqs, num_heads,
 * head_dim] contiguous. head_dim: a multiple of 8, at most MAX_DIM; num_heads / num_kv_heads at
 * most MAX_GROUP. window > 0: each decode attends to its last `window` tokens only, and its
 * block table entries before them are never read (they may be the null block).
 * kv_bf16: k, v and the caches are bfloat16 (q and out stay float32), else float32.
 * The caller checks slots, block ids and lengths against the cache. */
void pagedserve_store_and_decode(const float *q, int64_t q_stride, const void *k,
                                 int64_t k_stride, const void *v, int64_t v_stride,
                                 const int64_t *slots, int64_t num_tokens, void *k_cache,
                                 void *v_cache, const int32_t *block_tables, int64_t bt_stride,
                                 const int32_t *seq_lens, int64_t num_seqs, int64_t num_heads,
                                 int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                 float scale, int64_t window, float *out, int num_threads,
                                 int kv_bf16) {
    const shape sh = {block_size, num_kv_heads, num_heads / num_kv_heads, head_dim};
    store_rows(k, k_stride, v, v_stride, slots, num_tokens, num_kv_heads * head_dim, k_cache,
               v_cache, kv_bf16 ? 2 : 4);
    paged_decode(q, q_stride, k_cache, v_cache, block_tables, bt_stride, seq_lens, num_seqs, &sh,
                 scale, window, out, num_threads, kv_bf16);
}
