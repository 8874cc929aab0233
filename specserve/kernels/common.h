/* Helpers shared by the CPU kernels (AVX2 + FMA). */
#ifndef SPECSERVE_KERNELS_COMMON_H
#define SPECSERVE_KERNELS_COMMON_H
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

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
#endif
