/* Dense linear y = x W^T on CPU for float32 and bf16 weights (engines/kernels/cpu_gemm.py builds and
   loads this file; engines/layers/cpu_linear.py measures it against PyTorch's kernels at load and uses
   it where it is faster).

   The weight is packed once, as oneDNN packs it: blocks of 32 output columns, each input's 32 column
   weights side by side (bf16: each input pair's, for vdpbf16ps). A step of K broadcasts one
   activation (bf16: one pair) to every lane and multiplies it into the block's 32 columns: no
   horizontal sums, an activation read once per 32 columns, the weights streamed in order. Tiles of
   up to 8 rows x 32 columns (16 accumulators; AVX2: 2 rows, its 16 registers); blocks are spread
   over OpenMP threads. At one row (one client's decode) a linear reads every weight byte once, so
   its speed is the memory's: measured on a 2-core Zen 4 over the small model's 49 weights, bf16 at
   one row 4.8-6.5 ms (32-44 GB/s) where oneDNN's own packed linear took 8.9-9.6. Arithmetic, all
   sums in float32:

     bf16   vdpbf16ps (AVX512-BF16): exact products of bf16 pairs added into float32 lanes; bf16 out
            (rounded to nearest even)
     f32    vfmadd (AVX-512F, or AVX2 + FMA eight lanes wide)

   Where a build has neither, the entry points return 1 and do nothing (cpu_gemm.py offers the kernel
   only where its instructions are: cpu_gemm.vectorised_here). */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define LMI_BF16 1
#endif

/* --- bf16, packed in pairs for vdpbf16ps -------------------------------------------------------- */

/* [N / 32][K / 2][32][2] bf16: column c's inputs 2p and 2p + 1 side by side, zeros where N or K run
   out; each step: one activation pair broadcast, two vdpbf16ps (32 columns). */
#define PACK_COLS 32

void lmi_pack_bf16(const uint16_t *w, int64_t n_out, int64_t k_len, uint16_t *packed) {
    const int64_t pairs = (k_len + 1) / 2, blocks = (n_out + PACK_COLS - 1) / PACK_COLS;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t p = 0; p < pairs; p++)
            for (int64_t c = 0; c < PACK_COLS; c++)
                for (int64_t h = 0; h < 2; h++) {
                    const int64_t n = b * PACK_COLS + c, k = 2 * p + h;
                    packed[((b * pairs + p) * PACK_COLS + c) * 2 + h] = n < n_out && k < k_len ? w[n * k_len + k] : 0;
                }
}

#ifdef LMI_BF16
INLINE __m512bh pair_at(const uint16_t *x, int64_t p, int64_t k_len) {
    uint32_t v;
    if (2 * p + 1 < k_len)
        memcpy(&v, x + 2 * p, 4);
    else
        v = x[2 * p];  /* an odd K's last input, its pair zero */
    return (__m512bh)_mm512_set1_epi32((int)v);
}

INLINE void packed_tile(const uint16_t *x, int64_t x_stride, const uint16_t *block, int64_t pairs, int64_t k_len,
                        int rows, float out[8][PACK_COLS]) {
    __m512 acc[8][2];
    for (int i = 0; i < rows; i++)
        acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; p++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(block + p * 64));
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(block + p * 64 + 32));
        for (int i = 0; i < rows; i++) {
            const __m512bh xb = pair_at(x + i * x_stride, p, k_len);
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);
        }
    }
    for (int i = 0; i < rows; i++) {
        _mm512_storeu_ps(out[i], acc[i][0]);
        _mm512_storeu_ps(out[i] + 16, acc[i][1]);
    }
}

#endif

/* y [rows, n_out] (row stride y_stride) = x [rows, k_len] (bf16, row stride x_stride) times the weight
   packed by lmi_pack_bf16, bf16 out. Returns 1 where this build has no AVX512-BF16 (nothing done). */
int lmi_gemm_packed_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *packed, int64_t rows, int64_t k_len,
                         int64_t n_out, uint16_t *y, int64_t y_stride, int threads) {
#ifdef LMI_BF16
    const int64_t pairs = (k_len + 1) / 2, blocks = (n_out + PACK_COLS - 1) / PACK_COLS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const uint16_t *block = packed + b * pairs * PACK_COLS * 2;
        const int64_t n0 = b * PACK_COLS, cols = n_out - n0 < PACK_COLS ? n_out - n0 : PACK_COLS;
        float out[8][PACK_COLS];
        for (int64_t r0 = 0; r0 < rows; r0 += 8) {
            const int nr = rows - r0 < 8 ? (int)(rows - r0) : 8;
            switch (nr) {  /* constant tile heights: the accumulators stay in registers */
            case 1: packed_tile(x + r0 * x_stride, x_stride, block, pairs, k_len, 1, out); break;
            case 2: packed_tile(x + r0 * x_stride, x_stride, block, pairs, k_len, 2, out); break;
            case 3: packed_tile(x + r0 * x_stride, x_stride, block, pairs, k_len, 3, out); break;
            case 4: packed_tile(x + r0 * x_stride, x_stride, block, pairs, k_len, 4, out); break;
            case 5: packed_tile(x + r0 * x_stride, x_stride, block, pairs, k_len, 5, out); break;
            case 6: packed_tile(x + r0 * x_stride, x_stride, block, pairs, k_len, 6, out); break;
            case 7: packed_tile(x + r0 * x_stride, x_stride, block, pairs, k_len, 7, out); break;
            default: packed_tile(x + r0 * x_stride, x_stride, block, pairs, k_len, 8, out); break;
            }
            for (int i = 0; i < nr; i++)
                for (int64_t j = 0; j < cols; j++)
                    store_elem(y + (r0 + i) * y_stride, n0 + j, out[i][j], 1);
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)packed; (void)rows; (void)k_len; (void)n_out; (void)y; (void)y_stride; (void)threads;
    return 1;
#endif
}

/* --- float32, packed ----------------------------------------------------------------------------- */

/* The same blocking for float32: [N / 32][K][32] (each input's 32 column weights side by side), one
   activation broadcast per input into 32 columns: two vfmadd of 16 lanes (AVX-512F; tiles of up to
   8 rows) or four of 8 (AVX2 + FMA; tiles of up to 2 rows, its 16 registers). */
void lmi_pack_f32(const float *w, int64_t n_out, int64_t k_len, float *packed) {
    const int64_t blocks = (n_out + PACK_COLS - 1) / PACK_COLS;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t k = 0; k < k_len; k++)
            for (int64_t c = 0; c < PACK_COLS; c++) {
                const int64_t n = b * PACK_COLS + c;
                packed[(b * k_len + k) * PACK_COLS + c] = n < n_out ? w[n * k_len + k] : 0.0f;
            }
}

#if defined(__AVX512F__)
#define F32_ROWS 8
#define F32_VECS 2
typedef __m512 fvec;
#define FV_ZERO() _mm512_setzero_ps()
#define FV_LOAD(p) _mm512_loadu_ps(p)
#define FV_STORE(p, v) _mm512_storeu_ps(p, v)
#define FV_BCAST(p) _mm512_set1_ps(*(p))
#define FV_FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#elif defined(__AVX2__) && defined(__FMA__)
#define F32_ROWS 2
#define F32_VECS 4
typedef __m256 fvec;
#define FV_ZERO() _mm256_setzero_ps()
#define FV_LOAD(p) _mm256_loadu_ps(p)
#define FV_STORE(p, v) _mm256_storeu_ps(p, v)
#define FV_BCAST(p) _mm256_broadcast_ss(p)
#define FV_FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#endif

#ifdef F32_ROWS
#define LANES_F32 (PACK_COLS / F32_VECS)
INLINE void packed_tile_f32(const float *x, int64_t x_stride, const float *block, int64_t k_len, int rows,
                            float out[8][PACK_COLS]) {
    fvec acc[F32_ROWS][F32_VECS];
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < F32_VECS; v++)
            acc[i][v] = FV_ZERO();
    for (int64_t k = 0; k < k_len; k++) {
        fvec w[F32_VECS];
        for (int v = 0; v < F32_VECS; v++)
            w[v] = FV_LOAD(block + k * PACK_COLS + v * LANES_F32);
        for (int i = 0; i < rows; i++) {
            const fvec xb = FV_BCAST(x + i * x_stride + k);
            for (int v = 0; v < F32_VECS; v++)
                acc[i][v] = FV_FMA(xb, w[v], acc[i][v]);
        }
    }
    for (int i = 0; i < rows; i++)
        for (int v = 0; v < F32_VECS; v++)
            FV_STORE(out[i] + v * LANES_F32, acc[i][v]);
}
#endif

/* y [rows, n_out] float32 = x [rows, k_len] float32 times the weight packed by lmi_pack_f32. Returns 1
   where this build has neither AVX-512F nor AVX2 + FMA (nothing done). */
int lmi_gemm_packed_f32(const float *x, int64_t x_stride, const float *packed, int64_t rows, int64_t k_len,
                        int64_t n_out, float *y, int64_t y_stride, int threads) {
#ifdef F32_ROWS
    const int64_t blocks = (n_out + PACK_COLS - 1) / PACK_COLS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const float *block = packed + b * k_len * PACK_COLS;
        const int64_t n0 = b * PACK_COLS, cols = n_out - n0 < PACK_COLS ? n_out - n0 : PACK_COLS;
        float out[8][PACK_COLS];
        for (int64_t r0 = 0; r0 < rows; r0 += F32_ROWS) {
            const int nr = rows - r0 < F32_ROWS ? (int)(rows - r0) : F32_ROWS;
            switch (nr) {  /* constant tile heights */
            case 1: packed_tile_f32(x + r0 * x_stride, x_stride, block, k_len, 1, out); break;
#if F32_ROWS > 2
            case 2: packed_tile_f32(x + r0 * x_stride, x_stride, block, k_len, 2, out); break;
            case 3: packed_tile_f32(x + r0 * x_stride, x_stride, block, k_len, 3, out); break;
            case 4: packed_tile_f32(x + r0 * x_stride, x_stride, block, k_len, 4, out); break;
            case 5: packed_tile_f32(x + r0 * x_stride, x_stride, block, k_len, 5, out); break;
            case 6: packed_tile_f32(x + r0 * x_stride, x_stride, block, k_len, 6, out); break;
            case 7: packed_tile_f32(x + r0 * x_stride, x_stride, block, k_len, 7, out); break;
#endif
            default: packed_tile_f32(x + r0 * x_stride, x_stride, block, k_len, F32_ROWS, out); break;
            }
            for (int i = 0; i < nr; i++)
                memcpy(y + (r0 + i) * y_stride + n0, out[i], sizeof(float) * (size_t)cols);
        }
    }
    return 0;
#else
    (void)x; (void)x_stride; (void)packed; (void)rows; (void)k_len; (void)n_out; (void)y; (void)y_stride; (void)threads;
    return 1;
#endif
}
