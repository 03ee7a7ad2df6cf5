/* What the CPU kernels share (cpu_attention.c, cpu_lora.c): float32 / bf16 element access, every sum
   in float32, bf16 written by rounding to nearest even (NaN stays NaN). cpu_attention.cached_build keys
   each kernel's build on this file too. */
#ifndef LMI_CPU_KERNELS_H
#define LMI_CPU_KERNELS_H
#include <stdint.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

INLINE float load_elem(const void *p, int64_t i, int bf16) {
    if (bf16) {
        uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)p)[i];
}

INLINE void store_elem(void *p, int64_t i, float x, int bf16) {
    if (!bf16) {
        ((float *)p)[i] = x;
        return;
    }
    uint32_t u;
    memcpy(&u, &x, 4);
    ((uint16_t *)p)[i] = (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)((u >> 16) | 0x40u)  /* NaN stays NaN */
                                                        : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#endif
