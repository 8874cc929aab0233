/* Row-invariant paged attention (AVX2 + FMA, AVX-512 where built so: the same bits either way).

   For every query row t (request b = row_batch[t], query j = row_query[t]) and query head,
   attend to the keys l of request b that mask[b, j, l] allows, reading K/V straight from the
   paged cache at slot kv_indices[b, l]:
       score_l = (q . K[slot_l]) / sqrt(head_dim)        the fixed sum order below
       w_l     = exp(score_l - max score)                one vectorized exp, elementwise
       out     = (sum_l w_l V[slot_l]) / (sum_l w_l)     float32; the numerator's terms in key
                                                         order, the denominator's in 8 lanes
                                                         (keys l = i mod 8 in order) and hsum8
   over each split of KEY_SPLIT keys (the max taken per split), the splits merged as the comment
   on KEY_SPLIT says (a row of at most KEY_SPLIT keys: exactly the formulas above). Over a
   bfloat16 cache the products are bfloat16 ones: the scaled query and the weights w_l rounded to
   bfloat16, each product exact, the sums in float32 in the orders the comments on PAIR_DIMS and
   weigh_bf16 give (vdpbf16ps where the CPU has AVX-512 BF16, FMAs elsewhere: the same bits).
   Every step depends only on the keys a row attends to, in their order, never on the other
   rows, the batch, padding or masked keys (skipped, not added as zeros), nor on the thread
   count: a token gets the same bits verified inside a draft tree, decoded alone or batched.

   A score's sum order (head_dim padded with zeros to a multiple of 16): 16 partial sums
   p_i = q_i k_i + q_(i+16) k_(i+16) + ... (one FMA chain each, d ascending), then the fixed tree
   r_i = p_i + p_(i+8), s_i = r_i + r_(i+4), total = (s_0 + s_1) + (s_2 + s_3). Keys are scored
   16 (AVX-512) or 8 (AVX2) at a time, each key's partial sums in a register of its own, and the
   trees of a tile's keys are summed together by shuffles into one vector of scores: no
   horizontal sum per key (AVX2 with bfloat16 rows of 64: each key's row widened once in
   registers for all the tile's queries, the same chains and tree; a verify's shared keys with
   vdpbf16ps: each tile transposed once, one key a lane, the same chains and tree as plain adds).
   The query heads of a GQA group share each key's loads, and the weighted values are summed for
   several heads at once
   (each element one chain of FMAs over l, the same whatever the vector width). Rows of one
   request (a verify forward, a prefill chunk) go in segments: the keys every row of a segment
   attends to are scored tile by tile and weighed chunk by chunk for all its rows while those
   keys are in L1, and each row then goes on alone with its own keys; every score and every FMA
   chain is the one the row would get alone. A few rows (a decode step) go as tasks of one row,
   KV head and key split each, so the threads share a long context.
   Built by build.py (cpu_kernels.c), called from attention.py and decoder_layer.c. */
#include "common.h"

#define MAX_GROUP 16          /* query heads per KV head */
#define PREFETCH_KEYS 16      /* keys ahead whose K or V rows are prefetched */
#define VALUE_CHUNKS 4        /* vectors of a value row summed per pass */
#define ROW_BLOCK 8           /* rows of one request whose shared keys are scored and weighed together */
#define KEY_CHUNK 64          /* shared keys whose value rows are weighed for every row at once */

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ATT_LANES 16          /* keys per score tile, lanes per vector */
#define HEADS_PER_PASS 4      /* query heads whose weighted values are summed together */
typedef __m512 vecf;
static inline vecf v_zero(void) { return _mm512_setzero_ps(); }
static inline vecf v_set1(float x) { return _mm512_set1_ps(x); }
static inline vecf v_fma(vecf a, vecf b, vecf c) { return _mm512_fmadd_ps(a, b, c); }
/* the lanes of chunk d .. d + 15 that lie inside head_dim */
static inline __mmask16 chunk_mask(int d, int head_dim) {
    const int n = head_dim - d;
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (n > 0 ? n : 0)) - 1);
}
/* elements d .. d + 15 of a K/V row (float32 or bfloat16), zeros past head_dim */
static inline vecf v_load_row(const char *row, int d, int head_dim, int is_bf16) {
    const __mmask16 m = chunk_mask(d, head_dim);
    if (is_bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, row + 2 * (long)d)), 16));
    return _mm512_maskz_loadu_ps(m, (const float *)row + d);
}
static inline void v_store_part(float *out, vecf v, int n) { _mm512_mask_storeu_ps(out, chunk_mask(0, n), v); }
static inline void v_store(float *out, vecf v) { _mm512_storeu_ps(out, v); }
#else
#define ATT_LANES 8
#define HEADS_PER_PASS 2
typedef __m256 vecf;
static inline vecf v_zero(void) { return _mm256_setzero_ps(); }
static inline vecf v_set1(float x) { return _mm256_set1_ps(x); }
static inline vecf v_fma(vecf a, vecf b, vecf c) { return _mm256_fmadd_ps(a, b, c); }
/* elements d .. d + 7 of a K/V row, zeros past head_dim (a multiple of 8) */
static inline vecf v_load_row(const char *row, int d, int head_dim, int is_bf16) {
    return d < head_dim ? load8(row + (long)d * (is_bf16 ? 2 : 4), is_bf16) : _mm256_setzero_ps();
}
static inline void v_store(float *out, vecf v) { _mm256_storeu_ps(out, v); }
static inline void v_store_part(float *out, vecf v, int n) {
    if (n >= 8) {
        _mm256_storeu_ps(out, v);
    } else {
        float lanes[8];
        _mm256_storeu_ps(lanes, v);
        memcpy(out, lanes, (size_t)(n > 0 ? n : 0) * sizeof(float));
    }
}
#endif

/* prefetch the `bytes` bytes of a key or value row that a later iteration reads */
static inline void prefetch_row(const char *p, int bytes) {
    for (int off = 0; off < bytes; off += 64) _mm_prefetch(p + off, _MM_HINT_T0);
}

/* Rows of keys [key, end) at slots to prefetch a few lines at a time between pieces of work: a
   burst of software prefetches longer than the core's miss buffers is mostly dropped here (64 KiB
   prefetched in one burst then read in 0.53x the time of no prefetch; one line every few dozen
   cycles, in 0.15x: the time of reading it from L2; AVX-512 Zen4). */
typedef struct {
    const char *base;
    long stride;
    const int64_t *slots;
    int key, end, lines, line, to_l2;
} drip;

static inline drip drip_rows(const char *base, long stride, const int64_t *slots, int key, int end, int bytes,
                             int to_l2) {
    const drip d = {base, stride, slots, key, end, (bytes + 63) / 64, 0, to_l2};
    return d;
}
/* what to prefetch while tile [l0, l0 + lanes) of the `common` keys at slots is scored: the next
   tile's key rows into L1 (*next), this tile's value rows into L2 (*values) */
static inline void tile_drips(const char *k_base, const char *v_base, long stride, const int64_t *slots, int l0,
                              int lanes, int common, int bytes, drip *next, drip *values) {
    const int end = l0 + 2 * lanes < common ? l0 + 2 * lanes : common;
    *next = drip_rows(k_base, stride, slots, l0 + lanes, end, bytes, 0);
    *values = drip_rows(v_base, stride, slots, l0, l0 + lanes, bytes, 1);
}
/* lines left in d */
static inline int drip_left(const drip *d) { return (d->end - d->key) * d->lines - d->line; }
/* up to n of d's lines prefetched; returns how many of the n are left */
static inline int drip_some(drip *d, int n) {
    for (; n > 0 && d->key < d->end; n--) {
        const char *p = d->base + d->slots[d->key] * d->stride + 64L * d->line;
        if (d->to_l2) _mm_prefetch(p, _MM_HINT_T1);
        else _mm_prefetch(p, _MM_HINT_T0);
        if (++d->line == d->lines) d->line = 0, d->key++;
    }
    return n;
}

/* With a bfloat16 cache a score is a sum of bfloat16 products: the scaled query is rounded to
   bfloat16 (nearest even), every product is exact in float32, and the products are summed in the
   order of AVX-512 BF16's vdpbf16ps: lane i (of 16) of each chunk of PAIR_DIMS dims adds the
   product of dims 2i + 1, then that of dims 2i, chunk after chunk; then the fixed tree over the
   16 lanes (reduce_tile). Where the CPU has no vdpbf16ps the same sums are FMAs over query and
   key rows widened "pair-split": a chunk's odd dims at positions 0-15, its even dims at 16-31,
   so that score_tile_f32's chains p_i over positions i, i + 16, ... are those lanes' sums: the
   same bits on every variant (vdpbf16ps also treats denormal inputs and sums as zero, which the
   FMAs do not: they differ only where a product or partial sum is below ~1e-38). vdpbf16ps
   reads a key row as bfloat16 and makes two products a lane where an FMA over a widened row
   makes one. */
#define PAIR_DIMS 32
static inline int round_pairs(int head_dim) { return (head_dim + PAIR_DIMS - 1) / PAIR_DIMS * PAIR_DIMS; }
/* the position of dim d in a pair-split row */
static inline int pair_split_pos(int d) {
    const int c = d % PAIR_DIMS;
    return d - c + ((c & 1) ? c / 2 : PAIR_DIMS / 2 + c / 2);
}
/* 8 32-bit words of a bfloat16 row (16 dims) as float32: *odd the high halves (dims 2i + 1),
   *even the low halves (dims 2i), exact */
static inline void split_pairs8(const char *words, __m256 *odd, __m256 *even) {
    const __m256i w = _mm256_loadu_si256((const __m256i *)words);
    *odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
    *even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
/* a bfloat16 row of head_dim (a multiple of 8) widened pair-split into hdq floats (exact, zeros
   past head_dim): whole chunks by vectors, a short last chunk element by element */
static inline __attribute__((always_inline)) void widen_pair_split_dims(const char *row, float *dst, int head_dim,
                                                                        int hdq) {
    int d = 0;
    for (; d + PAIR_DIMS <= head_dim; d += PAIR_DIMS)
        for (int half = 0; half < 2; half++) {      /* words 0-7 -> lanes 0-7, words 8-15 -> 8-15 */
            __m256 odd, even;
            split_pairs8(row + 2 * (long)d + 32 * half, &odd, &even);
            _mm256_storeu_ps(dst + d + 8 * half, odd);
            _mm256_storeu_ps(dst + d + 16 + 8 * half, even);
        }
    if (d < hdq) {
        memset(dst + d, 0, (size_t)(hdq - d) * sizeof(float));
        for (int e = d; e < head_dim; e++) dst[pair_split_pos(e)] = bf16_to_f32(((const uint16_t *)row)[e]);
    }
}
/* with the common head sizes as constants */
static inline void widen_pair_split(const char *row, float *dst, int head_dim, int hdq) {
    if (head_dim == 64) widen_pair_split_dims(row, dst, 64, 64);
    else if (head_dim == 128) widen_pair_split_dims(row, dst, 128, 128);
    else widen_pair_split_dims(row, dst, head_dim, hdq);
}

#if ATT_LANES == 16
/* 16 keys' partial sums p_i -> their 16 scores in key order, each by the fixed tree */
static inline __m512 reduce_tile(const __m512 *p) {
    __m512 z[8], w[4], v[2];
    for (int j = 0; j < 8; j++)      /* r_i = p_i + p_(i+8): keys 2j, 2j + 1 in the two halves */
        z[j] = _mm512_add_ps(_mm512_shuffle_f32x4(p[2 * j], p[2 * j + 1], 0x44),
                             _mm512_shuffle_f32x4(p[2 * j], p[2 * j + 1], 0xEE));
    for (int j = 0; j < 4; j++)      /* s_i = r_i + r_(i+4): keys 4j .. 4j + 3, one per 128-bit block */
        w[j] = _mm512_add_ps(_mm512_shuffle_f32x4(z[2 * j], z[2 * j + 1], 0x88),
                             _mm512_shuffle_f32x4(z[2 * j], z[2 * j + 1], 0xDD));
    for (int j = 0; j < 2; j++)      /* (s_0 + s_1), (s_2 + s_3) */
        v[j] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * j], w[2 * j + 1], 0x88),
                             _mm512_shuffle_ps(w[2 * j], w[2 * j + 1], 0xDD));
    const __m512 total = _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
    /* lane 4b + j holds key 4j + b */
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), total);
}
/* scores of 16 keys for one query head q (hd16 floats, zero padded); HD16 a constant where
   the caller can make it one, so the query's chunks stay in registers */
static inline __attribute__((always_inline)) __m512 score_tile_f32(
        const float *q, const char *const *keys, int head_dim, int HD16) {
    __m512 p[16];
    _Pragma("GCC unroll 16") for (int k = 0; k < 16; k++) {
        const char *key = keys[k];
        p[k] = _mm512_mul_ps(_mm512_loadu_ps(q), v_load_row(key, 0, head_dim, 0));
        _Pragma("GCC unroll 8") for (int d = 16; d < HD16; d += 16)
            p[k] = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), v_load_row(key, d, head_dim, 0), p[k]);
    }
    return reduce_tile(p);
}
#else
/* 8 keys' r_i = p_i + p_(i+8) -> their 8 scores in key order, by the same tree as the AVX-512 variant */
static inline __m256 reduce_tile(const __m256 *r) {
    __m256 s[4], t[2];
    for (int j = 0; j < 4; j++)      /* s_i = r_i + r_(i+4): keys 2j, 2j + 1, one per 128-bit half */
        s[j] = _mm256_add_ps(_mm256_permute2f128_ps(r[2 * j], r[2 * j + 1], 0x20),
                             _mm256_permute2f128_ps(r[2 * j], r[2 * j + 1], 0x31));
    for (int j = 0; j < 2; j++)
        t[j] = _mm256_add_ps(_mm256_shuffle_ps(s[2 * j], s[2 * j + 1], 0x88),
                             _mm256_shuffle_ps(s[2 * j], s[2 * j + 1], 0xDD));
    const __m256 total = _mm256_add_ps(_mm256_shuffle_ps(t[0], t[1], 0x88), _mm256_shuffle_ps(t[0], t[1], 0xDD));
    /* lanes hold keys 0, 2, 4, 6, 1, 3, 5, 7 */
    return _mm256_permutevar8x32_ps(total, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
/* scores of 8 keys: the 16 partial sums as two halves, lo = lanes 0..7, hi = lanes 8..15 */
static inline __attribute__((always_inline)) __m256 score_tile_f32(
        const float *q, const char *const *keys, int head_dim, int HD16) {
    __m256 r[8];
    _Pragma("GCC unroll 8") for (int k = 0; k < 8; k++) {
        const char *key = keys[k];
        __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(q), v_load_row(key, 0, head_dim, 0));
        __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(q + 8), v_load_row(key, 8, head_dim, 0));
        _Pragma("GCC unroll 8") for (int d = 16; d < HD16; d += 16) {
            lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), v_load_row(key, d, head_dim, 0), lo);
            hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + d + 8), v_load_row(key, d + 8, head_dim, 0), hi);
        }
        r[k] = _mm256_add_ps(lo, hi);
    }
    return reduce_tile(r);
}
#endif
/* score_tile_f32 (key rows in float32: ``tile_rows`` widens bfloat16 ones first) with the common
   head sizes as constants (no lane masks) */
static vecf score_tile(const float *q, const char *const *keys, int head_dim, int hd16) {
    switch (head_dim) {
    case 64: return score_tile_f32(q, keys, 64, 64);
    case 128: return score_tile_f32(q, keys, 128, 128);
    default: return score_tile_f32(q, keys, head_dim, hd16);
    }
}

#ifdef __AVX512BF16__
/* a bfloat16 key row's dims d .. d + 31 (zeros past head_dim) */
static inline __m512bh key_pairs(const char *row, int d, int head_dim) {
    const int n = head_dim - d;
    const __mmask32 m = n >= PAIR_DIMS ? (__mmask32)0xffffffffu : (__mmask32)((1u << n) - 1);
    return (__m512bh)_mm512_maskz_loadu_epi16(m, row + 2 * (long)d);
}
/* scores of 16 keys (bfloat16 rows, read in place) for one query head qb (bfloat16, hdq of them,
   zero padded) by vdpbf16ps: the sums the comment on PAIR_DIMS gives */
static inline __attribute__((always_inline)) __m512 score_tile_bf16_dims(
        const uint16_t *qb, const char *const *keys, int head_dim, int HDQ) {
    __m512 p[16];
    _Pragma("GCC unroll 16") for (int k = 0; k < 16; k++) {
        p[k] = _mm512_setzero_ps();
        _Pragma("GCC unroll 8") for (int d = 0; d < HDQ; d += PAIR_DIMS)
            p[k] = _mm512_dpbf16_ps(p[k], (__m512bh)_mm512_loadu_si512(qb + d), key_pairs(keys[k], d, head_dim));
    }
    return reduce_tile(p);
}
static vecf score_tile_bf16(const uint16_t *qb, const char *const *keys, int head_dim, int hdq) {
    switch (head_dim) {
    case 64: return score_tile_bf16_dims(qb, keys, 64, 64);
    case 128: return score_tile_bf16_dims(qb, keys, 128, 128);
    default: return score_tile_bf16_dims(qb, keys, head_dim, hdq);
    }
}

/* Scoring with the keys in lanes, for a tile scored by many queries (a verify's rows share their
   keys): the same sums as score_tile_bf16, lane i's chains and the fixed tree, each lane now one
   key, so the tree is plain adds (no shuffles) and each word of the tile is loaded once for a
   group of queries. The tile is transposed once: 64 shuffles a chunk of 32 dims. Attention at 8
   rows, 1 thread, with K/V in cache: 1.38-1.42 against 1.62-1.65 ms over 30 layers; in a forward
   (K/V from memory, prefetched as drip says) 1.51-1.67 against 1.78-1.81 ms (AVX-512 Zen4). */
#define KEYS_IN_LANES_MIN_PAIRS 8     /* (row, query head) pairs a tile must serve to be transposed */
#define KEYS_IN_LANES_GROUP 4         /* queries scored together against each loaded word */

/* rows[k]'s 32-bit words 0..15 -> t[i] lane k = rows[k] word i (a 16 x 16 transpose) */
static inline void transpose16(const __m512i *rows, __m512i *t) {
    __m512i a[16], b[16];
    for (int k = 0; k < 16; k += 2) {        /* words of keys k, k + 1 interleaved */
        a[k] = _mm512_unpacklo_epi32(rows[k], rows[k + 1]);
        a[k + 1] = _mm512_unpackhi_epi32(rows[k], rows[k + 1]);
    }
    for (int g = 0; g < 16; g += 4) {        /* b[g + m], 128-bit block L: word 4L + m of keys g .. g + 3 */
        b[g] = _mm512_unpacklo_epi64(a[g], a[g + 2]);
        b[g + 1] = _mm512_unpackhi_epi64(a[g], a[g + 2]);
        b[g + 2] = _mm512_unpacklo_epi64(a[g + 1], a[g + 3]);
        b[g + 3] = _mm512_unpackhi_epi64(a[g + 1], a[g + 3]);
    }
    for (int m = 0; m < 4; m++) {            /* the four key groups' blocks side by side */
        const __m512i v0 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0x44), v1 = _mm512_shuffle_i32x4(b[m], b[4 + m], 0xEE);
        const __m512i v2 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0x44);
        const __m512i v3 = _mm512_shuffle_i32x4(b[8 + m], b[12 + m], 0xEE);
        t[m] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        t[4 + m] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
        t[8 + m] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        t[12 + m] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
    }
}

/* p_i of G queries (bfloat16, zero padded to CHUNKS * 32) against the transposed tile kt (chunk
   c's words at kt + 16c): the chain of score_tile_bf16_dims's lane i, one key a lane */
static inline __attribute__((always_inline)) void part_sums(const uint16_t *const *qs, int G, const __m512i *kt,
                                                            int CHUNKS, int i, __m512 *p) {
    for (int g = 0; g < G; g++) p[g] = _mm512_setzero_ps();
    for (int c = 0; c < CHUNKS; c++) {
        const __m512bh k = (__m512bh)kt[16 * c + i];
        for (int g = 0; g < G; g++)      /* the query's word as the instruction's broadcast operand */
            __asm__("vdpbf16ps %2%{1to16%}, %1, %0"
                    : "+v"(p[g]) : "v"(k), "m"(*(const int32_t *)(qs[g] + PAIR_DIMS * c + 2 * i)));
    }
}

/* the scores of the tile's 16 keys for G queries into out[g] + l0: reduce_tile's tree,
   total = (s_0 + s_1) + (s_2 + s_3), s_j = (p_j + p_(j+8)) + (p_(j+4) + p_(j+12)), lane by lane;
   partial sums folded in as soon as they are whole (fewer of them live: no spills) */
static inline __attribute__((always_inline)) void score_keys_in_lanes(const uint16_t *const *qs, int G,
                                                                      const __m512i *kt, int CHUNKS,
                                                                      float *const *out, int l0) {
    __m512 half[KEYS_IN_LANES_GROUP], first[KEYS_IN_LANES_GROUP];     /* s_0 + s_1; s_0 or s_2 */
    for (int j = 0; j < 4; j++) {
        __m512 a[KEYS_IN_LANES_GROUP], b[KEYS_IN_LANES_GROUP], r[KEYS_IN_LANES_GROUP];
        part_sums(qs, G, kt, CHUNKS, j, a);
        part_sums(qs, G, kt, CHUNKS, j + 8, b);
        for (int g = 0; g < G; g++) r[g] = _mm512_add_ps(a[g], b[g]);
        part_sums(qs, G, kt, CHUNKS, j + 4, a);
        part_sums(qs, G, kt, CHUNKS, j + 12, b);
        for (int g = 0; g < G; g++) {
            const __m512 sj = _mm512_add_ps(r[g], _mm512_add_ps(a[g], b[g]));
            if (j == 0 || j == 2) first[g] = sj;
            else if (j == 1) half[g] = _mm512_add_ps(first[g], sj);
            else _mm512_storeu_ps(out[g] + l0, _mm512_add_ps(half[g], _mm512_add_ps(first[g], sj)));
        }
    }
}

/* score_shared's tiles for head sizes of CHUNKS * 32 (bfloat16 keys): each tile transposed once,
   then scored for the queries KEYS_IN_LANES_GROUP at a time */
static inline __attribute__((always_inline)) void score_shared_keys_in_lanes_dims(
        const uint16_t *const *qs, float *const *outs, int n, const char *k_base, const char *v_base, long stride,
        const int64_t *slots, int common, int CHUNKS) {
    drip next = drip_rows(k_base, stride, slots, 0, common < 16 ? common : 16, CHUNKS * 64, 0);
    drip_some(&next, 1 << 30);
    for (int l0 = 0; l0 < common; l0 += 16) {
        drip values;
        tile_drips(k_base, v_base, stride, slots, l0, 16, common, CHUNKS * 64, &next, &values);
        __m512i kt[16 * 4];
        for (int c = 0; c < CHUNKS; c++) {
            __m512i rows[16];
            for (int k = 0; k < 16; k++) rows[k] = _mm512_loadu_si512(k_base + slots[l0 + k] * stride + 64 * c);
            transpose16(rows, kt + 16 * c);
        }
        const int steps = n / KEYS_IN_LANES_GROUP + n % KEYS_IN_LANES_GROUP;
        const int per_step = (drip_left(&next) + drip_left(&values) + steps - 1) / steps;
        int g = 0;
        for (; g + KEYS_IN_LANES_GROUP <= n; g += KEYS_IN_LANES_GROUP) {
            score_keys_in_lanes(qs + g, KEYS_IN_LANES_GROUP, kt, CHUNKS, outs + g, l0);
            drip_some(&values, drip_some(&next, per_step));
        }
        for (; g < n; g++) {
            score_keys_in_lanes(qs + g, 1, kt, CHUNKS, outs + g, l0);
            drip_some(&values, drip_some(&next, per_step));
        }
        drip_some(&values, drip_some(&next, 1 << 30));
    }
}
/* ... with the common head sizes as constants; 0 where the head size is not one */
static int score_shared_keys_in_lanes(const uint16_t *const *qs, float *const *outs, int n, const char *k_base,
                                      const char *v_base, long stride, const int64_t *slots, int common, int head_dim) {
    switch (head_dim) {
    case 64: score_shared_keys_in_lanes_dims(qs, outs, n, k_base, v_base, stride, slots, common, 2); return 1;
    case 128: score_shared_keys_in_lanes_dims(qs, outs, n, k_base, v_base, stride, slots, common, 4); return 1;
    default: return 0;
    }
}
#define HAS_BF16_PRODUCTS 1
#else
#define HAS_BF16_PRODUCTS 0
#endif

/* The scores of a tile's keys (as tile_rows gives them) for one query head q (as load_queries
   gives it, hdq floats): a float32 cache's by score_tile, a bfloat16 cache's by bfloat16 products
   (the comment on PAIR_DIMS) */
static inline vecf score_head(const float *q, const char *const *keys, int head_dim, int hdq, int is_bf16) {
#if HAS_BF16_PRODUCTS
    if (is_bf16) return score_tile_bf16((const uint16_t *)q, keys, head_dim, hdq);
#endif
    return score_tile(q, keys, is_bf16 ? hdq : head_dim, hdq);
}

/* A bfloat16 K/V row widened into hd16 float32s at dst (exact, zeros past head_dim) by
   full-vector stores: as wide as the loads that read them back, which a narrower or masked store
   cannot forward to (256-bit stores read back by 512-bit loads slowed AVX-512 scoring 5-9%) */
static inline __attribute__((always_inline)) void widen_row_dims(const char *row, float *dst, int head_dim, int hd16) {
    for (int d = 0; d < hd16; d += ATT_LANES) v_store(dst + d, v_load_row(row, d, head_dim, 1));
}
/* with the common head sizes as constants: unrolled, no lane masks (a loop over a runtime size
   spent ~25 cycles a row of 64 in its branches and masks, ~14% of attention at 8 rows) */
static inline void widen_row(const char *row, float *dst, int head_dim, int hd16) {
    if (head_dim == 64) widen_row_dims(row, dst, 64, 64);
    else if (head_dim == 128) widen_row_dims(row, dst, 128, 128);
    else widen_row_dims(row, dst, head_dim, hd16);
}

/* A tile's key rows as score_head reads them: bfloat16 rows widened pair-split once into
   `widened` (ATT_LANES rows of hdq floats, exact) for all the query heads that score them,
   instead of once per head (at batch 32 the per-head widening made a bfloat16 cache no faster
   than a float32 one); float32 rows, and bfloat16 ones where vdpbf16ps reads them, in place.
   head_dim <= MAX_HEAD_DIM (attention_rows checks). */
static void tile_rows(const char *const *rows, const char **out, float *widened, int head_dim, int hdq, int is_bf16) {
    for (int i = 0; i < ATT_LANES; i++) {
        if (!is_bf16 || HAS_BF16_PRODUCTS) {
            out[i] = rows[i];
            continue;
        }
        float *dst = widened + (long)i * hdq;
        widen_pair_split(rows[i], dst, head_dim, hdq);
        out[i] = (const char *)dst;
    }
}

/* Whether score_tile_bf16_64 scores these rows: AVX2 (its 16 registers cannot hold a query and
   the 8 keys' chains, so the keys are widened once and the queries read from L1), bfloat16 rows of
   64. Elsewhere tile_rows and score_tile. */
static inline int scores_bf16_64(int head_dim, int is_bf16) { return ATT_LANES == 8 && is_bf16 && head_dim == 64; }

#if ATT_LANES == 8
/* The scores of 8 keys (their bfloat16 rows of 64 at key_rows) for nq queries qs[j] (scaled,
   rounded and pair-split as load_queries gives them) into out[j] + l0 (n of them: a short last
   tile repeats a key). Each key's row is widened pair-split once, in registers, for every query,
   instead of into memory and read back per query (attention 1.03-1.2x faster in a forward on a
   Zen3); each query's two chains per key and the reduction of the 8 keys' partial sums are
   score_tile_f32's and reduce_tile's over pair-split rows: the same bits. ahead, behind (or NULL):
   lines prefetched a share after each key (ahead's first). */
static void score_tile_bf16_64(const float *const *qs, int nq, const char *const *key_rows, float *const *out,
                               int l0, int n, drip *ahead, drip *behind) {
    __m256 part[ROW_BLOCK * MAX_GROUP][8];
    const int per_key = ahead ? (drip_left(ahead) + drip_left(behind) + 7) / 8 : 0;
    for (int i = 0; i < 8; i++) {
        if (ahead) drip_some(behind, drip_some(ahead, per_key));
        const uint16_t *row = (const uint16_t *)key_rows[i];
        __m256 k[8];                 /* pair-split: chunk c / 4, odd dims of words 0-7, 8-15, even of 0-7, 8-15 */
        for (int c = 0; c < 8; c += 4)
            for (int half = 0; half < 2; half++)
                split_pairs8((const char *)(row + 8 * c + 16 * half), &k[c + half], &k[c + 2 + half]);
        for (int j = 0; j < nq; j++) {
            const float *q = qs[j];
            __m256 lo = _mm256_mul_ps(_mm256_loadu_ps(q), k[0]);
            __m256 hi = _mm256_mul_ps(_mm256_loadu_ps(q + 8), k[1]);
            for (int c = 2; c < 8; c += 2) {
                lo = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), k[c], lo);
                hi = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c + 8), k[c + 1], hi);
            }
            part[j][i] = _mm256_add_ps(lo, hi);
        }
    }
    for (int j = 0; j < nq; j++) v_store_part(out[j] + l0, reduce_tile(part[j]), n);
}
#else
static void score_tile_bf16_64(const float *const *qs, int nq, const char *const *key_rows, float *const *out,
                               int l0, int n, drip *ahead, drip *behind) {
    (void)qs, (void)nq, (void)key_rows, (void)out, (void)l0, (void)n, (void)ahead, (void)behind;  /* not called here */
}
#endif

/* scores[g * padded + l] = q_g . K[slots[l]] for the `group` query heads (q: group x hdq, as
   load_queries gives them), ATT_LANES keys at a time (a short last tile repeats its first key) */
static void score_keys(const float *q, const char *k_base, long slot_stride, const int64_t *slots, int num_keys,
                       int group, int head_dim, int hdq, int is_bf16, int padded, float *scores) {
    const int esize = is_bf16 ? 2 : 4, in_registers = scores_bf16_64(head_dim, is_bf16);
    const float *qs[MAX_GROUP];
    float *outs[MAX_GROUP];
    for (int g = 0; in_registers && g < group; g++) qs[g] = q + g * hdq, outs[g] = scores + g * padded;
    float widened[ATT_LANES * MAX_HEAD_DIM];
    for (int l0 = 0; l0 < num_keys; l0 += ATT_LANES) {
        const int n = num_keys - l0 < ATT_LANES ? num_keys - l0 : ATT_LANES;
        const char *rows[ATT_LANES], *keys[ATT_LANES];
        for (int i = 0; i < ATT_LANES; i++) rows[i] = k_base + slots[l0 + (i < n ? i : 0)] * slot_stride;
        for (int i = 0; i < ATT_LANES && l0 + ATT_LANES + i < num_keys; i++)   /* the next tile's keys */
            prefetch_row(k_base + slots[l0 + ATT_LANES + i] * slot_stride, head_dim * esize);
        if (in_registers) {
            score_tile_bf16_64(qs, group, rows, outs, l0, n, NULL, NULL);
            continue;
        }
        tile_rows(rows, keys, widened, head_dim, hdq, is_bf16);
        for (int g = 0; g < group; g++)
            v_store_part(scores + g * padded + l0, score_head(q + g * hdq, keys, head_dim, hdq, is_bf16), n);
    }
}

/* orow[p][d] for NG (weights, output) pairs and the VALUE_CHUNKS vectors from d0, over keys
   [l_begin, l_end): orow[p][d] (+)= sum_l wrow[p][l] * V[slots[l]][d], keys in order, each element
   one chain of FMAs over l. resume: the chain goes on from orow's values (the sum over the keys
   before l_begin), so splitting the keys into ranges gives the same bits as one range. */
static inline __attribute__((always_inline)) void weigh_pass(
        const float *const *wrow, float *const *orow, int NG, const char *v_base, long slot_stride,
        const int64_t *slots, int l_begin, int l_end, int d0, int head_dim, int is_bf16, int resume, int prefetch) {
    const int esize = is_bf16 ? 2 : 4;
    vecf acc[HEADS_PER_PASS][VALUE_CHUNKS];
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < VALUE_CHUNKS; c++)
            acc[g][c] = resume ? v_load_row((const char *)orow[g], d0 + c * ATT_LANES, head_dim, 0) : v_zero();
    for (int l = l_begin; l < l_end; l++) {
        if (prefetch && l + PREFETCH_KEYS < l_end)      /* the first pass over the values reads them */
            prefetch_row(v_base + slots[l + PREFETCH_KEYS] * slot_stride + (long)d0 * esize,
                         VALUE_CHUNKS * ATT_LANES * esize);
        const char *value = v_base + slots[l] * slot_stride;
        vecf v[VALUE_CHUNKS];
        for (int c = 0; c < VALUE_CHUNKS; c++) v[c] = v_load_row(value, d0 + c * ATT_LANES, head_dim, is_bf16);
        for (int g = 0; g < NG; g++) {
            const vecf wv = v_set1(wrow[g][l]);
            for (int c = 0; c < VALUE_CHUNKS; c++) acc[g][c] = v_fma(wv, v[c], acc[g][c]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int c = 0; c < VALUE_CHUNKS; c++) {
            const int d = d0 + c * ATT_LANES;
            v_store_part(orow[g] + d, acc[g][c], head_dim - d);
        }
}

static inline __attribute__((always_inline)) void weigh_pairs_dims(
        const float *const *wrow, float *const *orow, int pairs, const char *v_base, long slot_stride,
        const int64_t *slots, int l_begin, int l_end, int head_dim, int is_bf16, int resume) {
    for (int d0 = 0; d0 < head_dim; d0 += VALUE_CHUNKS * ATT_LANES)
        for (int p0 = 0; p0 < pairs; p0 += HEADS_PER_PASS) {
            const int ng = pairs - p0 < HEADS_PER_PASS ? pairs - p0 : HEADS_PER_PASS;
#define WEIGH_HEADS(NG) weigh_pass(wrow + p0, orow + p0, NG, v_base, slot_stride, slots, l_begin, l_end, d0, \
                                   head_dim, is_bf16, resume, p0 == 0)
            switch (ng) {   /* constant head counts keep the accumulators in registers */
            case 1: WEIGH_HEADS(1); break;
#if HEADS_PER_PASS > 2
            case 2: WEIGH_HEADS(2); break;
            case 3: WEIGH_HEADS(3); break;
#endif
            default: WEIGH_HEADS(HEADS_PER_PASS);
            }
#undef WEIGH_HEADS
        }
}

#if HAS_BF16_PRODUCTS
/* Weighing a bfloat16 cache's values by vdpbf16ps. softmax_rows rounds the weights to bfloat16,
   so each product w_l V[l][d] is exact, and vdpbf16ps over a pair of keys (l, l + 1) adds
   w_l V[l][d] (its odd element) and then w_(l+1) V[l+1][d]: each element gets weigh_pass's chain
   of FMAs, in key order, the same bits, at half the instructions. A key pair's value rows are
   interleaved by unpacking (unpack_value_pair; key l + 1 in the low halves), and the
   accumulators hold their dims in that order; an odd last key pairs with zeros. */
#define PAIRS_PER_BLOCK 2     /* 32-dim blocks weighed per pass: 64 dims, as weigh_pass */

static const uint16_t zero_value_row[MAX_HEAD_DIM];

/* weights l .. l + 15 (bfloat16 values as float32) stored packed in key pairs over the start of
   their row: word l / 2 + i = w_(l+2i+1) in the low half, w_(l+2i) in the high half (l even,
   and the packed words never overtake the weights still to be read) */
static inline void store_weight_pairs16(float *row, int l, __m512 w) {
    const __m256i b = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(w), 16));
    _mm256_storeu_si256((__m256i *)((uint32_t *)row + l / 2), _mm256_rol_epi32(b, 16));
}
static inline void store_weight_pairs8(float *row, int l, __m256 w) {
    const __m128i b = _mm256_cvtepi32_epi16(_mm256_srli_epi32(_mm256_castps_si256(w), 16));
    _mm_storeu_si128((__m128i *)((uint32_t *)row + l / 2), _mm_rol_epi32(b, 16));
}

/* a value row's dims d .. d + 31 as bfloat16, zeros past head_dim */
static inline __m512i value_block(const char *row, int d, int head_dim) {
    const int n = head_dim - d;
    const __mmask32 m = n >= 32 ? (__mmask32)0xffffffffu : n > 0 ? (__mmask32)((1u << n) - 1) : 0;
    return _mm512_maskz_loadu_epi16(m, row + 2 * (long)d);
}
/* value rows a (key l) and c (key l + 1), dims d .. d + 31, interleaved for vdpbf16ps: *lo holds
   dims d + 8b + e (b = 0..3, e = 0..3) in lanes 4b + e, *hi dims d + 8b + 4 + e */
static inline void unpack_value_pair(const char *a, const char *c, int d, int head_dim, __m512i *lo, __m512i *hi) {
    const __m512i va = value_block(a, d, head_dim), vc = value_block(c, d, head_dim);
    *lo = _mm512_unpacklo_epi16(vc, va);
    *hi = _mm512_unpackhi_epi16(vc, va);
}
/* unpack order <-> dims in order, as vpermt2ps indices (0-15: the first source, 16-31: the
   second). TO_DIMS[half]: dims d + 16 * half .. + 15 from the low and high accumulators (lane
   4b + e of the low one is dim 8b + e, of the high one 8b + 4 + e); TO_UNPACK[high]: the low or
   high accumulator from dims d .. d + 15 and d + 16 .. d + 31. */
static const int32_t TO_DIMS[2][16] __attribute__((aligned(64))) = {
    {0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23},
    {8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31}};
static const int32_t TO_UNPACK[2][16] __attribute__((aligned(64))) = {
    {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
    {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31}};
static inline __m512i to_dims_index(int half) { return _mm512_load_si512(TO_DIMS[half]); }
static inline __m512i to_unpack_index(int high) { return _mm512_load_si512(TO_UNPACK[high]); }

/* orow[p][d] (+)= sum_l w_l V[slots[l]][d] for NG (packed weights, output) pairs, dims d0 ..
   d0 + 63, keys [l_begin, l_end) (l_begin even): value rows from the cache, or (interleaved)
   from a buffer of key pairs already unpacked (pair i at i * pair_stride bytes: its blocks'
   low and high vectors in turn) */
static inline __attribute__((always_inline)) void weigh_bf16_pass(
        const uint32_t *const *wpk, float *const *orow, int NG, const char *v_base, long slot_stride,
        const int64_t *slots, int l_begin, int l_end, int d0, int head_dim, int resume, int prefetch,
        const char *interleaved, long pair_stride, drip *later) {
    __m512 acc[HEADS_PER_PASS][2 * PAIRS_PER_BLOCK];
    for (int g = 0; g < NG; g++)
        for (int b = 0; b < PAIRS_PER_BLOCK; b++) {
            const int d = d0 + 32 * b;
            if (!resume) {
                acc[g][2 * b] = acc[g][2 * b + 1] = _mm512_setzero_ps();
                continue;
            }
            const __m512 n0 = v_load_row((const char *)orow[g], d, head_dim, 0);
            const __m512 n1 = v_load_row((const char *)orow[g], d + 16, head_dim, 0);
            acc[g][2 * b] = _mm512_permutex2var_ps(n0, to_unpack_index(0), n1);
            acc[g][2 * b + 1] = _mm512_permutex2var_ps(n0, to_unpack_index(1), n1);
        }
    for (int l = l_begin; l < l_end; l += 2) {
        __m512i v[2 * PAIRS_PER_BLOCK];
        if (interleaved) {
            const char *pair = interleaved + (long)((l - l_begin) / 2) * pair_stride + d0 * 4;
            for (int i = 0; i < 2 * PAIRS_PER_BLOCK; i++) v[i] = _mm512_loadu_si512(pair + 64 * i);
        } else {
            if (prefetch && l + PREFETCH_KEYS + 1 < l_end) {
                prefetch_row(v_base + slots[l + PREFETCH_KEYS] * slot_stride + (long)d0 * 2, 64 * PAIRS_PER_BLOCK);
                prefetch_row(v_base + slots[l + PREFETCH_KEYS + 1] * slot_stride + (long)d0 * 2, 64 * PAIRS_PER_BLOCK);
            }
            const char *a = v_base + slots[l] * slot_stride;
            const char *c = l + 1 < l_end ? v_base + slots[l + 1] * slot_stride : (const char *)zero_value_row;
            for (int b = 0; b < PAIRS_PER_BLOCK; b++)
                unpack_value_pair(a, c, d0 + 32 * b, head_dim, &v[2 * b], &v[2 * b + 1]);
        }
        if (later) drip_some(later, 1);
        for (int g = 0; g < NG; g++) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)wpk[g][l / 2]);
            for (int i = 0; i < 2 * PAIRS_PER_BLOCK; i++) acc[g][i] = _mm512_dpbf16_ps(acc[g][i], w, (__m512bh)v[i]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int b = 0; b < PAIRS_PER_BLOCK; b++)
            for (int half = 0; half < 2; half++) {
                const int d = d0 + 32 * b + 16 * half;
                v_store_part(orow[g] + d, _mm512_permutex2var_ps(acc[g][2 * b], to_dims_index(half), acc[g][2 * b + 1]),
                             head_dim - d);
            }
}

/* weigh_bf16_pass over every pair and dim block (see weigh_pairs) */
static void weigh_bf16(const float *const *wrow, float *const *orow, int pairs, const char *v_base, long slot_stride,
                       const int64_t *slots, int l_begin, int l_end, int head_dim, int resume,
                       const char *interleaved, long pair_stride, drip *later) {
    const uint32_t *const *wpk = (const uint32_t *const *)wrow;
    for (int d0 = 0; d0 < head_dim; d0 += 32 * PAIRS_PER_BLOCK)
        for (int p0 = 0; p0 < pairs; p0 += HEADS_PER_PASS) {
            const int ng = pairs - p0 < HEADS_PER_PASS ? pairs - p0 : HEADS_PER_PASS;
#define WEIGH_BF16(NG) weigh_bf16_pass(wpk + p0, orow + p0, NG, v_base, slot_stride, slots, l_begin, l_end, d0, \
                                       head_dim, resume, p0 == 0, interleaved, pair_stride, later)
            switch (ng) {
            case 1: WEIGH_BF16(1); break;
            case 2: WEIGH_BF16(2); break;
            case 3: WEIGH_BF16(3); break;
            default: WEIGH_BF16(HEADS_PER_PASS);
            }
#undef WEIGH_BF16
        }
}

/* weigh_bf16 over keys [l_begin, l_end) (at most KEY_CHUNK, l_begin even) for many pairs: each
   key pair's value rows unpacked once into a buffer for every pass of HEADS_PER_PASS pairs;
   `later` (or NULL): lines for what follows, prefetched a line a key pair of each pass */
static void weigh_bf16_chunk(const float *const *wrow, float *const *orow, int pairs, const char *v_base,
                             long slot_stride, const int64_t *slots, int l_begin, int l_end, int head_dim, int resume,
                             drip *later) {
    if (pairs <= HEADS_PER_PASS) {
        weigh_bf16(wrow, orow, pairs, v_base, slot_stride, slots, l_begin, l_end, head_dim, resume, NULL, 0, later);
        return;
    }
    const int blocks = (head_dim + 63) / 64 * 2;           /* 32-dim blocks, whole passes */
    const long pair_stride = (long)blocks * 128;
    char buffer[KEY_CHUNK / 2 * MAX_HEAD_DIM * 4] __attribute__((aligned(64)));
    for (int l = l_begin; l < l_end; l += 2) {
        if (l + PREFETCH_KEYS + 1 < l_end) {
            prefetch_row(v_base + slots[l + PREFETCH_KEYS] * slot_stride, head_dim * 2);
            prefetch_row(v_base + slots[l + PREFETCH_KEYS + 1] * slot_stride, head_dim * 2);
        }
        const char *a = v_base + slots[l] * slot_stride;
        const char *c = l + 1 < l_end ? v_base + slots[l + 1] * slot_stride : (const char *)zero_value_row;
        char *pair = buffer + (long)((l - l_begin) / 2) * pair_stride;
        for (int b = 0; b < blocks; b++) {
            __m512i lo, hi;
            unpack_value_pair(a, c, 32 * b, head_dim, &lo, &hi);
            _mm512_store_si512(pair + 128 * b, lo);
            _mm512_store_si512(pair + 128 * b + 64, hi);
        }
    }
    weigh_bf16(wrow, orow, pairs, v_base, slot_stride, slots, l_begin, l_end, head_dim, resume, buffer, pair_stride,
               later);
}
#endif

/* weigh_pairs_dims with the common head sizes as constants (no lane masks) */
static void weigh_pairs(const float *const *wrow, float *const *orow, int pairs, const char *v_base,
                        long slot_stride, const int64_t *slots, int l_begin, int l_end, int head_dim, int is_bf16,
                        int resume) {
#if HAS_BF16_PRODUCTS
    if (is_bf16) {
        weigh_bf16(wrow, orow, pairs, v_base, slot_stride, slots, l_begin, l_end, head_dim, resume, NULL, 0, NULL);
        return;
    }
#endif
    if (head_dim == 64 && !is_bf16)
        weigh_pairs_dims(wrow, orow, pairs, v_base, slot_stride, slots, l_begin, l_end, 64, 0, resume);
    else if (head_dim == 128 && !is_bf16)
        weigh_pairs_dims(wrow, orow, pairs, v_base, slot_stride, slots, l_begin, l_end, 128, 0, resume);
    else
        weigh_pairs_dims(wrow, orow, pairs, v_base, slot_stride, slots, l_begin, l_end, head_dim, is_bf16, resume);
}

/* weigh_pairs over keys [l_begin, l_end) (at most KEY_CHUNK) for many pairs: bfloat16 value rows
   widened once into a buffer on the stack (hd16 floats a key, exact) and weighed from there,
   instead of widened again in every pass of HEADS_PER_PASS pairs (at 8 rows x 3 heads: 6
   passes on AVX-512, 12 on AVX2, where widening took a third to a half of the instructions).
   The same FMA chains, so the same bits. (A buffer malloc'ed with the rows' scratch made the
   whole attention slower, not faster: 3.4 against 2.8 ms at 8 rows, AVX-512 Xeon.) The buffer
   is KEY_CHUNK * hd16 floats: 16 KiB for heads of 64, 128 KiB at MAX_HEAD_DIM. `later` (or NULL):
   lines for what follows, prefetched a few at a time (as weigh_bf16_chunk) or after. */
static void weigh_chunk(const float *const *wrow, float *const *orow, int pairs, const char *v_base,
                        long slot_stride, const int64_t *slots, int l_begin, int l_end, int head_dim, int hd16,
                        int is_bf16, int resume, drip *later) {
#if HAS_BF16_PRODUCTS
    if (is_bf16) {
        weigh_bf16_chunk(wrow, orow, pairs, v_base, slot_stride, slots, l_begin, l_end, head_dim, resume, later);
        return;
    }
#endif
    if (!is_bf16 || pairs <= HEADS_PER_PASS) {
        weigh_pairs(wrow, orow, pairs, v_base, slot_stride, slots, l_begin, l_end, head_dim, is_bf16, resume);
        if (later) drip_some(later, 1 << 30);
        return;
    }
    const int n = l_end - l_begin;
    float widened[KEY_CHUNK * hd16];
    int64_t rows_of_widened[KEY_CHUNK];     /* key l_begin + i is row i of `widened` */
    for (int i = 0; i < n; i++) {
        if (i + PREFETCH_KEYS < n)
            prefetch_row(v_base + slots[l_begin + i + PREFETCH_KEYS] * slot_stride, head_dim * 2);
        widen_row(v_base + slots[l_begin + i] * slot_stride, widened + (long)i * hd16, head_dim, hd16);
        rows_of_widened[i] = i;
        if (later) drip_some(later, 2);
    }
    if (later) drip_some(later, 1 << 30);
    const float *w[ROW_BLOCK * MAX_GROUP];
    for (int p = 0; p < pairs; p++) w[p] = wrow[p] + l_begin;
    weigh_pairs(w, orow, pairs, (const char *)widened, (long)hd16 * sizeof(float), rows_of_widened, 0, n, head_dim,
                0, resume);
}

/* The largest of row[0 .. padded) (padded: a multiple of 8), two chains of 8 lanes (max is exact
   in any order) */
static float row_max(const float *row, int padded) {
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int l = 0;
    for (; l + 16 <= padded; l += 16) {
        m0 = _mm256_max_ps(m0, _mm256_loadu_ps(row + l));
        m1 = _mm256_max_ps(m1, _mm256_loadu_ps(row + l + 8));
    }
    if (l < padded) m0 = _mm256_max_ps(m0, _mm256_loadu_ps(row + l));
    float lanes[8], max = -INFINITY;
    _mm256_storeu_ps(lanes, _mm256_max_ps(m0, m1));
    for (int i = 0; i < 8; i++) max = lanes[i] > max ? lanes[i] : max;
    return max;
}

/* softmax weights l .. l + 15 (or + 7) of a row stored for the weighing: float32, or for a
   bfloat16 cache rounded to bfloat16 and, where weigh_bf16 reads them, packed in key pairs */
#ifdef __AVX512F__
static inline __m512 store_weights16(float *row, int l, __m512 e, int is_bf16) {
    if (!is_bf16) {
        _mm512_storeu_ps(row + l, e);
        return e;
    }
    e = round_bf16x16(e);
#if HAS_BF16_PRODUCTS
    store_weight_pairs16(row, l, e);
#else
    _mm512_storeu_ps(row + l, e);
#endif
    return e;
}
#endif
static inline __m256 store_weights8(float *row, int l, __m256 e, int is_bf16) {
    if (!is_bf16) {
        _mm256_storeu_ps(row + l, e);
        return e;
    }
    e = round_bf16x8(e);
#if HAS_BF16_PRODUCTS
    store_weight_pairs8(row, l, e);
#else
    _mm256_storeu_ps(row + l, e);
#endif
    return e;
}

/* The `group` rows of scores (row g at g * padded, num_keys of them, padded to a multiple of 8)
   -> softmax weights exp(score - max) in place (for a bfloat16 cache rounded to bfloat16, and
   packed in key pairs where weigh_bf16 reads them so), max[g] and sum[g] of the weights (lane
   i of 8 sums keys i, i + 8, ... in order, then hsum8). The heads go side by side, key block
   by key block: each head's sum is one chain of adds, and `group` of them in flight hide
   their latency (one head at a time waited on its chain); each lane's operations are the
   same, so the same bits. */
static void softmax_rows(float *scores, int padded, int num_keys, int group, int is_bf16, float *max_out,
                         float *sum_out) {
    __m256 sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        float *row = scores + g * padded;
        for (int l = num_keys; l < padded; l++) row[l] = -INFINITY;
        max_out[g] = row_max(row, padded);
        sum[g] = _mm256_setzero_ps();
    }
    int l = 0;
#ifdef __AVX512F__
    for (; l + 16 <= padded; l += 16)
        for (int g = 0; g < group; g++) {
            float *row = scores + g * padded;
            const __m512 e = store_weights16(
                row, l, exp16(_mm512_sub_ps(_mm512_loadu_ps(row + l), _mm512_set1_ps(max_out[g]))), is_bf16);
            sum[g] = _mm256_add_ps(sum[g], _mm512_castps512_ps256(e));
            sum[g] = _mm256_add_ps(sum[g], _mm512_extractf32x8_ps(e, 1));
        }
#endif
    for (; l < padded; l += 8)
        for (int g = 0; g < group; g++) {
            float *row = scores + g * padded;
            const __m256 e = store_weights8(
                row, l, exp8(_mm256_sub_ps(_mm256_loadu_ps(row + l), _mm256_set1_ps(max_out[g]))), is_bf16);
            sum[g] = _mm256_add_ps(sum[g], e);
        }
    for (int g = 0; g < group; g++) sum_out[g] = hsum8(sum[g]);
}

/* One query row against one KV head, scores: the `group` query heads q[g * hdq ...] (as
   load_queries gives them) against the keys at `slots` (num_keys of them), the
   scores of keys [0, scored) already in `scores` (scored: a multiple of ATT_LANES); then their
   softmax (softmax_rows). scores: >= round8(num_keys) * group floats of scratch, row g at
   g * round8(num_keys). */
static void score_row(const float *q, const char *k_base, long slot_stride, const int64_t *slots, int num_keys,
                      int scored, int group, int head_dim, int hdq, int is_bf16, float *scores, float *max_out,
                      float *sum_out) {
    const int padded = (num_keys + 7) / 8 * 8;
    score_keys(q, k_base, slot_stride, slots + scored, num_keys - scored, group, head_dim, hdq, is_bf16, padded,
               scores + scored);
    softmax_rows(scores, padded, num_keys, group, is_bf16, max_out, sum_out);
}

/* slots[0 .. n) = the slots of the allowed keys, in order; returns n. Masks are mostly runs
   (causal, tree prefixes), so 8 mask bytes are tested at once. */
static int allowed_slots(const uint8_t *allowed, const int64_t *kv_row, int L, int64_t *slots) {
    int n = 0, l = 0;
    for (; l + 8 <= L; l += 8) {
        uint64_t bytes;
        memcpy(&bytes, allowed + l, 8);
        if (bytes == 0) continue;
        if (bytes == 0x0101010101010101ull) {
            memcpy(slots + n, kv_row + l, 8 * sizeof(int64_t));
            n += 8;
            continue;
        }
        for (int i = l; i < l + 8; i++)
            if (allowed[i]) slots[n++] = kv_row[i];
    }
    for (; l < L; l++)
        if (allowed[l]) slots[n++] = kv_row[l];
    return n;
}

/* The keys of a row are taken in splits of KEY_SPLIT (by their index in the row's list of
   allowed keys), each split's softmax on its own, then merged in split order:
       m_c = max score of split c, s_c = sum of exp(score - m_c), a_c = sum of exp(score - m_c) V
       M = max_c m_c, f_c = exp(m_c - M), out = (sum_c f_c a_c) * (1 / sum_c f_c s_c)
   A row with at most KEY_SPLIT keys has one split, f_0 = 1 exactly, so out = a_0 * (1 / s_0).
   The splits depend only on the row's own keys, so rows stay invariant; they let the threads
   share one long row (a decode step on a long context: each thread takes whole splits, and
   reads every byte of the K/V rows it fetches, instead of one KV head's third of each). */
#define KEY_SPLIT 256          /* a multiple of ATT_LANES and KEY_CHUNK */

/* a split's partial result for one row and KV head: max[group], sum[group], acc[group][head_dim] */
static inline long partial_floats(int group, int head_dim) { return (long)group * (head_dim + 2); }

/* one row's buffers: its scores (of one split), allowed slots, scaled query heads (all KV heads') */
typedef struct {
    float *scores, *qf;
    int64_t *slots;
    int num_keys;
} row_scratch;

static void scratch_alloc(row_scratch *s, int L, int num_heads, int group, int hdq) {
    s->scores = (float *)malloc((size_t)KEY_SPLIT * group * sizeof(float));
    s->slots = (int64_t *)malloc((size_t)(L > 0 ? L : 1) * sizeof(int64_t));
    s->qf = (float *)calloc((size_t)num_heads * hdq, sizeof(float));
}

static void scratch_free(row_scratch *s) { free(s->scores), free(s->slots), free(s->qf); }

/* how many leading entries of a and b (m of them at most) are equal; 4 compared at once */
static int common_prefix(const int64_t *a, const int64_t *b, int m) {
    int i = 0;
    for (; i + 4 <= m; i += 4) {
        const __m256i eq = _mm256_cmpeq_epi64(_mm256_loadu_si256((const __m256i *)(a + i)),
                                              _mm256_loadu_si256((const __m256i *)(b + i)));
        const int equal = _mm256_movemask_pd(_mm256_castsi256_pd(eq));
        if (equal != 0xf) return i + __builtin_ctz(~equal);
    }
    while (i < m && a[i] == b[i]) i++;
    return i;
}

/* how many leading keys rows 1 .. rows - 1 share with row 0 (same slots, same order), in
   whole score tiles */
static int shared_keys(const row_scratch *s, int rows) {
    int n = s[0].num_keys;
    for (int r = 1; r < rows; r++) n = common_prefix(s[r].slots, s[0].slots, s[r].num_keys < n ? s[r].num_keys : n);
    return n / ATT_LANES * ATT_LANES;
}

/* Where a layer's K (and V) rows are: bytes from one slot to the next and from one KV head to the
   next, a head's head_dim values contiguous. [slots, heads, head_dim] (slot-major) or [heads,
   slots, head_dim] (head-major: a head's keys one stream, what the CPU's KV cache holds) alike. */
typedef struct {
    long slot, head;
} kv_strides;

/* The shape of one attention_rows call */
typedef struct {
    const void *q, *k_layer, *v_layer;
    long q_ld;
    kv_strides kv;
    const int64_t *kv_indices;
    const uint8_t *mask;
    const int32_t *row_batch, *row_query;
    int L, Q, num_heads, num_kv_heads, group, head_dim, hd16, q_bf16, is_bf16;
    int hdq;                       /* a query head's floats in row_scratch.qf (load_queries) */
} att_call;

/* the allowed keys of rows t0 .. t0 + rows - 1 into s; returns the keys they all share */
static int gather_rows(const att_call *c, int t0, int rows, row_scratch *s) {
    for (int r = 0; r < rows; r++) {
        const int t = t0 + r, b = c->row_batch[t];
        s[r].num_keys = allowed_slots(c->mask + ((long)b * c->Q + c->row_query[t]) * c->L,
                                      c->kv_indices + (long)b * c->L, c->L, s[r].slots);
    }
    return rows > 1 ? shared_keys(s, rows) : 0;
}

/* the scaled query heads of KV heads [h0, h1) (the ones a segment's tasks read) of rows t0 ..
   into s[r].qf, head i at i * hdq, zero padded: float32 for a float32 cache; for a bfloat16 one
   rounded to bfloat16 (as f32_to_bf16), as bfloat16 where vdpbf16ps reads them, pair-split
   float32 elsewhere (the comment on PAIR_DIMS). By vectors (element by element, attention at 8
   rows took 2.16-2.28 ms a forward against 2.13-2.21, 1 thread, AVX-512 Zen4). */
static void load_queries(const att_call *c, int t0, int rows, int h0, int h1, row_scratch *s) {
    const __m256 scale = _mm256_set1_ps(1.0f / sqrtf((float)c->head_dim));
    const int esize = c->q_bf16 ? 2 : 4, head_dim = c->head_dim;
    uint16_t rounded[MAX_HEAD_DIM];
    for (int r = 0; r < rows; r++) {
        const char *row = (const char *)c->q + (long)(t0 + r) * c->q_ld * esize;
        for (int i = h0 * c->group; i < h1 * c->group; i++) {
            const char *src = row + (long)i * head_dim * esize;
            float *head = s[r].qf + (long)i * c->hdq;
            if (!c->is_bf16) {
                for (int d = 0; d < head_dim; d += 8)
                    _mm256_storeu_ps(head + d, _mm256_mul_ps(load8(src + d * esize, c->q_bf16), scale));
                continue;
            }
            uint16_t *dst = HAS_BF16_PRODUCTS ? (uint16_t *)head : rounded;
            for (int d = 0; d < head_dim; d += 8)
                store8(dst + d, _mm256_mul_ps(load8(src + d * esize, c->q_bf16), scale), 1);
            if (!HAS_BF16_PRODUCTS) widen_pair_split((const char *)rounded, head, head_dim, c->hdq);
        }
    }
}

/* The scores of the `common` keys at slots (whole tiles) for n (row, query head) pairs: query
   qs[p], scores into outs[p], each tile's keys loaded (and widened) once for every pair, or with
   vdpbf16ps and at least KEYS_IN_LANES_MIN_PAIRS pairs transposed once (score_shared_keys_in_lanes).
   While a tile is scored, the next tile's keys are prefetched into L1 and its values into L2. */
static void score_shared(const float *const *qs, float *const *outs, int n, const char *k_base, const char *v_base,
                         long stride, const int64_t *slots, int common, int head_dim, int hdq, int is_bf16) {
    const int esize = is_bf16 ? 2 : 4;
#if HAS_BF16_PRODUCTS
    if (is_bf16 && n >= KEYS_IN_LANES_MIN_PAIRS &&
        score_shared_keys_in_lanes((const uint16_t *const *)qs, outs, n, k_base, v_base, stride, slots, common,
                                   head_dim))
        return;
#endif
    for (int l0 = 0; l0 < common; l0 += ATT_LANES) {
        const char *tile[ATT_LANES], *keys[ATT_LANES];
        for (int i = 0; i < ATT_LANES; i++) tile[i] = k_base + slots[l0 + i] * stride;
        drip next, values;
        tile_drips(k_base, v_base, stride, slots, l0, ATT_LANES, common, head_dim * esize, &next, &values);
        if (scores_bf16_64(head_dim, is_bf16)) {
            score_tile_bf16_64(qs, n, tile, outs, l0, ATT_LANES, &next, &values);
            continue;
        }
        float widened[ATT_LANES * MAX_HEAD_DIM];
        tile_rows(tile, keys, widened, head_dim, hdq, is_bf16);
        const int per_query = (drip_left(&next) + drip_left(&values) + n - 1) / n;
        for (int p = 0; p < n; p++) {
            v_store(outs[p] + l0, score_head(qs[p], keys, head_dim, hdq, is_bf16));
            drip_some(&values, drip_some(&next, per_query));
        }
        drip_some(&values, drip_some(&next, 1 << 30));
    }
}

/* Split `split` of rows t0 .. t0 + rows - 1 (one request; queries loaded) against KV head h:
   each row's partial into part + r * part_stride (max -inf, sum 0 for a row without keys in
   it). The score tiles of keys every row attends to (the shared prefix) are scored for all
   rows while a tile's keys are in L1, and their values weighed for every row KEY_CHUNK keys at
   a time; each score and FMA chain is the one the row would get alone, so the bits do not
   change. */
static void attend_split(const att_call *c, int rows, int h, int split, int shared, row_scratch *s, float *part,
                         long part_stride) {
    const int group = c->group, head_dim = c->head_dim, hd16 = c->hd16, is_bf16 = c->is_bf16;
    const int k0 = split * KEY_SPLIT;
    const int hdq = c->hdq;
    const long q0 = (long)h * group * hdq;           /* this KV head's query heads in qf */
    const char *k_base = (const char *)c->k_layer + h * c->kv.head;
    const char *v_base = (const char *)c->v_layer + h * c->kv.head;
    const long stride = c->kv.slot;
    int count[ROW_BLOCK];                    /* keys of each row in this split */
    for (int r = 0; r < rows; r++) {
        const int n = s[r].num_keys - k0;
        count[r] = n < 0 ? 0 : n > KEY_SPLIT ? KEY_SPLIT : n;
    }
    int common = shared - k0;                /* keys of this split every row attends to */
    common = common < 0 ? 0 : common > KEY_SPLIT ? KEY_SPLIT : common;
    const float *qs[ROW_BLOCK * MAX_GROUP];
    float *outs[ROW_BLOCK * MAX_GROUP];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < group; g++) {
            qs[r * group + g] = s[r].qf + q0 + g * hdq;
            outs[r * group + g] = s[r].scores + g * ((count[r] + 7) / 8 * 8);
        }
    score_shared(qs, outs, rows * group, k_base, v_base, stride, s[0].slots + k0, common, head_dim, hdq, is_bf16);
    for (int r = 0; r < rows; r++) {
        float *p = part + r * part_stride;
        if (count[r] > 0) {
            score_row(s[r].qf + q0, k_base, stride, s[r].slots + k0, count[r], common, group, head_dim, hdq, is_bf16,
                      s[r].scores, p, p + group);
        } else {
            for (int g = 0; g < group; g++) p[g] = -INFINITY, p[group + g] = 0.0f;
        }
    }
    const float *wrow[ROW_BLOCK * MAX_GROUP];
    float *orow[ROW_BLOCK * MAX_GROUP];
    for (int r = 0; r < rows; r++)
        for (int g = 0; g < group; g++) {
            wrow[r * group + g] = s[r].scores + g * ((count[r] + 7) / 8 * 8);
            orow[r * group + g] = part + r * part_stride + 2 * group + g * head_dim;
        }
    for (int l0 = 0; l0 < common; l0 += KEY_CHUNK) {
        const int l1 = l0 + KEY_CHUNK < common ? l0 + KEY_CHUNK : common;
        drip next_head = drip_rows(k_base + c->kv.head, stride, s[0].slots + k0, l0, h + 1 < c->num_kv_heads ? l1 : l0,
                                   head_dim * (is_bf16 ? 2 : 4), 1);     /* the next KV head's keys, into L2 */
        weigh_chunk(wrow, orow, rows * group, v_base, stride, s[0].slots + k0, l0, l1, head_dim, hd16, is_bf16,
                    l0 > 0, &next_head);
    }
    for (int r = 0; r < rows; r++) {     /* then each row's own keys, going on from those sums */
        if (count[r] > common)
            weigh_pairs(wrow + r * group, orow + r * group, group, v_base, stride, s[r].slots + k0, common, count[r],
                        head_dim, is_bf16, common > 0);
        else if (count[r] == 0)
            memset(orow[r * group], 0, (size_t)group * head_dim * sizeof(float));
    }
}

/* row t's output for KV head h from its splits' partials (num_splits of them, split_stride
   floats apart), as the comment on KEY_SPLIT says */
static void merge_splits(const att_call *c, int t, int h, const float *part, long split_stride, int num_splits,
                         void *out) {
    const int group = c->group, head_dim = c->head_dim;
    const long out_off = ((long)t * c->num_heads + (long)h * group) * head_dim;
    float res[MAX_GROUP * MAX_HEAD_DIM];
    for (int g = 0; g < group; g++) {
        float max = -INFINITY, sum = 0.0f;
        for (int i = 0; i < num_splits; i++) max = part[i * split_stride + g] > max ? part[i * split_stride + g] : max;
        float *acc = res + g * head_dim;
        int first = 1;
        for (int i = 0; i < num_splits; i++) {
            const float *p = part + i * split_stride;
            if (p[g] == -INFINITY) continue;        /* a split without keys of this row */
            const float f = expf(p[g] - max);       /* 1 exactly for the split holding the max */
            const float *a = p + 2 * group + g * head_dim;
            sum = first ? f * p[group + g] : sum + f * p[group + g];
            for (int d = 0; d < head_dim; d++) acc[d] = first ? f * a[d] : acc[d] + f * a[d];
            first = 0;
        }
        if (first) {                                /* no keys at all */
            memset(acc, 0, (size_t)head_dim * sizeof(float));
            continue;
        }
        const float inv = 1.0f / sum;
        for (int d = 0; d < head_dim; d++) acc[d] *= inv;
    }
    for (int i = 0; i < group * head_dim; i++) set_elem(out, out_off + i, res[i], c->q_bf16);
}

/* merge_splits for rows t0 .. t0 + rows - 1 and KV head h (their partials from part, row by row) */
static void merge_rows(const att_call *c, int t0, int rows, int h, const float *part, long split_stride,
                       int num_splits, void *out) {
    const long pf = partial_floats(c->group, c->head_dim);
    for (int r = 0; r < rows; r++) merge_splits(c, t0 + r, h, part + r * pf, split_stride, num_splits, out);
}

/* rows t0 .. t0 + rows - 1 (one request) against KV heads [h0, h1), split by split (the heads of
   a split in turn), merged. part: rows * (h1 - h0) * max_splits partials of scratch. */
static void attend_segment(const att_call *c, int t0, int rows, int h0, int h1, void *out, row_scratch *s,
                           float *part, int max_splits) {
    const int shared = gather_rows(c, t0, rows, s);
    const long pf = partial_floats(c->group, c->head_dim), split_stride = (long)rows * (h1 - h0) * pf;
    int splits = 0;
    for (int r = 0; r < rows; r++) {
        const int n = (s[r].num_keys + KEY_SPLIT - 1) / KEY_SPLIT;
        splits = n > splits ? n : splits;
    }
    splits = splits < 1 ? 1 : splits > max_splits ? max_splits : splits;
    load_queries(c, t0, rows, h0, h1, s);
    for (int split = 0; split < splits; split++)
        for (int h = h0; h < h1; h++)
            attend_split(c, rows, h, split, shared, s, part + split * split_stride + (long)(h - h0) * rows * pf, pf);
    for (int h = h0; h < h1; h++)
        merge_rows(c, t0, rows, h, part + (long)(h - h0) * rows * pf, split_stride, splits, out);
}

/* The T rows of one request (at most ROW_BLOCK) shared out as (KV head, row) pairs, head by head:
   thread i takes pairs [P i / n, P (i + 1) / n) of P = num_kv_heads * T: whole heads, and a
   head's rows split between two threads, so that each thread transposes and reads the keys and
   values of fewer heads than in segments of rows (every head each). A verify of 4 rows on 2
   threads of an AVX-512 Zen4, 3 KV heads: 0.974x-0.978x the forward's time, of 8 rows
   0.987x-0.997x (`bench kernel-ab`, two runs of 60 rounds). */
static void attend_by_head_rows(const att_call *c, int T, int max_splits, void *out) {
    long p0, p1;
    team_share((long)c->num_kv_heads * T, &p0, &p1);
    row_scratch scratch[ROW_BLOCK];
    for (int r = 0; r < T; r++) scratch_alloc(&scratch[r], c->L, c->num_heads, c->group, c->hdq);
    float *part = (float *)malloc((size_t)T * max_splits * partial_floats(c->group, c->head_dim) * sizeof(float));
    for (long p = p0; p < p1;) {
        const int h = (int)(p / T), r0 = (int)(p % T);
        const int r1 = (long)(h + 1) * T <= p1 ? T : (int)(p1 - (long)h * T);
        attend_segment(c, r0, r1 - r0, h, h + 1, out, scratch, part, max_splits);
        p += r1 - r0;
    }
    free(part);
    for (int r = 0; r < T; r++) scratch_free(&scratch[r]);
    #pragma omp barrier
}

/* segments of consecutive rows of one request, at most `block` rows each: their count, and
   their first rows into start[0 .. count] (start[count] = T) unless start is NULL */
static int count_segments(const int32_t *row_batch, int T, int block, int *start) {
    int n = 0, first = 0;
    for (int t = 0; t < T; t++)
        if (t == 0 || row_batch[t] != row_batch[t - 1] || t - first == block) {
            if (start) start[n] = t;
            first = t, n++;
        }
    if (start) start[n] = T;
    return n;
}

/* How T rows over L keys are shared out to n threads. Tasks of a segment, KV head and split for
   rows too few to share out (a decode step: a row a segment; one request's 2-3 rows, a short
   verify, as one segment, whose tasks then read each K/V row once for all of them: attention at
   W=2 0.54-0.55 against 0.59-0.61 ms a forward, W=3 0.71 against 0.79-0.82, 2-thread Xeon,
   `verify-cost` in turns) and for a verify on a long context
   (ROW_BLOCK rows a segment, at least two whole splits' tasks a thread: each K/V row is then read
   once, for every row of the verify, where a task per segment reads all of them once a segment:
   after 512 or 1,024 tokens, attention in 0.80-0.89x the time at W=8 and 0.86-0.92x at W=4 on a
   2-thread Zen3, interleaved runs); otherwise a task per segment, sized to share the rows out (a
   verify on a short context: 3 KV heads of one split do not split evenly over 2 threads), and
   where those segments are one request's at most ROW_BLOCK rows, as (KV head, row) pairs instead
   (by_head_rows: attend_by_head_rows).
   segment_start (or NULL): the segments' first rows, as count_segments gives them. */
typedef struct {
    int by_split, by_head_rows, block, num_segments;
} att_plan;

static att_plan plan_attention(const int32_t *row_batch, int T, int L, int num_kv_heads, int n, int *segment_start) {
    const int segments_of_block = count_segments(row_batch, T, ROW_BLOCK, NULL);
    const int per_thread = (T + n - 1) / n, whole_splits = L / KEY_SPLIT;
    att_plan plan;
    plan.by_split = T < 2 * n ||
                    (segments_of_block < n && (long)segments_of_block * num_kv_heads * whole_splits >= 2L * n);
    plan.block = T < 2 * n ? (segments_of_block == 1 ? T : 1)
                           : plan.by_split || per_thread > ROW_BLOCK ? ROW_BLOCK : per_thread;
    plan.num_segments = count_segments(row_batch, T, plan.block, segment_start);
    plan.by_head_rows = !plan.by_split && plan.num_segments > 1 && segments_of_block == 1 && T <= ROW_BLOCK;
    return plan;
}

/* The by-split tasks' partials and per-(segment, head) counters of a team's calls, prepared by one
   thread before them (decoder_layer_team: with the step before attention), so that the call
   needs no barrier to share its own (a single's copy cost ~2 us a layer at 1 row) */
typedef struct {
    float *part;
    int *splits_done;
    long part_capacity, counter_capacity;      /* floats, ints */
} att_scratch;

/* s holds what attention_rows_team needs for these rows (row_batch, T of them) over L keys, its
   counters zeroed; called by one thread of the team that then calls attention_rows_team. -1
   where memory could not be had. */
static int att_scratch_prepare(att_scratch *s, const int32_t *row_batch, int T, int L, int num_heads,
                               int num_kv_heads, int head_dim) {
    const att_plan plan = plan_attention(row_batch, T, L, num_kv_heads, omp_get_num_threads(), NULL);
    const int group = num_heads / num_kv_heads, max_splits = L > 0 ? (L + KEY_SPLIT - 1) / KEY_SPLIT : 1;
    const long counters = plan.by_split ? (long)plan.num_segments * num_kv_heads : 1;
    const long floats = counters * max_splits * plan.block * partial_floats(group, head_dim);
    if (floats > s->part_capacity) {
        free(s->part);
        s->part = (float *)malloc((size_t)floats * sizeof(float));
        s->part_capacity = s->part ? floats : 0;
    }
    if (counters > s->counter_capacity) {
        free(s->splits_done);
        s->splits_done = (int *)malloc((size_t)counters * sizeof(int));
        s->counter_capacity = s->splits_done ? counters : 0;
    }
    if (!s->part || !s->splits_done) return -1;
    memset(s->splits_done, 0, (size_t)counters * sizeof(int));
    return 0;
}

static void att_scratch_free(att_scratch *s) { free(s->part), free(s->splits_done); }

/* tasks of one segment, KV head and split (splits outermost: the threads work on the same slots
   at the same time, each on a head of its own); the task that finishes a (segment, head)'s last
   split merges its rows (a counter per pair, acquire-release: it sees every other split's
   partials; no barrier) */
static void attend_by_split(const att_call *c, const int *segment_start, int num_segments, int block,
                            int max_splits, void *out, const att_scratch *prepared) {
    const long pf = partial_floats(c->group, c->head_dim), per_split = (long)block * pf;
    const long per_head = (long)num_segments * c->num_kv_heads;
    float *part = prepared ? prepared->part : NULL;
    int *splits_done = prepared ? prepared->splits_done : NULL;
    if (!prepared) {
        #pragma omp single copyprivate(part, splits_done)
        {
            part = (float *)malloc((size_t)per_head * max_splits * per_split * sizeof(float));
            splits_done = (int *)calloc((size_t)per_head, sizeof(int));
        }
    }
    {
        row_scratch scratch[ROW_BLOCK];
        for (int r = 0; r < block; r++) scratch_alloc(&scratch[r], c->L, c->num_heads, c->group, c->hdq);
        int loaded = -1, shared = 0;         /* the segment whose keys and queries scratch holds */
        #pragma omp for schedule(dynamic, 1)
        for (long task = 0; task < per_head * max_splits; task++) {
            const int split = (int)(task / per_head);
            const long sh = task % per_head;              /* segment * num_kv_heads + head */
            const int seg = (int)(sh / c->num_kv_heads), h = (int)(sh % c->num_kv_heads);
            const int t0 = segment_start[seg], rows = segment_start[seg + 1] - t0;
            if (seg != loaded) {
                shared = gather_rows(c, t0, rows, scratch);
                load_queries(c, t0, rows, 0, c->num_kv_heads, scratch);
                loaded = seg;
            }
            float *pair_part = part + sh * max_splits * per_split;
            attend_split(c, rows, h, split, shared, scratch, pair_part + split * per_split, pf);
            if (__atomic_add_fetch(&splits_done[sh], 1, __ATOMIC_ACQ_REL) == max_splits)
                merge_rows(c, t0, rows, h, pair_part, per_split, max_splits, out);
        }
        for (int r = 0; r < block; r++) scratch_free(&scratch[r]);
    }
    if (!prepared) {
        #pragma omp single nowait
        {
            free(splits_done);
            free(part);
        }
    }
}

/* a task per segment, its heads and splits in turn */
static void attend_by_segment(const att_call *c, const int *segment_start, int num_segments, int block,
                              int max_splits, void *out) {
    const long pf = partial_floats(c->group, c->head_dim);
    {
        row_scratch scratch[ROW_BLOCK];
        for (int r = 0; r < block; r++) scratch_alloc(&scratch[r], c->L, c->num_heads, c->group, c->hdq);
        float *part = (float *)malloc((size_t)block * c->num_kv_heads * max_splits * pf * sizeof(float));
        /* dynamic: requests' key counts differ (a batch of 32 mixed prompts: -5% against
           contiguous static halves); a task writes only its own rows, so bits do not depend on
           which thread takes it */
        #pragma omp for schedule(dynamic, 1)
        for (long seg = 0; seg < num_segments; seg++)
            attend_segment(c, segment_start[seg], segment_start[seg + 1] - segment_start[seg], 0, c->num_kv_heads,
                           out, scratch, part, max_splits);
        free(part);
        for (int r = 0; r < block; r++) scratch_free(&scratch[r]);
    }
}

/* q: T rows of num_heads * head_dim (row stride q_ld elements); k_layer/v_layer a layer's K/V,
   its rows where kv says (kv_strides); kv_indices [B, L] int64; mask [B, Q, L] bool;
   row_batch/row_query [T] int32; out [T, num_heads * head_dim]. dtype (q and out) and kv_dtype
   (K/V, the cache's `--kv-cache-dtype`): 0 float32, 1 bfloat16. Returns 0, or -1 for shapes it
   does not take.
   Work is shared three ways, with the same bits: rows of few requests (a decode step, a verify)
   go as tasks of a segment of rows, one KV head and one key split each, merged after; the rows
   of one short verify that the threads would otherwise split into segments go as (KV head, row)
   pairs (attend_by_head_rows); otherwise a task is a segment of consecutive rows of one request
   with all its heads and splits. */
static int attention_rows_team(const void *q, long q_ld, const void *k_layer, const void *v_layer, kv_strides kv,
                               void *out,
                               const int64_t *kv_indices, const uint8_t *mask,
                               const int32_t *row_batch, const int32_t *row_query,
                               int T, int L, int Q, int num_heads, int num_kv_heads, int head_dim,
                               int dtype, int kv_dtype, const att_scratch *prepared) {
    const int group = num_heads / num_kv_heads;
    if (head_dim % 8 || head_dim > MAX_HEAD_DIM || num_heads % num_kv_heads || group > MAX_GROUP) return -1;
    const int is_bf16 = kv_dtype == DTYPE_BF16;
    const att_call c = {q, k_layer, v_layer, q_ld, kv, kv_indices, mask,
                        row_batch, row_query, L, Q, num_heads, num_kv_heads, group, head_dim,
                        (head_dim + 15) / 16 * 16, dtype == DTYPE_BF16, is_bf16,
                        is_bf16 ? round_pairs(head_dim) : (head_dim + 15) / 16 * 16};
    const int max_splits = L > 0 ? (L + KEY_SPLIT - 1) / KEY_SPLIT : 1;
    int *segment_start = (int *)malloc((size_t)(T + 1) * sizeof(int));
    const att_plan plan = plan_attention(row_batch, T, L, num_kv_heads, omp_get_num_threads(), segment_start);
    if (plan.by_split)
        attend_by_split(&c, segment_start, plan.num_segments, plan.block, max_splits, out, prepared);
    else if (plan.by_head_rows)
        attend_by_head_rows(&c, T, max_splits, out);
    else
        attend_by_segment(&c, segment_start, plan.num_segments, plan.block, max_splits, out);
    free(segment_start);
    return 0;
}

/* attention_rows_team in a region of its own */
int attention_rows(const void *q, long q_ld, const void *k_layer, const void *v_layer, kv_strides kv, void *out,
                   const int64_t *kv_indices, const uint8_t *mask,
                   const int32_t *row_batch, const int32_t *row_query,
                   int T, int L, int Q, int num_heads, int num_kv_heads, int head_dim,
                   int dtype, int kv_dtype, int nthreads) {
    int status = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        const int s = attention_rows_team(q, q_ld, k_layer, v_layer, kv, out, kv_indices, mask, row_batch, row_query,
                                          T, L, Q, num_heads, num_kv_heads, head_dim, dtype, kv_dtype, NULL);
        #pragma omp master
        status = s;
    }
    return status;
}

/* q [T, num_heads, head_dim] contiguous; K/V rows slot_stride and head_stride bytes apart
   (kv_strides); see attention_rows */
int paged_attention(const void *q, const void *k_layer, const void *v_layer, long slot_stride, long head_stride,
                    void *out,
                    const int64_t *kv_indices, const uint8_t *mask,
                    const int32_t *row_batch, const int32_t *row_query,
                    int T, int L, int Q, int num_heads, int num_kv_heads, int head_dim,
                    int dtype, int kv_dtype, int nthreads) {
    const kv_strides kv = {slot_stride, head_stride};
    return attention_rows(q, (long)num_heads * head_dim, k_layer, v_layer, kv, out, kv_indices, mask, row_batch,
                          row_query, T, L, Q, num_heads, num_kv_heads, head_dim, dtype, kv_dtype, nthreads);
}
