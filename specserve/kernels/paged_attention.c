/* Row-invariant paged attention for decode-shaped forwards (AVX2 + FMA).

   For every query row t (request b = row_batch[t], query j = row_query[t]) and query head,
   attend to the keys l of request b that mask[b, j, l] allows, reading K/V straight from the
   paged cache at slot kv_indices[b, l]:
       score_l = (q . K[slot_l]) / sqrt(head_dim)        8-lane FMA chain + fixed horizontal sum
       w_l     = exp(score_l - max score)                one vectorized exp, elementwise
       out     = (sum_l w_l V[slot_l]) / (sum_l w_l)     keys in order, float32
   Every step depends only on the keys a row attends to, in their order, never on the other
   rows, the batch, padding or masked keys (skipped, not added as zeros), nor on the thread
   count: a token gets the same bits verified inside a draft tree, decoded alone or batched.
   The query heads of a GQA group share each key's address; keys are scored four at a time and
   the weighted values summed in registers (the same chains, overlapped).
   Built by build.py (cpu_kernels.c), called from attention.py and decoder_layer.c. */
#include "common.h"

#define MAX_GROUP 16          /* query heads per KV head */

#define KEY_TILE 4            /* keys scored together (independent FMA chains) */
#define PREFETCH_KEYS 16      /* keys ahead whose K or V rows are prefetched */

/* prefetch the `bytes` bytes of a key or value row that a later iteration reads */
static inline void prefetch_row(const char *p, int bytes) {
    for (int off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

/* scores[g * padded + l] = q_g . K[slots[l]] for the `group` query heads, KEY_TILE keys at a
   time so their chains overlap; each score is still its own chain over d and one hsum8 */
static void score_keys(const float *q, const char *k_base, long slot_stride, const int64_t *slots,
                       int num_keys, int group, int head_dim, int is_bf16, int padded, float *scores) {
    const int esize = is_bf16 ? 2 : 4;
    for (int l0 = 0; l0 < num_keys; l0 += KEY_TILE) {
        const int n = num_keys - l0 < KEY_TILE ? num_keys - l0 : KEY_TILE;
        const char *keys[KEY_TILE];
        for (int i = 0; i < KEY_TILE; i++) keys[i] = k_base + slots[l0 + (i < n ? i : 0)] * slot_stride;
        for (int i = 0; i < KEY_TILE && l0 + PREFETCH_KEYS + i < num_keys; i++)
            prefetch_row(k_base + slots[l0 + PREFETCH_KEYS + i] * slot_stride, head_dim * esize);
        for (int g = 0; g < group; g++) {
            __m256 acc[KEY_TILE];
            for (int i = 0; i < KEY_TILE; i++) acc[i] = _mm256_setzero_ps();
            for (int d = 0; d < head_dim; d += 8) {
                const __m256 qv = _mm256_loadu_ps(q + g * head_dim + d);
                for (int i = 0; i < KEY_TILE; i++)
                    acc[i] = _mm256_fmadd_ps(qv, load8(keys[i] + d * esize, is_bf16), acc[i]);
            }
            for (int i = 0; i < n; i++) scores[g * padded + l0 + i] = hsum8(acc[i]);
        }
    }
}

/* out[d0 .. d0 + NV * 8) of one head = sum_l w[l] * V[slots[l]][d], keys in order, the partial
   sums in registers (each element one chain of FMAs over l) */
#define DEFINE_WEIGH(NAME, NV)                                                                   \
static void NAME(const float *w, const char *v_base, long slot_stride, const int64_t *slots,    \
                 int num_keys, int d0, int is_bf16, float *out) {                                \
    const int esize = is_bf16 ? 2 : 4;                                                           \
    __m256 acc[NV];                                                                              \
    for (int i = 0; i < NV; i++) acc[i] = _mm256_setzero_ps();                                   \
    for (int l = 0; l < num_keys; l++) {                                                         \
        if (l + PREFETCH_KEYS < num_keys)                                                        \
            prefetch_row(v_base + slots[l + PREFETCH_KEYS] * slot_stride + (long)d0 * esize, NV * 8 * esize); \
        const char *value = v_base + slots[l] * slot_stride + (long)d0 * esize;                  \
        const __m256 wv = _mm256_set1_ps(w[l]);                                                  \
        for (int i = 0; i < NV; i++) acc[i] = _mm256_fmadd_ps(wv, load8(value + i * 8 * esize, is_bf16), acc[i]); \
    }                                                                                            \
    for (int i = 0; i < NV; i++) _mm256_storeu_ps(out + d0 + i * 8, acc[i]);                     \
}
DEFINE_WEIGH(weigh_values_8, 8)
DEFINE_WEIGH(weigh_values_1, 1)

/* One query row against one KV head: the `group` query heads q[g * head_dim ...] (float32,
   already scaled), keys/values at `slots` (num_keys of them). scores: >= round8(num_keys) *
   group floats of scratch. Writes out[g * head_dim + d] in float32. */
static void attend_row(const float *q, const char *k_base, const char *v_base, long slot_stride,
                       const int64_t *slots, int num_keys, int group, int head_dim, int is_bf16,
                       float *scores, float *out) {
    const int padded = (num_keys + 7) / 8 * 8;
    score_keys(q, k_base, slot_stride, slots, num_keys, group, head_dim, is_bf16, padded, scores);
    for (int g = 0; g < group; g++) {
        float *row = scores + g * padded;
        float max = -INFINITY;
        for (int l = 0; l < num_keys; l++) max = row[l] > max ? row[l] : max;
        for (int l = num_keys; l < padded; l++) row[l] = -INFINITY;
        const __m256 m = _mm256_set1_ps(max);
        for (int l = 0; l < padded; l += 8)
            _mm256_storeu_ps(row + l, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + l), m)));
        float sum = 0.f;
        for (int l = 0; l < num_keys; l++) sum += row[l];
        int d0 = 0;
        for (; d0 + 64 <= head_dim; d0 += 64)
            weigh_values_8(row, v_base, slot_stride, slots, num_keys, d0, is_bf16, out + g * head_dim);
        for (; d0 < head_dim; d0 += 8)
            weigh_values_1(row, v_base, slot_stride, slots, num_keys, d0, is_bf16, out + g * head_dim);
        const float inv = 1.0f / sum;
        for (int d = 0; d < head_dim; d++) out[g * head_dim + d] *= inv;
    }
}

/* q: T rows of num_heads * head_dim (row stride q_ld elements); k_layer/v_layer
   [num_slots, num_kv_heads, head_dim]; kv_indices [B, L] int64; mask [B, Q, L] bool;
   row_batch/row_query [T] int32; out [T, num_heads * head_dim]. dtype 0 float32,
   1 bfloat16 (q, K/V and out share it). Returns 0, or -1 for shapes it does not take. */
int attention_rows(const void *q, long q_ld, const void *k_layer, const void *v_layer, void *out,
                   const int64_t *kv_indices, const uint8_t *mask,
                   const int32_t *row_batch, const int32_t *row_query,
                   int T, int L, int Q, int num_heads, int num_kv_heads, int head_dim,
                   int dtype, int nthreads) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % 8 || num_heads % num_kv_heads || group > MAX_GROUP) return -1;
    const int is_bf16 = dtype == DTYPE_BF16, esize = is_bf16 ? 2 : 4;
    const long slot_stride = (long)num_kv_heads * head_dim * esize;
    const float scale = 1.0f / sqrtf((float)head_dim);
    #pragma omp parallel num_threads(nthreads)
    {
        const int padded = (L + 7) / 8 * 8;
        float *scores = (float *)malloc((size_t)padded * group * sizeof(float));
        int64_t *slots = (int64_t *)malloc((size_t)L * sizeof(int64_t));
        float *qf = (float *)malloc((size_t)group * head_dim * sizeof(float));
        float *res = (float *)malloc((size_t)group * head_dim * sizeof(float));
        #pragma omp for schedule(static)
        for (long task = 0; task < (long)T * num_kv_heads; task++) {
            const int t = (int)(task / num_kv_heads), h = (int)(task % num_kv_heads);
            const int b = row_batch[t], j = row_query[t];
            const uint8_t *allowed = mask + ((long)b * Q + j) * L;
            int num_keys = 0;
            for (int l = 0; l < L; l++)
                if (allowed[l]) slots[num_keys++] = kv_indices[(long)b * L + l];
            const long q_off = (long)t * q_ld + (long)h * group * head_dim;
            const long out_off = ((long)t * num_heads + (long)h * group) * head_dim;
            for (int i = 0; i < group * head_dim; i++) qf[i] = get_elem(q, q_off + i, is_bf16) * scale;
            attend_row(qf, (const char *)k_layer + (long)h * head_dim * esize,
                       (const char *)v_layer + (long)h * head_dim * esize, slot_stride,
                       slots, num_keys, group, head_dim, is_bf16, scores, res);
            for (int i = 0; i < group * head_dim; i++) set_elem(out, out_off + i, res[i], is_bf16);
        }
        free(scores);
        free(slots);
        free(qf);
        free(res);
    }
    return 0;
}

/* q [T, num_heads, head_dim] contiguous; see attention_rows */
int paged_attention(const void *q, const void *k_layer, const void *v_layer, void *out,
                    const int64_t *kv_indices, const uint8_t *mask,
                    const int32_t *row_batch, const int32_t *row_query,
                    int T, int L, int Q, int num_heads, int num_kv_heads, int head_dim,
                    int dtype, int nthreads) {
    return attention_rows(q, (long)num_heads * head_dim, k_layer, v_layer, out, kv_indices, mask, row_batch,
                          row_query, T, L, Q, num_heads, num_kv_heads, head_dim, dtype, nthreads);
}
