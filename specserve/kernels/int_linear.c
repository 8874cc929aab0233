/* Integer linear over GGUF weight blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 as stored; Q4_K, Q5_K
   and Q6_K through the float32-scaled formats below): the `--quantization gguf` path.

       y[M, N] = x[M, K] @ W[N, K]^T (+ bias)

   Weights stay in their 32-weight blocks (a float16 scale d, for Q4_1 a float16 min m, 4- or
   8-bit codes c). Each input row is quantized per 32-value block to int8 q with its own scale
   dx (as llama.cpp's Q8_0/Q8_1), and every block's dot product runs in integers:

       p     = sum_k c_k q_k - off             off = 8 * sum(q) for Q4_0 (codes 0..15 stand for c - 8),
                                               16 * sum(q) for Q5_0, 32 * sum(q) for Q6 (per half),
                                               else 0 (the int32 sum is exact)
       acc   = fma(d * dx, float(p), acc)      per block, in block order
       acc   = fma(m, dx * sum(q), acc)        formats with a min (Q4_1, Q5_1, F4, F8)
       y     = acc (+ bias)

   The F formats hold blocks whose scales are not float16 values (K-quants: a super-block's
   float16 d times a 6-bit sub-block scale) in float32: F4 (4-bit codes, scale and min: Q4_K),
   F8 (int8 codes, scale and min: Q5_K, or blocks of mixed types in one fused matrix) and F8H
   (int8 codes, one scale per 16-weight half and no min), whose two halves are summed and
   scaled apart, as Q6 (Q6_K: F8H's scales, 6-bit codes c + 32 stored as nibbles and two bit
   planes) does too:
       acc   = fma(d_lo * dx, float(p_lo), acc),  acc = fma(d_hi * dx, float(p_hi), acc)

   Layout: weights are repacked in panels of 16 rows (IQ_ROWS, the int32 lanes of a 512-bit
   vector). A panel holds, per block b of K, one record:
       float16 d[16] | float16 m[16] (Q4_1, Q5_1) | codes
   (F formats: float32 d[16] | float32 m[16], or F8H's and Q6's float32 d_lo[16] | d_hi[16])
   where code chunk j (j = 0..7: weights k = 4j..4j+3 of the block) is 64 bytes, byte 4i + t =
   row i's weight 4j + t. Q8_0 and F8* store the 8 chunks as int8 (512 bytes); Q4_0/Q4_1/F4 store
   chunk j (low nibble) and chunk j + 4 (high nibble) in one 64-byte group, 4 groups (256
   bytes); Q5_0/Q5_1 add their codes' fifth bits after those (Q6: a plane of fifth bits, then
   one of sixth), 8 bytes per chunk, bit 4i + t = row i's weight 4j + t (a byte mask on
   AVX-512: one masked move puts a plane in place). So one vpdpbusd of a chunk against 4 input
   bytes broadcast gives the 16 rows' partial sums in its 16 lanes: no horizontal sums, the
   weights of a block are decoded once for every input row of the tile (register blocking over
   W), and each lane's arithmetic is the same whatever the vector width: the AVX2 variant runs the same panels as two halves of 8 lanes
   (vpmaddubsw + vpmaddwd instead of vpdpbusd, the same exact int32 sums) and gives the same bits.

   Row invariance: a row's result depends only on that row and the weights (its own quantization
   scales, fixed per-lane operation order), never on M, the tiling or the thread count.
   Built by build.py (cpu_kernels.c) once per ISA variant; called through linear_forward. */
#include "common.h"
#include "profile.h"

#define IQ_ROWS 16            /* weight rows per panel */
#define IQ_K 32               /* weights per block */
#define IQ_CHUNK_ROWS 64      /* input rows per work item (many-row inputs, e.g. prefill) */
enum { IQ_NONE = 0, IQ_Q4_0 = 1, IQ_Q4_1 = 2, IQ_Q8_0 = 3, IQ_F4 = 4, IQ_F8 = 5, IQ_F8H = 6, IQ_Q5_0 = 7, IQ_Q5_1 = 8,
       IQ_Q6 = 9, IQ_K4 = 10, IQ_NUM_FORMATS = 10 };

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && !defined(IQ_TILE_256)
#define IQ_LEVEL 2            /* avx512_vnni */
#define IQ_TILE 16            /* input rows per register tile (16 accumulators + 8 weight vectors) */
#define IQ_GROUP 8             /* rows whose integer sums run interleaved (two chains each) */
#define IQ_PREFETCH_BYTES 16384  /* weights prefetched this far ahead (panels lie back to back), */
#define IQ_PREFETCH_HINT _MM_HINT_T1   /* into L2, */
/* or into L1 for tiles of this many rows or fewer (a decode step's 1, a short verify's 2): their
   few products a block left each block's loads waiting on L2. In a forward on 1 thread of an
   AVX-512 Zen4, in turns: W=1 4.6-5.4 against 5.6-5.8 ms, W=2 4.9-5.6 against 5.5-5.7. At 4 and
   8 rows L1 cost (W=4 6.6-6.7 against 6.1-6.4 ms); 4 KiB ahead there gained nothing, 8 KiB lost. */
#define IQ_PREFETCH_L1_ROWS 2
#else
#define IQ_LEVEL 1            /* avx2 */
#define IQ_TILE 4
/* Weights prefetched 4 KiB ahead with the non-temporal hint, not 16 KiB ahead into L2: the ~100 MB
   a decode step streams then displace less of what the rest of the step keeps in L2 and L3
   (the KV cache's rows, the host's Python state). On a 2-core Zen3 VM, interleaved: decode steps
   1.3-3.8% faster at 200-1,000 tokens of context, forwards of 1-4 rows 2-6% faster, 8-256 rows
   within +-3%. */
#define IQ_PREFETCH_BYTES 4096
#define IQ_PREFETCH_HINT _MM_HINT_NTA
/* AVX-VNNI (AVX2 CPUs with vpdpbusd on 256 bits: Intel's since Alder Lake, its E-core Xeons): the
   256-bit tile's sums by vpdpbusd, one instruction a chunk where vpmaddubsw + vpmaddwd (and a
   16-bit add) took two or three; the same exact int32 sums, so the same bits. IQ_TILE_256 with
   AVX-512 VNNI: the same tile through vpdpbusd's EVEX encoding (the instruction's other form),
   for tests on AVX-512 CPUs. */
#if defined(__AVXVNNI__)
#define IQ_DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define IQ_DPBUSD256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif
#endif

static inline int iq_is_f32(int fmt) { return (fmt >= IQ_F4 && fmt <= IQ_F8H) || fmt == IQ_Q6; }   /* float32 scales */
static inline int iq_has_halves(int fmt) { return fmt == IQ_F8H || fmt == IQ_Q6; }   /* a scale per 16 weights */
/* code bits above the nibble, stored as planes of 64 bytes: Q5_0/Q5_1 one, Q6 two */
static inline int iq_bit_planes(int fmt) { return fmt == IQ_Q6 ? 2 : fmt == IQ_Q5_0 || fmt == IQ_Q5_1 ? 1 : 0; }
/* codes as nibbles (and maybe bit planes), unsigned */
static inline int iq_is_nibble(int fmt) {
    return fmt == IQ_Q4_0 || fmt == IQ_Q4_1 || fmt == IQ_F4 || fmt == IQ_K4 || iq_bit_planes(fmt) > 0;
}
static inline int iq_has_min(int fmt) {
    return fmt == IQ_Q4_1 || fmt == IQ_Q5_1 || fmt == IQ_F4 || fmt == IQ_F8 || fmt == IQ_K4;
}
/* K4 (Q4_K as stored): a record holds the block's 6-bit scales and mins as bytes (32 bytes);
   each super-block of 8 blocks has float16 d[16] and dmin[16] (64 bytes) in the panel's tail,
   after its nb records; scale = d * sc and min = -(dmin * m) are exact float32 products, the
   values F4 would hold */
static inline int iq_scale_bytes(int fmt) {
    return iq_is_f32(fmt) ? 128 : (iq_has_min(fmt) && fmt != IQ_K4) ? 64 : 32;
}
static inline int iq_record_bytes(int fmt) {
    return iq_scale_bytes(fmt) + (iq_is_nibble(fmt) ? 256 : 512) + 64 * iq_bit_planes(fmt);
}
static inline long iq_panel_bytes(int fmt, int nb) {
    return (long)nb * iq_record_bytes(fmt) + (fmt == IQ_K4 ? (long)(nb / 8) * 64 : 0);
}
/* panels of IQ_ROWS weight rows holding N rows (the last one zero padded) */
static inline long iq_num_panels(long N) { return (N + IQ_ROWS - 1) / IQ_ROWS; }

/* The input rows quantized: q [M, K] int8; per row and block (index m * nb + b): the scale d,
   d * sum(q) (for the min term), the int32 start value of the block's integer sum and that of
   its first half (the weights k < 16; F8H sums the halves apart). */
typedef struct {
    int8_t *q;
    float *d, *ds;
    int32_t *start, *start_lo;
    int K, nb, group;       /* group: rows a group of the layout (iq_block_index) */
    /* where this thread's share of the weights ends, and its share of the linear the team runs
       next (NULL: not known): the tiles' prefetches past the one go on into the other (iq_ahead) */
    const char *share_end, *next_share;
} iq_input;

/* the integer linear a team runs next (panels NULL: none, or not known) */
typedef struct {
    const uint8_t *panels;
    int fmt, N, K;
} iq_next_linear;

/* Rows lie in groups of IQ_GROUP_ROWS (a multiple of every IQ_TILE; all the rows when there are
   fewer), block-major within a group: the group's rows of one block side by side, so a tile
   (IQ_TILE rows from a multiple of IQ_TILE) reads each block's codes and scales at one base
   address plus constant offsets, instead of one address computation per row (its 8-16 row
   pointers did not fit the registers: ~20% fewer instructions at 8 and 16 rows) */
#define IQ_GROUP_ROWS 16

/* where row m's block b lies in a's arrays: its scales at this index, its codes at IQ_K times it */
static inline long iq_block_index(const iq_input *a, long m, int b) {
    return ((m / a->group) * a->nb + b) * a->group + m % a->group;
}
/* the same for rows of one group: row m's block b from its block 0 (no division per block) */
static inline long iq_next_block(const iq_input *a, long first, int b) { return first + (long)b * a->group; }

/* The line a tile prefetches `ahead` bytes past p. Panels lie back to back and a thread's share
   of a linear's panels is contiguous, so ahead of p lie its next panels, then the rest of the
   linear (another thread's share on a team) or whatever follows it in memory. Past its share's
   end the prefetch goes the same distance into its share of the linear the team runs next, where
   that is known: the first 16 KiB of each share were read cold from memory otherwise. On 2
   threads of an AVX-512 Zen4, the layers' linears alone (a C loop, in turns): 3.5% faster at 8
   rows. Only for prefetches into L2 (AVX-512's tiles of 3 or more rows, AMX's): those into L1
   (AVX-512's tiles of 1-2 rows, AVX2's) may not outlive what runs between two linears; whole
   forwards of one row on AVX-512 were 3% slower so (kernel-ab, three runs), where the linears
   alone had been 1.7% faster, and the AVX2 build's forwards ~1% at every width. */
static inline const char *iq_ahead(const iq_input *a, const uint8_t *p, long ahead) {
    const char *line = (const char *)p + ahead;
    const uintptr_t at = (uintptr_t)line, end = (uintptr_t)a->share_end;     /* may lie past the panels */
    return a->next_share && at >= end ? a->next_share + (at - end) : line;
}

static inline int32_t iq_load4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* int8 codes (Q8_0, F8, F8H): on VNNI the kernel's unsigned operand is the code's byte xor 0x80 */
static inline int iq_is_signed(int fmt) { return !iq_is_nibble(fmt); }

/* The integer sum's start value for q that sum to `sum`: minus the codes' offset times the sum,
   where the kernel's unsigned operand is the code plus an offset (Q4_0: the stored nibble is
   c + 8; Q5_0: c + 16; int8 codes on VNNI: c + 128). */
static inline int32_t iq_start(int fmt, int32_t sum) {
    if (fmt == IQ_Q4_0) return -8 * sum;
    if (fmt == IQ_Q5_0) return -16 * sum;
    if (fmt == IQ_Q6) return -32 * sum;
    if (iq_is_signed(fmt) && IQ_LEVEL >= 2) return -128 * sum;
    return 0;
}
/* whether iq_start is 0 for every block of this format: the tiles then start their sums at 0
   instead of loading it (one broadcast load per row and block fewer: -10% at 8 rows, Q4_1,
   1 thread, AVX-512 VNNI Xeon) */
static inline int iq_starts_at_zero(int fmt) { return iq_start(fmt, 1) == 0; }

/* one block of 32 values: q = rint(clamp(x / d, -127, 127)), d = max|x| / 127 */
static void iq_quantize_block(const void *x, int is_bf16, int fmt, int8_t *q, float *d, float *ds, int32_t *start,
                              int32_t *start_lo) {
    const int esize = is_bf16 ? 2 : 4;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int s = 0; s < 4; s++) {
        v[s] = load8((const char *)x + s * 8 * esize, is_bf16);
        amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[s]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float m = _mm_cvtss_f32(m4);      /* the largest |x| (max is exact in any order) */
    const float scale = m / 127.0f, inv = scale != 0.0f ? 1.0f / scale : 0.0f;
    const __m256 inv8 = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
    __m256i n[4];
    __m256i total = _mm256_setzero_si256(), lo_half = _mm256_setzero_si256();
    for (int s = 0; s < 4; s++) {     /* clamp, then cvtps rounds to nearest even (MXCSR's default,
                                         which nothing here changes): the same as rounding first,
                                         and 2 uops fewer per vector (-20% per block) */
        n[s] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v[s], inv8), lo), hi));
        total = _mm256_add_epi32(total, n[s]);
        if (s == 1) lo_half = total;
    }
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(n[0], n[1]), _mm256_packs_epi32(n[2], n[3]));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    const int32_t sum = _mm_cvtsi128_si32(s4);
    __m128i l4 = _mm_add_epi32(_mm256_castsi256_si128(lo_half), _mm256_extracti128_si256(lo_half, 1));
    l4 = _mm_add_epi32(l4, _mm_shuffle_epi32(l4, 0x4E));
    l4 = _mm_add_epi32(l4, _mm_shuffle_epi32(l4, 0xB1));
    *d = scale;
    *ds = scale * (float)sum;
    *start = iq_start(fmt, sum);
    *start_lo = iq_start(fmt, _mm_cvtsi128_si32(l4));
}

/* buffers for M rows of K (a's K, nb and group set for that shape) */
static int iq_input_alloc(iq_input *a, int M, int K) {
    const int nb = K / IQ_K;
    const long rows = (M + IQ_GROUP_ROWS - 1) / IQ_GROUP_ROWS * IQ_GROUP_ROWS;
    a->K = K, a->nb = nb, a->group = M < IQ_GROUP_ROWS ? M : IQ_GROUP_ROWS;
    a->share_end = a->next_share = NULL;
    a->q = (int8_t *)malloc((size_t)rows * K);
    a->d = (float *)malloc((size_t)rows * nb * 4);
    a->ds = (float *)malloc((size_t)rows * nb * 4);
    a->start = (int32_t *)malloc((size_t)rows * nb * 4);
    a->start_lo = (int32_t *)malloc((size_t)rows * nb * 4);
    return !a->q || !a->d || !a->ds || !a->start || !a->start_lo ? -1 : 0;
}

/* block b of input rows [0, M) quantized into a (threads sharing the work take whole blocks:
   the rows of a block share the scales' cache lines) */
static void iq_quantize_column(iq_input *a, const void *x, int b, long M, int is_bf16, int fmt) {
    const int K = a->K, esize = is_bf16 ? 2 : 4;
    for (long m = 0; m < M; m++) {
        const long i = iq_block_index(a, m, b);
        iq_quantize_block((const char *)x + (m * K + (long)b * IQ_K) * esize, is_bf16, fmt,
                          a->q + i * IQ_K, a->d + i, a->ds + i, a->start + i, a->start_lo + i);
    }
}

#if IQ_LEVEL >= 2
#define IQ_QUANT_BATCH 16     /* blocks of a row whose scales are divided out together */
/* 16 values of x (float32 or bfloat16) */
static inline __m512 iq_load16(const char *p, int is_bf16) {
    if (is_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps((const float *)p);
}

/* Row m's blocks [b0, b0 + n) (n <= IQ_QUANT_BATCH) quantized as iq_quantize_block does, lane for
   lane (the same max, divisions, products, clamps and rounding, so the same bits for any input
   without NaNs): each block's largest |x| first, then every block's scale and inverse by one
   vector division each (a block's two dependent scalar divisions were most of its latency:
   36 -> 25-27 cycles a block, 1 thread, AVX-512 Xeon), then the codes. */
static void iq_quantize_blocks(iq_input *a, const void *x, long m, int b0, int n, int is_bf16, int fmt) {
    const int esize = is_bf16 ? 2 : 4;
    const char *row = (const char *)x + (m * a->K + (long)b0 * IQ_K) * esize;
    float amax[IQ_QUANT_BATCH], scale[IQ_QUANT_BATCH], inv[IQ_QUANT_BATCH];
    for (int i = 0; i < n; i++) {
        const char *p = row + (long)i * IQ_K * esize;
        amax[i] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(iq_load16(p, is_bf16)),
                                                     _mm512_abs_ps(iq_load16(p + 16 * esize, is_bf16))));
    }
    const __mmask16 lanes = (__mmask16)((1u << n) - 1);
    const __m512 d = _mm512_div_ps(_mm512_maskz_loadu_ps(lanes, amax), _mm512_set1_ps(127.0f));
    const __mmask16 nonzero = _mm512_cmp_ps_mask(d, _mm512_setzero_ps(), _CMP_NEQ_UQ);   /* as scale != 0.0f */
    _mm512_storeu_ps(scale, d);
    _mm512_storeu_ps(inv, _mm512_maskz_div_ps(nonzero, _mm512_set1_ps(1.0f), d));
    const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
    const long first = iq_block_index(a, m, b0);
    for (int i = 0; i < n; i++) {
        const char *p = row + (long)i * IQ_K * esize;
        const __m512 inv16 = _mm512_set1_ps(inv[i]);
        const __m512i n0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(iq_load16(p, is_bf16), inv16), lo), hi));
        const __m512i n1 = _mm512_cvtps_epi32(
            _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(iq_load16(p + 16 * esize, is_bf16), inv16), lo), hi));
        const long k = iq_next_block(a, first, i);
        _mm_storeu_si128((__m128i *)(a->q + k * IQ_K), _mm512_cvtsepi32_epi8(n0));
        _mm_storeu_si128((__m128i *)(a->q + k * IQ_K + 16), _mm512_cvtsepi32_epi8(n1));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(n0, n1));
        a->d[k] = scale[i];
        a->ds[k] = scale[i] * (float)sum;
        a->start[k] = iq_start(fmt, sum);
        a->start_lo[k] = iq_starts_at_zero(fmt) ? 0 : iq_start(fmt, _mm512_reduce_add_epi32(n0));
    }
}
#endif

/* blocks [b0, b1) of input rows [0, M) quantized into a */
static void iq_quantize_range(iq_input *a, const void *x, long M, int b0, int b1, int is_bf16, int fmt) {
#if IQ_LEVEL >= 2
    for (long m = 0; m < M; m++)
        for (int b = b0; b < b1; b += IQ_QUANT_BATCH)
            iq_quantize_blocks(a, x, m, b, b1 - b < IQ_QUANT_BATCH ? b1 - b : IQ_QUANT_BATCH, is_bf16, fmt);
#else
    for (int b = b0; b < b1; b++) iq_quantize_column(a, x, b, M, is_bf16, fmt);
#endif
}

static int iq_input_init(iq_input *a, const void *x, int M, int K, int is_bf16, int fmt) {
    if (iq_input_alloc(a, M, K)) return -1;
    iq_quantize_range(a, x, M, 0, a->nb, is_bf16, fmt);
    return 0;
}

static void iq_input_free(iq_input *a) { free(a->q), free(a->d), free(a->ds), free(a->start), free(a->start_lo); }

#if IQ_LEVEL >= 2
/* a block's 16 scales (float16 or float32) at p */
static inline __m512 iq_scales16(const uint8_t *p, int f32) {
    return f32 ? _mm512_loadu_ps(p) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
/* K4: 16 float16 values at f16 times the 16 bytes at bytes (exact: 11 x 6 bits) */
static inline __m512 iq_k4_scales16(const uint8_t *f16, const uint8_t *bytes) {
    return _mm512_mul_ps(iq_scales16(f16, 0), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes))));
}

/* code chunks j and j + 4 of a block (weights 4j..4j+3 and 16+4j..16+4j+3 of the 16 rows) as
   vpdpbusd's unsigned operand: int8 codes xor 0x80, else the nibbles with their bit planes.
   Decoded where a group of rows uses them, not all 8 ahead: the 8 chunks, 16 sums and the rows'
   accumulators did not fit the 32 registers (8 rows of Q6: 58 -> 29 spill accesses a block). */
static inline __attribute__((always_inline)) void iq_chunk_pair(const uint8_t *codes, int fmt, int j, __m512i *lo,
                                                                __m512i *hi) {
    if (iq_is_signed(fmt)) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        *lo = _mm512_xor_si512(_mm512_loadu_si512(codes + 64 * j), flip);
        *hi = _mm512_xor_si512(_mm512_loadu_si512(codes + 64 * (j + 4)), flip);
        return;
    }
    const __m512i nibble = _mm512_set1_epi8(15), v = _mm512_loadu_si512(codes + 64 * j);
    *lo = _mm512_and_si512(v, nibble);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    for (int plane = 0; plane < iq_bit_planes(fmt); plane++) {
        const __m512i value = _mm512_set1_epi8((char)(16 << plane));
        uint64_t bits_lo, bits_hi;
        memcpy(&bits_lo, codes + 256 + 64 * plane + 8 * j, 8);
        memcpy(&bits_hi, codes + 256 + 64 * plane + 8 * (j + 4), 8);
        *lo = _mm512_or_si512(*lo, _mm512_maskz_mov_epi8((__mmask64)bits_lo, value));
        *hi = _mm512_or_si512(*hi, _mm512_maskz_mov_epi8((__mmask64)bits_hi, value));
    }
}

/* block b's 16 scales dw and mins mw (F8H and Q6: the first half's scales and the second's) */
static inline __attribute__((always_inline)) void iq_block_scales16(const uint8_t *panel, int fmt, int nb, int b,
                                                                    __m512 *dw, __m512 *mw) {
    const int rec = iq_record_bytes(fmt), f32 = iq_is_f32(fmt);
    const uint8_t *p = panel + (long)b * rec;
    if (fmt == IQ_K4) {
        const uint8_t *super = panel + (long)nb * rec + (long)(b / 8) * 64;
        *dw = iq_k4_scales16(super, p);
        *mw = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(iq_k4_scales16(super + 32, p + 16)),
                                                   _mm512_set1_epi32((int)0x80000000u)));      /* -(dmin * m) */
    } else {
        *dw = iq_scales16(p, f32);
        *mw = iq_has_min(fmt) || iq_has_halves(fmt) ? iq_scales16(p + (f32 ? 64 : 32), f32) : _mm512_setzero_ps();
    }
}

/* R input rows (from m0) x one panel, AVX-512 VNNI: out[r][i] = row m0 + r, weight row i */
static inline __attribute__((always_inline)) void iq_tile(const uint8_t *panel, int fmt, const iq_input *a,
                                                          long m0, int R, float out[][IQ_ROWS]) {
    const int rec = iq_record_bytes(fmt), nb = a->nb, halves = iq_has_halves(fmt);
    const long first = iq_block_index(a, m0, 0);
    __m512 acc[16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = panel + (long)b * rec, *codes = p + iq_scale_bytes(fmt);
        const long i0 = iq_next_block(a, first, b);    /* row m0 + r's block b: i0 + r */
        for (int off = 0; off < rec; off += 64) {
            if (R <= IQ_PREFETCH_L1_ROWS) _mm_prefetch((const char *)p + IQ_PREFETCH_BYTES + off, _MM_HINT_T0);
            else _mm_prefetch(iq_ahead(a, p, IQ_PREFETCH_BYTES + off), IQ_PREFETCH_HINT);
        }
        __m512 dw, mw;
        iq_block_scales16(panel, fmt, nb, b, &dw, &mw);
        /* rows in groups of 8, two dpbusd chains each (the block's halves: chunks 0-3 are
           weights 0..15, chunks 4-7 weights 16..31), interleaved in program order: 16
           independent chains in flight hide vpdpbusd's latency, where one row's 8-long chain
           at a time left the core waiting (-11..-22% at 8 rows, 1 thread, AVX-512 VNNI Xeon).
           The int32 sums are exact in any order, so the bits are the same. */
        _Pragma("GCC unroll 2") for (int r0 = 0; r0 < R; r0 += IQ_GROUP) {
            const int G = R - r0 < IQ_GROUP ? R - r0 : IQ_GROUP;
            __m512i s[IQ_GROUP], t[IQ_GROUP];
            _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
                const long i = i0 + r0 + g;
                if (iq_starts_at_zero(fmt)) {
                    s[g] = t[g] = _mm512_setzero_si512();
                } else if (halves) {
                    s[g] = _mm512_set1_epi32(a->start_lo[i]);
                    t[g] = _mm512_set1_epi32(a->start[i] - a->start_lo[i]);
                } else {
                    s[g] = _mm512_set1_epi32(a->start[i]);
                    t[g] = _mm512_setzero_si512();
                }
            }
            _Pragma("GCC unroll 8") for (int j = 0; j < 4; j++) {
                __m512i lo, hi;
                iq_chunk_pair(codes, fmt, j, &lo, &hi);
                _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
                    const int8_t *q = a->q + (i0 + r0 + g) * IQ_K;
                    s[g] = _mm512_dpbusd_epi32(s[g], lo, _mm512_set1_epi32(iq_load4(q + 4 * j)));
                    t[g] = _mm512_dpbusd_epi32(t[g], hi, _mm512_set1_epi32(iq_load4(q + 16 + 4 * j)));
                }
            }
            _Pragma("GCC unroll 8") for (int g = 0; g < G; g++) {
                const long i = i0 + r0 + g;
                const __m512 dx = _mm512_set1_ps(a->d[i]);
                __m512 v = acc[r0 + g];
                if (halves) {
                    v = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(s[g]), v);
                    v = _mm512_fmadd_ps(_mm512_mul_ps(mw, dx), _mm512_cvtepi32_ps(t[g]), v);
                } else {
                    v = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(_mm512_add_epi32(s[g], t[g])), v);
                    if (iq_has_min(fmt)) v = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->ds[i]), v);
                }
                acc[r0 + g] = v;
            }
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#else
/* 32 bytes of 0 or `value`: bit b of the 4 bytes at p set -> byte b is `value` (a chunk half's
   fifth or sixth bits) */
static inline __m256i iq_plane_bits32(const uint8_t *p, char value) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(value));
}

/* a block's 8 scales (float16 or float32) of half h at p */
static inline __m256 iq_scales8(const uint8_t *p, int h, int f32) {
    return f32 ? _mm256_loadu_ps((const float *)p + 8 * h) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * h)));
}
/* K4, half h: 8 float16 values at f16 times 8 bytes at bytes (exact: 11 x 6 bits) */
static inline __m256 iq_k4_scales8(const uint8_t *f16, const uint8_t *bytes, int h) {
    return _mm256_mul_ps(iq_scales8(f16, h, 0),
                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(bytes + 8 * h)))));
}

/* block b's scales dw and mins (F8H: second-half scales) mw of half h, as in the AVX-512 tile */
static inline __attribute__((always_inline)) void iq_block_scales8(const uint8_t *panel, int fmt, int nb, int b, int h,
                                                                   __m256 *dw, __m256 *mw) {
    const uint8_t *p = panel + (long)b * iq_record_bytes(fmt);
    const int f32 = iq_is_f32(fmt);
    if (fmt == IQ_K4) {
        const uint8_t *super = panel + (long)nb * iq_record_bytes(fmt) + (long)(b / 8) * 64;
        *dw = iq_k4_scales8(super, p, h);
        *mw = _mm256_xor_ps(iq_k4_scales8(super + 32, p + 16, h), _mm256_set1_ps(-0.0f));   /* -(dmin * m) */
    } else {
        *dw = iq_scales8(p, h, f32);
        *mw = iq_has_min(fmt) || iq_has_halves(fmt) ? iq_scales8(p + (f32 ? 64 : 32), h, f32) : _mm256_setzero_ps();
    }
}

/* acc plus each lane's 4 products of unsigned bytes u and signed bytes s, exact: vpdpbusd where
   built with it (IQ_DPBUSD256), else vpmaddubsw + vpmaddwd (a lane's pairs of products fit 16
   bits for |c| <= 128 against |q| <= 127) */
static inline __m256i iq_add_dot4(__m256i acc, __m256i u, __m256i s) {
#ifdef IQ_DPBUSD256
    return IQ_DPBUSD256(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* R input rows x half h (weight rows 8h..8h+7) of one panel, AVX2: the same lanes' arithmetic
   as the AVX-512 tile. Two 16-bit partial sums per lane pair are exact: Q4 codes <= 15 and
   |q| <= 127 keep 8 maddubs results of a block below 2^15 (5-bit codes: 4, so they are widened
   per half); int8 codes use |c| and q with c's sign (|c| <= 128), each maddubs result widened
   at once, the block's halves summed apart. */
static inline __attribute__((always_inline)) void iq_half(const uint8_t *panel, int fmt, const iq_input *a,
                                                          long m0, int R, int h, float out[][IQ_ROWS]) {
    const int rec = iq_record_bytes(fmt), nb = a->nb, halves = iq_has_halves(fmt);
    const long first = iq_block_index(a, m0, 0);
    __m256 acc[16];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    const __m256i nibble = _mm256_set1_epi8(15);
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = panel + (long)b * rec, *codes = p + iq_scale_bytes(fmt) + 32 * h;
        const long i0 = iq_next_block(a, first, b);    /* row m0 + r's block b: i0 + r */
        if (h == 0)
            for (int off = 0; off < rec; off += 64) _mm_prefetch((const char *)p + IQ_PREFETCH_BYTES + off, IQ_PREFETCH_HINT);
        __m256 dw, mw;
        iq_block_scales8(panel, fmt, nb, b, h, &dw, &mw);
        __m256i w[8];
        if (iq_is_signed(fmt)) {
            for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256((const __m256i *)(codes + 64 * j));
        } else {
            for (int j = 0; j < 4; j++) {
                const __m256i v = _mm256_loadu_si256((const __m256i *)(codes + 64 * j));
                w[j] = _mm256_and_si256(v, nibble);
                w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibble);
            }
            const uint8_t *planes = codes - 32 * h + 256 + 4 * h;    /* chunk j's 8 bytes, this half's 4 */
            for (int plane = 0; plane < iq_bit_planes(fmt); plane++)
                for (int j = 0; j < 8; j++)
                    w[j] = _mm256_or_si256(w[j], iq_plane_bits32(planes + 64 * plane + 8 * j, (char)(16 << plane)));
        }
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
            const long i = i0 + r;
            const int8_t *q = a->q + i * IQ_K;
            const __m256 dx = _mm256_set1_ps(a->d[i]);
            /* the exact integer sums of the block's halves (weights 0..15, 16..31), from their
               start values as in the AVX-512 tile */
            __m256i lo = _mm256_setzero_si256(), hi = _mm256_setzero_si256();
            if (!iq_starts_at_zero(fmt)) {
                lo = _mm256_set1_epi32(halves ? a->start_lo[i] : a->start[i]);
                if (halves) hi = _mm256_set1_epi32(a->start[i] - a->start_lo[i]);
            }
            if (iq_is_signed(fmt)) {              /* int8 codes as |c| against q with c's sign */
                for (int j = 0; j < 8; j++) {
                    const __m256i qv = _mm256_set1_epi32(iq_load4(q + 4 * j));
                    if (j < 4) lo = iq_add_dot4(lo, _mm256_abs_epi8(w[j]), _mm256_sign_epi8(qv, w[j]));
                    else hi = iq_add_dot4(hi, _mm256_abs_epi8(w[j]), _mm256_sign_epi8(qv, w[j]));
                }
            } else {
#ifdef IQ_DPBUSD256
                for (int j = 0; j < 8; j++) {
                    const __m256i qv = _mm256_set1_epi32(iq_load4(q + 4 * j));
                    if (j < 4) lo = iq_add_dot4(lo, w[j], qv);
                    else hi = iq_add_dot4(hi, w[j], qv);
                }
#else             /* 16-bit sums widened every 8 chunks (4-bit codes), 4 (5-bit: 8 products
                     of <= 31 * 127 fit) or 2 (6-bit: 4 of <= 63 * 127) */
                const int widen = iq_bit_planes(fmt) == 2 ? 2 : iq_bit_planes(fmt) == 1 ? 4 : 8;
                const __m256i ones = _mm256_set1_epi16(1);
                __m256i t = _mm256_setzero_si256();
                for (int j = 0; j < 8; j++) {
                    t = _mm256_add_epi16(t, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(iq_load4(q + 4 * j))));
                    if ((j + 1) % widen == 0) {
                        if (j >= 4) hi = _mm256_add_epi32(hi, _mm256_madd_epi16(t, ones));
                        else lo = _mm256_add_epi32(lo, _mm256_madd_epi16(t, ones));
                        t = _mm256_setzero_si256();
                    }
                }
#endif
            }
            if (halves) {
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(lo), acc[r]);
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(hi), acc[r]);
                continue;
            }
            acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi)), acc[r]);
            if (iq_has_min(fmt)) acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(a->ds[i]), acc[r]);
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r] + 8 * h, acc[r]);
}
/* The empty asm statements below pin each row's sums in registers in program order: without
   them GCC hoisted the unrolled products and spilled (~100 stack accesses a block). */

/* t[r][h]: the 16-bit sums of input block i0 + r (a row's block b) x block b's 4-bit codes of
   half h (8 products of <= 15 * 127 fit); group j holds chunks j (low nibbles) and j + 4 (high) */
static inline __attribute__((always_inline)) void iq_nibble_sums(const uint8_t *codes, const iq_input *a, long i0,
                                                                 int R, __m256i t[][2]) {
    const __m256i nibble = _mm256_set1_epi8(15);
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(codes + 64 * j));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(codes + 64 * j + 32));
        const __m256i lo0 = _mm256_and_si256(v0, nibble), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), nibble);
        const __m256i lo1 = _mm256_and_si256(v1, nibble), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), nibble);
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
            const int8_t *q = a->q + (i0 + r) * IQ_K;
            const __m256i qa = _mm256_set1_epi32(iq_load4(q + 4 * j)), qb = _mm256_set1_epi32(iq_load4(q + 16 + 4 * j));
#ifdef IQ_DPBUSD256                         /* 32-bit sums at once */
            const __m256i zero = _mm256_setzero_si256();
            t[r][0] = IQ_DPBUSD256(IQ_DPBUSD256(j == 0 ? zero : t[r][0], lo0, qa), hi0, qb);
            t[r][1] = IQ_DPBUSD256(IQ_DPBUSD256(j == 0 ? zero : t[r][1], lo1, qa), hi1, qb);
#else
            const __m256i p0 = _mm256_add_epi16(_mm256_maddubs_epi16(lo0, qa), _mm256_maddubs_epi16(hi0, qb));
            const __m256i p1 = _mm256_add_epi16(_mm256_maddubs_epi16(lo1, qa), _mm256_maddubs_epi16(hi1, qb));
            t[r][0] = j == 0 ? p0 : _mm256_add_epi16(t[r][0], p0);
            t[r][1] = j == 0 ? p1 : _mm256_add_epi16(t[r][1], p1);
#endif
            __asm__ volatile("" : "+x"(t[r][0]), "+x"(t[r][1]));
        }
    }
}

/* t[r][h]: the 32-bit sums of input block i0 + r x block b's int8 codes of half h, as iq_half's */
static inline __attribute__((always_inline)) void iq_int8_sums(const uint8_t *codes, const iq_input *a, long i0,
                                                               int R, __m256i t[][2]) {
    _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)(codes + 64 * j));
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)(codes + 64 * j + 32));
        const __m256i abs0 = _mm256_abs_epi8(w0), abs1 = _mm256_abs_epi8(w1);
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
            const int8_t *q = a->q + (i0 + r) * IQ_K;
            const __m256i qv = _mm256_set1_epi32(iq_load4(q + 4 * j)), zero = _mm256_setzero_si256();
            t[r][0] = iq_add_dot4(j == 0 ? zero : t[r][0], abs0, _mm256_sign_epi8(qv, w0));
            t[r][1] = iq_add_dot4(j == 0 ? zero : t[r][1], abs1, _mm256_sign_epi8(qv, w1));
            __asm__ volatile("" : "+x"(t[r][0]), "+x"(t[r][1]));
        }
    }
}

/* R input rows x one panel, both halves in one pass, for formats with one scale per block
   (Q4_0, Q4_1, F4, K4, Q8_0, F8): each input broadcast feeds both halves. 4 rows of Q4_1 run
   24 -> 34 multiply-adds a cycle, Q8_0 19 -> 21.5, against iq_half (Zen3, 1 thread, panels in
   L1), near the bound of the two ports that multiply (~38 and ~27). The same exact int32 sums
   and float operations as iq_half, so the same bits. */
static inline __attribute__((always_inline)) void iq_whole(const uint8_t *panel, int fmt, const iq_input *a,
                                                           long m0, int R, float out[][IQ_ROWS]) {
    const int rec = iq_record_bytes(fmt), nb = a->nb;
    const long first = iq_block_index(a, m0, 0);
    __m256 acc[16][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = panel + (long)b * rec, *codes = p + iq_scale_bytes(fmt);
        for (int off = 0; off < rec; off += 64) _mm_prefetch((const char *)p + IQ_PREFETCH_BYTES + off, IQ_PREFETCH_HINT);
        const long i0 = iq_next_block(a, first, b);    /* row m0 + r's block b: i0 + r */
        __m256i t[16][2];
        if (iq_is_nibble(fmt)) iq_nibble_sums(codes, a, i0, R, t);
        else iq_int8_sums(codes, a, i0, R, t);
        __m256 dw[2], mw[2];
        for (int h = 0; h < 2; h++) iq_block_scales8(panel, fmt, nb, b, h, &dw[h], &mw[h]);
        _Pragma("GCC unroll 16") for (int r = 0; r < R; r++) {
            const long i = i0 + r;
            const __m256 dx = _mm256_set1_ps(a->d[i]);
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {
#ifdef IQ_DPBUSD256
                __m256i s = t[r][h];                 /* 32-bit sums already */
#else
                __m256i s = iq_is_nibble(fmt) ? _mm256_madd_epi16(t[r][h], _mm256_set1_epi16(1)) : t[r][h];
#endif
                if (!iq_starts_at_zero(fmt)) s = _mm256_add_epi32(_mm256_set1_epi32(a->start[i]), s);
                __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(dw[h], dx), _mm256_cvtepi32_ps(s), acc[r][h]);
                if (iq_has_min(fmt)) v = _mm256_fmadd_ps(mw[h], _mm256_set1_ps(a->ds[i]), v);
                acc[r][h] = v;
            }
        }
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out[r], acc[r][0]), _mm256_storeu_ps(out[r] + 8, acc[r][1]);
}
static inline __attribute__((always_inline)) void iq_tile(const uint8_t *panel, int fmt, const iq_input *a,
                                                          long m0, int R, float out[][IQ_ROWS]) {
    if (!iq_bit_planes(fmt) && !iq_has_halves(fmt)) {
        iq_whole(panel, fmt, a, m0, R, out);
        return;
    }
    iq_half(panel, fmt, a, m0, R, 0, out);     /* Q5_0, Q5_1, Q6, F8H */
    iq_half(panel, fmt, a, m0, R, 1, out);
}
#endif

/* iq_tile specialised per format and row count (constants let the compiler keep the tile in
   registers) */
#define IQ_DEFINE(FMT, R) \
    static void iq_tile_##FMT##_##R(const uint8_t *p, const iq_input *a, long m0, float out[][IQ_ROWS]) { \
        iq_tile(p, FMT, a, m0, R, out); }
#define IQ_DEFINE_ROWS(FMT) IQ_DEFINE(FMT, 1) IQ_DEFINE(FMT, 2) IQ_DEFINE(FMT, 3) IQ_DEFINE(FMT, 4) \
    IQ_DEFINE(FMT, 5) IQ_DEFINE(FMT, 6) IQ_DEFINE(FMT, 7) IQ_DEFINE(FMT, 8) IQ_DEFINE(FMT, 9) IQ_DEFINE(FMT, 10) \
    IQ_DEFINE(FMT, 11) IQ_DEFINE(FMT, 12) IQ_DEFINE(FMT, 13) IQ_DEFINE(FMT, 14) IQ_DEFINE(FMT, 15) IQ_DEFINE(FMT, 16)
IQ_DEFINE_ROWS(IQ_Q4_0) IQ_DEFINE_ROWS(IQ_Q4_1) IQ_DEFINE_ROWS(IQ_Q8_0) IQ_DEFINE_ROWS(IQ_F4) IQ_DEFINE_ROWS(IQ_F8)
IQ_DEFINE_ROWS(IQ_F8H) IQ_DEFINE_ROWS(IQ_Q5_0) IQ_DEFINE_ROWS(IQ_Q5_1) IQ_DEFINE_ROWS(IQ_Q6) IQ_DEFINE_ROWS(IQ_K4)
typedef void (*iq_tile_fn)(const uint8_t *, const iq_input *, long, float[][IQ_ROWS]);
#define IQ_ROW_FNS(FMT) {iq_tile_##FMT##_1, iq_tile_##FMT##_2, iq_tile_##FMT##_3, iq_tile_##FMT##_4, \
    iq_tile_##FMT##_5, iq_tile_##FMT##_6, iq_tile_##FMT##_7, iq_tile_##FMT##_8, iq_tile_##FMT##_9, iq_tile_##FMT##_10, \
    iq_tile_##FMT##_11, iq_tile_##FMT##_12, iq_tile_##FMT##_13, iq_tile_##FMT##_14, iq_tile_##FMT##_15, iq_tile_##FMT##_16}
static const iq_tile_fn IQ_TILE_FNS[IQ_NUM_FORMATS][16] = {
    IQ_ROW_FNS(IQ_Q4_0), IQ_ROW_FNS(IQ_Q4_1), IQ_ROW_FNS(IQ_Q8_0), IQ_ROW_FNS(IQ_F4), IQ_ROW_FNS(IQ_F8), IQ_ROW_FNS(IQ_F8H),
    IQ_ROW_FNS(IQ_Q5_0), IQ_ROW_FNS(IQ_Q5_1), IQ_ROW_FNS(IQ_Q6), IQ_ROW_FNS(IQ_K4)};

/* a thread's AMX tile configuration: the input rows and kind of format it was set for (0 rows: none) */
typedef struct { int rows, halves; } iq_amx_state;
#include "int_amx.h"

/* rows [m0, m1) x panel `pnl` into y (float32 or bfloat16, stride N); amx: this thread's tile
   configuration (AMX builds: tiles of at least IQ_AMX_MIN_ROWS rows go to the AMX tile) */
static void iq_panel_rows(const uint8_t *panel, int fmt, const iq_input *a, long m0, long m1, int pnl,
                          const float *bias, void *y, int N, int is_bf16, iq_amx_state *amx) {
    float out[IQ_TILE][IQ_ROWS];
    const int n0 = pnl * IQ_ROWS, nn = N - n0 < IQ_ROWS ? N - n0 : IQ_ROWS;
    for (long m = m0; m < m1;) {
        const int r = m1 - m < IQ_TILE ? (int)(m1 - m) : IQ_TILE;
        if (IQ_AMX && r >= IQ_AMX_MIN_ROWS) iq_tile_amx(panel, fmt, a, m, r, out, amx);
        else IQ_TILE_FNS[fmt - 1][r - 1](panel, a, m, out);
        for (int t = 0; t < r; t++)
            for (int i = 0; i < nn; i++)
                set_elem(y, (m + t) * N + n0 + i, out[t][i] + (bias ? bias[n0 + i] : 0.0f), is_bf16);
        m += r;
    }
}

/* y = x @ W^T (+ bias) for W as panels (N rounded up to 16 rows, zero rows past N), by the
   threads of the current team: every thread of a parallel region calls it (decoder_layers runs
   a model's layers in one region), or one thread outside any. scratch: buffers for the quantized
   input (NULL: its own); own_scratch: they are this thread's alone, and each thread quantizes
   every row into its own (a few rows: cheaper than a barrier after one thread's); next: the
   integer linear the team runs after this one on as many rows (NULL: none, or not known), where
   the prefetches past this thread's share go on (iq_ahead). Returns the same status in each. */
static int int_linear_team(const uint8_t *panels, int fmt, const void *x, const float *bias, void *y,
                           int M, int N, int K, int dtype, const iq_input *scratch, int own_scratch,
                           const iq_next_linear *next) {
    if (K % IQ_K || fmt < IQ_Q4_0 || fmt > IQ_NUM_FORMATS || M < 1 || N < 1) return -1;
    if (fmt == IQ_K4 && K % 256) return -1;
    const int is_bf16 = dtype == DTYPE_BF16, num_panels = (int)iq_num_panels(N);
    const long panel_bytes = iq_panel_bytes(fmt, K / IQ_K);
    const long num_chunks = (M + IQ_CHUNK_ROWS - 1) / IQ_CHUNK_ROWS, items = num_chunks * num_panels;
    const int quantize_inside = M >= 4 * omp_get_num_threads();    /* fewer rows: one thread quantizes them */
    iq_input a;
    int failed = 0;
    if (scratch) {              /* buffers of the caller's, for at least M rows of K */
        a = *scratch;
        a.K = K, a.nb = K / IQ_K, a.group = M < IQ_GROUP_ROWS ? M : IQ_GROUP_ROWS;
    } else {
        #pragma omp single copyprivate(a, failed)
        {
            failed = iq_input_alloc(&a, M, K);
            if (failed) iq_input_free(&a);
        }
    }
    if (failed) return -1;
    if (scratch && own_scratch) {
        iq_quantize_range(&a, x, M, 0, a.nb, is_bf16, fmt);
    } else if (!quantize_inside) {
        #pragma omp master
        {
            double t = profile_clock();
            iq_quantize_range(&a, x, M, 0, a.nb, is_bf16, fmt);
            profile_mark(PROF_QUANTIZE, t);
        }
        #pragma omp barrier
    } else {
        double t = profile_clock();
        long b0, b1;                        /* a contiguous share of blocks each */
        team_share(a.nb, &b0, &b1);
        iq_quantize_range(&a, x, M, (int)b0, (int)b1, is_bf16, fmt);
        #pragma omp barrier
        #pragma omp master
        profile_mark(PROF_QUANTIZE, t);    /* also inside its linear's time */
    }
    /* panel-major: a thread's share is a range of panels, each taken for every chunk of rows
       in turn (while it is in cache); chunk-major gave one thread the first 64 rows and the
       other the rest (79 rows: 64 against 15) and streamed the weights once per chunk */
    iq_amx_state amx = {0, 0};
    long first, end;
    team_share(items, &first, &end);
    a.share_end = (const char *)panels + end * panel_bytes, a.next_share = NULL;
    if (num_chunks == 1 && next && next->panels && end > first) {     /* items are panels */
        long next_first, next_end;
        team_share(iq_num_panels(next->N), &next_first, &next_end);
        if (next_end > next_first)
            a.next_share = (const char *)next->panels + next_first * iq_panel_bytes(next->fmt, next->K / IQ_K);
    }
    for (long it = first; it < end; it++) {
        const long chunk = it % num_chunks, m0 = chunk * IQ_CHUNK_ROWS;
        const long m1 = m0 + IQ_CHUNK_ROWS < M ? m0 + IQ_CHUNK_ROWS : M;
        const int pnl = (int)(it / num_chunks);
        iq_panel_rows(panels + pnl * panel_bytes, fmt, &a, m0, m1, pnl, bias, y, N, is_bf16, &amx);
    }
    #pragma omp barrier
    iq_amx_release(&amx);     /* the tiles back to their initial state for whatever runs next */
    if (!scratch) {
        #pragma omp single nowait
        iq_input_free(&a);
    }
    return 0;
}

/* which variant this library was built as: 1 avx2, 2 avx512_vnni, 3 avx512_bf16 (the integer
   kernels of avx512_vnni; attention's bfloat16 products by vdpbf16ps), 4 avx512_amx (avx512_bf16's,
   AMX tiles for 4 or more input rows; also its emulated build), 5 avx_vnni (avx2's with the
   256-bit tile's sums by vpdpbusd) */
int int_kernel_level(void) {
#if IQ_AMX
    return 4;
#elif IQ_LEVEL == 1 && defined(IQ_DPBUSD256)
    return 5;                 /* avx_vnni (and its test build over AVX-512's encoding) */
#elif defined(__AVX512BF16__)
    return IQ_LEVEL + 1;
#else
    return IQ_LEVEL;
#endif
}

/* The code bytes of panels (each record's bytes after its scale header; int_codes.panels writes
   the headers): from int8 codes [N, K] row-major, stored as code + offset (Q5_0 16, Q6 32, else
   0), in fmt's layout (the comment at the top): chunk j byte 4i + t = row i's code 4j + t of the
   block; 4-bit formats chunk j in the low nibbles of group j and chunk j + 4 in the high ones,
   then a plane per code bit above the nibble (bit 4i + t of chunk j's 8 bytes); rows past N
   zero. records: ceil(N / 16) panels of panel_bytes, K / 32 records each. What numpy's
   int_codes._code_chunks gives, at memory speed (loading a 7B model packs 6.5G codes). */
int int_pack_codes(const int8_t *codes, long N, long K, int fmt, int offset, uint8_t *records, long panel_bytes) {
    if (K % IQ_K || fmt < IQ_Q4_0 || fmt > IQ_NUM_FORMATS) return -1;
    const int nb = (int)(K / IQ_K), rec = iq_record_bytes(fmt), head = iq_scale_bytes(fmt);
    const int nibbles = iq_is_nibble(fmt), planes = iq_bit_planes(fmt);
    const long num_panels = iq_num_panels(N);
    #pragma omp parallel for schedule(static)
    for (long p = 0; p < num_panels; p++)
        for (int b = 0; b < nb; b++) {
            uint8_t *out = records + p * panel_bytes + (long)b * rec + head;
            uint32_t chunk[8][IQ_ROWS];      /* chunk j, word i: row i's codes 4j .. 4j + 3 (a word transpose) */
            for (int i = 0; i < IQ_ROWS; i++) {
                const long row = p * IQ_ROWS + i;
                uint8_t stored[IQ_K] = {0};      /* rows past N: zeros, as stored */
                if (row < N)
                    for (int k = 0; k < IQ_K; k++) stored[k] = (uint8_t)(codes[row * K + (long)b * IQ_K + k] + offset);
                uint32_t words[8];
                memcpy(words, stored, sizeof words);
                for (int j = 0; j < 8; j++) chunk[j][i] = words[j];
            }
            const uint8_t *bytes = (const uint8_t *)chunk;
            if (!nibbles) {
                memcpy(out, chunk, sizeof chunk);
                continue;
            }
            for (int j = 0; j < 4; j++)
                for (int x = 0; x < 64; x++)
                    out[64 * j + x] = (uint8_t)((bytes[64 * j + x] & 15) | ((bytes[64 * (j + 4) + x] & 15) << 4));
            for (int k = 0; k < planes; k++)
                for (int x = 0; x < 512; x += 8) {       /* chunk x / 64's bits 4i + t, 8 a byte */
                    uint8_t bits = 0;
                    for (int u = 0; u < 8; u++) bits |= (uint8_t)(((bytes[x + u] >> (4 + k)) & 1) << u);
                    out[256 + 64 * k + x / 8] = bits;
                }
        }
    return 0;
}

/* the quantized input rows as the kernels see them (for tests): q [M, K], d, ds, start [M, K / 32] */
int int_quantize_rows(const void *x, int M, int K, int dtype, int fmt, int8_t *q, float *d, float *ds, int32_t *start) {
    if (K % IQ_K) return -1;
    iq_input a;
    if (iq_input_init(&a, x, M, K, dtype == DTYPE_BF16, fmt)) {
        iq_input_free(&a);
        return -1;
    }
    for (long m = 0; m < M; m++)
        for (int b = 0; b < a.nb; b++) {
            const long i = iq_block_index(&a, m, b), o = m * a.nb + b;
            memcpy(q + o * IQ_K, a.q + i * IQ_K, IQ_K);
            d[o] = a.d[i], ds[o] = a.ds[i], start[o] = a.start[i];
        }
    iq_input_free(&a);
    return 0;
}
