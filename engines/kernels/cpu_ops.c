/* The per-layer elementwise ops on CPU in one call each (engines/kernels/cpu_ops.py builds and loads
   this file): residual add + RMSNorm, and rotary position embedding. In eager PyTorch each is 8-14
   small ops (a dispatch and an allocation apiece): at one client's decode they cost more than the
   arithmetic. Numerics are engines/kernels/torch_ops.py's, rounding where it rounds; built with
   -ffp-contract=off so that no product and sum are fused where PyTorch rounds between them.

   add_rms_norm, per row: r = x + residual (rounded to the dtype; x when there is no residual),
   rf = r in float32, inv = 1 / sqrt(sum(rf^2) / n + eps), y = round(w * round(rf * inv)). The one
   difference from PyTorch: the order of the sum of squares (here 16 partial sums, one per vector
   lane), a last-bit change in float32 that rarely reaches a bf16 rounding.

   rotary (neox "rotate half", the first rot_dim dims of each head, in place): for i < h = rot_dim / 2,
       x1 = x[i], x2 = x[i + h], c = round(cos[pos, .]), s = round(sin[pos, .])
       x[i] = round(round(x1 c_i) - round(x2 s_i)),  x[i + h] = round(round(x2 c_{i+h}) + round(x1 s_{i+h}))
   (round: to the dtype; float32: the products and the sum each rounded once, as PyTorch's ops do) —
   bit for bit PyTorch's. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_kernels.h"

#define LANES 16 /* partial sums of squares: one vector's lanes (the loops below vectorise) */

/* v rounded to bf16 (to nearest even; NaN stays NaN) and widened back, or v itself for float32:
   arithmetic only, so that loops of it vectorise */
INLINE float round_to(float v, int bf16) {
    if (!bf16)
        return v;
    uint32_t u;
    memcpy(&u, &v, 4);
    u = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x400000u) & 0xffff0000u : (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    float out;
    memcpy(&out, &u, 4);
    return out;
}

INLINE float load_f(const void *p, int64_t i, int bf16) {
    if (bf16) {
        const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    return ((const float *)p)[i];
}

/* v, already a bf16 value when bf16 (round_to), stored */
INLINE void store_rounded(void *p, int64_t i, float v, int bf16) {
    if (bf16) {
        uint32_t u;
        memcpy(&u, &v, 4);
        ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
    } else {
        ((float *)p)[i] = v;
    }
}

INLINE void norm_row(const void *xr, const void *resr, const void *w, int w_bf16, void *yr, void *rr, int64_t n,
                     float eps, int bf16) {
    float part[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++) {
            float v = load_f(xr, i + l, bf16);
            if (resr) {
                v = round_to(v + load_f(resr, i + l, bf16), bf16);
                store_rounded(rr, i + l, v, bf16);
            }
            const float sq = v * v;
            part[l] += sq;
        }
    for (; i < n; i++) {
        float v = load_f(xr, i, bf16);
        if (resr) {
            v = round_to(v + load_f(resr, i, bf16), bf16);
            store_rounded(rr, i, v, bf16);
        }
        const float sq = v * v;
        part[i % LANES] += sq;
    }
    float ss = 0.0f;
    for (int l = 0; l < LANES; l++)
        ss += part[l];
    const float inv = 1.0f / sqrtf(ss / (float)n + eps);
    const void *src = resr ? rr : xr;
    for (i = 0; i < n; i++) {
        const float normed = round_to(load_f(src, i, bf16) * inv, bf16);
        store_rounded(yr, i, round_to(load_f(w, i, w_bf16) * normed, bf16), bf16);
    }
}

/* x, residual (NULL: none), y, r: [rows, n] with row strides; w [n]; r written only with a residual. */
void lmi_add_rms_norm(const void *x, int64_t x_stride, const void *res, int64_t res_stride, const void *w, int w_bf16,
                      void *y, int64_t y_stride, void *r, int64_t r_stride, int64_t rows, int64_t n, float eps,
                      int bf16, int threads) {
    const size_t esize = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 16384)
    for (int64_t row = 0; row < rows; row++) {
        const char *xr = (const char *)x + row * x_stride * esize;
        const char *resr = res ? (const char *)res + row * res_stride * esize : 0;
        char *yr = (char *)y + row * y_stride * esize, *rr = res ? (char *)r + row * r_stride * esize : 0;
        if (bf16)  /* constant dtypes: each loop compiled (and vectorised) for its own */
            w_bf16 ? norm_row(xr, resr, w, 1, yr, rr, n, eps, 1) : norm_row(xr, resr, w, 0, yr, rr, n, eps, 1);
        else
            norm_row(xr, resr, w, w_bf16, yr, rr, n, eps, 0);
    }
}

INLINE void rotate_heads(char *base, int64_t heads, int64_t head_stride, int64_t half, const float *cos,
                         const float *sin, int bf16) {
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t h = 0; h < heads; h++) {
        char *x = base + h * head_stride * esize;
        for (int64_t i = 0; i < half; i++) {
            const float x1 = load_f(x, i, bf16), x2 = load_f(x, i + half, bf16);
            const float c1 = round_to(cos[i], bf16), s1 = round_to(sin[i], bf16);
            const float c2 = round_to(cos[i + half], bf16), s2 = round_to(sin[i + half], bf16);
            const float a = round_to(x1 * c1, bf16), b = round_to(x2 * s1, bf16);
            const float c = round_to(x2 * c2, bf16), d = round_to(x1 * s2, bf16);
            store_rounded(x, i, round_to(a - b, bf16), bf16);
            store_rounded(x, i + half, round_to(c + d, bf16), bf16);
        }
    }
}

/* q [rows, hq, D] and k [rows, hk, D] (token and head strides in elements, dims contiguous), rotated in
   place; positions [rows] int64; cos, sin float32 [P, table_stride]. */
void lmi_rotary_neox(const int64_t *positions, int64_t rows, void *q, int64_t q_token_stride, int64_t q_head_stride,
                     int64_t hq, void *k, int64_t k_token_stride, int64_t k_head_stride, int64_t hk, const float *cos,
                     const float *sin, int64_t table_stride, int64_t half, int bf16, int threads) {
    const size_t esize = bf16 ? 2 : 4;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows >= 16)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + positions[t] * table_stride, *s = sin + positions[t] * table_stride;
        if (bf16) {  /* constant dtypes: each loop compiled (and vectorised) for its own */
            rotate_heads((char *)q + t * q_token_stride * esize, hq, q_head_stride, half, c, s, 1);
            rotate_heads((char *)k + t * k_token_stride * esize, hk, k_head_stride, half, c, s, 1);
        } else {
            rotate_heads((char *)q + t * q_token_stride * esize, hq, q_head_stride, half, c, s, 0);
            rotate_heads((char *)k + t * k_token_stride * esize, hk, k_head_stride, half, c, s, 0);
        }
    }
}
