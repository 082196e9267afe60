/* specscope's CPU products of a GGUF's quantised weights with 8-bit activations, as llama.cpp
 * computes them.
 *
 * A weight row is the GGUF's, in blocks of 32 inputs: codes q with a scale d and, for Q4_1,
 * an offset m per block, w = d * q + m (Q4_1: q in 0..15; Q4_0: q - 8 in -8..7 with m = 0;
 * Q8_0: q in -127..127, m = 0). Each activation row is quantised per block of 32 to int8
 * codes a with a scale e = max |x| / 127 (rounded to nearest even), and a block's product is
 *     sum_i w_i x_i ~= (d e) * sum_i q_i a_i + m * (e sum_i a_i)
 * with the first sum exact in integers: AVX2's vpmaddubsw or VNNI's vpdpbusd do 32-64 of
 * those products an instruction, where fp32 does 8-16, which is what lets a verify of several
 * tokens cost little more than one token's decode step.
 *
 * Layout (built by models/quant.py): the N weight rows in tiles of T = 8 (or 16 where AVX-512
 * VNNI runs, one 512-bit vector a group); a tile's block holds its 32 inputs
 * as 8 groups of 4, each group as T rows x 4 codes (4 T bytes), so one 4-byte broadcast of
 * the activation meets T rows at once and every int32 lane sums one row's block with no
 * horizontal reduction. 4-bit codes pack groups g and g + 4 into one byte (low and high
 * nibble: 16 T bytes a tile block); 8-bit codes take 32 T, each stored as q + 128 (0..255),
 * so VNNI's vpdpbusd takes them as its unsigned operand against the signed activations as
 * they are: sum_i q_i a_i = sum_i (q_i + 128) a_i - 128 sum_i a_i, exact in int32, with the
 * activation block's 128 sum a_i computed once a row (AVX2's vpmaddubsw, whose int16 pairs
 * would overflow, gets the signed codes back with one xor a block). Scales and offsets are
 * fp32, [N/T, K/32, T].
 *
 * Every path sums in the same order (each block's integer sum, then per block
 * acc = fma(isum, d * e, acc) and acc = fma(m, e * sum a, acc)), so the scalar reference,
 * AVX2 and VNNI give bit-equal results, and a row's result depends on that row alone (a
 * token's logits are the same in a decode step and in a verify).
 *
 * Threads: OpenMP over tiles; the library links libgomp.so.1, the runtime torch has loaded,
 * so its workers are torch's own.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define QK 32
#define TILE 8
#ifndef PF_BYTES
#define PF_BYTES 2048
#endif


#if defined(__AVX2__)
/* Eight activations from p + k as fp32. */
static inline __m256 load8(const void *p, int64_t k, int bf16) {
    if (!bf16) return _mm256_loadu_ps((const float *)p + k);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* quantize_row's block in vectors: the same operations (cvtps rounds to nearest even as
 * rintf does; |x * id| <= 127 so the saturating packs never clamp). Returns the code sum. */
static inline int quantize_block(const void *x, int64_t k, int bf16, int8_t *a, float *amax_out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        v[i] = load8(x, k + 8 * i, bf16);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float amax = _mm_cvtss_f32(m4);
    __m256 id = _mm256_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
    __m256i q[4];
    for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], id));
    __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m256i p16 = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
    __m256i p8 = _mm256_packs_epi16(p16, p16b);
    /* the packs interleave 128-bit lanes: put the dwords back in element order */
    p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)a, p8);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    *amax_out = amax;
    return _mm_cvtsi128_si32(s4);
}
#endif

/* Activation row `row` of M [K] (fp32 or bf16) -> its codes, scales e, e * (the block's code
 * sum) s (the offset term's factor) and 128 * the code sum c (the 8-bit codes' offset), in
 * block-major layouts: a [K/32, M, 32], e, s, c [K/32, M]. A block's rows then lie at fixed
 * distances from one address, so the products need one pointer for all their rows, not
 * three a row (which ran out of general registers at six rows). */
static void quantize_row(const void *x, int64_t row, int64_t M, int64_t K, int bf16, int8_t *a,
                         float *e, float *s, int32_t *c, int reference) {
    float buf[QK];
    for (int64_t b = 0; b < K / QK; b++) {
        float amax = 0.0f;
        int sum = 0;
        int64_t at = b * M + row;
#if defined(__AVX2__)
        if (!reference) {
            sum = quantize_block(x, row * K + b * QK, bf16, a + at * QK, &amax);
            e[at] = amax / 127.0f;
            s[at] = e[at] * (float)sum;
            c[at] = 128 * sum;
            continue;
        }
#endif
        for (int i = 0; i < QK; i++) {
            int64_t k = row * K + b * QK + i;
            buf[i] = bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
            float v = fabsf(buf[i]);
            amax = v > amax ? v : amax;
        }
        float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < QK; i++) {
            int q = (int)rintf(buf[i] * id);
            q = q > 127 ? 127 : (q < -127 ? -127 : q);
            a[at * QK + i] = (int8_t)q;
            sum += q;
        }
        e[at] = amax / 127.0f;
        s[at] = e[at] * (float)sum;
        c[at] = 128 * sum;
    }
}

/* Bytes of one tile block: T rows x 32 codes at 4 or 8 bits. */
static inline int64_t tile_block_bytes(int bits, int T) { return (bits == 4 ? 16 : 32) * T; }

/* The code of row r (0..T-1), input i (0..31) of a tile block (the layout above). */
static inline int code_at(const uint8_t *blk, int r, int i, int bits, int T) {
    int g = i / 4, j = i % 4;
    if (bits == 8) return (int)blk[g * 4 * T + r * 4 + j] - 128;
    uint8_t byte = blk[(g % 4) * 4 * T + r * 4 + j];
    return g < 4 ? (byte & 0x0F) : (byte >> 4);
}

/* The reference: every path's order, one lane at a time. */
static void tile_scalar(const uint8_t *w, const float *wd, const float *wm, int64_t nb,
                        int bits, int T, const int8_t *a, const float *e, const float *s,
                        int64_t M, int64_t m, float *acc) {
    for (int r = 0; r < T; r++) acc[r] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * tile_block_bytes(bits, T);
        const int8_t *ab = a + (b * M + m) * QK;
        for (int r = 0; r < T; r++) {
            int32_t t = 0;
            for (int i = 0; i < QK; i++) t += code_at(blk, r, i, bits, T) * ab[i];
            acc[r] = fmaf((float)t, wd[b * T + r] * e[b * M + m], acc[r]);
            if (wm) acc[r] = fmaf(wm[b * T + r], s[b * M + m], acc[r]);
        }
    }
}

#if defined(__AVX2__)
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DPBUSD(acc, u, s8) _mm256_dpbusd_epi32((acc), (u), (s8))
#elif defined(__AVXVNNI__)
#define DPBUSD(acc, u, s8) _mm256_dpbusd_avx_epi32((acc), (u), (s8))
#endif

static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* A tile block's codes as 8 vectors of 8 rows x 4 codes, group g in w[g]: 4-bit codes
 * unpacked to bytes 0..15; 8-bit codes as stored (q + 128) for vpdpbusd, else back to the
 * signed q (xor 0x80) for vpmaddubsw. */
static inline __attribute__((always_inline)) void block_codes(const uint8_t *blk, int bits,
                                                             __m256i *w) {
    if (bits == 4) {
        const __m256i low = _mm256_set1_epi8(0x0F);
        for (int g = 0; g < 4; g++) {
            __m256i p = _mm256_loadu_si256((const __m256i *)(blk + g * 32));
            w[g] = _mm256_and_si256(p, low);
            w[g + 4] = _mm256_and_si256(_mm256_srli_epi16(p, 4), low);
        }
    } else {
        for (int g = 0; g < 8; g++) {
            w[g] = _mm256_loadu_si256((const __m256i *)(blk + g * 32));
#ifndef DPBUSD
            w[g] = _mm256_xor_si256(w[g], _mm256_set1_epi8((char)0x80));
#endif
        }
    }
}

/* The block's integer sums for one activation row ab: lane r = sum_i q[r, i] a[i]; c128 =
 * 128 * sum_i a[i] (the 8-bit codes' offset). */
static inline __attribute__((always_inline)) __m256i block_isum(const __m256i *w, int bits,
                                                                const int8_t *ab, int32_t c128,
                                                                int rows) {
    if (bits == 4) {
#ifdef DPBUSD
        /* Four chains at one row, not one: vpdpbusd's latency would otherwise bound the
         * loop; with four rows or more their chains interleave, and two a row save the
         * adds (integer sums: the same result however they are grouped). */
        __m256i c[4];
        if (rows >= 4) {
            c[0] = DPBUSD(_mm256_setzero_si256(), w[0], bcast4(ab));
            c[1] = DPBUSD(_mm256_setzero_si256(), w[1], bcast4(ab + 4));
            for (int g = 2; g < 8; g++) c[g & 1] = DPBUSD(c[g & 1], w[g], bcast4(ab + 4 * g));
            return _mm256_add_epi32(c[0], c[1]);
        }
        for (int g = 0; g < 4; g++) c[g] = DPBUSD(_mm256_setzero_si256(), w[g], bcast4(ab + 4 * g));
        for (int g = 4; g < 8; g++) c[g - 4] = DPBUSD(c[g - 4], w[g], bcast4(ab + 4 * g));
        return _mm256_add_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_add_epi32(c[2], c[3]));
#else
        /* 8 products of at most 15 * 127 * 2 per int16 lane stay within its range. */
        __m256i acc16 = _mm256_maddubs_epi16(w[0], bcast4(ab));
        for (int g = 1; g < 8; g++)
            acc16 = _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w[g], bcast4(ab + 4 * g)));
        return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1));
#endif
    }
    __m256i c[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
#ifdef DPBUSD
    /* 8-bit codes q + 128 as the unsigned operand, the offset's 128 sum a taken off. */
    for (int g = 0; g < 8; g++) c[g & 1] = DPBUSD(c[g & 1], w[g], bcast4(ab + 4 * g));
    return _mm256_sub_epi32(_mm256_add_epi32(c[0], c[1]), _mm256_set1_epi32(c128));
#else
    /* Signed codes: |q| as the unsigned operand, a carrying q's sign. */
    (void)c128;
    for (int g = 0; g < 8; g++) {
        __m256i av = _mm256_sign_epi8(bcast4(ab + 4 * g), w[g]);
        c[g & 1] = _mm256_add_epi32(c[g & 1], _mm256_madd_epi16(
            _mm256_maddubs_epi16(_mm256_abs_epi8(w[g]), av), _mm256_set1_epi16(1)));
    }
    return _mm256_add_epi32(c[0], c[1]);
#endif
}

#endif

static void store_row(void *y, int64_t i, const float *v, int n, int bf16) {
    for (int r = 0; r < n; r++) {
        if (bf16) ((uint16_t *)y)[i + r] = f32_to_bf16(v[r]);
        else ((float *)y)[i + r] = v[r];
    }
}

#if defined(__AVX2__)
/* f32_to_bf16 of 8 lanes at once, bit for bit (round to nearest even, a NaN kept quiet):
 * a wide product's outputs (the head's 49,152 a row) are too many to round one by one. */
static inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16),
                                              _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* A tile's 8 outputs of one row to y + i: whole tiles in one store, the last tile's
 * `cols` < 8 as store_row does. */
static inline void store8(void *y, int64_t i, __m256 v, int cols, int bf16) {
    if (cols == TILE && bf16) {
        _mm_storeu_si128((__m128i *)((uint16_t *)y + i), bf16x8(v));
    } else if (cols == TILE) {
        _mm256_storeu_ps((float *)y + i, v);
    } else {
        float out[TILE];
        _mm256_storeu_ps(out, v);
        store_row(y, i, out, cols, bf16);
    }
}

/* Rows m0 .. m0 + R - 1 against one tile, written to y: acc[j] lanes = the tile's 8 outputs
 * of row m0 + j. Each block's codes are unpacked once for the R rows. R, bits and whether
 * the blocks have offsets are constants at every call (the dispatch below), and the
 * accumulators are this function's own: with an array indexed by a runtime row count, the
 * compiler kept them in memory, a store and a reload on every block's chain. */
static inline __attribute__((always_inline)) void tile_rows(
        const uint8_t *w, const float *wd, const float *wm, int64_t nb, int bits,
        const int8_t *a, const float *e, const float *s, const int32_t *c, int64_t M,
        int64_t m0, int R, void *y, int64_t N, int64_t n0, int cols, int bf16) {
    __m256 acc[8];
    for (int j = 0; j < R; j++) acc[j] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        __m256i codes[8];
        /* The weights a block ahead by PF_BYTES: a thread's tiles lie one after another, so
         * this runs on into its next tile; past the weight's end a prefetch is harmless. */
        const char *ahead = (const char *)(w + b * tile_block_bytes(bits, TILE)) + PF_BYTES;
        for (int l = 0; l < tile_block_bytes(bits, TILE); l += 64)
            _mm_prefetch(ahead + l, _MM_HINT_T0);
        _mm_prefetch((const char *)(wd + b * TILE) + PF_BYTES / 4, _MM_HINT_T0);
        if (wm) _mm_prefetch((const char *)(wm + b * TILE) + PF_BYTES / 4, _MM_HINT_T0);
        block_codes(w + b * tile_block_bytes(bits, TILE), bits, codes);
        __m256 d = _mm256_loadu_ps(wd + b * TILE);
        __m256 mo = wm ? _mm256_loadu_ps(wm + b * TILE) : d;
        for (int j = 0; j < R; j++) {
            int64_t m = m0 + j;
            __m256i isum = block_isum(codes, bits, a + (b * M + m) * QK, c[b * M + m], R);
            __m256 de = _mm256_mul_ps(d, _mm256_set1_ps(e[b * M + m]));
            acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), de, acc[j]);
            if (wm) acc[j] = _mm256_fmadd_ps(mo, _mm256_set1_ps(s[b * M + m]), acc[j]);
        }
    }
    for (int j = 0; j < R; j++) store8(y, (m0 + j) * N + n0, acc[j], cols, bf16);
}

/* F (tile_rows, or tile_rows16 below) with R, bits and the offsets' presence as constants. */
#define ROWS_R(F, R_) do {                                                                  \
        if (bits == 4 && wm)                                                               \
            F(w, wd, wm, nb, 4, a, e, s, c, M, m0, R_, y, N, n0, cols, bf16);              \
        else if (bits == 4)                                                                \
            F(w, wd, NULL, nb, 4, a, e, s, c, M, m0, R_, y, N, n0, cols, bf16);            \
        else                                                                               \
            F(w, wd, wm, nb, 8, a, e, s, c, M, m0, R_, y, N, n0, cols, bf16);              \
    } while (0)
#endif

/* Up to 8 rows a pass, each block's codes unpacked once for all of them. AVX-512 holds
 * their accumulators beside the codes in its 32 vector registers; AVX2's 16 spill some, yet
 * there too 8 rows in one pass ran the 8-bit head's 6 and 8 rows 14-20 % faster than passes
 * of 4 (the codes' loads and signs taken once) and the 4-bit products as fast (docs/cpu.md). */
#define MAX_R 8

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define WIDE 1
/* 16-row tiles in 512-bit vectors: one broadcast and one vpdpbusd chain serve 16 weight
 * rows, one scale fma 16 outputs. Zen 4 runs a 512-bit op as two 256-bit halves, so the
 * arithmetic's throughput is the same as two 8-row tiles'; what halves is the instructions
 * around it (the broadcasts, the scales' loads and the loop), which bound a product of
 * several rows: 8 rows of the 4-bit products 7-16 % and 128 rows 18-25 % faster than 8-row
 * tiles, the 8-bit head's 8 rows 10-22 % (docs/cpu.md). The same order of operations as
 * tile_rows, lane for lane, so bit-equal. */
static inline __m512i bcast4z(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

/* A 16-row tile's outputs of one row to y + i, as store8 writes 8. */
static inline void store16(void *y, int64_t i, __m512 v, int cols, int bf16) {
    __m256 lo = _mm512_castps512_ps256(v);
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    store8(y, i, lo, cols < TILE ? cols : TILE, bf16);
    if (cols > TILE) store8(y, i + TILE, hi, cols - TILE, bf16);
}

/* tile_rows for a 16-row tile: rows m0 .. m0 + R - 1, each block's codes unpacked once. */
static inline __attribute__((always_inline)) void tile_rows16(
        const uint8_t *w, const float *wd, const float *wm, int64_t nb, int bits,
        const int8_t *a, const float *e, const float *s, const int32_t *c, int64_t M,
        int64_t m0, int R, void *y, int64_t N, int64_t n0, int cols, int bf16) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const int64_t bb = tile_block_bytes(bits, 2 * TILE);
    __m512 acc[8];
    for (int j = 0; j < R; j++) acc[j] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = w + b * bb;
        for (int l = 0; l < bb; l += 64)
            _mm_prefetch((const char *)blk + PF_BYTES + l, _MM_HINT_T0);
        _mm_prefetch((const char *)(wd + b * 2 * TILE) + PF_BYTES / 4, _MM_HINT_T0);
        if (wm) _mm_prefetch((const char *)(wm + b * 2 * TILE) + PF_BYTES / 4, _MM_HINT_T0);
        __m512i q[8];
        if (bits == 4) {
            for (int g = 0; g < 4; g++) {
                __m512i p = _mm512_loadu_si512((const void *)(blk + g * 64));
                q[g] = _mm512_and_si512(p, low);
                q[g + 4] = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
            }
        } else {  /* 8-bit codes as stored, q + 128: the unsigned operand */
            for (int g = 0; g < 8; g++) q[g] = _mm512_loadu_si512((const void *)(blk + g * 64));
        }
        __m512 d = _mm512_loadu_ps(wd + b * 2 * TILE);
        __m512 mo = wm ? _mm512_loadu_ps(wm + b * 2 * TILE) : d;
        for (int j = 0; j < R; j++) {
            int64_t m = m0 + j;
            const int8_t *ab = a + (b * M + m) * QK;
            __m512i c0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[0], bcast4z(ab));
            __m512i c1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q[1], bcast4z(ab + 4));
            for (int g = 2; g < 8; g += 2) {
                c0 = _mm512_dpbusd_epi32(c0, q[g], bcast4z(ab + 4 * g));
                c1 = _mm512_dpbusd_epi32(c1, q[g + 1], bcast4z(ab + 4 * g + 4));
            }
            __m512i isum = _mm512_add_epi32(c0, c1);
            if (bits == 8) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(c[b * M + m]));
            __m512 de = _mm512_mul_ps(d, _mm512_set1_ps(e[b * M + m]));
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), de, acc[j]);
            if (wm) acc[j] = _mm512_fmadd_ps(mo, _mm512_set1_ps(s[b * M + m]), acc[j]);
        }
    }
    for (int j = 0; j < R; j++) store16(y, (m0 + j) * N + n0, acc[j], cols, bf16);
}
#else
#define WIDE 0
#endif

/* Rows [m_lo, m_hi) through F, MAX_R at a time, each pass's row count a constant. */
#define ROW_PASSES(F)                                                                      \
    for (int64_t m0 = m_lo; m0 < m_hi; m0 += MAX_R) {                                      \
        int R = (int)(m_hi - m0 < MAX_R ? m_hi - m0 : MAX_R);                              \
        switch (R) {                                                                       \
        case 8: ROWS_R(F, 8); break;                                                       \
        case 7: ROWS_R(F, 7); break;                                                       \
        case 6: ROWS_R(F, 6); break;                                                       \
        case 5: ROWS_R(F, 5); break;                                                       \
        case 4: ROWS_R(F, 4); break;                                                       \
        case 3: ROWS_R(F, 3); break;                                                       \
        case 2: ROWS_R(F, 2); break;                                                       \
        default: ROWS_R(F, 1); break;                                                      \
        }                                                                                  \
    }

/* Rows a pass of the tiles takes when there are many (sc_quant_linear). */
#define CHUNK_ROWS 64
/* Rows from which the activations' quantisation is shared among the threads (a prefill
 * chunk's; from fewer it gained nothing, docs/cpu.md). */
#define QUANTIZE_PARALLEL_ROWS 32

/* One tile's outputs for activation rows [m_lo, m_lo + rows), MAX_R at a time (each block's codes
 * unpacked once for them); T rows a tile (16 on the WIDE path only). */
static void tile(const uint8_t *w, const float *wd, const float *wm, int64_t nb, int bits,
                 int T, const int8_t *a, const float *e, const float *s, const int32_t *c,
                 int64_t M, int64_t m_lo, int64_t rows, int64_t N, int64_t n0, void *y,
                 int bf16, int reference) {
    int cols = (int)(N - n0 < T ? N - n0 : T);
    int64_t m_hi = m_lo + rows;
    float out[2 * TILE];
#if defined(__AVX2__)
    if (!reference && T == TILE) {
        ROW_PASSES(tile_rows);
        return;
    }
#endif
#if WIDE
    if (!reference && T == 2 * TILE) {
        ROW_PASSES(tile_rows16);
        return;
    }
#endif
    (void)reference;
    (void)c;
    for (int64_t m = m_lo; m < m_hi; m++) {
        tile_scalar(w, wd, wm, nb, bits, T, a, e, s, M, m, out);
        store_row(y, m * N + n0, out, cols, bf16);
    }
}

/* Whether this build runs 16-row tiles on its vector path; elsewhere they would take the
 * scalar loop, so models/quant.py lays weights out in 8-row tiles. */
int sc_quant_wide(void) { return WIDE; }

int sc_quant_version(void) { return 8; }

/* y [M, N] = x [M, K] W^T, W in the tiled layout above (`bits` 4 or 8, T rows a tile; wm
 * NULL where the blocks have no offset), x and y fp32 or bf16 (`bf16`). scratch: at least
 * SC_QUANT_SCRATCH(M, K) bytes. `reference` runs the scalar loop (for the tests). */
void sc_quant_linear(const void *x, int64_t M, int64_t K, const uint8_t *w, const float *wd,
                     const float *wm, int64_t N, int bits, int T, void *y, int bf16,
                     void *scratch, int reference) {
    const int64_t nb = K / QK, tiles = (N + T - 1) / T;
    int8_t *a = (int8_t *)scratch;
    float *e = (float *)(a + M * K);
    float *s = e + M * nb;
    int32_t *c = (int32_t *)(s + M * nb);
#pragma omp parallel for schedule(static) if (M >= QUANTIZE_PARALLEL_ROWS)
    for (int64_t m = 0; m < M; m++)
        quantize_row(x, m, M, K, bf16, a, e, s, c, reference);
    /* Many rows (a prefill chunk) go CHUNK_ROWS at a time through every tile: a chunk's
     * codes stay in L2 while a thread's tiles pass, where all M rows' would be read again
     * from L3 for every tile. The threads keep the same tiles chunk after chunk (static
     * schedule), so each one's weights stay in its own cache; no chunk waits for another. */
#pragma omp parallel
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        int64_t rows = M - m0 < CHUNK_ROWS ? M - m0 : CHUNK_ROWS;
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < tiles; t++)
            tile(w + t * nb * tile_block_bytes(bits, T), wd + t * nb * T,
                 wm ? wm + t * nb * T : NULL, nb, bits, T, a, e, s, c, M, m0, rows, N, t * T,
                 y, bf16, reference);
    }
}
