/* specscope's CPU layer kernels: the work between a decoder layer's matmuls, one call each.
 *
 * A 135M-parameter model's decode step on two CPU cores spends most of its time in the
 * framework between its matmuls (tens of ATen calls a layer at 1-10 us each: docs/cpu.md).
 * These kernels do that work in four calls a layer: RMSNorm (with the residual add before
 * it), silu(gate) * up, and q/k norms + rotary + the paged KV write + attention over the
 * paged cache. Built on the user's machine by specscope/native/__init__.py; the torch code
 * in models/ and kvcache/ is their reference and runs wherever they do not.
 *
 * Numerics follow the torch reference: 16-bit activations are rounded to bf16 (round to
 * nearest even) wherever the reference rounds (after each elementwise op it runs in bf16),
 * reductions and the softmax run in fp32. Each row's result depends on that row alone
 * (never on how many rows share the call), so a token's logits are the same in a decode
 * step and in a verify.
 *
 * dtype codes: 0 = float32, 1 = bfloat16 (activations, weights of the norms, the cache).
 * Head dims are multiples of 8 (the attention's vectors).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#ifdef _OPENMP
#include <omp.h>
#endif

/* Rows from which the row-wise kernels (norms, silu-mul) share them among the threads: from
 * a verify's or a batched step's few rows on (the decoder's forward of 8 sequences' tokens
 * or of a 6-token verify 3 % faster than with 32), not one decode token's. */
#define PARALLEL_ROWS 4

/* x rounded as the activation dtype holds it. */
static inline float rnd(float x, int bf16) {
    return bf16 ? bf16_to_f32(f32_to_bf16(x)) : x;
}

static inline float load(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store(void *p, int64_t i, float x, int bf16) {
    if (bf16) ((uint16_t *)p)[i] = f32_to_bf16(x);
    else ((float *)p)[i] = x;
}

/* n values from p (offset i) into dst as fp32. */
static void load_row(float *dst, const void *p, int64_t i, int64_t n, int bf16) {
    if (bf16) {
        const uint16_t *s = (const uint16_t *)p + i;
        for (int64_t d = 0; d < n; d++) dst[d] = bf16_to_f32(s[d]);
    } else {
        memcpy(dst, (const float *)p + i, (size_t)n * sizeof(float));
    }
}

/* Eight floats in one vector (GCC and clang vector extensions): AVX2's register width, half
 * of AVX-512's, two of NEON's; the compiler picks the instructions. */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline v8f ld8(const float *p) { v8f v; memcpy(&v, p, sizeof v); return v; }
static inline void st8(float *p, v8f v) { memcpy(p, &v, sizeof v); }
static inline v8f splat(float x) { return (v8f){x, x, x, x, x, x, x, x}; }

/* The lanes added pairwise in a fixed order. */
static inline float hsum8(v8f v) {
    return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
}

/* r[k] = hsum8(a[k]) for eight vectors at once, in hsum8's order (so a score is the same
 * whichever way it was reduced): pairs, then quads, then halves, by shuffles where the
 * compiler has them. */
static inline v8f hsum8x8(const v8f *a) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define EVEN(x, y) __builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14)
#define ODD(x, y) __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15)
#define LO2(x, y) __builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13)
#define HI2(x, y) __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15)
    v8f b[4], c[2];
    for (int i = 0; i < 4; i++) b[i] = EVEN(a[2 * i], a[2 * i + 1]) + ODD(a[2 * i], a[2 * i + 1]);
    for (int i = 0; i < 2; i++) c[i] = LO2(b[2 * i], b[2 * i + 1]) + HI2(b[2 * i], b[2 * i + 1]);
    return __builtin_shufflevector(c[0], c[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + __builtin_shufflevector(c[0], c[1], 4, 5, 6, 7, 12, 13, 14, 15);
#undef EVEN
#undef ODD
#undef LO2
#undef HI2
#else
    v8f r;
    for (int k = 0; k < 8; k++) r[k] = hsum8(a[k]);
    return r;
#endif
}

/* a * b + c as a product, then a sum (two roundings, not fused): the attention's sums keep
 * the order and the roundings the kernels have always had, so its outputs (and a greedy
 * text) stay what they were. A fused form measured faster but moves outputs by a rounding
 * (docs/cpu.md). */
static inline v8f madd8(v8f a, v8f b, v8f c) { return a * b + c; }

#if defined(__AVX512F__)
#include <immintrin.h>
/* Sixteen floats: one AVX-512 register. Lane l of a 16-lane sum over a row is lane l % 8 of
 * one of the two 8-lane sums the narrower builds keep (score_lanes, rows_values), so both
 * widths give the same bits. */
typedef float v16f __attribute__((vector_size(64)));
static inline v16f ld16(const float *p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void st16(float *p, v16f v) { memcpy(p, &v, sizeof v); }
static inline v16f splat16(float x) {
    return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}
static inline v16f madd16(v16f a, v16f b, v16f c) { return a * b + c; }
#endif

static inline v8f max8(v8f a, v8f b) {
    v8i m = a > b;
    union { v8f f; v8i i; } x = {a}, y = {b}, r;
    r.i = (x.i & m) | (y.i & ~m);
    return r.f;
}

/* exp(x) for x <= 0, eight at a time, to about 2 ulp: Cody-Waite reduction by n =
 * round(x / ln 2) (for y <= 0, floor(y + 1/2) = -trunc(1/2 - y)), Cephes' polynomial. */
static inline v8f exp8_neg(v8f x) {
    x = max8(x, splat(-87.0f));
    v8f y = x * 1.44269504088896341f;
    v8i ni = -__builtin_convertvector(0.5f - y, v8i);
    v8f n = __builtin_convertvector(ni, v8f);
    v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8f p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { v8i i; v8f f; } s;
    s.i = (ni + 127) << 23;
    return p * s.f;
}

/* The same for one value (the tails of rows whose length is not a multiple of 8). */
static inline float exp_neg(float x) {
    v8f v = exp8_neg(splat(x));
    return v[0];
}

/* The lanes of a product a . b (n % 8 == 0) before their final sum: two accumulators. */
static inline __attribute__((always_inline)) v8f dot_lanes(const float *a, const float *b,
                                                           int64_t n) {
    v8f acc0 = splat(0.0f), acc1 = splat(0.0f);
    int64_t d = 0;
    for (; d + 16 <= n; d += 16) {
        acc0 += ld8(a + d) * ld8(b + d);
        acc1 += ld8(a + d + 8) * ld8(b + d + 8);
    }
    if (d < n) acc0 += ld8(a + d) * ld8(b + d);
    return acc0 + acc1;
}

/* Sum of a[d] * b[d] in a fixed order: dot_lanes over the whole vectors, then the rest. */
static inline __attribute__((always_inline)) float dot(const float *a, const float *b,
                                                       int64_t n) {
    int64_t whole = n - n % 8;
    float s = hsum8(dot_lanes(a, b, whole));
    for (int64_t d = whole; d < n; d++) s += a[d] * b[d];
    return s;
}

/* The lanes of a query row's score against a key (D % 8 == 0) before their final sum: two
 * 8-lane sums, one over the even 8-float chunks of the row and one over the odd, each
 * summing its products in chunk order, then added (dot_lanes' order); AVX-512 keeps both
 * in one register's halves. */
static inline __attribute__((always_inline)) v8f score_lanes(const float *q, const float *k,
                                                             int64_t D) {
#if defined(__AVX512F__)
    if (D % 16 == 0) {
        v16f acc = ld16(q) * ld16(k);
        for (int64_t d = 16; d < D; d += 16) acc = madd16(ld16(q + d), ld16(k + d), acc);
        __m512 a = (__m512)acc;
        return (v8f)_mm512_castps512_ps256(a) +
               (v8f)_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1));
    }
#endif
    v8f acc0 = ld8(q) * ld8(k), acc1 = splat(0.0f);
    int64_t d = 8;
    if (D >= 16) {
        acc1 = ld8(q + 8) * ld8(k + 8);
        d = 16;
    }
    for (; d + 16 <= D; d += 16) {
        acc0 = madd8(ld8(q + d), ld8(k + d), acc0);
        acc1 = madd8(ld8(q + d + 8), ld8(k + d + 8), acc1);
    }
    if (d < D) acc0 = madd8(ld8(q + d), ld8(k + d), acc0);
    return acc0 + acc1;
}

/* Sum of a[0..n) in a fixed order, as dot. */
static inline float lane_sum(const float *a, int64_t n) {
    v8f acc = splat(0.0f);
    int64_t d = 0;
    for (; d + 8 <= n; d += 8) acc += ld8(a + d);
    float s = hsum8(acc);
    for (; d < n; d++) s += a[d];
    return s;
}

/* a[0..n) = exp(a - mx), in place; returns their sum. */
static float exp_shifted(float *a, int64_t n, float mx) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) st8(a + j, exp8_neg(ld8(a + j) - mx));
    for (; j < n; j++) a[j] = exp_neg(a[j] - mx);
    return lane_sum(a, n);
}

/* The probability softmax gives column `best` of row `row` of x [M, n] (fp32 or bf16), the
 * row's largest: 1 / sum_i exp(x_i - x_best). A draft step's confidence in its greedy
 * pick; NaN where the row holds a NaN (argmax_row's pick then), 1 for an infinite top. */
float sc_top_prob(const void *x, int64_t row, int64_t n, int64_t best, int bf16) {
    const float *f = (const float *)x + row * n;
    const uint16_t *h = (const uint16_t *)x + row * n;
    float mx = bf16 ? bf16_to_f32(h[best]) : f[best], buf[8];
    if (mx != mx) return mx;  /* argmax_row picks a NaN wherever a row holds one */
    if (isinf(mx)) return 1.0f;
    v8f acc = splat(0.0f);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        for (int l = 0; l < 8; l++) buf[l] = bf16 ? bf16_to_f32(h[j + l]) : f[j + l];
        acc += exp8_neg(ld8(buf) - mx);
    }
    float sum = hsum8(acc);
    for (; j < n; j++) sum += exp_neg((bf16 ? bf16_to_f32(h[j]) : f[j]) - mx);
    return 1.0f / sum;
}

static float row_max(const float *a, int64_t n) {
    v8f m = splat(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) m = max8(m, ld8(a + j));
    float mx = -INFINITY;
    for (int l = 0; l < 8; l++) mx = m[l] > mx ? m[l] : mx;
    for (; j < n; j++) mx = a[j] > mx ? a[j] : mx;
    return mx;
}

static inline float sum_squares(const float *a, int64_t n) {
    return dot(a, a, n);
}

/* One row x [D] (fp32, in the activation's precision) normed in place: x = w * rnd(x *
 * rsqrt(mean(x^2) + eps)), rounded as the activation dtype holds it (HF's RMSNorm: the
 * normalised row is cast back before the weight multiplies it). The layer norms and
 * Qwen3's per-head q/k norms alike. */
static void norm_row(float *x, const void *w, int64_t D, float eps, int bf16) {
    float inv = 1.0f / sqrtf(sum_squares(x, D) / (float)D + eps);
    for (int64_t d = 0; d < D; d++) x[d] = rnd(load(w, d, bf16) * rnd(x[d] * inv, bf16), bf16);
}

/* x [N, D] (+ residual [N, D] into h [N, D], rounded) -> out [N, D]. residual may be NULL
 * (then h is not written). */
void sc_rms_norm(const void *x, const void *residual, const void *w, void *out, void *h,
                 int64_t N, int64_t D, float eps, int bf16) {
#pragma omp parallel if (N >= PARALLEL_ROWS)
    {
        float *row = (float *)malloc((size_t)D * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N; i++) {
            if (!row) continue;
            int64_t o = i * D;
            for (int64_t d = 0; d < D; d++) {
                float v = load(x, o + d, bf16);
                if (residual) {
                    v = rnd(v + load(residual, o + d, bf16), bf16);
                    store(h, o + d, v, bf16);
                }
                row[d] = v;
            }
            norm_row(row, w, D, eps, bf16);
            for (int64_t d = 0; d < D; d++) store(out, o + d, row[d], bf16);
        }
        free(row);
    }
}

/* gate_up [N, 2I] (gate then up) -> out [N, I] = rnd(rnd(silu(gate)) * up). */
void sc_silu_mul(const void *gate_up, void *out, int64_t N, int64_t I, int bf16) {
#pragma omp parallel if (N >= PARALLEL_ROWS)
    {
        float *g = (float *)malloc((size_t)I * sizeof(float));
#pragma omp for schedule(static)
        for (int64_t i = 0; i < N; i++) {
            if (!g) continue;
            load_row(g, gate_up, i * 2 * I, I, bf16);
            /* silu(x) = x / (1 + exp(-x)) = x e / (1 + e) with e = exp(x): exp of -|x| either
             * way, so the argument is never positive. */
            int64_t d = 0;
            for (; d + 8 <= I; d += 8) {
                v8f x = ld8(g + d);
                v8f e = exp8_neg(-max8(x, -x));
                v8f pos = x / (1.0f + e), neg = x * e / (1.0f + e);
                v8i m = x < 0.0f;
                union { v8f f; v8i i; } a = {neg}, b = {pos}, r;
                r.i = (a.i & m) | (b.i & ~m);
                st8(g + d, r.f);
            }
            for (; d < I; d++) {
                float x = g[d], e = exp_neg(x < 0.0f ? x : -x);
                g[d] = x < 0.0f ? x * e / (1.0f + e) : x / (1.0f + e);
            }
            for (int64_t d = 0; d < I; d++)
                store(out, i * I + d, rnd(g[d], bf16) * load(gate_up, i * 2 * I + I + d, bf16),
                      bf16);
        }
        free(g);
    }
}

/* One head row x [D] (fp32, already in the activation's precision) rotated in place:
 * x * cos + rotate_half(x) * sin, each product and the sum rounded as the reference's
 * elementwise ops round them. */
static void rope_row(float *x, const void *cos, const void *sin, int64_t t, int64_t D,
                     float *tmp, int bf16) {
    int64_t half = D / 2;
    for (int64_t d = 0; d < D; d++) {
        float c = load(cos, t * D + d, bf16), s = load(sin, t * D + d, bf16);
        float other = d < half ? -x[d + half] : x[d - half];
        tmp[d] = rnd(rnd(x[d] * c, bf16) + rnd(other * s, bf16), bf16);
    }
    memcpy(x, tmp, (size_t)D * sizeof(float));
}

typedef struct {
    const int64_t *seq_index, *block_tables, *visible, *window_start, *tree_start;
    const uint8_t *tree_mask;
    int64_t max_blocks, block_size, T;
} Meta;

/* Slots of positions [a, b) of block-table row `row`, into out; returns b - a. One
 * division a block, not one a key. */
static int64_t slots_of_range(const Meta *m, int64_t row, int64_t a, int64_t b, int64_t *out) {
    const int64_t *table = m->block_tables + row * m->max_blocks;
    int64_t bs = m->block_size, n = 0;
    for (int64_t p = a; p < b;) {
        int64_t blk = p / bs, off = p - blk * bs, end = (blk + 1) * bs < b ? (blk + 1) * bs : b;
        int64_t base = table[blk] * bs;
        for (int64_t q = off; q < off + (end - p); q++) out[n++] = base + q;
        p = end;
    }
    return n;
}

/* The cache slots token i sees, in position order: its prefix window, then its tree
 * ancestors (and itself) not already in the window. Returns how many. */
static int64_t key_slots(const Meta *m, int64_t i, int64_t *slots) {
    int64_t vis = m->visible[i], ws = m->window_start[i] < 0 ? 0 : m->window_start[i];
    int64_t row = m->seq_index[i];
    int64_t n = ws < vis ? slots_of_range(m, row, ws, vis, slots) : 0;
    for (int64_t t = 0; t < m->T; t++) {
        int64_t p = m->tree_start[i] + t;
        if (m->tree_mask[i * m->T + t] && (p >= vis || p < ws))
            n += slots_of_range(m, row, p, p + 1, slots + n);
    }
    return n;
}

/* One KV head's keys or values in the paged cache: rows at `slots` (in position order),
 * each `row` elements apart, the head's D columns from `off`. */
typedef struct {
    const void *c;
    const int64_t *slots;
    int64_t row, off;
    int bf16;
} Head;

/* Keys a block of attend_piece visits before moving on: the block's K or V rows (8 KB at
 * D = 64) are converted to fp32 into an L1-sized buffer that every row of the piece then
 * uses, so no key is converted or read from the cache twice and no context-sized fp32 copy
 * passes through the caches. A multiple of 8 (row_scores' groups). */
#define KEY_BLOCK 32

/* Rows [j0, j1) of a head into buf [j1 - j0, D] as fp32, the next block's rows fetched
 * ahead meanwhile (the cache's rows of one head are strided: the hardware's prefetch
 * does not see them coming). Fetched into L2, not L1 (locality 1): a fetch into L1 holds
 * one of its few miss buffers until the line comes, so rows fetched ahead would queue
 * behind each other; into L2 many more are in flight (docs/cpu.md). */
static inline void load_block(const Head *h, int64_t j0, int64_t j1, int64_t L, int64_t D,
                              float *buf) {
    size_t es = h->bf16 ? 2 : 4;
    for (int64_t j = j0; j < j1; j++) {
        int64_t ahead = j + KEY_BLOCK;
        if (ahead < L) {
            const char *p = (const char *)h->c + (h->slots[ahead] * h->row + h->off) * es;
            for (size_t b = 0; b < D * es; b += 64) __builtin_prefetch(p + b, 0, 1);
        }
        load_row(buf + (j - j0) * D, h->c, h->slots[j] * h->row + h->off, D, h->bf16);
    }
}

/* Scores of one query row q [D] against keys [j0, j1) (kb: key j0's row of a block, [.., D]),
 * scaled, into s (indexed by key): keys below `whole` (its row's key count rounded down to
 * 8) eight at a time, the rest one by one, as a row of L keys takes them (hsum8x8 sums as
 * hsum8 does, so a score does not depend on which way it was reduced). D is a constant
 * where the callers pass one. */
static inline __attribute__((always_inline)) void row_scores(
        const float *q, int64_t D, const float *kb, int64_t j0, int64_t j1, int64_t whole,
        float scale, float *s) {
    int64_t j = j0;
    for (; j + 8 <= j1 && j + 8 <= whole; j += 8) {
        v8f lanes[8];
        for (int k = 0; k < 8; k++) lanes[k] = score_lanes(q, kb + (j - j0 + k) * D, D);
        st8(s + j, hsum8x8(lanes) * scale);
    }
    for (; j < j1; j++) s[j] = hsum8(score_lanes(q, kb + (j - j0) * D, D)) * scale;
}

/* Rows a value pass carries at once (rows_values): their sums stay in registers with the
 * value row's vectors beside them, 16 registers of sums where AVX-512 has 32; elsewhere one
 * row (AVX2's 16 registers hold one row's 8 sums of D = 64). */
#if defined(__AVX512F__)
#define VALUE_ROWS(D) ((D) == 64 ? 4 : (D) == 128 ? 2 : 1)
#else
#define VALUE_ROWS(D) 1
#endif

/* For R rows r (R <= VALUE_ROWS(D)): o_r [D] += sum over j in [j0, j1) of p_r[j] v_j (p_r =
 * p + r p_stride, o_r = o + r D; vb: value j0's row of a block), each lane summing its
 * products in key order, whatever the width or R; o_r starts from zero at j0 == start. A
 * value row read serves all R rows, and their chains interleave: one row's chain alone
 * waits on its own latency at every key. */
static inline __attribute__((always_inline)) void rows_values(
        const float *vb, const float *p, int64_t p_stride, int R, int64_t j0, int64_t j1,
        int64_t D, float *o, int64_t start) {
#if defined(__AVX512F__)
    if (D == 64 || D == 128) {
        int DC = (int)(D / 16);
        v16f a[4][8], vv[8];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < DC; c++)
                a[r][c] = j0 == start ? splat16(0.0f) : ld16(o + r * D + 16 * c);
        for (int64_t j = j0; j < j1; j++) {
            const float *v = vb + (j - j0) * D;
            for (int c = 0; c < DC; c++) vv[c] = ld16(v + 16 * c);
            for (int r = 0; r < R; r++) {
                v16f pj = splat16(p[r * p_stride + j]);
                for (int c = 0; c < DC; c++) a[r][c] = madd16(pj, vv[c], a[r][c]);
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < DC; c++) st16(o + r * D + 16 * c, a[r][c]);
        return;
    }
#endif
    for (int r = 0; r < R; r++) {
        const float *pr = p + r * p_stride;
        float *orow = o + r * D;
        if (D == 64 || D == 128) {
            int DC = (int)(D / 8);
            v8f a[16];
            for (int c = 0; c < DC; c++) a[c] = j0 == start ? splat(0.0f) : ld8(orow + 8 * c);
            for (int64_t j = j0; j < j1; j++) {
                v8f pj = splat(pr[j]);
                const float *v = vb + (j - j0) * D;
                for (int c = 0; c < DC; c++) a[c] = madd8(pj, ld8(v + 8 * c), a[c]);
            }
            for (int c = 0; c < DC; c++) st8(orow + 8 * c, a[c]);
            continue;
        }
        if (j0 == start) memset(orow, 0, (size_t)D * sizeof(float));
        for (int64_t j = j0; j < j1; j++) {
            v8f pj = splat(pr[j]);
            const float *v = vb + (j - j0) * D;
            for (int64_t d = 0; d + 8 <= D; d += 8)
                st8(orow + d, madd8(pj, ld8(v + d), ld8(orow + d)));
        }
    }
}

/* rows_values with R a constant (its sums' registers are then allotted), R <= 4. */
static inline __attribute__((always_inline)) void rows_values_r(
        const float *vb, const float *p, int64_t p_stride, int R, int64_t j0, int64_t j1,
        int64_t D, float *o, int64_t start) {
    switch (R) {
    case 4: rows_values(vb, p, p_stride, 4, j0, j1, D, o, start); break;
    case 3: rows_values(vb, p, p_stride, 3, j0, j1, D, o, start); break;
    case 2: rows_values(vb, p, p_stride, 2, j0, j1, D, o, start); break;
    default: rows_values(vb, p, p_stride, 1, j0, j1, D, o, start); break;
    }
}

/* Keys a long row's attention is split into, so that one token's few KV heads still give
 * every thread work (flash-decoding's split-K): the default model's 3 KV heads on 2 threads
 * left one idle half the time. A row of at most KEY_CHUNK keys is attended whole; a longer
 * one chunk by chunk, merged in chunk order. Whether a row is split depends on its key
 * count alone, so a token's output is the same in a decode step and in a verify, however
 * many tokens share the call. At 300-400 keys splitting cost about what it saved, hence
 * 512 (a chat's usual context keeps the whole pass). A multiple of KEY_BLOCK. */
#define KEY_CHUNK 512

/* Attention of a piece of n tokens of one sequence over keys [j_lo, j_hi) of one KV head,
 * each token t seeing its first lens[t] (k, v: the cache's rows in position order), G query
 * heads a token (token t's at q + t * q_stride, [G, D] fp32): out [n, G, D] fp32. Scores in
 * fp32, scaled after the product, softmax, then the weighted sum of the values: the
 * reference's order, row by row. The keys, then the values, are visited KEY_BLOCK at a time
 * for every row of the piece (load_block). s: [n * G * lens[n - 1]] floats; blk:
 * [KEY_BLOCK * D].
 * ml NULL: every row whole over [0, lens[t]) (j_lo 0), normalised. Otherwise a chunk: a row
 * of more than KEY_CHUNK keys gets its part over the chunk unnormalised, with its running
 * max and exp-sum at ml[2 r], ml[2 r + 1] (max -inf where it sees none of the chunk); a row
 * of at most KEY_CHUNK keys (whole in chunk 0) is normalised, as in the whole pass. */
static inline __attribute__((always_inline)) void attend_piece(
        const float *q, int64_t q_stride, int64_t n, const int64_t *lens, int64_t G,
        int64_t D, const Head *k, const Head *v, float scale, float *out, float *s,
        float *blk, int64_t j_lo, int64_t j_hi, float *ml) {
    int64_t L_max = 0;
    for (int64_t t = 0; t < n; t++) {
        int64_t L = lens[t] < j_hi ? lens[t] : j_hi;
        L_max = L > L_max ? L : L_max;
    }
    for (int64_t j0 = j_lo; j0 < L_max; j0 += KEY_BLOCK) {
        load_block(k, j0, j0 + KEY_BLOCK < L_max ? j0 + KEY_BLOCK : L_max, L_max, D, blk);
        for (int64_t t = 0; t < n; t++) {
            int64_t L = lens[t] < j_hi ? lens[t] : j_hi;
            int64_t j1 = j0 + KEY_BLOCK < L ? j0 + KEY_BLOCK : L;
            for (int64_t h = 0; h < G && j0 < j1; h++)
                row_scores(q + t * q_stride + h * D, D, blk, j0, j1, lens[t] - lens[t] % 8,
                           scale, s + (t * G + h) * L_max);
        }
    }
    for (int64_t r = 0; r < n * G; r++) {
        int64_t L = lens[r / G] < j_hi ? lens[r / G] : j_hi;
        float *sr = s + r * L_max + j_lo;
        if (L <= j_lo) {
            memset(out + r * D, 0, (size_t)D * sizeof(float));
            if (ml) { ml[2 * r] = -INFINITY; ml[2 * r + 1] = 0.0f; }
            continue;
        }
        float mx = row_max(sr, L - j_lo), sum = exp_shifted(sr, L - j_lo, mx);
        if (ml && lens[r / G] > KEY_CHUNK) {
            ml[2 * r] = mx;
            ml[2 * r + 1] = sum;
            continue;
        }
        float inv = 1.0f / sum;
        for (int64_t j = 0; j < L - j_lo; j++) sr[j] *= inv;
    }
    for (int64_t j0 = j_lo; j0 < L_max; j0 += KEY_BLOCK) {
        load_block(v, j0, j0 + KEY_BLOCK < L_max ? j0 + KEY_BLOCK : L_max, L_max, D, blk);
        for (int64_t t = 0; t < n; t++) {  /* a token's G rows see the same keys */
            int64_t L = lens[t] < j_hi ? lens[t] : j_hi;
            int64_t j1 = j0 + KEY_BLOCK < L ? j0 + KEY_BLOCK : L;
            for (int64_t h = 0; h < G && j0 < j1; h += VALUE_ROWS(D)) {
                int R = (int)(G - h < VALUE_ROWS(D) ? G - h : VALUE_ROWS(D));
                rows_values_r(blk, s + (t * G + h) * L_max, L_max, R, j0, j1, D,
                              out + (t * G + h) * D, j_lo);
            }
        }
    }
}

/* attend_piece with the head dims the models use as constants (the products unroll). */
static void attend_piece_d(const float *q, int64_t q_stride, int64_t n, const int64_t *lens,
                           int64_t G, int64_t D, const Head *k, const Head *v, float scale,
                           float *out, float *s, float *blk, int64_t j_lo, int64_t j_hi,
                           float *ml) {
    if (D == 64)
        attend_piece(q, q_stride, n, lens, G, 64, k, v, scale, out, s, blk, j_lo, j_hi, ml);
    else if (D == 128)
        attend_piece(q, q_stride, n, lens, G, 128, k, v, scale, out, s, blk, j_lo, j_hi, ml);
    else
        attend_piece(q, q_stride, n, lens, G, D, k, v, scale, out, s, blk, j_lo, j_hi, ml);
}

/* A split row's output o [D] from its chunks' unnormalised parts part[c] ([.., D], `stride`
 * floats apart) and their (max, exp-sum) ml[c] (2 floats, `ml_stride` apart), in chunk
 * order. */
static void merge_chunks(const float *part, int64_t stride, const float *ml, int64_t ml_stride,
                         int64_t chunks, int64_t D, float *o) {
    float mx = -INFINITY, tot = 0.0f;
    for (int64_t c = 0; c < chunks; c++) mx = ml[c * ml_stride] > mx ? ml[c * ml_stride] : mx;
    for (int64_t c = 0; c < chunks; c++)
        tot += ml[c * ml_stride + 1] * expf(ml[c * ml_stride] - mx);
    memset(o, 0, (size_t)D * sizeof(float));
    for (int64_t c = 0; c < chunks; c++) {
        float w = expf(ml[c * ml_stride] - mx) / tot;
        for (int64_t d = 0; d < D; d++) o[d] += w * part[c * stride + d];
    }
}

/* *buf grown to at least n elements of `size` bytes (half as much again, so a context that
 * grows a token a step does not reallocate every step); NULL when memory is short. */
static void *grow(void **buf, size_t *cap, size_t n, size_t size) {
    if (n > *cap) {
        size_t want = n + n / 2;
        void *grown = realloc(*buf, want * size);
        if (!grown) return NULL;
        *buf = grown;
        *cap = want;
    }
    return *buf;
}

/* Per-thread scratches kept between calls: the attention's keys, values and scores grow
 * with the context, and a fresh allocation of that size every layer of every step would be
 * mapped and faulted in each time. Two, as a call holds its key slots (the calling thread's)
 * while every thread's work item uses its floats. */
static float *scratch_floats(size_t n) {
    static __thread void *buf;
    static __thread size_t cap;
    return (float *)grow(&buf, &cap, n, sizeof(float));
}

static int64_t *scratch_slots(size_t n) {
    static __thread void *buf;
    static __thread size_t cap;
    return (int64_t *)grow(&buf, &cap, n, sizeof(int64_t));
}

/* Key chunks a row of L keys is attended in (1: whole). */
static inline int64_t chunks_of(int64_t L) {
    return L > KEY_CHUNK ? (L + KEY_CHUNK - 1) / KEY_CHUNK : 1;
}

/* A split piece's rows for head g merged from its chunks' parts (attend_piece's layout:
 * [ch][n G D] outputs, then [ch][n G 2] max and exp-sum) into out [N, H * D]; a row of at
 * most KEY_CHUNK keys is chunk 0's as it is. a: the piece's first token, n its tokens. */
static void merge_piece(const float *base, int64_t ch, int64_t a, int64_t n, int64_t g,
                        const int64_t *lens, int64_t H, int64_t G, int64_t D, void *out,
                        int bf16) {
    int64_t stride = n * G * D;
    const float *ml = base + ch * stride;
    float o[D];
    for (int64_t r = 0; r < n * G; r++) {
        int64_t i = a + r / G, h = g * G + r % G, L = lens[i];
        const float *src = base + r * D;
        if (L > KEY_CHUNK) {
            merge_chunks(src, stride, ml + 2 * r, n * G * 2, chunks_of(L), D, o);
            src = o;
        }
        for (int64_t d = 0; d < D; d++) store(out, (i * H + h) * D + d, src[d], bf16);
    }
}

/* Work items biggest first (rows times keys; then in order): handed out one at a time,
 * the threads end together although chunks and pieces differ in size. */
static __thread const int64_t *item_cost;  /* qsort takes no context argument */
static int by_cost(const void *x, const void *y) {
    int64_t i = *(const int64_t *)x, j = *(const int64_t *)y;
    if (item_cost[i] != item_cost[j]) return item_cost[i] < item_cost[j] ? 1 : -1;
    return i < j ? -1 : (i > j);
}

/* Rotary (and the per-head q/k norms) on each token's q and k heads from qkv [N, W], q to
 * q [N, H, D] fp32, this step's K and V written to the paged cache at slots [N]. row:
 * [2 D] floats of scratch. */
static void write_qkv(const void *qkv, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                      const void *cos, const void *sin, void *k_cache, void *v_cache,
                      const int64_t *slots, const void *q_norm, const void *k_norm, float eps,
                      float *q, float *row, int bf16) {
    int64_t W = (H + 2 * Hkv) * D;
    for (int64_t i = 0; i < N; i++) {
        for (int64_t h = 0; h < H + Hkv; h++) {  /* q heads, then k heads */
            float *x = h < H ? q + (i * H + h) * D : row;
            load_row(x, qkv, i * W + h * D, D, bf16);
            if (q_norm) norm_row(x, h < H ? q_norm : k_norm, D, eps, bf16);
            rope_row(x, cos, sin, i, D, row + D, bf16);
            if (h >= H)
                for (int64_t d = 0; d < D; d++)
                    store(k_cache, (slots[i] * Hkv + (h - H)) * D + d, x[d], bf16);
        }
        for (int64_t h = 0; h < Hkv; h++)
            for (int64_t d = 0; d < D; d++)
                store(v_cache, (slots[i] * Hkv + h) * D + d,
                      load(qkv, i * W + (H + Hkv + h) * D + d, bf16), bf16);
    }
}

/* Tokens a piece of a prefill run holds at most (cut_pieces). */
#define PIECE_TOKENS 64

/* Runs of tokens (run_of [N]) cut into pieces [piece_a, piece_b): enough work items (piece,
 * KV head, key chunk) for the threads to share; a run is cut into pieces of tokens only
 * where its chunks are too few (each piece reads the run's keys again). Returns the count. */
static int64_t cut_pieces(int64_t N, int64_t Hkv, const int64_t *lens, const int64_t *run_of,
                          int64_t *piece_a, int64_t *piece_b) {
    int threads = 1;
#ifdef _OPENMP
    threads = omp_get_max_threads();
#endif
    int64_t run_items = 0;
    for (int64_t i = 0; i < N; i++)
        if (i == N - 1 || run_of[i + 1] != run_of[i]) run_items += Hkv * chunks_of(lens[i]);
    int64_t parts = run_items >= 4 * threads ? 1 : (4 * threads + run_items - 1) / run_items;
    int64_t pieces = 0;
    for (int64_t a = 0; a < N;) {
        int64_t b = a;
        while (b < N && run_of[b] == run_of[a]) b++;
        int64_t n = b - a, k = parts < n ? parts : n;
        /* A prefill run in pieces of at most PIECE_TOKENS: its scores' scratch stays
         * bounded (rows times keys) and every thread gets a share. */
        int64_t least = (n + PIECE_TOKENS - 1) / PIECE_TOKENS;
        if (k < least) k = least;
        for (int64_t j = 0; j < k; j++) {
            piece_a[pieces] = a + n * j / k;
            piece_b[pieces++] = a + n * (j + 1) / k;
        }
        a = b;
    }
    return pieces;
}

/* What every work item of one layer's attention reads: the queries, each token's key count
 * (lens [N]) and run (run_of [N]), each run's key slots (lists [runs, L_cap]: its last
 * token's, whose first lens[t] are every token t's of the run), the pieces, the cache, and
 * for split pieces the parts' buffer (per piece and head: [chunks][n G D] outputs, then
 * [chunks][n G 2] max, sum, from part_at[p]) with each (piece, head)'s count of finished
 * chunks. */
typedef struct {
    const float *q;
    const int64_t *lists, *lens, *run_of, *piece_a, *piece_b, *part_at, *chunks;
    int64_t *finished;
    float *part;
    int64_t L_cap, H, Hkv, G, D;
    void *k_cache, *v_cache, *out;
    float scale;
    int bf16;
} Attn;

/* Item (piece p, head g, chunk c): its attention, written to out where the piece is whole;
 * a split piece's part goes to the parts' buffer, and the chunk that finishes the (piece,
 * head) last merges it. Returns 0, or -1 when scratch memory could not be had. */
static int run_item(const Attn *A, int64_t p, int64_t g, int64_t c) {
    int64_t a = A->piece_a[p], b = A->piece_b[p], n = b - a, ch = A->chunks[p];
    int64_t G = A->G, D = A->D, rows = n * G;
    float *sc = scratch_floats((size_t)(rows * (A->L_cap + D) + KEY_BLOCK * D));
    if (!sc) return -1;
    float *acc = sc + rows * A->L_cap, *blk = acc + rows * D, *ml = NULL, *base = NULL;
    if (ch > 1) {
        base = A->part + A->part_at[p] + g * ch * rows * (D + 2);
        acc = base + c * rows * D;
        ml = base + ch * rows * D + c * rows * 2;
    }
    const int64_t *keys = A->lists + A->run_of[b - 1] * A->L_cap;
    Head kh = {A->k_cache, keys, A->Hkv * D, g * D, A->bf16};
    Head vh = {A->v_cache, keys, A->Hkv * D, g * D, A->bf16};
    attend_piece_d(A->q + (a * A->H + g * G) * D, A->H * D, n, A->lens + a, G, D, &kh, &vh,
                   A->scale, acc, sc, blk, ch > 1 ? c * KEY_CHUNK : 0,
                   ch > 1 ? (c + 1) * KEY_CHUNK : INT64_MAX, ml);
    if (ch == 1) {
        for (int64_t i = a; i < b; i++)
            for (int64_t e = 0; e < G * D; e++)
                store(A->out, (i * A->H + g * G) * D + e, acc[(i - a) * G * D + e], A->bf16);
        return 0;
    }
    int64_t done_now;
#pragma omp atomic capture seq_cst
    done_now = ++A->finished[p * A->Hkv + g];
    if (done_now == ch) {  /* the last of this (piece, head): every part is written */
#pragma omp flush
        merge_piece(base, ch, a, n, g, A->lens, A->H, G, D, A->out, A->bf16);
    }
    return 0;
}

/* Floats the split pieces' parts take (attend_items' buffer): per piece whose rows pass
 * KEY_CHUNK keys, its chunks' unnormalised outputs and (max, sum) for every row and head. */
static int64_t split_floats(const int64_t *lens, const int64_t *piece_a,
                            const int64_t *piece_b, int64_t pieces, int64_t Hkv, int64_t G,
                            int64_t D) {
    int64_t floats = 0;
    for (int64_t p = 0; p < pieces; p++) {
        int64_t ch = chunks_of(lens[piece_b[p] - 1]);
        if (ch > 1) floats += Hkv * ch * (piece_b[p] - piece_a[p]) * G * (D + 2);
    }
    return floats;
}

/* Every (piece, head, chunk) item of A's pieces, biggest first (rows times keys), handed
 * out one at a time so the threads end together though the items differ in size. Returns
 * 0, or -1 when memory could not be had. */
static int attend_items(Attn *A, int64_t pieces) {
    int64_t items = 0, Hkv = A->Hkv, rc = 0;
    int64_t part_floats = split_floats(A->lens, A->piece_a, A->piece_b, pieces, Hkv, A->G, A->D);
    for (int64_t p = 0; p < pieces; p++) items += Hkv * chunks_of(A->lens[A->piece_b[p] - 1]);
    int64_t *item = (int64_t *)malloc((size_t)(5 * items + (2 + Hkv) * pieces) *
                                      sizeof(int64_t));
    float *part = part_floats ? (float *)malloc((size_t)part_floats * sizeof(float)) : NULL;
    if (!item || (part_floats && !part)) { free(item); free(part); return -1; }
    int64_t *item_p = item, *item_g = item + items, *item_c = item + 2 * items;
    int64_t *cost = item + 3 * items, *order = item + 4 * items;
    int64_t *part_at = item + 5 * items, *chunks = part_at + pieces, *finished = chunks + pieces;
    for (int64_t p = 0, it = 0, at = 0; p < pieces; p++) {
        int64_t n = A->piece_b[p] - A->piece_a[p], L = A->lens[A->piece_b[p] - 1];
        chunks[p] = chunks_of(L);
        part_at[p] = at;
        if (chunks[p] > 1) at += Hkv * chunks[p] * n * A->G * (A->D + 2);
        for (int64_t g = 0; g < Hkv; g++) {
            finished[p * Hkv + g] = 0;
            for (int64_t c = 0; c < chunks[p]; c++, it++) {
                int64_t lo = chunks[p] > 1 ? c * KEY_CHUNK : 0;
                int64_t hi = chunks[p] > 1 && (c + 1) * KEY_CHUNK < L ? (c + 1) * KEY_CHUNK : L;
                item_p[it] = p;
                item_g[it] = g;
                item_c[it] = c;
                cost[it] = n * (hi - lo);
                order[it] = it;
            }
        }
    }
    item_cost = cost;
    qsort(order, (size_t)items, sizeof(int64_t), by_cost);
    A->part_at = part_at;
    A->chunks = chunks;
    A->finished = finished;
    A->part = part;
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
    for (int64_t k = 0; k < items; k++) {
        int64_t it = order[k];
        if (run_item(A, item_p[it], item_g[it], item_c[it]) != 0) {
#pragma omp atomic write
            rc = -1;
        }
    }
    free(item);
    free(part);
    return (int)rc;
}

/* Each token's key count lens [N] and run run_of [N]: runs of tokens of one sequence, each
 * token's keys the first ones of the next token's (a decode token alone, a verify's chain,
 * a prefill chunk), whose keys and values are converted once for all their tokens. Two
 * lists at a time (cur, prev: [2, L_cap]); each run's last token in last [N]. Returns the
 * run count. */
static int64_t find_runs(const Meta *m, int64_t N, int64_t L_cap, int64_t *two, int64_t *lens,
                         int64_t *run_of, int64_t *last) {
    int64_t runs = 0;
    for (int64_t i = 0; i < N; i++) {
        int64_t *cur = two + (i & 1) * L_cap, *prev = two + ((i + 1) & 1) * L_cap;
        lens[i] = key_slots(m, i, cur);
        int joins = i > 0 && m->seq_index[i] == m->seq_index[i - 1] && lens[i] >= lens[i - 1] &&
            memcmp(cur, prev, (size_t)lens[i - 1] * sizeof(int64_t)) == 0;
        run_of[i] = joins ? run_of[i - 1] : runs++;
        last[run_of[i]] = i;
    }
    return runs;
}

/* One layer's attention for N tokens of a flattened batch, from the fused projection's rows
 * qkv [N, (H + 2 Hkv) D]: per-head q/k norms (q_norm and k_norm may be NULL), rotary by
 * cos/sin [N, D] (rotate-half form), this step's K and V written to the paged cache at
 * slots [N] (k_cache/v_cache [num_slots, Hkv, D]), then each token's attention over the
 * keys it sees (Meta: BatchMeta's fields) into out [N, H * D]. Every K/V is written
 * before any token attends, so the tokens of a verify see each other's. Returns 0; -1 when
 * scratch memory could not be had (out is then incomplete: the caller fails); -2, before
 * anything is written, when the runs' key lists and the split rows' parts would take more
 * than max_bytes (a long chunk over a long context, or one whose tokens form many runs as
 * a sliding window's do: the caller runs another path). */
int sc_attend_qkv(const void *qkv, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                  const void *cos, const void *sin, void *k_cache, void *v_cache,
                  const int64_t *slots, const int64_t *seq_index, const int64_t *block_tables,
                  int64_t max_blocks, int64_t block_size, const int64_t *visible,
                  const int64_t *window_start, const int64_t *tree_start,
                  const uint8_t *tree_mask, int64_t T, int64_t max_len,
                  const void *q_norm, const void *k_norm, float eps, float scale, void *out,
                  int bf16, int64_t max_bytes) {
    if (N == 0) return 0;
    int64_t L_cap = max_len + T;
    Meta m = {seq_index, block_tables, visible, window_start, tree_start, tree_mask,
              max_blocks, block_size, T};
    int64_t *idx = scratch_slots((size_t)(2 * L_cap + 5 * N));
    if (!idx) return -1;
    int64_t *lens = idx + 2 * L_cap, *run_of = lens + N, *last = run_of + N;
    int64_t *piece_a = last + N, *piece_b = piece_a + N;
    int64_t runs = find_runs(&m, N, L_cap, idx, lens, run_of, last);
    int64_t pieces = cut_pieces(N, Hkv, lens, run_of, piece_a, piece_b);
    /* the first test keeps the product below from overflowing */
    if (runs > max_bytes / 8 / L_cap ||
        runs * L_cap * 8 + split_floats(lens, piece_a, piece_b, pieces, Hkv, H / Hkv, D) * 4 >
        max_bytes)
        return -2;
    float *q = (float *)malloc((size_t)(N * H * D) * sizeof(float));
    float *row = (float *)malloc((size_t)(2 * D) * sizeof(float));
    int64_t *lists = (int64_t *)malloc((size_t)(runs * L_cap) * sizeof(int64_t));
    int rc = 0;
    if (!q || !row || !lists) { rc = -1; goto done; }
    write_qkv(qkv, N, H, Hkv, D, cos, sin, k_cache, v_cache, slots, q_norm, k_norm, eps, q, row,
              bf16);
    for (int64_t r = 0; r < runs; r++) key_slots(&m, last[r], lists + r * L_cap);
    Attn A = {q, lists, lens, run_of, piece_a, piece_b, NULL, NULL, NULL, NULL, L_cap, H, Hkv,
              H / Hkv, D, k_cache, v_cache, out, scale, bf16};
    rc = attend_items(&A, pieces);
done:
    free(q); free(row); free(lists);
    return rc;
}

/* The library's interface version: the loader refuses a build whose version differs. */
int sc_version(void) { return 6; }
