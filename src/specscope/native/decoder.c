/* A dense decoder's layers in one call: the CPU step without Python between its ops.
 *
 * A layer of a Llama-family model on GGUF codes is seven kernels (cpu_kernels.c's norms,
 * attention and silu * up; quant_kernels.c's products) and a residual add. Called from
 * Python one by one they cost ~15 us each of module calls, tensor allocations and argument
 * conversion, about as much as the kernels themselves for a 135M model's few-token step
 * (docs/cpu.md). Here the same kernels run in the same order on the same rounded values, so
 * the result is bit-equal to the layer-by-layer path (models/llama.py), which stays the
 * reference.
 *
 * Per layer, for h [N, D] (the residual stream, updated in place):
 *     x   = input_norm(h)
 *     qkv = x Wqkv^T;  att = attention(qkv) (q/k norms, rotary, the paged KV write)
 *     o   = att Wo^T;  x, h2 = post_norm(h + o), h + o
 *     h   = h2 + down(silu(gate) * up) with gate, up = x Wgate_up^T
 * and after each tapped layer h is copied into its columns of taps [N, n_taps * D].
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16.h"
#include "kernels.h"

/* One product's weights in quant_kernels.c's tiled layout (offsets NULL: none). */
typedef struct {
    const uint8_t *codes;
    const float *scales;
    const float *offsets;
    int64_t out_features;
    int64_t bits;
    int64_t tile;  /* rows a tile of the layout: 8, or 16 (quant_kernels.c) */
} sc_qlinear;

/* One layer: its norms' weights (q_norm, k_norm NULL without q/k norms), its four products
 * and its paged K/V cache. */
typedef struct {
    const void *input_norm, *post_norm, *q_norm, *k_norm;
    sc_qlinear qkv, o, gate_up, down;
    void *k_cache, *v_cache;
} sc_layer;

/* The flattened batch, as sc_attend_qkv reads it (the same for every layer). */
typedef struct {
    const int64_t *slots, *seq_index, *block_tables;
    int64_t max_blocks, block_size;
    const int64_t *visible, *window_start, *tree_start;
    const uint8_t *tree_mask;
    int64_t T, max_len;
} sc_batch;

/* The model's sizes and constants. */
typedef struct {
    int64_t D, H, Hkv, Dh, I;
    float norm_eps, qk_eps, scale;
} sc_dims;

int sc_decoder_version(void) { return 7; }

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    int64_t m = a > b ? a : b;
    return m > c ? m : c;
}

/* Bytes of sc_decoder's (and sc_eagle3_layer's) work area for N tokens: its activations,
 * then a product's scratch. */
int64_t sc_decoder_work_bytes(const sc_dims *m, int64_t N, int bf16) {
    int64_t es = bf16 ? 2 : 4;
    int64_t acts = N * (6 * m->D + (m->H + 2 * m->Hkv) * m->Dh + m->H * m->Dh + 3 * m->I);
    int64_t K = max3(2 * m->D, m->H * m->Dh, m->I);
    return acts * es + 64 + SC_QUANT_SCRATCH(N, K) + 64;
}

static void add_rows(void *h, const void *a, const void *b, int64_t n, int bf16) {
    if (bf16) {
        uint16_t *o = (uint16_t *)h;
        const uint16_t *x = (const uint16_t *)a, *y = (const uint16_t *)b;
        for (int64_t i = 0; i < n; i++) o[i] = f32_to_bf16(bf16_to_f32(x[i]) + bf16_to_f32(y[i]));
    } else {
        float *o = (float *)h;
        const float *x = (const float *)a, *y = (const float *)b;
        for (int64_t i = 0; i < n; i++) o[i] = x[i] + y[i];
    }
}

/* The work area's buffers (sc_decoder_work_bytes' layout). */
typedef struct {
    void *xin, *g, *x, *h2, *o, *qkv, *att, *gu, *act, *scratch;
} Work;

static Work work_of(void *work, const sc_dims *m, int64_t N, int bf16) {
    const int64_t es = bf16 ? 2 : 4, D = m->D;
    char *p = (char *)work;
    Work w;
    w.xin = p; p += N * 2 * D * es;
    w.g = p;   p += N * D * es;
    w.x = p;   p += N * D * es;
    w.h2 = p;  p += N * D * es;
    w.o = p;   p += N * D * es;
    w.qkv = p; p += N * (m->H + 2 * m->Hkv) * m->Dh * es;
    w.att = p; p += N * m->H * m->Dh * es;
    w.gu = p;  p += N * 2 * m->I * es;
    w.act = p; p += N * m->I * es;
    w.scratch = (void *)(((uintptr_t)p + 63) & ~(uintptr_t)63);
    return w;
}

/* A layer from its attention input x [N, K] on: q/k/v, the attention (the paged KV write),
 * o; h2 = res + o and its post-attention norm; the MLP; out = h2 + mlp. res and out may be
 * one buffer. */
static int layer_from(const sc_layer *y, const sc_dims *m, const void *x, int64_t K,
                      const void *res, void *out, int64_t N, const void *cos, const void *sin,
                      const sc_batch *b, const Work *w, int bf16) {
    const int64_t D = m->D, A = m->H * m->Dh, I = m->I;
    sc_quant_linear(x, N, K, y->qkv.codes, y->qkv.scales, y->qkv.offsets,
                    y->qkv.out_features, (int)y->qkv.bits, (int)y->qkv.tile, w->qkv, bf16,
                    w->scratch, 0);
    int rc = sc_attend_qkv(w->qkv, N, m->H, m->Hkv, m->Dh, cos, sin, y->k_cache, y->v_cache,
                           b->slots, b->seq_index, b->block_tables, b->max_blocks,
                           b->block_size, b->visible, b->window_start, b->tree_start,
                           b->tree_mask, b->T, b->max_len, y->q_norm, y->k_norm, m->qk_eps,
                           m->scale, w->att, bf16, INT64_MAX);
    if (rc != 0) return rc;
    sc_quant_linear(w->att, N, A, y->o.codes, y->o.scales, y->o.offsets, y->o.out_features,
                    (int)y->o.bits, (int)y->o.tile, w->o, bf16, w->scratch, 0);
    sc_rms_norm(w->o, res, y->post_norm, w->x, w->h2, N, D, m->norm_eps, bf16);
    sc_quant_linear(w->x, N, D, y->gate_up.codes, y->gate_up.scales, y->gate_up.offsets,
                    y->gate_up.out_features, (int)y->gate_up.bits, (int)y->gate_up.tile,
                    w->gu, bf16, w->scratch, 0);
    sc_silu_mul(w->gu, w->act, N, I, bf16);
    /* o is free again: the MLP's output lands there */
    sc_quant_linear(w->act, N, I, y->down.codes, y->down.scales, y->down.offsets,
                    y->down.out_features, (int)y->down.bits, (int)y->down.tile, w->o, bf16,
                    w->scratch, 0);
    add_rows(out, w->h2, w->o, N * D, bf16);
    return 0;
}

/* Run L layers over h [N, D] in place. tap_slot[l] >= 0: after layer l, h goes to columns
 * [tap_slot[l] * D, (tap_slot[l] + 1) * D) of taps [N, n_taps * D]. work: at least
 * sc_decoder_work_bytes. Returns 0, or the attention's error (its scratch not allocated). */
int sc_decoder(const sc_layer *layers, int64_t L, const sc_dims *m, void *h, int64_t N,
               const void *cos, const void *sin, const sc_batch *b, const int64_t *tap_slot,
               int64_t n_taps, void *taps, void *work, int bf16) {
    const int64_t es = bf16 ? 2 : 4, D = m->D;
    Work w = work_of(work, m, N, bf16);
    for (int64_t l = 0; l < L; l++) {
        const sc_layer *y = &layers[l];
        sc_rms_norm(h, NULL, y->input_norm, w.xin, NULL, N, D, m->norm_eps, bf16);
        int rc = layer_from(y, m, w.xin, D, h, h, N, cos, sin, b, &w, bf16);
        if (rc != 0) return rc;
        if (tap_slot[l] >= 0)
            for (int64_t i = 0; i < N; i++)
                memcpy((char *)taps + (i * n_taps + tap_slot[l]) * D * es,
                       (char *)h + i * D * es, (size_t)(D * es));
    }
    return 0;
}

/* EAGLE-3's first draft layer (draft/eagle3.py FirstLayer): attention over the token
 * embedding emb [N, D] normed by the layer's input norm beside the hidden input [N, D]
 * normed by hidden_norm (g), the residual g (norm_before_residual) or the hidden input
 * itself; out [N, D]. */
int sc_eagle3_layer(const sc_layer *y, const sc_dims *m, const void *emb, const void *hidden,
                    const void *hidden_norm, int norm_before_residual, void *out, int64_t N,
                    const void *cos, const void *sin, const sc_batch *b, void *work,
                    int bf16) {
    const int64_t es = bf16 ? 2 : 4, D = m->D;
    Work w = work_of(work, m, N, bf16);
    sc_rms_norm(hidden, NULL, hidden_norm, w.g, NULL, N, D, m->norm_eps, bf16);
    sc_rms_norm(emb, NULL, y->input_norm, w.x, NULL, N, D, m->norm_eps, bf16);
    for (int64_t i = 0; i < N; i++) {  /* the embedding first */
        memcpy((char *)w.xin + 2 * i * D * es, (char *)w.x + i * D * es, (size_t)(D * es));
        memcpy((char *)w.xin + (2 * i + 1) * D * es, (char *)w.g + i * D * es,
               (size_t)(D * es));
    }
    return layer_from(y, m, w.xin, 2 * D, norm_before_residual ? w.g : hidden, out, N, cos,
                      sin, b, &w, bf16);
}


/* What a greedy EAGLE-3 chain's draft steps read besides the layer: the token embedding
 * [V, D], the final norm, the draft's head [Vd, D] on codes and its vocabulary map
 * (target = draft + d2t[draft]), the rope tables [max_pos, Dh], the first layer's
 * hidden_norm and residual choice, whether a step feeds its normed output on (EAGLE-3.1
 * norm_output), and the S sequences' draft block tables [S, max_blocks] and root
 * positions n [S]. max_len: a bound on every position a step sees. */
typedef struct {
    const void *embed, *norm;
    sc_qlinear head;
    const int64_t *d2t;
    const void *cos, *sin, *hidden_norm;
    int64_t norm_before_residual, norm_output;
    const int64_t *block_tables;
    int64_t max_blocks, block_size;
    const int64_t *n;
    int64_t max_len;
} sc_chain;

/* Bytes of sc_eagle3_chain_step's work area for S sequences: the layer's, then the head's
 * logits [S, Vd], the embeddings [S, D], rope rows [S, Dh] twice and the batch's indices. */
int64_t sc_eagle3_chain_work_bytes(const sc_dims *m, int64_t S, int64_t Vd, int bf16) {
    int64_t es = bf16 ? 2 : 4;
    return sc_decoder_work_bytes(m, S, bf16) + S * (Vd + m->D + 2 * m->Dh) * es +
        5 * S * 8 + 64;
}

/* The first column holding a row's largest value, NaN counting as the largest (torch's
 * argmax over the fp32 logits): one element at a time, the reference of argmax_row. */
static int64_t argmax_scalar(const void *x, int64_t row, int64_t n, int bf16) {
    int64_t best = 0;
    float top = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        int64_t k = row * n + i;
        float v = bf16 ? bf16_to_f32(((const uint16_t *)x)[k]) : ((const float *)x)[k];
        if (isnan(v)) return i;
        if (v > top || i == 0) { top = v; best = i; }
    }
    return best;
}

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* Eight values from x + k as fp32 (the compiler's vectors: AVX2, AVX-512 or NEON). */
static inline v8f load8(const void *x, int64_t k, int bf16) {
    v8f v;
    if (bf16) {
        uint16_t h[8];
        v8i u;
        memcpy(h, (const uint16_t *)x + k, sizeof h);
        for (int l = 0; l < 8; l++) u[l] = (int32_t)((uint32_t)h[l] << 16);
        memcpy(&v, &u, sizeof v);
    } else {
        memcpy(&v, (const float *)x + k, sizeof v);
    }
    return v;
}

static inline v8i select8(v8i take, v8i a, v8i b) { return (a & take) | (b & ~take); }

/* argmax_scalar's pick, eight lanes at a time: each lane keeps its largest value and the
 * first column holding it (a strict `>`, as argmax_scalar's), then the first column among
 * the lanes holding the row's largest; a NaN anywhere hands the row to argmax_scalar, which
 * returns the first. Every greedy step picks over a whole vocabulary (the head's 49,152
 * columns a row), too many to compare one at a time. */
static int64_t argmax_row(const void *x, int64_t row, int64_t n, int bf16) {
    const int64_t base = row * n, whole = n - n % 8;
    if (whole == 0 || whole > INT32_MAX) return argmax_scalar(x, row, n, bf16);
    v8f m = load8(x, base, bf16);
    v8i mi, nan = m != m, at = {0, 1, 2, 3, 4, 5, 6, 7}, col = at;
    memcpy(&mi, &m, sizeof m);
    for (int64_t i = 8; i < whole; i += 8) {
        v8f v = load8(x, base + i, bf16);
        v8i vi, gt = v > m;
        nan |= v != v;
        col += 8;
        memcpy(&vi, &v, sizeof v);
        mi = select8(gt, vi, mi);
        memcpy(&m, &mi, sizeof m);
        at = select8(gt, col, at);
    }
    float top = m[0];
    for (int l = 0; l < 8; l++) {
        if (nan[l]) return argmax_scalar(x, row, n, bf16);
        top = m[l] > top ? m[l] : top;
    }
    int64_t best = n;
    for (int l = 0; l < 8; l++)
        if (m[l] == top && at[l] < best) best = at[l];
    for (int64_t i = whole; i < n; i++) {
        float v = bf16 ? bf16_to_f32(((const uint16_t *)x)[base + i])
                       : ((const float *)x)[base + i];
        if (isnan(v)) return i;
        if (v > top) { top = v; best = i; }
    }
    return best;
}

/* out[r] = the argmax of row r of x [M, N] (argmax_row's), for r < M: a greedy pick over a
 * head's logits without torch's single-threaded reduction and fp32 copy. */
void sc_argmax_rows(const void *x, int64_t M, int64_t N, int bf16, int64_t *out) {
    for (int64_t r = 0; r < M; r++) out[r] = argmax_row(x, r, N, bf16);
}

/* Token i of a draft forward over c's sequences: token t at position q of the sequence
 * whose draft block table is row `row`: its embedding and rope rows into emb, cos, sin
 * ([.., D], [.., Dh]), its cache slot, row and key count into idx ([4][N]: slots, rows,
 * visible, zeros). */
static void draft_token(const sc_chain *c, int64_t D, int64_t Dh, int64_t es, int64_t i,
                        int64_t t, int64_t q, int64_t row, void *emb, void *cos, void *sin,
                        int64_t *idx, int64_t N) {
    memcpy((char *)emb + i * D * es, (const char *)c->embed + t * D * es, (size_t)(D * es));
    memcpy((char *)cos + i * Dh * es, (const char *)c->cos + q * Dh * es, (size_t)(Dh * es));
    memcpy((char *)sin + i * Dh * es, (const char *)c->sin + q * Dh * es, (size_t)(Dh * es));
    idx[i] = c->block_tables[row * c->max_blocks + q / c->block_size] * c->block_size +
        q % c->block_size;
    idx[N + i] = row;
    idx[2 * N + i] = q + 1;
    idx[3 * N + i] = 0;
}

/* The causal batch of N draft_token rows (idx as draft_token fills it). */
static sc_batch draft_batch(const sc_chain *c, const int64_t *idx, int64_t N) {
    sc_batch b = {idx, idx + N, c->block_tables, c->max_blocks, c->block_size, idx + 2 * N,
                  idx + 3 * N, idx + 2 * N, (const uint8_t *)(idx + 3 * N), 0, c->max_len};
    return b;
}

/* Draft step j (1-based) of S greedy chains, as spec/drafter.py draft_chain's greedy path
 * takes it: token j of each chain is the argmax of the head over normed [S, D], mapped to
 * the target's vocabulary (tokens[s * stride + j]); then, unless `last`, the draft's
 * forward of those tokens at positions n + j - 1 beside the hidden h [S, D]: its K/V
 * written to the cache, h and normed replaced by the step's outputs. The same kernels in
 * the same order as the layer-by-layer path, so bit-equal to it.
 * conf [S] (NULL: none): each chain's confidence so far, multiplied here by the softmax
 * probability of its pick (draft_chain's confidence stop); where every chain's falls below
 * `stop` the step ends before the forward (its tokens are dropped, no later step runs) and
 * returns 1. Else 0, or the attention's error. */
int sc_eagle3_chain_step(const sc_layer *y, const sc_dims *m, const sc_chain *c, int64_t S,
                         int64_t j, int last, void *h, void *normed, int64_t *tokens,
                         int64_t stride, void *work, int bf16, float *conf, float stop) {
    const int64_t es = bf16 ? 2 : 4, D = m->D, Dh = m->Dh, Vd = c->head.out_features;
    Work w = work_of(work, m, S, bf16);
    char *p = (char *)work + sc_decoder_work_bytes(m, S, bf16);
    void *logits = p, *emb = p + S * Vd * es, *cos = (char *)emb + S * D * es;
    void *sin = (char *)cos + S * Dh * es;
    int64_t *idx = (int64_t *)(((uintptr_t)((char *)sin + S * Dh * es) + 7) & ~(uintptr_t)7);
    sc_quant_linear(normed, S, D, c->head.codes, c->head.scales, c->head.offsets, Vd,
                    (int)c->head.bits, (int)c->head.tile, logits, bf16, w.scratch, 0);
    int below = conf != NULL;
    for (int64_t s = 0; s < S; s++) {
        int64_t d = argmax_row(logits, s, Vd, bf16);
        tokens[s * stride + j] = d + c->d2t[d];
        if (conf != NULL) {
            conf[s] *= sc_top_prob(logits, s, Vd, d, bf16);
            below &= conf[s] < stop;
        }
    }
    if (below) return 1;
    if (last) return 0;
    for (int64_t s = 0; s < S; s++)
        draft_token(c, D, Dh, es, s, tokens[s * stride + j], c->n[s] + j - 1, s, emb, cos, sin,
                    idx, S);
    sc_batch b = draft_batch(c, idx, S);
    int rc = sc_eagle3_layer(y, m, emb, h, c->hidden_norm, (int)c->norm_before_residual, h, S,
                             cos, sin, &b, work, bf16);
    if (rc != 0) return rc;
    sc_rms_norm(h, NULL, c->norm, normed, NULL, S, D, m->norm_eps, bf16);
    if (c->norm_output) memcpy(h, normed, (size_t)(S * D * es));
    return 0;
}

/* Bytes of sc_eagle3_extend's work area for N pairs of K tap columns: the layer's, then the
 * hidden input [N, D], the embeddings [N, D], rope rows [N, Dh] twice, the batch's indices
 * and the projection's scratch. */
int64_t sc_eagle3_extend_work_bytes(const sc_dims *m, int64_t N, int64_t K, int bf16) {
    int64_t es = bf16 ? 2 : 4;
    return sc_decoder_work_bytes(m, N, bf16) + N * (2 * m->D + 2 * m->Dh) * es + 4 * N * 8 +
        SC_QUANT_SCRATCH(N, K) + 128;
}

/* EAGLE-3's draft extend (engine/draft_runner.py DraftRunner.extend) over N pending pairs:
 * pair i is the target's taps [N, K] at position pos[i] of the sequence whose draft block
 * table is row rows[i] of c's, and the token ids[i] after it. The draft's hidden input
 * fc(taps), then its forward of (ids, hidden) at pos: the embedding, the first layer (its
 * paged K/V written), the final norm, for the S pairs sel[s] (each speculating sequence's
 * last): h_out [S, D] (the layer's output, or the normed one with norm_output) and
 * normed_out [S, D]. c's head, d2t and n are not read. The same kernels in the same order
 * as Eagle3Draft.project then forward, so bit-equal to them. Returns 0, or the attention's
 * error. */
int sc_eagle3_extend(const sc_layer *y, const sc_dims *m, const sc_chain *c,
                     const sc_qlinear *fc, int64_t N, const int64_t *ids, const int64_t *pos,
                     const int64_t *rows, const void *taps, int64_t K, int64_t S,
                     const int64_t *sel, void *h_out, void *normed_out, void *work, int bf16) {
    const int64_t es = bf16 ? 2 : 4, D = m->D, Dh = m->Dh;
    char *p = (char *)work + sc_decoder_work_bytes(m, N, bf16);
    void *hid = p, *emb = p + N * D * es, *cos = (char *)emb + N * D * es;
    void *sin = (char *)cos + N * Dh * es;
    int64_t *idx = (int64_t *)(((uintptr_t)((char *)sin + N * Dh * es) + 7) & ~(uintptr_t)7);
    void *scratch = (void *)(((uintptr_t)(idx + 4 * N) + 63) & ~(uintptr_t)63);
    sc_quant_linear(taps, N, K, fc->codes, fc->scales, fc->offsets, fc->out_features,
                    (int)fc->bits, (int)fc->tile, hid, bf16, scratch, 0);
    for (int64_t i = 0; i < N; i++)
        draft_token(c, D, Dh, es, i, ids[i], pos[i], rows[i], emb, cos, sin, idx, N);
    sc_batch b = draft_batch(c, idx, N);
    int rc = sc_eagle3_layer(y, m, emb, hid, c->hidden_norm, (int)c->norm_before_residual, hid,
                             N, cos, sin, &b, work, bf16);
    if (rc != 0) return rc;
    for (int64_t s = 0; s < S; s++)
        memcpy((char *)h_out + s * D * es, (char *)hid + sel[s] * D * es, (size_t)(D * es));
    sc_rms_norm(h_out, NULL, c->norm, normed_out, NULL, S, D, m->norm_eps, bf16);
    if (c->norm_output) memcpy(h_out, normed_out, (size_t)(S * D * es));
    return 0;
}
