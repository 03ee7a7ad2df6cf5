/* Paged decode attention on CPU (engines/kernels/cpu_attention.py builds and loads this file).

   One query per sequence; K and V are read in place through the block table, never gathered into a
   contiguous copy (the torch backend's index_select + two batched matmuls move every byte three
   times: read, write, read again). Cache layout, as engines/attention/torch_backend.py:

       k_cache, v_cache: [num_kv_heads, num_blocks, block_size, head_dim]
       q, out:           [num_rows, num_heads, head_dim]   (q: any row and head stride; out: contiguous)
       block_table:      [num_rows, >= ceil(len / block_size)] int64 (any row stride)
       context_lens:     [num_rows] int64: row b attends positions lo .. len-1,
                         lo = len - window when a sliding window is shorter than len, else 0

   Work item = (row, kv head): its group of num_heads / num_kv_heads query heads share every K/V row
   read. Per KV block: the rows widened to float32 once into a tile (L1), then
     pass 1  scores[g][pos] = (q[g] . k[pos]) * scale   (then softcap: cap * tanh(s / cap)); on a bf16
             cache with AVX512-BF16 (-march=native finds it) straight from bf16 pairs, K not widened
     softmax over each head's scores in float32 (max, exp, sum, normalise)
     pass 2  acc[g] += p[g][pos] * v[pos]
   and acc rounded to the output dtype (bf16: round to nearest even). Everything accumulates in
   float32. head_dim 64 and 128 get loops of constant length (unrolled, vectorised); others run the
   same code with a variable length. Items are spread over OpenMP threads (libgomp: the runtime
   PyTorch's CPU build already loaded, so one thread pool). Returns 0, or 1 when scratch memory could
   not be allocated. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#define PAIR_VECTORS 64 /* most 32-wide query vectors held for vdpbf16ps: group * head_dim <= 2048 */
#endif

#include "cpu_kernels.h"

/* e^x for x <= 0, without branches or library calls so that a loop of it vectorises: 2^n e^r with
   |r| <= ln2 / 2 (n rounded by the 1.5 * 2^23 trick, ln2 split in two for an exact r), e^r by its
   degree-6 Taylor polynomial (relative error below 2e-7); x is clamped at -87 (e^-87 ~ 1.6e-38). */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float n = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
    const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return p * two_n;
}

typedef struct {
    const void *q, *k_cache, *v_cache;
    const int64_t *block_table, *context_lens;
    void *out;
    int64_t q_row_stride, q_head_stride, table_row_stride;
    int64_t num_rows, num_heads, num_kv_heads, head_dim, num_blocks, block_size, window;
    float scale, softcap;
} Args;

#if defined(__AVX512BF16__)
/* Pass 1 on a bf16 cache where the CPU has AVX512-BF16: each K row's dot products with the group's
   queries straight from bf16 pairs (vdpbf16ps: exact products, float32 sums), K never widened; the
   row is read once for the whole group. q: group * chunks vectors of 32 bf16. */
INLINE void pair_scores(const __m512bh *q, int64_t chunks, int64_t group, const uint16_t *k, int64_t rows,
                        float scale, float *scores, int64_t n) {
    for (int64_t r = 0; r < rows; r++)
        for (int64_t g = 0; g < group; g++) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t c = 0; c < chunks; c++)
                sum = _mm512_dpbf16_ps(sum, q[g * chunks + c], (__m512bh)_mm512_loadu_si512(k + (r * chunks + c) * 32));
            scores[g * n + r] = _mm512_reduce_add_ps(sum) * scale;
        }
}
#endif

/* One (row, kv head). scratch: 2 * group * dim + block_size * dim + group * len floats. */
INLINE void attend(const Args *a, int64_t row, int64_t head, const int64_t dim, int bf16, float *restrict scratch) {
    const int64_t group = a->num_heads / a->num_kv_heads, bs = a->block_size, len = a->context_lens[row];
    const int64_t lo = a->window > 0 && len > a->window ? len - a->window : 0, n = len - lo;
    float *restrict qf = scratch, *restrict acc = scratch + group * dim;
    float *restrict tile = scratch + 2 * group * dim, *restrict scores = tile + bs * dim;  /* [group][n] */
    const int64_t *blocks = a->block_table + row * a->table_row_stride;
    const int64_t head_offset = head * a->num_blocks * bs * dim;  /* this kv head's first block */
    const int64_t q_offset = row * a->q_row_stride + head * group * a->q_head_stride;
    for (int64_t g = 0; g < group; g++)
        for (int64_t d = 0; d < dim; d++) qf[g * dim + d] = load_elem(a->q, q_offset + g * a->q_head_stride + d, bf16);
    memset(acc, 0, sizeof(float) * group * dim);
#if defined(__AVX512BF16__)
    const int64_t chunks = dim / 32;
    const int pairs = bf16 && dim % 32 == 0 && group * chunks <= PAIR_VECTORS;
    __m512bh qv[PAIR_VECTORS];
    for (int64_t g = 0; pairs && g < group; g++)
        for (int64_t c = 0; c < chunks; c++)
            qv[g * chunks + c] = (__m512bh)_mm512_loadu_si512((const uint16_t *)a->q + q_offset + g * a->q_head_stride + 32 * c);
#else
    const int pairs = 0;
#endif
    for (int64_t j = lo / bs; j * bs < len; j++) {  /* pass 1, block by block */
        const int64_t first = j * bs > lo ? j * bs : lo, end = (j + 1) * bs < len ? (j + 1) * bs : len;
        const int64_t src = head_offset + (blocks[j] * bs + first - j * bs) * dim;
#if defined(__AVX512BF16__)
        if (pairs) {
            pair_scores(qv, chunks, group, (const uint16_t *)a->k_cache + src, end - first, a->scale,
                        scores + first - lo, n);
            continue;
        }
#endif
        for (int64_t i = 0; i < (end - first) * dim; i++) tile[i] = load_elem(a->k_cache, src + i, bf16);
        for (int64_t g = 0; g < group; g++)
            for (int64_t r = 0; r < end - first; r++) {
                float s = 0.f;
#pragma omp simd reduction(+ : s)
                for (int64_t d = 0; d < dim; d++) s += qf[g * dim + d] * tile[r * dim + d];
                scores[g * n + first - lo + r] = s * a->scale;
            }
    }
    for (int64_t g = 0; g < group; g++) {  /* softmax */
        float *restrict s = scores + g * n, top = -INFINITY, sum = 0.f;
        if (a->softcap > 0.f)
            for (int64_t i = 0; i < n; i++) s[i] = a->softcap * tanhf(s[i] / a->softcap);
#pragma omp simd reduction(max : top)
        for (int64_t i = 0; i < n; i++) top = s[i] > top ? s[i] : top;
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < n; i++) {
            s[i] = exp_nonpositive(s[i] - top);
            sum += s[i];
        }
        const float inv = 1.0f / sum;
        for (int64_t i = 0; i < n; i++) s[i] *= inv;
    }
    for (int64_t j = lo / bs; j * bs < len; j++) {  /* pass 2 */
        const int64_t first = j * bs > lo ? j * bs : lo, end = (j + 1) * bs < len ? (j + 1) * bs : len;
        const int64_t src = head_offset + (blocks[j] * bs + first - j * bs) * dim;
        for (int64_t i = 0; i < (end - first) * dim; i++) tile[i] = load_elem(a->v_cache, src + i, bf16);
        for (int64_t g = 0; g < group; g++) {  /* a local accumulator: registers across the block's rows */
            const float *restrict p = scores + g * n + first - lo;
            float sum[dim];
            for (int64_t d = 0; d < dim; d++) sum[d] = acc[g * dim + d];
            for (int64_t r = 0; r < end - first; r++)
#pragma omp simd
                for (int64_t d = 0; d < dim; d++) sum[d] += p[r] * tile[r * dim + d];
            for (int64_t d = 0; d < dim; d++) acc[g * dim + d] = sum[d];
        }
    }
    const int64_t out_offset = (row * a->num_heads + head * group) * dim;
    for (int64_t i = 0; i < group * dim; i++) store_elem(a->out, out_offset + i, acc[i], bf16);
}

INLINE int run(const Args *a, int bf16, int threads) {
    int64_t longest = 1;
    for (int64_t b = 0; b < a->num_rows; b++) longest = a->context_lens[b] > longest ? a->context_lens[b] : longest;
    const int64_t group = a->num_heads / a->num_kv_heads, dim = a->head_dim;
    const size_t scratch_floats = (size_t)(group * (2 * dim + longest) + a->block_size * dim);
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        float *scratch = malloc(sizeof(float) * scratch_floats);
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < a->num_rows * a->num_kv_heads; item++) {
            const int64_t row = item / a->num_kv_heads, head = item % a->num_kv_heads;
            if (!scratch) continue;
            if (a->context_lens[row] <= 0) {  /* nothing to attend (steps never send one): zeros, not garbage */
                for (int64_t i = 0; i < group * dim; i++)
                    store_elem(a->out, (row * a->num_heads + head * group) * dim + i, 0.f, bf16);
                continue;
            }
            if (dim == 64)
                attend(a, row, head, 64, bf16, scratch);
            else if (dim == 128)
                attend(a, row, head, 128, bf16, scratch);
            else
                attend(a, row, head, dim, bf16, scratch);
        }
        free(scratch);
    }
    return failed;
}

#define EXPORT(NAME, BF16)                                                                                    \
    int NAME(const void *q, int64_t q_row_stride, int64_t q_head_stride, const void *k_cache,                 \
             const void *v_cache, const int64_t *block_table, int64_t table_row_stride,                        \
             const int64_t *context_lens, void *out, int64_t num_rows, int64_t num_heads, int64_t num_kv_heads, \
             int64_t head_dim, int64_t num_blocks, int64_t block_size, float scale, int64_t window,             \
             float softcap, int threads) {                                                                     \
        const Args a = {q, k_cache, v_cache, block_table, context_lens, out, q_row_stride, q_head_stride,      \
                        table_row_stride, num_rows, num_heads, num_kv_heads, head_dim, num_blocks, block_size, \
                        window, scale, softcap};                                                               \
        return run(&a, BF16, threads);                                                                         \
    }

EXPORT(lmi_paged_decode_f32, 0)
EXPORT(lmi_paged_decode_bf16, 1)
