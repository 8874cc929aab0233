/* Helpers shared by the CPU kernels (AVX2 + FMA). */
#ifndef SPECSERVE_KERNELS_COMMON_H
#define SPECSERVE_KERNELS_COMMON_H
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };
#define MAX_HEAD_DIM 512      /* the largest head the attention and layer kernels take (stack buffers) */

/* 8 bfloat16 values widened to float32 (exact) */
static inline __m256 load_bf16(const uint16_t *p) {
    __m128i v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const void *p, int is_bf16) {
    return is_bf16 ? load_bf16((const uint16_t *)p) : _mm256_loadu_ps((const float *)p);
}
/* the fixed horizontal sum every kernel uses (part of the row-invariance contract) */
static inline float hsum8(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
static inline uint16_t f32_to_bf16(float f) {      /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}
static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
/* element i of a float32 or bfloat16 array */
static inline float get_elem(const void *p, long i, int is_bf16) {
    return is_bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}
static inline void set_elem(void *p, long i, float v, int is_bf16) {
    if (is_bf16) ((uint16_t *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}
/* v rounded to the storage dtype and back (what storing then loading gives) */
static inline float round_to(float v, int is_bf16) { return is_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v; }

/* the calling thread's share [*first, *end) of n items split over its team: contiguous, in thread
   order, sizes differing by at most one; a thread can tell its share of a later split too */
static inline void team_share(long n, long *first, long *end) {
    const long threads = omp_get_num_threads(), id = omp_get_thread_num();
    *first = n * id / threads, *end = n * (id + 1) / threads;
}

/* 8 lanes rounded to bfloat16 and back, round to nearest even (finite values only) */
static inline __m256 round_bf16x8(__m256 v) {
    __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int)0xffff0000u)));
}
#ifdef __AVX512F__
/* round_bf16x8 on 16 lanes */
static inline __m512 round_bf16x16(__m512 v) {
    __m512i b = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32((int)0xffff0000u)));
}
#endif
/* round_to on 8 lanes: f32_to_bf16's bits, NaNs included */
static inline __m256 round_to8(__m256 v, int is_bf16) {
    if (!is_bf16) return v;
    const __m256 quiet_nan = _mm256_castsi256_ps(_mm256_and_si256(
        _mm256_or_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x400000)), _mm256_set1_epi32((int)0xffff0000u)));
    return _mm256_blendv_ps(round_bf16x8(v), quiet_nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
}
/* store 8 lanes in the storage dtype (bfloat16: rounded as f32_to_bf16) */
static inline void store8(void *p, __m256 v, int is_bf16) {
    if (!is_bf16) {
        _mm256_storeu_ps((float *)p, v);
        return;
    }
    const __m256i bits = _mm256_srli_epi32(_mm256_castps_si256(round_to8(v, 1)), 16);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}
/* exp's constants, shared by exp8 and exp16 so that the two give the same bits: the clamp,
   log2(e), ln(2) in two parts (Cephes range reduction) and the degree-5 polynomial */
#define EXP_MAX 88.3762626647949f
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500E-4f
#define EXP_P1 1.3981999507E-3f
#define EXP_P2 8.3334519073E-3f
#define EXP_P3 4.1665795894E-2f
#define EXP_P4 1.6666665459E-1f
#define EXP_P5 5.0000001201E-1f
/* exp on 8 lanes (Cephes-style range reduction + degree-5 polynomial, ~1 ulp);
   exp(-inf) = 0. The same code for every lane, so a value's exp never depends on its
   neighbours. */
static inline __m256 exp8(__m256 x) {
    const __m256 hi = _mm256_set1_ps(EXP_MAX), lo = _mm256_set1_ps(-EXP_MAX);
    __m256 is_tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2_HI), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(EXP_LN2_LO), x);
    __m256 z = _mm256_mul_ps(x, x);
    __m256 y = _mm256_set1_ps(EXP_P0);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P1));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P2));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P3));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P4));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P5));
    y = _mm256_fmadd_ps(y, z, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(is_tiny, y);
}
#ifdef __AVX512F__
/* exp8 on 16 lanes: the same operations and constants lane by lane, so the same bits (the
   attention's softmax: half the instructions of two exp8 calls) */
static inline __m512 exp16(__m512 x) {
    const __m512 hi = _mm512_set1_ps(EXP_MAX), lo = _mm512_set1_ps(-EXP_MAX);
    const __mmask16 is_tiny = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
    __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2_HI), x);
    x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(EXP_LN2_LO), x);
    __m512 z = _mm512_mul_ps(x, x);
    __m512 y = _mm512_set1_ps(EXP_P0);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P1));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P2));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P3));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P4));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(EXP_P5));
    y = _mm512_fmadd_ps(y, z, _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
    return _mm512_maskz_mov_ps((__mmask16)~is_tiny, y);
}
#endif
#endif
