/* bf16 <-> fp32 for specscope's CPU kernels (cpu_kernels.c, quant_kernels.c): bf16 is the
 * top half of an fp32; rounding to it is to nearest even, a NaN stays a NaN. */
#ifndef SPECSCOPE_BF16_H
#define SPECSCOPE_BF16_H
#include <stdint.h>

static inline float bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}

static inline uint16_t f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40u);  /* NaN */
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}

#endif
