/* The kernels one C file of the native library calls in another (cpu_kernels.c,
 * quant_kernels.c), declared once: decoder.c chains them, and their own files include this
 * so a definition that drifts from its declaration does not compile. */
#ifndef SPECSCOPE_KERNELS_H
#define SPECSCOPE_KERNELS_H
#include <stdint.h>

void sc_rms_norm(const void *x, const void *residual, const void *w, void *out, void *h,
                 int64_t N, int64_t D, float eps, int bf16);
void sc_silu_mul(const void *gate_up, void *out, int64_t N, int64_t I, int bf16);
int sc_attend_qkv(const void *qkv, int64_t N, int64_t H, int64_t Hkv, int64_t D,
                  const void *cos, const void *sin, void *k_cache, void *v_cache,
                  const int64_t *slots, const int64_t *seq_index, const int64_t *block_tables,
                  int64_t max_blocks, int64_t block_size, const int64_t *visible,
                  const int64_t *window_start, const int64_t *tree_start,
                  const uint8_t *tree_mask, int64_t T, int64_t max_len,
                  const void *q_norm, const void *k_norm, float eps, float scale, void *out,
                  int bf16, int64_t max_bytes);
/* sc_quant_linear's scratch for M rows of K inputs: the 8-bit codes, then per block of 32
 * the scale, the offset term's factor and the 8-bit codes' offset (4 bytes each). */
#define SC_QUANT_SCRATCH(M, K) ((M) * (K) + 12 * (M) * ((K) / 32))
void sc_quant_linear(const void *x, int64_t M, int64_t K, const uint8_t *w, const float *wd,
                     const float *wm, int64_t N, int bits, int T, void *y, int bf16,
                     void *scratch, int reference);

float sc_top_prob(const void *x, int64_t row, int64_t n, int64_t best, int bf16);

#endif
