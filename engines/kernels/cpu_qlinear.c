/* int8 x int8 linear with one scale per activation row (option.quantize=int8_dynamic on CPUs with VNNI;
   engines/kernels/cpu_qlinear.py builds and loads this file).

   The arithmetic is the torch path's (engines/layers/quant.py, Int8DynamicWeight.forward), so the
   two give the same bits:

       step[r] = max(amax_k |x[r,k]|, 1e-12) / 127                 (float32)
       q[r,k]  = round_half_even(x[r,k] / step[r])                  (int8, |q| <= 127)
       y[r,n]  = ((float)(sum_k q[r,k] w[n,k]) * step[r]) * scale[n] (int32 sums, exact)

   and y is rounded to the activations' dtype (bf16: to nearest even). What differs is how the int32
   sums are formed. The activations are stored as unsigned bytes q + 128, so that AVX-512 VNNI's
   vpdpbusd (u8 x s8, four products summed into each int32 lane) multiplies them with the signed
   weights; the 128 * sum_k w[n,k] this adds is subtracted once per output (`wsum`, computed when
   the weight is packed). The weights are [N, Kp] int8, rows padded with zeros to a multiple of 64
   (the activations' padding is 128: a zero). A lone row (one client's decode: memory-bound) takes
   each weight row in one sequential pass, two accumulators, prefetching 1 KiB ahead; measured on a
   2-core Zen 4 with the model's 49 weights cold, 4.5 ms where torch._int_mm took 7.4 (PyTorch's
   own sum of the same bytes: 2.8-3.6 ms). More rows are tiled 4 rows x 4 columns: each 64-byte step
   of K loads four weight and four activation vectors for sixteen vpdpbusd, a weight row read once
   per four activation rows (torch._int_mm's blocked GEMM is faster from about 16 rows on, which
   engines/layers/cpu_linear.py measures). Column tiles are spread over OpenMP threads. Without AVX-512 VNNI the
   same loops run in plain C (the compiler vectorises what it can). Returns 0, or 1 when scratch
   memory could not be allocated. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define LMI_VNNI 1
#endif

#include "cpu_kernels.h"

#define TILE 4
#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif

/* One row of activations to bytes q + offset (128: u8 for the s8 weights; 0: s8 for the int4 ones)
   and its step; the K..Kp padding to `offset` (a zero). */
static void quantize_row(const void *x, int bf16, int64_t k_len, int64_t kp, uint8_t *out, float *step, int offset) {
    float amax = 0.0f;
    int nan = 0;
    for (int64_t k = 0; k < k_len; k++) {
        const float v = fabsf(load_elem(x, k, bf16));
        nan |= v != v;
        amax = v > amax ? v : amax;
    }
    const float s = nan ? NAN : (amax > 1e-12f ? amax : 1e-12f) / 127.0f;
    *step = s;
    for (int64_t k = 0; k < k_len; k++)
        out[k] = nan ? (uint8_t)offset : (uint8_t)((int)nearbyintf(load_elem(x, k, bf16) / s) + offset);
    for (int64_t k = k_len; k < kp; k++)
        out[k] = (uint8_t)offset;
}

/* sums[i][j] = sum_k xq[i][k] w[j][k] (u8 x s8) for a tile of `rows` x `cols` (each <= TILE): called
   with constant sizes, so that the loops unroll and the accumulators stay in registers. */
INLINE void tile_sums(const uint8_t *xq, const int8_t *w, int64_t kp, int rows, int cols,
                      int32_t sums[TILE][TILE]) {
#ifdef LMI_VNNI
    __m512i acc[TILE][TILE];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++)
            acc[i][j] = _mm512_setzero_si512();
    for (int64_t k = 0; k < kp; k += 64) {
        __m512i wv[TILE];
        for (int j = 0; j < cols; j++) {
            _mm_prefetch((const char *)(w + (j + PREFETCH_ROWS) * kp + k), _MM_HINT_T0);
            wv[j] = _mm512_loadu_si512((const void *)(w + j * kp + k));
        }
        for (int i = 0; i < rows; i++) {
            const __m512i xv = _mm512_loadu_si512((const void *)(xq + i * kp + k));
            for (int j = 0; j < cols; j++)
                acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++)
            sums[i][j] = _mm512_reduce_add_epi32(acc[i][j]);
#else
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            int32_t s = 0;
            const uint8_t *a = xq + i * kp;
            const int8_t *b = w + j * kp;
            for (int64_t k = 0; k < kp; k++)
                s += (int32_t)a[k] * (int32_t)b[k];
            sums[i][j] = s;
        }
#endif
}

#ifdef LMI_VNNI
/* one activation row: each weight row's dot product over K in one sequential pass, two accumulators */
INLINE int32_t row_dot(const uint8_t *xq, const int8_t *w, int64_t kp) {
    __m512i a0 = _mm512_setzero_si512(), a1 = _mm512_setzero_si512();
    int64_t k = 0;
    for (; k + 128 <= kp; k += 128) {
        _mm_prefetch((const char *)(w + k + 1024), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k + 1088), _MM_HINT_T0);
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512((const void *)(xq + k)), _mm512_loadu_si512((const void *)(w + k)));
        a1 = _mm512_dpbusd_epi32(a1, _mm512_loadu_si512((const void *)(xq + k + 64)), _mm512_loadu_si512((const void *)(w + k + 64)));
    }
    if (k < kp)
        a0 = _mm512_dpbusd_epi32(a0, _mm512_loadu_si512((const void *)(xq + k)), _mm512_loadu_si512((const void *)(w + k)));
    return _mm512_reduce_add_epi32(_mm512_add_epi32(a0, a1));
}
#endif

static void tile_any(const uint8_t *xq, const int8_t *w, int64_t kp, int rows, int cols, int32_t sums[TILE][TILE]) {
    /* the constant-size instances (rows, cols in 1..TILE) */
#define CASE(r, c) case (r) * 8 + (c): tile_sums(xq, w, kp, r, c, sums); return;
    switch (rows * 8 + cols) {
        CASE(1, 1) CASE(1, 2) CASE(1, 3) CASE(1, 4)
        CASE(2, 1) CASE(2, 2) CASE(2, 3) CASE(2, 4)
        CASE(3, 1) CASE(3, 2) CASE(3, 3) CASE(3, 4)
        CASE(4, 1) CASE(4, 2) CASE(4, 3) CASE(4, 4)
    }
#undef CASE
}

/* y[rows, n_out] (row stride y_stride, in x's dtype) = the int8 product of x[rows, k_len] (row stride
   x_stride, float32 or bf16) and the packed weight w[n_out, kp] (int8), wsum[n] = 128 * sum_k w[n,k],
   scale[n] the weight rows' float32 scales. */
int lmi_qlinear_s8(const void *x, int64_t x_stride, int bf16, int64_t rows, int64_t k_len, const int8_t *w,
                   const int32_t *wsum, const float *scale, int64_t kp, int64_t n_out, void *y, int64_t y_stride,
                   int threads) {
    uint8_t *xq = aligned_alloc(64, (size_t)(rows * kp + 64));
    float *step = malloc(sizeof(float) * (size_t)rows);
    if (!xq || !step) {
        free(xq);
        free(step);
        return 1;
    }
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++)
        quantize_row((const char *)x + r * x_stride * esize, bf16, k_len, kp, xq + r * kp, step + r, 128);
#ifdef LMI_VNNI
    if (rows == 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t n = 0; n < n_out; n++) {
            const float v = ((float)(row_dot(xq, w + n * kp, kp) - wsum[n]) * step[0]) * scale[n];
            store_elem(y, n, v, bf16);
        }
        free(xq);
        free(step);
        return 0;
    }
#endif
    const int64_t col_tiles = (n_out + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < col_tiles; t++) {
        const int64_t n0 = t * TILE;
        const int cols = n_out - n0 < TILE ? (int)(n_out - n0) : TILE;
        int32_t sums[TILE][TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int nr = rows - r0 < TILE ? (int)(rows - r0) : TILE;
            tile_any(xq + r0 * kp, w + n0 * kp, kp, nr, cols, sums);
            for (int i = 0; i < nr; i++)
                for (int j = 0; j < cols; j++) {
                    const float v = ((float)(sums[i][j] - wsum[n0 + j]) * step[r0 + i]) * scale[n0 + j];
                    store_elem((char *)y + (r0 + i) * y_stride * esize, n0 + j, v, bf16);
                }
        }
    }
    free(xq);
    free(step);
    return 0;
}

/* int4 weights x int8 activations (option.quantize=int4 on CPUs with VNNI, chosen by measurement
   against PyTorch's weight-only int4 kernel; llama.cpp's Q4_0 x Q8 arithmetic with one activation
   scale per row instead of per 32). Weights: q in 0..15 per group of 32 inputs with a scale s and a
   zero point z, W = (q - 8) s + z (engines/layers/quant.py's int4_quantize). With the activations
   quantised as above (s8, step[r]) and per group D = sum q xq, X = sum xq (int32, exact):

       y[r,n] = step[r] * (sum_g s[n,g] D[r,n,g] + sum_g c[n,g] X[r,g]),   c = z - 8 s

   in float32. Layout: each weight row is Kp / 128 blocks of 64 bytes, byte j of block b holding
   q[128 b + j] in its low nibble and q[128 b + 64 + j] in its high one, so that one 64-byte load
   gives two vectors of 64 consecutive q (u8) for vpdpbusd against 64 consecutive s8 activations;
   s and c are float32 [N, Kp / 32]. Each int32 lane of a vpdpbusd sums four products of one group
   (lanes 0-7: the first group of the 64, 8-15: the second), so the lanes are converted to float and
   multiplied by their group's scale (a permute of four scales) into a float32 accumulator: no
   horizontal sum until the row's end. Tiles: up to 4 activation rows per weight row, the weight
   block unpacked once for them. Returns 0, or 1 when scratch memory could not be allocated. */

INLINE void w4a8_tile(const int8_t *xq, const float *xsum, const float *step, int rows, int64_t kp,
                      const uint8_t *nib, const float *s, const float *c, float out[TILE]) {
    const int64_t groups = kp / 32;
#ifdef LMI_VNNI
    /* two accumulators a row (the block's first and second 64 inputs: two FMA chains, not one), and
       the c X terms four groups at a time */
    __m512 acc0[TILE], acc1[TILE];
    __m128 accc[TILE];
    for (int i = 0; i < rows; i++) {
        acc0[i] = acc1[i] = _mm512_setzero_ps();
        accc[i] = _mm_setzero_ps();
    }
    const __m512i low = _mm512_set1_epi8(0x0f);
    const __m512i first = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i second = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
    for (int64_t b = 0; b < kp / 128; b++) {
        _mm_prefetch((const char *)(nib + b * 64 + 512), _MM_HINT_T0);
        const __m512i packed = _mm512_loadu_si512((const void *)(nib + b * 64));
        const __m512i q0 = _mm512_and_si512(packed, low);
        const __m512i q1 = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
        const __m128 s4 = _mm_loadu_ps(s + b * 4), c4 = _mm_loadu_ps(c + b * 4);
        const __m512 s0 = _mm512_permutexvar_ps(first, _mm512_castps128_ps512(s4));
        const __m512 s1 = _mm512_permutexvar_ps(second, _mm512_castps128_ps512(s4));
        for (int i = 0; i < rows; i++) {
            const int8_t *xr = xq + i * kp + b * 128;
            const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q0, _mm512_loadu_si512((const void *)xr));
            const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q1,
                                                   _mm512_loadu_si512((const void *)(xr + 64)));
            acc0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d0), s0, acc0[i]);
            acc1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), s1, acc1[i]);
            accc[i] = _mm_fmadd_ps(c4, _mm_loadu_ps(xsum + i * groups + b * 4), accc[i]);
        }
    }
    for (int i = 0; i < rows; i++) {
        const __m128 h = _mm_add_ps(accc[i], _mm_movehl_ps(accc[i], accc[i]));
        const float cx = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
        out[i] = step[i] * (_mm512_reduce_add_ps(_mm512_add_ps(acc0[i], acc1[i])) + cx);
    }
#else
    for (int i = 0; i < rows; i++) {
        float acc = 0.0f, cx = 0.0f;
        for (int64_t b = 0; b < kp / 128; b++)
            for (int h = 0; h < 2; h++)
                for (int g = 0; g < 2; g++) {
                    int32_t d = 0;
                    for (int j = 32 * g; j < 32 * g + 32; j++) {
                        const int q = h ? nib[b * 64 + j] >> 4 : nib[b * 64 + j] & 15;
                        d += q * xq[i * kp + b * 128 + 64 * h + j];
                    }
                    acc += (float)d * s[b * 4 + 2 * h + g];
                }
        for (int64_t g = 0; g < groups; g++)
            cx += c[g] * xsum[i * groups + g];
        out[i] = step[i] * (acc + cx);
    }
#endif
}

static void w4a8_any(const int8_t *xq, const float *xsum, const float *step, int rows, int64_t kp,
                     const uint8_t *nib, const float *s, const float *c, float out[TILE]) {
    switch (rows) {  /* constant tile heights: the accumulators stay in registers */
    case 1: w4a8_tile(xq, xsum, step, 1, kp, nib, s, c, out); return;
    case 2: w4a8_tile(xq, xsum, step, 2, kp, nib, s, c, out); return;
    case 3: w4a8_tile(xq, xsum, step, 3, kp, nib, s, c, out); return;
    default: w4a8_tile(xq, xsum, step, 4, kp, nib, s, c, out); return;
    }
}

/* y[rows, n_out] (row stride y_stride, x's dtype) = x[rows, k_len] (row stride x_stride) times the int4
   weight: nib [n_out, kp / 2] in the layout above, s and c [n_out, kp / 32] float32. */
int lmi_qlinear_w4a8(const void *x, int64_t x_stride, int bf16, int64_t rows, int64_t k_len, const uint8_t *nib,
                     const float *s, const float *c, int64_t kp, int64_t n_out, void *y, int64_t y_stride,
                     int threads) {
    const int64_t groups = kp / 32;
    int8_t *xq = aligned_alloc(64, (size_t)(rows * kp + 64));
    float *step = malloc(sizeof(float) * (size_t)rows);
    float *xsum = malloc(sizeof(float) * (size_t)(rows * groups));
    if (!xq || !step || !xsum) {
        free(xq);
        free(step);
        free(xsum);
        return 1;
    }
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++) {
        quantize_row((const char *)x + r * x_stride * esize, bf16, k_len, kp, (uint8_t *)(xq + r * kp), step + r, 0);
        for (int64_t g = 0; g < groups; g++) {
            int32_t sum = 0;
            for (int k = 0; k < 32; k++)
                sum += xq[r * kp + g * 32 + k];
            xsum[r * groups + g] = (float)sum;
        }
    }
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        float out[TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int nr = rows - r0 < TILE ? (int)(rows - r0) : TILE;
            w4a8_any(xq + r0 * kp, xsum + r0 * groups, step + r0, nr, kp, nib + n * (kp / 2), s + n * groups,
                     c + n * groups, out);
            for (int i = 0; i < nr; i++)
                store_elem((char *)y + (r0 + i) * y_stride * esize, n, out[i], bf16);
        }
    }
    free(xq);
    free(step);
    free(xsum);
    return 0;
}
