/* SGMV LoRA on the CPU, fp32: y[t] += scale_k * B_k (A_k x[t]) for every adapter token t of
 * slot k, segment by segment, in one call for a whole (layer, module) of a step.
 *
 * The meaning is `sgmv_torch.lora_apply`'s. Each slot's A is a dense [r, in] and its B is held
 * transposed, a dense [r, out] (LoRAPool with b_transposed): a token's update is a sum of r
 * contiguous rows. Tokens go BLOCK at a time, so a segment reads its adapter's weights once per
 * BLOCK tokens; segments longer than `max_len` are skipped (the caller does them with a GEMM).
 * Built and loaded by sgmv_cpu.py; the caller checks every shape, rank and pointer. The same
 * library holds the loader's conversion of an adapter into the pool's form (at the end).
 *
 * A step's adapters come from memory, not from cache, a 4 KiB row of A or B^T at a time, and
 * the hardware's prefetcher stops at page boundaries: while one row is used the next is
 * prefetched (after the last row of A, B^T's first; after B^T's, the next segment's A).
 */
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) && !defined(LORAPLANE_PORTABLE_F16)
#include <immintrin.h>
#define HAVE_F16C 1
#endif

#define BLOCK 4
#define MAX_RANK 256

static inline void prefetch(const float *p, int64_t n) {
    if (p == 0) return;
    for (int64_t i = 0; i < n; i += 16) __builtin_prefetch(p + i, 0, 3); /* 64-byte lines */
}

/* h[b][j] = A_j . x_b for b < nb, j < r; then (n floats at) `after` is prefetched */
static void shrink(const float *const *xs, int nb, const float *a, int64_t r, int64_t in,
                   float h[BLOCK][MAX_RANK], const float *after, int64_t n) {
    for (int64_t j = 0; j < r; j++) {
        const float *aj = a + j * in;
        if (j + 1 < r)
            prefetch(aj + in, in);
        else
            prefetch(after, n);
        if (nb == BLOCK) {
            const float *x0 = xs[0], *x1 = xs[1], *x2 = xs[2], *x3 = xs[3];
            float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
            for (int64_t i = 0; i < in; i++) {
                float v = aj[i];
                s0 += v * x0[i];
                s1 += v * x1[i];
                s2 += v * x2[i];
                s3 += v * x3[i];
            }
            h[0][j] = s0;
            h[1][j] = s1;
            h[2][j] = s2;
            h[3][j] = s3;
        } else {
            for (int b = 0; b < nb; b++) {
                const float *xb = xs[b];
                float s = 0.0f;
#pragma omp simd reduction(+ : s)
                for (int64_t i = 0; i < in; i++) s += aj[i] * xb[i];
                h[b][j] = s;
            }
        }
    }
}

/* y_b += sum_j h[b][j] * bt_j for b < nb; then (n floats at) `after` is prefetched */
static void expand(float *const *ys, int nb, const float *bt, int64_t r, int64_t out,
                   float h[BLOCK][MAX_RANK], const float *after, int64_t n) {
    for (int64_t j = 0; j < r; j++) {
        const float *bj = bt + j * out;
        if (j + 1 < r)
            prefetch(bj + out, out);
        else
            prefetch(after, n);
        if (nb == BLOCK) {
            float *y0 = ys[0], *y1 = ys[1], *y2 = ys[2], *y3 = ys[3];
            float c0 = h[0][j], c1 = h[1][j], c2 = h[2][j], c3 = h[3][j];
#pragma omp simd
            for (int64_t o = 0; o < out; o++) {
                float v = bj[o];
                y0[o] += c0 * v;
                y1[o] += c1 * v;
                y2[o] += c2 * v;
                y3[o] += c3 * v;
            }
        } else {
            for (int b = 0; b < nb; b++) {
                float *yb = ys[b];
                float c = h[b][j];
#pragma omp simd
                for (int64_t o = 0; o < out; o++) yb[o] += c * bj[o];
            }
        }
    }
}

/* The A of the first segment after s that the kernel does (0: none). */
static const float *next_a(int64_t s, int64_t num_segs, const int32_t *seg_slots,
                           const int32_t *seg_bounds, int64_t max_len, const int64_t *a_ptrs,
                           const int64_t *ranks) {
    for (int64_t t = s + 1; t < num_segs; t++) {
        int64_t k = seg_slots[t];
        if (ranks[k] > 0 && seg_bounds[t + 1] - seg_bounds[t] <= max_len)
            return (const float *)(intptr_t)a_ptrs[k];
    }
    return 0;
}

/* One call's arguments, as every thread that works on it reads them. */
struct call {
    const float *x, *scales;
    float *y;
    int64_t x_stride, y_stride, in, out, num_segs, max_len;
    const int64_t *token_order, *a_ptrs, *bt_ptrs, *ranks;
    const int32_t *seg_slots, *seg_bounds;
};

/* Segments [lo, hi) of the call; returns how many it left for being longer than max_len. */
static int run_segments(const struct call *c, int64_t lo, int64_t hi) {
    float h[BLOCK][MAX_RANK];
    const float *xs[BLOCK];
    float *ys[BLOCK];
    int left = 0;
    for (int64_t s = lo; s < hi; s++) {
        int64_t k = c->seg_slots[s], r = c->ranks[k];
        int64_t start = c->seg_bounds[s], end = c->seg_bounds[s + 1];
        if (r <= 0) continue;
        if (end - start > c->max_len) {
            left++;
            continue;
        }
        const float *a = (const float *)(intptr_t)c->a_ptrs[k];
        const float *bt = (const float *)(intptr_t)c->bt_ptrs[k];
        float scale = c->scales[k];
        for (int64_t n = start; n < end; n += BLOCK) {
            int nb = end - n < BLOCK ? (int)(end - n) : BLOCK;
            for (int b = 0; b < nb; b++) {
                int64_t t = c->token_order[n + b];
                xs[b] = c->x + t * c->x_stride;
                ys[b] = c->y + t * c->y_stride;
            }
            shrink(xs, nb, a, r, c->in, h, bt, c->out);
            for (int b = 0; b < nb; b++)
                for (int64_t j = 0; j < r; j++) h[b][j] *= scale;
            /* next: this segment's A again, or the next segment this range does */
            const float *next = n + BLOCK < end ? a : next_a(s, hi, c->seg_slots, c->seg_bounds,
                                                              c->max_len, c->a_ptrs, c->ranks);
            expand(ys, nb, bt, r, c->out, h, next, c->in);
        }
    }
    return left;
}

/* ---- Threads ---------------------------------------------------------------------------------
 *
 * With tens of adapters in a step the kernel streams their weights from memory, and one core
 * draws about half of what two do, while the step's other cores wait for it. So a call with
 * enough work splits its segments (each writes only its own tokens' rows of y) into ranges of
 * about equal weight bytes, one per thread of an OpenMP team. Built with -fopenmp, the library
 * needs libgomp.so.1, which torch has loaded already: the team is torch's own, whose threads
 * are spinning or sleeping on the step's cores (a pool of its own would fight them for those
 * cores). Without OpenMP the kernel runs on the calling thread.
 */
#ifdef _OPENMP
#include <omp.h>
#endif

#define MAX_THREADS 16
/* below this many weight bytes a call stays on one thread: a team costs more */
#define MIN_SPLIT_BYTES (256 << 10)

/* Split the call's segments into at most `threads` ranges of about equal weight bytes;
 * returns the number of ranges (1: not worth splitting). */
static int split(const struct call *c, int threads, int64_t *bounds) {
    int64_t total = 0;
    for (int64_t s = 0; s < c->num_segs; s++) {
        int64_t r = c->ranks[c->seg_slots[s]], len = c->seg_bounds[s + 1] - c->seg_bounds[s];
        if (r > 0 && len <= c->max_len) total += r * (c->in + c->out);
    }
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 2 || c->num_segs < 2 || total * (int64_t)sizeof(float) < MIN_SPLIT_BYTES)
        return 1;
    int n = 0;
    int64_t acc = 0;
    bounds[0] = 0;
    for (int64_t s = 0; s < c->num_segs && n + 1 < threads; s++) {
        int64_t r = c->ranks[c->seg_slots[s]], len = c->seg_bounds[s + 1] - c->seg_bounds[s];
        if (r > 0 && len <= c->max_len) acc += r * (c->in + c->out);
        if (acc * threads >= total * (n + 1)) bounds[++n] = s + 1;
    }
    if (bounds[n] < c->num_segs) bounds[++n] = c->num_segs;
    return n;
}

/* Returns how many segments it left for being longer than max_len (0: it did them all), or
 * -1 when a slot's rank exceeds MAX_RANK (nothing is written then). `threads`: at most this
 * many threads work on the call (the caller's included). */
int loraplane_sgmv_f32(const float *x, int64_t x_stride, float *y, int64_t y_stride,
                       int64_t in, int64_t out, const int64_t *token_order,
                       const int32_t *seg_slots, const int32_t *seg_bounds, int64_t num_segs,
                       int64_t max_len, const int64_t *slot_table, int64_t num_slots,
                       const float *scales, int64_t threads) {
    /* slot_table: [3, num_slots]: A pointers, B^T pointers, ranks (0: not adapted) */
    struct call c = {x, scales, y, x_stride, y_stride, in, out, num_segs, max_len, token_order,
                     slot_table, slot_table + num_slots, slot_table + 2 * num_slots,
                     seg_slots, seg_bounds};
    for (int64_t s = 0; s < num_segs; s++)
        if (c.ranks[seg_slots[s]] > MAX_RANK) return -1;
    int64_t bounds[MAX_THREADS + 1];
    int n = split(&c, (int)threads, bounds);
    if (n < 2) return run_segments(&c, 0, num_segs);
    int left = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(n) schedule(static, 1) reduction(+ : left)
#endif
    for (int i = 0; i < n; i++) left += run_segments(&c, bounds[i], bounds[i + 1]);
    return left;
}

/* ---- The loader's conversion: an adapter's tensors into one fp32 buffer ---------------------
 *
 * `LoRAPool.host_form` on a CPU fp32 pool: every A and B of an adapter, from the file's dtype
 * (fp16, bf16 or fp32) into `dst`, back to back, each B transposed where the pool holds it so.
 * One call instead of two torch operations per tensor: a loader thread holds the GIL for a few
 * microseconds per adapter, not once per tensor (with two loader threads those hand-overs
 * serialised the loads, and took the GIL from the engine's step).
 */

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else { /* subnormal: normalise */
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400u));
            bits = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, nan (payload kept) */
    } else {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* n elements of type `dtype` at `src` -> n floats at `dst` */
static void to_f32(const void *src, int dtype, float *dst, int64_t n) {
    if (dtype == DT_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (dtype == DT_F16) {
        const uint16_t *h = (const uint16_t *)src;
        int64_t i = 0;
#ifdef HAVE_F16C
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
        for (; i < n; i++) dst[i] = half_to_float(h[i]);
    } else {
        const uint16_t *h = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) {
            uint32_t bits = (uint32_t)h[i] << 16;
            memcpy(dst + i, &bits, sizeof bits);
        }
    }
}

/* Transposed copies go TILE x TILE at a time: a [rows, cols] source read a row of TILE at a
 * time, written to the [cols, rows] destination a TILE-float run (a 64-byte line) at a time.
 * Element by element, B's columns would be written a row apart, every write to another page
 * and to the same cache set. */
#define TILE 16

static void transpose_to_f32(const char *src, int dtype, int64_t size, int64_t rows,
                             int64_t cols, float *out) {
    float tile[TILE][TILE];
    for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
        int64_t nr = rows - r0 < TILE ? rows - r0 : TILE;
        for (int64_t c0 = 0; c0 < cols; c0 += TILE) {
            int64_t nc = cols - c0 < TILE ? cols - c0 : TILE;
            for (int64_t r = 0; r < nr; r++)
                to_f32(src + ((r0 + r) * cols + c0) * size, dtype, tile[r], nc);
            for (int64_t c = 0; c < nc; c++) {
                float *dst = out + (c0 + c) * rows + r0;
                for (int64_t r = 0; r < nr; r++) dst[r] = tile[r][c];
            }
        }
    }
}

/* table: n rows of (source address, dtype, rows, cols, transpose, offset in dst): a dense
 * [rows, cols] source goes to dst + offset as [rows, cols], or as [cols, rows] when transpose.
 * Returns 0, or -1 for a dtype it does not know (nothing is written then). */
int loraplane_host_form_f32(const int64_t *table, int64_t n, float *dst) {
    for (int64_t k = 0; k < n; k++) {
        int64_t dtype = table[6 * k + 1];
        if (dtype != DT_F32 && dtype != DT_F16 && dtype != DT_BF16) return -1;
    }
    for (int64_t k = 0; k < n; k++) {
        const int64_t *e = table + 6 * k;
        const char *src = (const char *)(intptr_t)e[0];
        int dtype = (int)e[1];
        int64_t rows = e[2], cols = e[3], size = dtype == DT_F32 ? 4 : 2;
        if (e[4])
            transpose_to_f32(src, dtype, size, rows, cols, dst + e[5]);
        else
            to_f32(src, dtype, dst + e[5], rows * cols);
    }
    return 0;
}

/* ---- Paged decode attention: one query token per sequence ----------------------------------
 *
 * `attention.torch_attention`'s single-token queries (kernels/attention_cpu.py): for each
 * sequence b and query head h, over the keys j it sees (0 <= j < ctx_b; with a sliding window
 * w, j > ctx_b - 1 - w), read in place from the paged cache through block_tables[b]:
 *     s_j = scale * q[rows_b, h] . K[j, h / group]   (softcap c > 0: s_j = c * tanh(s_j / c))
 *     out[rows_b, h] = sum_j softmax(s)_j V[j, h / group]
 * The torch path gathers every sequence's blocks into a padded copy, masks the padding and
 * calls SDPA: a copy of all K and V per layer and step, which on a decode step of tens of
 * sequences cost more than the attention itself. Here the group = heads / kv_heads query heads
 * of one KV head share each key's read; one task per (sequence, KV head), split over the
 * caller's thread team. All fp32: q [T, heads, dim] rows `q_stride` floats apart, the caches
 * dense [num_blocks, block_size, kv_heads, dim], out like q. Returns 0, or -1 when memory for
 * the scores could not be had (out is then incomplete: the caller runs the torch path).
 */
#include <math.h>
#include <stdlib.h>

static void attend_one(const float *q, const float *k_cache, const float *v_cache,
                       const int32_t *table, int64_t ctx, int64_t first, int64_t block_size,
                       int64_t kv_row, int64_t kh, int64_t group, int64_t dim, float scale,
                       float softcap, float *scores, float *out) {
    int64_t n_keys = ctx - first, block_floats = block_size * kv_row;
    for (int64_t j = first; j < ctx; j++) {
        const float *k = k_cache + (int64_t)table[j / block_size] * block_floats +
                         (j % block_size) * kv_row + kh * dim;
        for (int64_t g = 0; g < group; g++) {
            const float *qg = q + g * dim;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int64_t i = 0; i < dim; i++) s += qg[i] * k[i];
            s *= scale;
            if (softcap > 0.0f) s = softcap * tanhf(s / softcap);
            scores[g * n_keys + (j - first)] = s;
        }
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * n_keys, top = sg[0], sum = 0.0f;
        for (int64_t j = 1; j < n_keys; j++)
            if (sg[j] > top) top = sg[j];
        for (int64_t j = 0; j < n_keys; j++) {
            sg[j] = expf(sg[j] - top);
            sum += sg[j];
        }
        float inv = 1.0f / sum;
        for (int64_t j = 0; j < n_keys; j++) sg[j] *= inv;
        memset(out + g * dim, 0, (size_t)dim * sizeof(float));
    }
    for (int64_t j = first; j < ctx; j++) {
        const float *v = v_cache + (int64_t)table[j / block_size] * block_floats +
                         (j % block_size) * kv_row + kh * dim;
        for (int64_t g = 0; g < group; g++) {
            float p = scores[g * n_keys + (j - first)], *o = out + g * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) o[i] += p * v[i];
        }
    }
}

int loraplane_decode_attention_f32(const float *q, int64_t q_stride, const float *k_cache,
                                   const float *v_cache, int64_t block_size,
                                   const int32_t *block_tables, int64_t table_stride,
                                   const int32_t *context_lens, const int64_t *rows,
                                   int64_t num_seqs, int64_t heads, int64_t kv_heads, int64_t dim,
                                   float scale, float softcap, int64_t window, float *out,
                                   int64_t out_stride, int64_t threads) {
    int64_t group = heads / kv_heads, tasks = num_seqs * kv_heads, kv_row = kv_heads * dim;
    int n = (int)(threads < 1 ? 1 : (threads > MAX_THREADS ? MAX_THREADS : threads));
    if (tasks < 2) n = 1;
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(n) schedule(static) reduction(| : failed) if (n > 1)
#endif
    for (int64_t t = 0; t < tasks; t++) {
        int64_t b = t / kv_heads, kh = t % kv_heads, ctx = context_lens[b];
        int64_t first = (window > 0 && ctx > window) ? ctx - window : 0;
        float *scores = (float *)malloc((size_t)(group * (ctx - first)) * sizeof(float));
        if (scores == NULL) {
            failed |= 1;
            continue;
        }
        attend_one(q + rows[b] * q_stride + kh * group * dim, k_cache, v_cache,
                   block_tables + b * table_stride, ctx, first, block_size, kv_row, kh, group,
                   dim, scale, softcap, scores, out + rows[b] * out_stride + kh * group * dim);
        free(scores);
    }
    return failed ? -1 : 0;
}

/* ---- A decoder layer's glue: RMSNorm after the residual's add, and RoPE ---------------------
 *
 * In a decode step of a small model these tensors are a few rows, and torch spends more on
 * dispatching each of its operations than on the arithmetic: RMSNorm is seven operations (its
 * CPU kernel is a composite), rotate-half RoPE five per tensor, each a few microseconds, for
 * every layer of every step. One call each here, fp32, rows `*_stride` floats apart. The
 * arithmetic is torch's (fp32 throughout, the same order of the products); only the order of
 * the sum of squares differs, so results agree to rounding, not bit for bit.
 */

/* below this many floats a call stays on the calling thread: a team costs more */
#define GLUE_SPLIT_FLOATS (1 << 15)
/* each product rounded on its own, as torch's separate operations round them (GCC contracts
 * a * b - c * d into a fused multiply-add otherwise) */
#if defined(__GNUC__) && !defined(__clang__)
#define TORCH_ROUNDING __attribute__((optimize("fp-contract=off")))
#else
#define TORCH_ROUNDING
#endif

static int glue_threads(int64_t threads, int64_t floats) {
    if (floats < GLUE_SPLIT_FLOATS || threads < 2) return 1;
    return (int)(threads > MAX_THREADS ? MAX_THREADS : threads);
}

/* Per row t: h[t] += res[t] when res is not NULL (h then holds the residual stream's sum);
 * out[t] = h[t] * (1 / sqrt(mean(h[t]^2) + eps)) * w. out may not alias h. */
TORCH_ROUNDING void loraplane_rms_norm_f32(float *h, int64_t h_stride, const float *res,
                                           int64_t res_stride, const float *w, float *out,
                                           int64_t out_stride, int64_t rows, int64_t dim,
                                           float eps, int64_t threads) {
    int n = glue_threads(threads, rows * dim);
    (void)n;
#ifdef _OPENMP
#pragma omp parallel for num_threads(n) schedule(static) if (n > 1)
#endif
    for (int64_t t = 0; t < rows; t++) {
        float *x = h + t * h_stride, *o = out + t * out_stride;
        if (res != NULL) {
            const float *r = res + t * res_stride;
#pragma omp simd
            for (int64_t i = 0; i < dim; i++) x[i] += r[i];
        }
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < dim; i++) s += x[i] * x[i];
        float inv = 1.0f / sqrtf(s / (float)dim + eps);
#pragma omp simd
        for (int64_t i = 0; i < dim; i++) o[i] = (x[i] * inv) * w[i];
    }
}

/* Rotate-half ("neox") RoPE in place on the first `rot` dims of each head of x [rows, heads,
 * head_dim] (heads `head_dim` apart, rows `stride` apart): for i < rot / 2,
 *     x_i <- x_i cos_i - x_{i+half} sin_i,   x_{i+half} <- x_{i+half} cos_{i+half} + x_i sin_{i+half}
 * with cos, sin [rows, rot] dense. */
TORCH_ROUNDING static void rope_rows(float *x, int64_t stride, int64_t heads, int64_t head_dim,
                      const float *cos_t, const float *sin_t, int64_t rot, int64_t lo,
                      int64_t hi) {
    int64_t half = rot / 2;
    for (int64_t t = lo; t < hi; t++) {
        const float *c = cos_t + t * rot, *s = sin_t + t * rot;
        for (int64_t hd = 0; hd < heads; hd++) {
            float *v = x + t * stride + hd * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                float a_c = a * c[i], b_s = b * s[i], b_c = b * c[i + half], a_s = a * s[i + half];
                v[i] = a_c - b_s;
                v[i + half] = b_c + a_s;
            }
        }
    }
}

void loraplane_rope_f32(float *q, int64_t q_stride, int64_t q_heads, float *k, int64_t k_stride,
                        int64_t k_heads, int64_t head_dim, const float *cos_t,
                        const float *sin_t, int64_t rot, int64_t rows, int64_t threads) {
    int n = glue_threads(threads, rows * (q_heads + k_heads) * rot);
    if (n < 2) {
        rope_rows(q, q_stride, q_heads, head_dim, cos_t, sin_t, rot, 0, rows);
        rope_rows(k, k_stride, k_heads, head_dim, cos_t, sin_t, rot, 0, rows);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads(n) schedule(static)
#endif
    for (int i = 0; i < n; i++) {
        int64_t lo = rows * i / n, hi = rows * (i + 1) / n;
        rope_rows(q, q_stride, q_heads, head_dim, cos_t, sin_t, rot, lo, hi);
        rope_rows(k, k_stride, k_heads, head_dim, cos_t, sin_t, rot, lo, hi);
    }
}

/* ---- a linear over a decode step's few rows: y = x W^T (+ bias), fp32 ----
 *
 * For T rows (a decode step: one per sequence) torch's BLAS call streams W [out, in] from
 * memory and shares it out poorly among threads at this size (kernels/cpu_linear.py). Here
 * each thread takes a contiguous band of W's rows; a tile of RO rows of W against RT rows of
 * x keeps RO x RT vector accumulators in registers over `in`, so W is read from memory once
 * and x (a few KiB a row) from cache. Every output element is one dot product summed in the
 * same order whatever the tile, band, thread count or number of rows around it: a row's
 * result does not depend on which other rows share its step. */

#if defined(__AVX512F__)
#define LIN_VW 16
#define LIN_RO 8
#define LIN_RT 3
#elif defined(__AVX__)
/* 3 x 4: 12 accumulators, 3 of W and one x vector at a time fill the 16 registers (0.83x the
 * time of 4 x 2 against torch's at 32 rows and 0.9x at 8, paired on an AVX2 EPYC). LIN_PIN
 * holds them there (lin_tile); LIN_PREFETCH fetches the next tile's W ahead. */
#define LIN_VW 8
#define LIN_RO 3
#define LIN_RT 4
#define LIN_PIN 1
#define LIN_PREFETCH 1
#else
#define LIN_VW 4
#define LIN_RO 4
#define LIN_RT 2
#endif
/* below this many multiply-adds a call stays on the calling thread */
#define LIN_SPLIT_MACS (1 << 16)

typedef float lin_vf __attribute__((vector_size(LIN_VW * sizeof(float))));

static inline lin_vf lin_load(const float *p) {
    lin_vf v;
    memcpy(&v, p, sizeof v); /* an unaligned vector load */
    return v;
}

/* the sum of a vector's lanes: halves folded onto each other, as shuffles where the compiler
 * has them (GCC 12 and clang), else through memory */
static inline float lin_hsum(lin_vf v) {
#if defined(__has_builtin)
#if __has_builtin(__builtin_shufflevector)
#define LIN_SHUFFLE 1
#endif
#endif
#if defined(LIN_SHUFFLE) && LIN_VW == 16
    v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2, 1, 0, 3, 2);
    return v[0];
#elif defined(LIN_SHUFFLE) && LIN_VW == 8
    v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 2, 3, 0, 1);
    v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 1, 0, 3, 2);
    return v[0];
#else
    float a[LIN_VW];
    memcpy(a, &v, sizeof a);
    for (int w = LIN_VW / 2; w > 0; w /= 2)
        for (int i = 0; i < w; i++) a[i] += a[i + w];
    return a[0];
#endif
}

/* Keep a vector in a register: the compiler may not fold its load into the multiply-adds that
 * use it. Without this GCC 12 kept one W vector in a register and read x from memory for each
 * of its 12 multiply-adds, 15 loads an iteration where 7 do, and x (32 rows of 576 floats,
 * 72 KiB) comes from L2: on the AVX2 EPYC one core's in-cache rate at 32 rows went from 56 to
 * 76-79 GFLOP/s with it, the same dot products summed in the same order. */
#ifdef LIN_PIN
#define lin_pin(v) __asm__("" : "+x"(v))
#else
#define lin_pin(v) ((void)0)
#endif

/* y[j][i] = sum_q w[i][q] x[j][q] (+ bias[i]) for i < no, j < nt; both compile-time constants
 * where this is inlined. `ahead` (or NULL): the next tile's W rows, fetched into cache while
 * this tile computes (the caller passes it for one tile of x rows in a band's pass) */
static inline __attribute__((always_inline)) void lin_tile(const float *x, int64_t xs,
                                                           const float *w, int64_t in,
                                                           const float *bias, float *y,
                                                           int64_t ys, const int no,
                                                           const int nt, const float *ahead) {
    lin_vf acc[LIN_RO][LIN_RT];
    for (int i = 0; i < no; i++)
        for (int j = 0; j < nt; j++) acc[i][j] = (lin_vf){0};
    int64_t q = 0;
    for (; q + LIN_VW <= in; q += LIN_VW) {
#ifdef LIN_PREFETCH
        if (ahead != NULL && q % 16 == 0) /* one 64-byte line of each row per 16 floats */
            for (int i = 0; i < no; i++) __builtin_prefetch(ahead + i * in + q, 0, 3);
#else
        (void)ahead;
#endif
        lin_vf wv[LIN_RO];
        for (int i = 0; i < no; i++) {
            wv[i] = lin_load(w + i * in + q);
            lin_pin(wv[i]);
        }
        for (int j = 0; j < nt; j++) {
            lin_vf xv = lin_load(x + j * xs + q);
            lin_pin(xv);
            for (int i = 0; i < no; i++) acc[i][j] += wv[i] * xv;
        }
    }
    for (int i = 0; i < no; i++)
        for (int j = 0; j < nt; j++) {
            float s = lin_hsum(acc[i][j]);
            for (int64_t r = q; r < in; r++) s += w[i * in + r] * x[j * xs + r];
            y[j * ys + i] = bias != NULL ? s + bias[i] : s;
        }
}

/* every row of x against `no` rows of W; `ahead` (or NULL): the band's next W rows, fetched
 * during the first tile of x rows so that the next lin_rows reads them from cache, not memory
 * (at 8 rows on the AVX2 EPYC, 30 layers of the SmolLM-135M shape's linears, 2 threads:
 * 63-65 -> 74-80 GFLOP/s) */
static inline __attribute__((always_inline)) void lin_rows(const float *x, int64_t xs,
                                                           int64_t rows, const float *w,
                                                           int64_t in, const float *bias,
                                                           float *y, int64_t ys, const int no,
                                                           const float *ahead) {
    int64_t j = 0;
    for (; j + LIN_RT <= rows; j += LIN_RT) {
        lin_tile(x + j * xs, xs, w, in, bias, y + j * ys, ys, no, LIN_RT, ahead);
        ahead = NULL;
    }
    switch (rows - j) {
    case 0:
        break;
#if LIN_RT > 3
    case 3:
        lin_tile(x + j * xs, xs, w, in, bias, y + j * ys, ys, no, 3, ahead);
        break;
#endif
#if LIN_RT > 2
    case 2:
        lin_tile(x + j * xs, xs, w, in, bias, y + j * ys, ys, no, 2, ahead);
        break;
#endif
    default: /* 1 */
        lin_tile(x + j * xs, xs, w, in, bias, y + j * ys, ys, no, 1, ahead);
    }
}

static void lin_band(const float *x, int64_t xs, int64_t rows, const float *w, int64_t in,
                     const float *bias, float *y, int64_t ys, int64_t lo, int64_t hi) {
    int64_t i = lo;
    for (; i + LIN_RO <= hi; i += LIN_RO)
        lin_rows(x, xs, rows, w + i * in, in, bias != NULL ? bias + i : NULL, y + i, ys, LIN_RO,
                 i + 2 * LIN_RO <= hi ? w + (i + LIN_RO) * in : NULL); /* a whole next tile */
    for (; i < hi; i++)
        lin_rows(x, xs, rows, w + i * in, in, bias != NULL ? bias + i : NULL, y + i, ys, 1,
                 i + 1 < hi ? w + (i + 1) * in : NULL);
}

/* y [rows, out] (rows y_stride apart) = x [rows, in] (rows x_stride apart) W^T + bias, W a
 * dense [out, in], bias [out] or NULL; threads split W's rows in bands of LIN_RO */
void loraplane_linear_f32(const float *x, int64_t x_stride, const float *w, const float *bias,
                          float *y, int64_t y_stride, int64_t rows, int64_t in, int64_t out,
                          int64_t threads) {
    int64_t blocks = (out + LIN_RO - 1) / LIN_RO;
    int64_t n = threads < MAX_THREADS ? threads : MAX_THREADS;
    if (n > blocks) n = blocks;
    if (n < 2 || rows * in * out < LIN_SPLIT_MACS) {
        lin_band(x, x_stride, rows, w, in, bias, y, y_stride, 0, out);
        return;
    }
#ifdef _OPENMP
#pragma omp parallel for num_threads((int)n) schedule(static)
#endif
    for (int64_t p = 0; p < n; p++) {
        int64_t lo = blocks * p / n * LIN_RO, hi = blocks * (p + 1) / n * LIN_RO;
        if (hi > out) hi = out;
        if (lo < hi) lin_band(x, x_stride, rows, w, in, bias, y, y_stride, lo, hi);
    }
}

/* the lanes of the linear's vectors in this build (16: AVX-512, 8: AVX/AVX2, 4: otherwise):
 * the caller keeps torch's BLAS where the build is too narrow to beat it */
int64_t loraplane_linear_lanes(void) { return LIN_VW; }

/* ---- A LoRA layer's whole decode call: the base linear, then its adapters -------------------
 *
 * What `LinearWithLoRA` does on the CPU in two calls (`loraplane_linear_f32`, then
 * `loraplane_sgmv_f32`), in one: the same two computations in the same order, so y is the same
 * to the bit. The caller keeps the arguments that do not change between calls in three small
 * int64 arrays, so a call converts 8 arguments, not 26 (ctypes converts each one):
 *   linear [4]: W, bias (0: none), in, out (cpu_linear.py)
 *   slots  [3]: the slot table [3, num_slots], num_slots, the scales [num_slots] (sgmv_cpu.py)
 *   step   [5]: token order, segment slots, segment bounds, segments, max_len (sgmv_cpu.py)
 * slots or step NULL: the linear alone. y is a dense [rows, out]. Returns what
 * `loraplane_sgmv_f32` does (0 for the linear alone). */
enum { LL_W, LL_BIAS, LL_IN, LL_OUT };
enum { LS_TABLE, LS_SLOTS, LS_SCALES };
enum { LT_ORDER, LT_SEG_SLOTS, LT_BOUNDS, LT_SEGS, LT_MAX_LEN };

int loraplane_linear_lora_f32(const float *x, int64_t x_stride, float *y, int64_t rows,
                              int64_t threads, const int64_t *linear, const int64_t *slots,
                              const int64_t *step) {
    int64_t in = linear[LL_IN], out = linear[LL_OUT];
    loraplane_linear_f32(x, x_stride, (const float *)(intptr_t)linear[LL_W],
                         (const float *)(intptr_t)linear[LL_BIAS], y, out, rows, in, out,
                         threads);
    if (slots == NULL || step == NULL || step[LT_SEGS] == 0) return 0;
    return loraplane_sgmv_f32(x, x_stride, y, out, in, out,
                              (const int64_t *)(intptr_t)step[LT_ORDER],
                              (const int32_t *)(intptr_t)step[LT_SEG_SLOTS],
                              (const int32_t *)(intptr_t)step[LT_BOUNDS], step[LT_SEGS],
                              step[LT_MAX_LEN], (const int64_t *)(intptr_t)slots[LS_TABLE],
                              slots[LS_SLOTS], (const float *)(intptr_t)slots[LS_SCALES],
                              threads);
}
