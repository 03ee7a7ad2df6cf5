/* Dense linear y = x W^T on CPU for float32 and bf16 weights (engines/kernels/cpu_gemm.py builds and
   loads this file; engines/layers/cpu_linear.py measures it against PyTorch's kernels at load and uses
   it where it is faster).

   At one client's decode a linear is a matrix-vector product: every weight byte is read once and used
   once, so its speed is the memory's. A lone row takes each weight row in one sequential pass with two
   accumulators, prefetching ahead; more rows are tiled 4 rows x 4 columns (each step of K: four weight
   and four activation vectors, sixteen products), a weight row read once per four activation rows.
   Columns are spread over OpenMP threads. Arithmetic, everything summed in float32:

     bf16   vdpbf16ps (AVX512-BF16): pairs of bf16 products into float32 lanes; bf16 activations
     f32    vfmadd (AVX-512F, or AVX2 + FMA eight lanes wide) on float32 activations and weights

   and the lanes summed at the end of each row, y rounded to the activations' dtype (bf16: to nearest
   even). Without those instructions the same loops run in plain C. */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

#define TILE 4

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define LMI_BF16 1
#endif

/* --- float32 ------------------------------------------------------------------------------------ */

#if defined(__AVX2__) && !defined(__AVX512F__)
INLINE float hsum256(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#endif

INLINE void f32_tile(const float *x, int64_t x_stride, const float *w, int64_t k_len, int rows, int cols,
                     float sums[TILE][TILE]) {
#if defined(__AVX512F__)
    __m512 acc[TILE][TILE];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++)
            acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= k_len; k += 16) {
        __m512 wv[TILE];
        for (int j = 0; j < cols; j++)
            wv[j] = _mm512_loadu_ps(w + j * k_len + k);
        for (int i = 0; i < rows; i++) {
            const __m512 xv = _mm512_loadu_ps(x + i * x_stride + k);
            for (int j = 0; j < cols; j++)
                acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    if (k < k_len) {  /* the tail, masked */
        const __mmask16 m = (__mmask16)((1u << (k_len - k)) - 1);
        for (int i = 0; i < rows; i++) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + i * x_stride + k);
            for (int j = 0; j < cols; j++)
                acc[i][j] = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, w + j * k_len + k), acc[i][j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++)
            sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[TILE][TILE];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++)
            acc[i][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= k_len; k += 8) {
        __m256 wv[TILE];
        for (int j = 0; j < cols; j++)
            wv[j] = _mm256_loadu_ps(w + j * k_len + k);
        for (int i = 0; i < rows; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * x_stride + k);
            for (int j = 0; j < cols; j++)
                acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            float s = hsum256(acc[i][j]);
            for (int64_t t = k; t < k_len; t++)  /* the tail */
                s += x[i * x_stride + t] * w[j * k_len + t];
            sums[i][j] = s;
        }
#else
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < k_len; k++)
                s += x[i * x_stride + k] * w[j * k_len + k];
            sums[i][j] = s;
        }
#endif
}

/* --- bf16 --------------------------------------------------------------------------------------- */

INLINE void bf16_tile(const uint16_t *x, int64_t x_stride, const uint16_t *w, int64_t k_len, int rows, int cols,
                      float sums[TILE][TILE]) {
#ifdef LMI_BF16
    __m512 acc[TILE][TILE];
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++)
            acc[i][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= k_len; k += 32) {
        __m512bh wv[TILE];
        for (int j = 0; j < cols; j++)
            wv[j] = (__m512bh)_mm512_loadu_si512((const void *)(w + j * k_len + k));
        for (int i = 0; i < rows; i++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(x + i * x_stride + k));
            for (int j = 0; j < cols; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
        }
    }
    if (k < k_len) {  /* the tail, masked (zeros add nothing) */
        const __mmask32 m = (__mmask32)((1ull << (k_len - k)) - 1);
        for (int i = 0; i < rows; i++) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(m, x + i * x_stride + k);
            for (int j = 0; j < cols; j++)
                acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, (__m512bh)_mm512_maskz_loadu_epi16(m, w + j * k_len + k));
        }
    }
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++)
            sums[i][j] = _mm512_reduce_add_ps(acc[i][j]);
#else
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            float s = 0.0f;
            for (int64_t k = 0; k < k_len; k++)
                s += load_elem(x, i * x_stride + k, 1) * load_elem(w, j * k_len + k, 1);
            sums[i][j] = s;
        }
#endif
}

/* one row: each weight row in one sequential pass, two accumulators, prefetching 1 KiB ahead */
INLINE float f32_row(const float *x, const float *w, int64_t k_len) {
#if defined(__AVX512F__)
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= k_len; k += 32) {
        _mm_prefetch((const char *)(w + k + 256), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k + 272), _MM_HINT_T0);
        a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_loadu_ps(w + k), a0);
        a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16), _mm512_loadu_ps(w + k + 16), a1);
    }
    for (; k < k_len; k += 16) {
        const __mmask16 m = k_len - k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (k_len - k)) - 1);
        a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, x + k), _mm512_maskz_loadu_ps(m, w + k), a0);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= k_len; k += 16) {
        _mm_prefetch((const char *)(w + k + 256), _MM_HINT_T0);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), a1);
    }
    float s = hsum256(_mm256_add_ps(a0, a1));
    for (; k < k_len; k++)
        s += x[k] * w[k];
    return s;
#else
    float sums[TILE][TILE];
    f32_tile(x, 0, w, k_len, 1, 1, sums);
    return sums[0][0];
#endif
}

INLINE float bf16_row(const uint16_t *x, const uint16_t *w, int64_t k_len) {
#ifdef LMI_BF16
    __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= k_len; k += 64) {
        _mm_prefetch((const char *)(w + k + 512), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + k + 544), _MM_HINT_T0);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512((const void *)(x + k)),
                              (__m512bh)_mm512_loadu_si512((const void *)(w + k)));
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512((const void *)(x + k + 32)),
                              (__m512bh)_mm512_loadu_si512((const void *)(w + k + 32)));
    }
    for (; k < k_len; k += 32) {
        const __mmask32 m = k_len - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1ull << (k_len - k)) - 1);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_maskz_loadu_epi16(m, x + k),
                              (__m512bh)_mm512_maskz_loadu_epi16(m, w + k));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#else
    float sums[TILE][TILE];
    bf16_tile(x, 0, w, k_len, 1, 1, sums);
    return sums[0][0];
#endif
}

#define CASES(tile, ...)                                                                                  \
    switch (rows * 8 + cols) {                                                                            \
    case 9: tile(__VA_ARGS__, 1, 1, sums); break;  case 10: tile(__VA_ARGS__, 1, 2, sums); break;         \
    case 11: tile(__VA_ARGS__, 1, 3, sums); break; case 12: tile(__VA_ARGS__, 1, 4, sums); break;         \
    case 17: tile(__VA_ARGS__, 2, 1, sums); break; case 18: tile(__VA_ARGS__, 2, 2, sums); break;         \
    case 19: tile(__VA_ARGS__, 2, 3, sums); break; case 20: tile(__VA_ARGS__, 2, 4, sums); break;         \
    case 25: tile(__VA_ARGS__, 3, 1, sums); break; case 26: tile(__VA_ARGS__, 3, 2, sums); break;         \
    case 27: tile(__VA_ARGS__, 3, 3, sums); break; case 28: tile(__VA_ARGS__, 3, 4, sums); break;         \
    case 33: tile(__VA_ARGS__, 4, 1, sums); break; case 34: tile(__VA_ARGS__, 4, 2, sums); break;         \
    case 35: tile(__VA_ARGS__, 4, 3, sums); break; default: tile(__VA_ARGS__, 4, 4, sums); break;         \
    }

/* y [rows, n_out] (row stride y_stride) = x [rows, k_len] (row stride x_stride) W^T, W [n_out, k_len]
   contiguous; x, W and y all float32 (bf16 = 0) or all bf16 (bf16 = 1). */
void lmi_gemm(const void *x, int64_t x_stride, const void *w, int64_t rows, int64_t k_len, int64_t n_out, void *y,
              int64_t y_stride, int bf16, int threads) {
    if (rows == 1) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t n = 0; n < n_out; n++) {
            const float v = bf16 ? bf16_row((const uint16_t *)x, (const uint16_t *)w + n * k_len, k_len)
                                 : f32_row((const float *)x, (const float *)w + n * k_len, k_len);
            store_elem(y, n, v, bf16);
        }
        return;
    }
    const int64_t col_tiles = (n_out + TILE - 1) / TILE;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < col_tiles; t++) {
        const int64_t n0 = t * TILE;
        const int cols = n_out - n0 < TILE ? (int)(n_out - n0) : TILE;
        float sums[TILE][TILE];
        for (int64_t r0 = 0; r0 < rows; r0 += TILE) {
            const int rows_here = rows - r0 < TILE ? (int)(rows - r0) : TILE;
            {
                const int rows = rows_here;
                if (bf16) {
                    CASES(bf16_tile, (const uint16_t *)x + r0 * x_stride, x_stride, (const uint16_t *)w + n0 * k_len,
                          k_len)
                } else {
                    CASES(f32_tile, (const float *)x + r0 * x_stride, x_stride, (const float *)w + n0 * k_len, k_len)
                }
            }
            for (int i = 0; i < rows_here; i++)
                for (int j = 0; j < cols; j++)
                    store_elem((char *)y + (r0 + i) * y_stride * (bf16 ? 2 : 4), n0 + j, sums[i][j], bf16);
        }
    }
}
