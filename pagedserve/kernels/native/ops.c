/* Float32 elementwise ops of the decoder for the CPU: residual add + RMSNorm, q/k RMSNorm +
 * RoPE in place on the fused qkv output, and SiLU(gate) * up, on AVX2 + FMA.
 *
 * Why: eager PyTorch runs each of these as 4 to 10 small ops (casts, pow, mean, rsqrt, roll,
 * muls, adds), each with its own dispatch, allocation and pass over memory. At decode sizes
 * ([16, 576] per norm) that per-op overhead, not the arithmetic, is the cost: ~35 ops per layer,
 * ~1,000 per step. Here each op is one call, and it makes its few passes over a row while the
 * row sits in L1.
 *
 * Numerics follow the eager reference in model/ops.py (and transformers), rounding where it
 * rounds: RMSNorm is w * (x * (1 / sqrt(mean(x^2) + eps))) with a true division and square root
 * (not the approximate rsqrt instruction); RoPE is x * cos + roll(x, D/2) * sin_signed with both
 * products rounded before the add (`rounded`); SiLU is x / (1 + exp(-x)) with an exp within an
 * ulp (torch's is within 0.6). What differs is the order in which a norm sums its squares and
 * the last bit of some exps, so results match to float32 rounding; the residual add and RoPE
 * without q/k norm are bit-identical.
 *
 * Rows (tokens) are split over OpenMP threads only when a call has enough work to pay for
 * waking them (`for_rows`), as for a prefill; decode sizes stay on the calling thread. Callers
 * pass torch's thread count. Wrapped by ops.py; built with the other kernels by build.py.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>

#include "parts.h"
#include "simd.h"

/* Elements a call must touch before it is split over threads: torch's own grain size for
 * elementwise ops (at::internal::GRAIN_SIZE). Below it a second thread saves little of an op
 * that is already microseconds long and risks much: a parallel region waits for its slowest
 * thread, milliseconds when another process holds that core (docs/benchmarks.md, "Native CPU
 * kernels: tuning notes"). */
#define PARALLEL_MIN_ELEMENTS 32768

/* Rows [r0, r1) of one op; `args` is the op's argument struct. */
typedef void (*rows_fn)(const void *args, int64_t r0, int64_t r1);

/* fn over rows [0, rows): on the calling thread, or in equal parts on num_threads threads when
 * the call touches enough elements. Serial calls skip the parallel region altogether: even one
 * disabled by an `if` clause costs libgomp a measurable entry (same section). */
static void for_rows(rows_fn fn, const void *args, int64_t rows, int64_t elements,
                     int num_threads) {
    if (elements < PARALLEL_MIN_ELEMENTS || num_threads < 2 || rows < 2) {
        fn(args, 0, rows);
        return;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        fn(args, rows * t / nt, rows * (t + 1) / nt);
    }
}

/* An opaque identity: the compiler can no longer fuse the multiply that made `v` into the
 * add that uses it (FMA contraction), so the product is rounded to float32 as in eager. */
static inline __m256 rounded(__m256 v) {
    __asm__("" : "+x"(v));
    return v;
}

/* `rounded` for one float (the scalar tail of a head). */
static inline float rounded1(float v) {
    __asm__("" : "+x"(v));
    return v;
}

static float sum_squares(const float *x, int64_t n) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(x + i + 8);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
        acc1 = _mm256_fmadd_ps(b, b, acc1);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i);
        acc0 = _mm256_fmadd_ps(a, a, acc0);
    }
    float sum = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < n; i++)
        sum += x[i] * x[i];
    return sum;
}

/* 1 / sqrt(mean of squares + eps), as torch.rsqrt computes it (a division, not rsqrtps). */
static float inv_rms(const float *x, int64_t n, float eps) {
    return 1.0f / sqrtf(sum_squares(x, n) / (float)n + eps);
}

/* out = w * (x * inv): the normalised row rounded before the weight multiply, as in eager. */
static void scale_row(const float *x, float inv, const float *w, float *out, int64_t n) {
    const __m256 vinv = _mm256_set1_ps(inv);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + i), vinv);
        _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(w + i), v));
    }
    for (; i < n; i++)
        out[i] = w[i] * (x[i] * inv);
}

static void add_row(float *residual, const float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(residual + i,
                         _mm256_add_ps(_mm256_loadu_ps(residual + i), _mm256_loadu_ps(x + i)));
    for (; i < n; i++)
        residual[i] += x[i];
}

struct norm_args {
    const float *x, *w;
    float *residual, *out;
    int64_t ldx, ldres, ldout, n;
    float eps;
};

static void norm_rows(const void *args, int64_t r0, int64_t r1) {
    const struct norm_args *a = args;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = a->x + r * a->ldx;
        if (a->residual) {
            float *res = a->residual + r * a->ldres;
            add_row(res, x, a->n);
            x = res;
        }
        scale_row(x, inv_rms(x, a->n, a->eps), a->w, a->out + r * a->ldout, a->n);
    }
}

void ps_add_rms_norm_rows(const float *x, int64_t ldx, float *residual, int64_t ldres,
                          const float *w, float *out, int64_t ldout, int64_t rows, int64_t n,
                          float eps) {
    const struct norm_args args = {x, w, residual, out, ldx, ldres, ldout, n, eps};
    norm_rows(&args, 0, rows);
}

/* out[r] = RMSNorm(residual[r] + x[r]) * w, the sum written into residual[r] first; with
 * residual NULL, out[r] = RMSNorm(x[r]) * w. Rows of n floats: x, residual and out have row
 * strides ldx, ldres, ldout. */
void pagedserve_add_rms_norm(const float *x, int64_t ldx, float *residual, int64_t ldres,
                             const float *w, float *out, int64_t ldout, int64_t rows, int64_t n,
                             float eps, int num_threads) {
    const struct norm_args args = {x, w, residual, out, ldx, ldres, ldout, n, eps};
    for_rows(norm_rows, &args, rows, rows * n, num_threads);
}

/* One head of D = 2 * half floats in place: optional RMSNorm with weight w (NULL: none), then
 * NeoX RoPE with this token's cos / sin_signed rows: out = x * cos + roll(x, half) * sin. */
static void rotate_head(float *x, int64_t half, const float *cos, const float *sin,
                        const float *w, float eps) {
    const float inv = w ? inv_rms(x, 2 * half, eps) : 1.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    float *hi = x + half;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
        __m256 a = _mm256_loadu_ps(x + i), b = _mm256_loadu_ps(hi + i);
        if (w) {
            a = _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(a, vinv));
            b = _mm256_mul_ps(_mm256_loadu_ps(w + half + i), _mm256_mul_ps(b, vinv));
        }
        __m256 ca = rounded(_mm256_mul_ps(a, _mm256_loadu_ps(cos + i)));
        __m256 sb = rounded(_mm256_mul_ps(b, _mm256_loadu_ps(sin + i)));
        __m256 cb = rounded(_mm256_mul_ps(b, _mm256_loadu_ps(cos + half + i)));
        __m256 sa = rounded(_mm256_mul_ps(a, _mm256_loadu_ps(sin + half + i)));
        _mm256_storeu_ps(x + i, _mm256_add_ps(ca, sb));
        _mm256_storeu_ps(hi + i, _mm256_add_ps(cb, sa));
    }
    for (; i < half; i++) {
        float a = x[i], b = hi[i];
        if (w) {
            a = w[i] * (a * inv);
            b = w[half + i] * (b * inv);
        }
        x[i] = rounded1(a * cos[i]) + rounded1(b * sin[i]);
        hi[i] = rounded1(b * cos[half + i]) + rounded1(a * sin[half + i]);
    }
}

void ps_rotate_head(float *x, int64_t half, const float *cos, const float *sin, const float *w,
                    float eps) {
    rotate_head(x, half, cos, sin, w, eps);
}

struct rotate_args {
    float *qkv;
    const int64_t *positions;
    const float *cos, *sin, *q_w, *k_w;
    int64_t ld_token, ld_head, hq, hkv, d;
    float eps;
};

static void rotate_rows(const void *args, int64_t t0, int64_t t1) {
    const struct rotate_args *a = args;
    for (int64_t t = t0; t < t1; t++) {
        const float *c = a->cos + a->positions[t] * a->d, *s = a->sin + a->positions[t] * a->d;
        for (int64_t h = 0; h < a->hq + a->hkv; h++)
            rotate_head(a->qkv + t * a->ld_token + h * a->ld_head, a->d / 2, c, s,
                        h < a->hq ? a->q_w : a->k_w, a->eps);
    }
}

/* In place on qkv [tokens][hq + 2 hkv][d] (token stride ld_token, head stride ld_head, each head
 * contiguous): RMSNorm each q head with q_w and each k head with k_w (both NULL: no norm), then
 * rotate the q and k heads by the token's position: row positions[t] of the cos / sin_signed
 * tables [max_positions][d]. v is not touched. d must be even. Returns -1, or (having written
 * nothing) the first token whose position is outside the tables. */
int64_t pagedserve_rotate_qk(float *qkv, int64_t ld_token, int64_t ld_head, int64_t tokens,
                             const int64_t *positions, int64_t max_positions, const float *cos,
                             const float *sin, int64_t hq, int64_t hkv, int64_t d,
                             const float *q_w, const float *k_w, float eps, int num_threads) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_positions)
            return t;
    const struct rotate_args args = {qkv, positions, cos, sin, q_w, k_w,
                                     ld_token, ld_head, hq, hkv, d, eps};
    for_rows(rotate_rows, &args, tokens, tokens * (hq + hkv) * d, num_threads);
    return -1;
}

/* gate / (1 + exp(-gate)), rounded to float32, then times up (F.silu(gate).mul_(up)). */
static inline __m256 silu_mul8(__m256 gate, __m256 up) {
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gate));
    return _mm256_mul_ps(_mm256_div_ps(gate, _mm256_add_ps(one, e)), up);
}

struct silu_args {
    const float *gate_up;
    float *out;
    int64_t ld, n;
};

/* The tail of a row that is no multiple of 8 goes through the same vector code via a buffer,
 * so every element sees the same exp. */
void ps_silu_mul(const float *gate, const float *up, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
    if (i < n) {
        float g[8] = {0}, u[8] = {0}, res[8];
        for (int64_t j = 0; i + j < n; j++)
            g[j] = gate[i + j], u[j] = up[i + j];
        _mm256_storeu_ps(res, silu_mul8(_mm256_loadu_ps(g), _mm256_loadu_ps(u)));
        for (int64_t j = 0; i + j < n; j++)
            out[i + j] = res[j];
    }
}

static void silu_rows(const void *args, int64_t r0, int64_t r1) {
    const struct silu_args *a = args;
    for (int64_t r = r0; r < r1; r++)
        ps_silu_mul(a->gate_up + r * a->ld, a->gate_up + r * a->ld + a->n, a->out + r * a->n,
                    a->n);
}

/* out [rows][n] (contiguous) = silu(gate_up[r][:n]) * gate_up[r][n:], gate_up rows at stride ld. */
void pagedserve_silu_and_mul(const float *gate_up, int64_t ld, int64_t rows, int64_t n,
                             float *out, int num_threads) {
    const struct silu_args args = {gate_up, out, ld, n};
    for_rows(silu_rows, &args, rows, rows * n, num_threads);
}
