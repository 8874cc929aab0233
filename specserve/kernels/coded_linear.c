/* Weight blocks for the skinny linear (skinny_linear.c) stored as codes. Every 32 consecutive
   weights of a row are scale * code + min (4-bit unsigned or 8-bit signed codes, a float32
   scale and min per block): how GGUF's Q4_0 / Q4_1 / Q8_0 tensors define their values. The
   product scale * code of two such numbers is exact in float32, so one fused multiply-add
   rebuilds the very float32 value the dequantized tensor holds (and, for bfloat16 weights,
   rounding it as torch does gives the stored bfloat16 value). The products with the inputs
   then run the dense blocks' chain of FMAs, so coded weights give the dense weights' bits
   while 6-12 bits a weight, not 16 or 32, stream from memory.
   Formats (one record per block of 32 weights):
     CODED_AFFINE4: float32 scale, float32 min, 16 bytes of codes: byte 8h + j holds weight
                   16h + j in its low nibble and weight 16h + j + 8 in its high one (24 bytes)
     CODED_AFFINE8: float32 scale, float32 min (0 for Q8_0), 32 int8 codes      (40 bytes)
     CODED_TABLE4 (bfloat16 only): the block's 16 values as bfloat16, low bytes then high
                   bytes (32 bytes), then 16 bytes of codes: byte j holds weight (j / 4) * 8 + j % 4
                   in its low nibble and that weight + 4 in its high one; a lookup, no arithmetic
                   (48 bytes) */
#include "common.h"

#define CODE_BLOCK 32
enum { CODED_NONE = 0, CODED_AFFINE4 = 1, CODED_AFFINE8 = 2, CODED_TABLE4 = 3 };

static inline int coded_record_bytes(int format) {
    return format == CODED_AFFINE4 ? 24 : format == CODED_AFFINE8 ? 40 : 48;
}
static inline long coded_row_bytes(int K, int format) { return (long)(K / CODE_BLOCK) * coded_record_bytes(format); }

/* the 32 weights of one block, in order, as 4 x 8 float32 */
static inline __attribute__((always_inline)) void expand_affine(const uint8_t *rec, int format, int to_bf16,
                                                                __m256 w[4]) {
    const __m256 scale = _mm256_broadcast_ss((const float *)rec);
    const __m256 min = _mm256_broadcast_ss((const float *)rec + 1);
    __m256i q[4];
    if (format == CODED_AFFINE4) {
        const __m256i nibble = _mm256_set1_epi32(15);
        for (int half = 0; half < 2; half++) {      /* byte 8h + j: weights 16h + j and 16h + j + 8 */
            const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(rec + 8 + half * 8)));
            q[2 * half] = _mm256_and_si256(b, nibble);
            q[2 * half + 1] = _mm256_srli_epi32(b, 4);
        }
    } else {
        for (int s = 0; s < 4; s++) q[s] = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(rec + 8 + s * 8)));
    }
    for (int s = 0; s < 4; s++) {
        const __m256 v = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(q[s]), min);
        w[s] = to_bf16 ? round_bf16x8(v) : v;
    }
}

static inline __attribute__((always_inline)) void expand_table(const uint8_t *rec, __m256 w[4]) {
    const __m256i table_lo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)rec));
    const __m256i table_hi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(rec + 16)));
    const __m128i codes = _mm_loadu_si128((const __m128i *)(rec + 32)), nibble = _mm_set1_epi8(15);
    const __m256i idx = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(codes, 4), nibble), _mm_and_si128(codes, nibble));
    const __m256i lo = _mm256_shuffle_epi8(table_lo, idx), hi = _mm256_shuffle_epi8(table_hi, idx);
    const __m256i w01 = _mm256_unpacklo_epi8(lo, hi), w23 = _mm256_unpackhi_epi8(lo, hi), z = _mm256_setzero_si256();
    w[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w01));
    w[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w01));
    w[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, w23));
    w[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, w23));
}

/* NW (<= NB) coded weight rows (row_bytes apart) x R (<= OUT_ROWS) input rows (float32,
   stride K); each output is the dense blocks' FMA chain (skinny_linear.c) */
static inline __attribute__((always_inline)) void coded_block(const float *x, const uint8_t *w, long row_bytes,
        int K, const uint8_t *pf, int NW, int R, int format, int to_bf16, float out[][OUT_ROWS]) {
    const int rec = coded_record_bytes(format);
    __m256 acc[NB][OUT_ROWS];
    for (int i = 0; i < NW; i++)
        for (int j = 0; j < R; j++) acc[i][j] = _mm256_setzero_ps();
    for (int b = 0; b < K / CODE_BLOCK; b++) {
        const long offset = (long)b * rec;
        for (int i = 0; i < NW; i++) {
            if (pf) _mm_prefetch((const char *)(pf + i * row_bytes + offset), _MM_HINT_T0);
            __m256 wv[4];
            if (format == CODED_TABLE4) expand_table(w + i * row_bytes + offset, wv);
            else expand_affine(w + i * row_bytes + offset, format, to_bf16, wv);
            for (int s = 0; s < 4; s++)
                for (int j = 0; j < R; j++)
                    acc[i][j] = _mm256_fmadd_ps(wv[s], _mm256_loadu_ps(x + (long)j * K + b * CODE_BLOCK + s * 8), acc[i][j]);
        }
    }
    for (int i = 0; i < NW; i++)
        for (int j = 0; j < R; j++) out[i][j] = hsum8(acc[i][j]);
}

/* NB coded weight rows expanded to float32 rows (stride K) in out: the values the dense
   blocks would load, so they can run over many input rows at the cost of one expansion */
static void expand_rows(const uint8_t *w, long row_bytes, int K, const uint8_t *pf, int format, int to_bf16,
                        float *out) {
    const int rec = coded_record_bytes(format);
    for (int i = 0; i < NB; i++)
        for (int b = 0; b < K / CODE_BLOCK; b++) {
            const long offset = i * row_bytes + (long)b * rec;
            if (pf) _mm_prefetch((const char *)(pf + offset), _MM_HINT_T0);
            __m256 wv[4];
            if (format == CODED_TABLE4) expand_table(w + offset, wv);
            else if (to_bf16) expand_affine(w + offset, format, 1, wv);
            else expand_affine(w + offset, format, 0, wv);
            for (int s = 0; s < 4; s++) _mm256_storeu_ps(out + (long)i * K + b * CODE_BLOCK + s * 8, wv[s]);
        }
}

/* Every record is expanded once, whatever R: R <= 3 rows take all NB weight rows at once;
   4 rows half a block at a time (NB * 4 accumulators would not fit the 16 vector registers);
   5-8 rows one weight row at a time (R accumulators, the 4 expanded vectors, inputs from L1) */
#define DEFINE_CODED(NAME, R, FORMAT, TO_BF16)                                                 \
static void NAME(const float *x, const uint8_t *w, long row_bytes, int K, const uint8_t *pf,  \
                 float out[NB][OUT_ROWS]) {                                                    \
    if (R < 4) {                                                                               \
        coded_block(x, w, row_bytes, K, pf, NB, R, FORMAT, TO_BF16, out);                      \
        return;                                                                                \
    }                                                                                          \
    if (R > 4) {                                                                               \
        for (int i = 0; i < NB; i++)                                                           \
            coded_block(x, w + i * row_bytes, row_bytes, K, pf ? pf + i * row_bytes : NULL, 1, R, FORMAT, TO_BF16, out + i); \
        return;                                                                                \
    }                                                                                          \
    const long half = (long)(NB / 2) * row_bytes;                                              \
    coded_block(x, w, row_bytes, K, pf, NB / 2, R, FORMAT, TO_BF16, out);                      \
    coded_block(x, w + half, row_bytes, K, pf ? pf + half : NULL, NB / 2, R, FORMAT, TO_BF16, out + NB / 2); \
}
#define DEFINE_CODED_ROWS(PREFIX, FORMAT, TO_BF16)                                             \
    DEFINE_CODED(PREFIX##_1, 1, FORMAT, TO_BF16) DEFINE_CODED(PREFIX##_2, 2, FORMAT, TO_BF16)   \
    DEFINE_CODED(PREFIX##_3, 3, FORMAT, TO_BF16) DEFINE_CODED(PREFIX##_4, 4, FORMAT, TO_BF16)   \
    DEFINE_CODED(PREFIX##_5, 5, FORMAT, TO_BF16) DEFINE_CODED(PREFIX##_6, 6, FORMAT, TO_BF16)   \
    DEFINE_CODED(PREFIX##_7, 7, FORMAT, TO_BF16) DEFINE_CODED(PREFIX##_8, 8, FORMAT, TO_BF16)
DEFINE_CODED_ROWS(a4_f32, CODED_AFFINE4, 0) DEFINE_CODED_ROWS(a4_bf16, CODED_AFFINE4, 1)
DEFINE_CODED_ROWS(a8_f32, CODED_AFFINE8, 0) DEFINE_CODED_ROWS(a8_bf16, CODED_AFFINE8, 1)
DEFINE_CODED_ROWS(t4_bf16, CODED_TABLE4, 1)

typedef void (*coded_fn)(const float *, const uint8_t *, long, int, const uint8_t *, float[NB][OUT_ROWS]);
static const coded_fn CODED_FNS[3][2][CODED_FUSED_ROWS] = {       /* [format - 1][bfloat16][rows - 1] */
#define ROWS(P) {P##_1, P##_2, P##_3, P##_4, P##_5, P##_6, P##_7, P##_8}
    {ROWS(a4_f32), ROWS(a4_bf16)}, {ROWS(a8_f32), ROWS(a8_bf16)}, {{NULL}, ROWS(t4_bf16)},
#undef ROWS
};

static inline int coded_supports(int format, int is_bf16) {
    return format >= CODED_AFFINE4 && format <= CODED_TABLE4 && (format != CODED_TABLE4 || is_bf16);
}

static void coded_rows(const float *x, const uint8_t *w, long row_bytes, int K, const uint8_t *pf, int r,
                       int format, int to_bf16, float out[NB][OUT_ROWS]) {
    CODED_FNS[format - 1][to_bf16][r - 1](x, w, row_bytes, K, pf, out);
}
