/* LoRA deltas of a batch whose rows use different adapters, on CPU (engines/kernels/cpu_lora.py
   builds and loads this file; engines/layers/lora.py calls it): punica's SGMV, shrink then expand,
   added in place into the linear's output. Layout, as the banks of engines/layers/lora.py:

       x:  [N, in]   (any row stride)         y:  [N, out]  (any row stride), y[dest] += delta
       A:  [S, W, in]    slot s: its rows      Bt: [S, W, out]  slot s: B transposed, scaling folded in
       segments: slots lo .. hi-1, `seg` positions each; position j of segment k takes row src[k*seg+j]
       and adds to row dest[k*seg+j]; dest == N marks padding (skipped: no work)

     shrink  h[k, j, :] = x[src] . A[lo + k]^T      [W] per position, float32
     expand  y[dest, :] += h[k, j, :] . Bt[lo + k]  vectorised along out (Bt rows contiguous)

   Each adapter's weights are read once per call whatever its rows (the memory-bound part); work
   items are (segment, rank row) for shrink and (segment, block of out) for expand, spread over
   OpenMP threads (libgomp, PyTorch's own pool), with a barrier between the two. Everything
   accumulates in float32; bf16 inputs are widened on load and the sum rounded to nearest even.
   Returns 0, or 1 when scratch memory could not be allocated. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

/* Positions are taken GROUP at a time, so that each weight element loaded feeds GROUP products held
   in registers (a group past the segment's end, or a padding position, computes on row 0 and is not
   stored). Vectors are GCC's vector extensions (16 floats: one AVX-512 register, two AVX2 ones). */
#define GROUP 4
#define OUT_VECS 4
#define OUT_BLOCK (16 * OUT_VECS)

typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));

INLINE v16 load16(const void *p, int64_t i, int bf16) {
    v16 f;
    if (bf16) {
        u16x16 half;
        memcpy(&half, (const uint16_t *)p + i, sizeof half);
        u32x16 wide = __builtin_convertvector(half, u32x16) << 16;
        memcpy(&f, &wide, sizeof f);
    } else {
        memcpy(&f, (const float *)p + i, sizeof f);
    }
    return f;
}

INLINE void store16(void *p, int64_t i, v16 f, int bf16) {
    if (!bf16) {
        memcpy((float *)p + i, &f, sizeof f);
        return;
    }
    u32x16 u;
    memcpy(&u, &f, sizeof u);
    u32x16 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16, quiet = (u >> 16) | 0x40u;
    u32x16 nan = (u32x16)((i32x16)(u & 0x7fffffffu) > 0x7f800000);  /* all ones where NaN */
    u16x16 half = __builtin_convertvector((quiet & nan) | (rounded & ~nan), u16x16);
    memcpy((uint16_t *)p + i, &half, sizeof half);
}

INLINE float hsum(v16 v) {
    float sum = 0.0f;
    for (int l = 0; l < 16; l++)
        sum += v[l];
    return sum;
}

/* h[g] = x_g . a over n elements, for GROUP rows x_g (bf16 with AVX512-BF16: vdpbf16ps on the pairs as
   they are, 32 elements an instruction, nothing widened) */
INLINE void dot_group(const void *const *x, const void *a, int64_t n, float *h, int bf16) {
    int64_t i = 0;
#if defined(__AVX512BF16__)
    if (bf16) {
        __m512 pairs[GROUP];
        for (int g = 0; g < GROUP; g++)
            pairs[g] = _mm512_setzero_ps();
        for (; i + 32 <= n; i += 32) {
            const __m512bh av = (__m512bh)_mm512_loadu_si512((const uint16_t *)a + i);
            for (int g = 0; g < GROUP; g++)
                pairs[g] = _mm512_dpbf16_ps(pairs[g], av, (__m512bh)_mm512_loadu_si512((const uint16_t *)x[g] + i));
        }
        for (int g = 0; g < GROUP; g++) {
            float sum = _mm512_reduce_add_ps(pairs[g]);
            for (int64_t t = i; t < n; t++)
                sum += load_elem(a, t, 1) * load_elem(x[g], t, 1);
            h[g] = sum;
        }
        return;
    }
#endif
    v16 acc[GROUP] = {0};
    for (; i + 16 <= n; i += 16) {
        const v16 av = load16(a, i, bf16);
        for (int g = 0; g < GROUP; g++)
            acc[g] += av * load16(x[g], i, bf16);
    }
    for (int g = 0; g < GROUP; g++) {
        float sum = hsum(acc[g]);
        for (int64_t t = i; t < n; t++)
            sum += load_elem(a, t, bf16) * load_elem(x[g], t, bf16);
        h[g] = sum;
    }
}

/* y_g[o0 .. o0+len) += sum_r hq[g, r] * bt_r[o0 .. o0+len) for the live positions g */
INLINE void expand_block(const float *hq, const char *bt, int64_t w, int64_t out, int64_t o0, int64_t len,
                         char *const *yrows, int bf16) {
    const int64_t esize = bf16 ? 2 : 4;
    if (len == OUT_BLOCK) {
        v16 acc[GROUP][OUT_VECS] = {{0}};
        for (int64_t r = 0; r < w; r++) {
            const char *brow = bt + (r * out + o0) * esize;
            v16 bv[OUT_VECS];
            for (int c = 0; c < OUT_VECS; c++)
                bv[c] = load16(brow, 16 * c, bf16);
            for (int g = 0; g < GROUP; g++)
                for (int c = 0; c < OUT_VECS; c++)
                    acc[g][c] += hq[g * w + r] * bv[c];
        }
        for (int g = 0; g < GROUP; g++)
            if (yrows[g])
                for (int c = 0; c < OUT_VECS; c++)
                    store16(yrows[g], o0 + 16 * c, load16(yrows[g], o0 + 16 * c, bf16) + acc[g][c], bf16);
        return;
    }
    for (int g = 0; g < GROUP; g++) {  /* the last, partial block */
        if (!yrows[g])
            continue;
        for (int64_t o = o0; o < o0 + len; o++) {
            float sum = load_elem(yrows[g], o, bf16);
            for (int64_t r = 0; r < w; r++)
                sum += hq[g * w + r] * load_elem(bt, r * out + o, bf16);
            store_elem(yrows[g], o, sum, bf16);
        }
    }
}

INLINE int sgmv(const void *x, int64_t x_stride, const void *a, const void *bt, void *y, int64_t y_stride,
                const int64_t *src, const int64_t *dest, int64_t lo, int64_t hi, int64_t seg, int64_t n_rows,
                int64_t in, int64_t w, int64_t out, int threads, int bf16) {
    const int64_t k = hi - lo, esize = bf16 ? 2 : 4, groups = (seg + GROUP - 1) / GROUP;
    const int64_t padded = groups * GROUP;  /* positions per segment in h */
    float *h = malloc(sizeof(float) * (size_t)(k * padded * w + 1));
    if (!h)
        return 1;
    const int64_t blocks = (out + OUT_BLOCK - 1) / OUT_BLOCK;
#pragma omp parallel num_threads(threads)
    {
        /* shrink: one rank row r of segment s, GROUP positions at a time */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < k * w * groups; item++) {
            const int64_t s = item / (w * groups), r = (item / groups) % w, q = item % groups;
            const void *rows[GROUP];
            int any = 0;
            for (int g = 0; g < GROUP; g++) {
                const int64_t j = q * GROUP + g, p = s * seg + j;
                const int live = j < seg && dest[p] < n_rows;
                rows[g] = (const char *)x + (live ? src[p] : 0) * x_stride * esize;
                any |= live;
            }
            float hv[GROUP] = {0};
            if (any)
                dot_group(rows, (const char *)a + ((lo + s) * w + r) * in * esize, in, hv, bf16);
            for (int g = 0; g < GROUP; g++)
                h[(s * padded + q * GROUP + g) * w + r] = hv[g];
        }
        /* expand: OUT_BLOCK outputs of segment s for GROUP positions, each Bt element loaded once */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < k * groups * blocks; item++) {
            const int64_t s = item / (groups * blocks), q = (item / blocks) % groups;
            const int64_t o0 = (item % blocks) * OUT_BLOCK, len = o0 + OUT_BLOCK < out ? OUT_BLOCK : out - o0;
            char *yrows[GROUP];
            int any = 0;
            for (int g = 0; g < GROUP; g++) {
                const int64_t j = q * GROUP + g, p = s * seg + j;
                yrows[g] = j < seg && dest[p] < n_rows ? (char *)y + dest[p] * y_stride * esize : NULL;
                any |= yrows[g] != NULL;
            }
            if (any)
                expand_block(h + (s * padded + q * GROUP) * w, (const char *)bt + (lo + s) * w * out * esize, w,
                             out, o0, len, yrows, bf16);
        }
    }
    free(h);
    return 0;
}

int lmi_lora_sgmv_f32(const void *x, int64_t x_stride, const void *a, const void *bt, void *y, int64_t y_stride,
                      const int64_t *src, const int64_t *dest, int64_t lo, int64_t hi, int64_t seg, int64_t n_rows,
                      int64_t in, int64_t w, int64_t out, int threads) {
    return sgmv(x, x_stride, a, bt, y, y_stride, src, dest, lo, hi, seg, n_rows, in, w, out, threads, 0);
}

int lmi_lora_sgmv_bf16(const void *x, int64_t x_stride, const void *a, const void *bt, void *y, int64_t y_stride,
                       const int64_t *src, const int64_t *dest, int64_t lo, int64_t hi, int64_t seg, int64_t n_rows,
                       int64_t in, int64_t w, int64_t out, int threads) {
    return sgmv(x, x_stride, a, bt, y, y_stride, src, dest, lo, hi, seg, n_rows, in, w, out, threads, 1);
}
