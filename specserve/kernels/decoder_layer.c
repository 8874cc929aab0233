/* One Llama decoder layer for decode-shaped forwards, in one call (AVX2 + FMA):

       x = RMSNorm(h) * w_ln1                 h: [T, H] residual stream, updated in place
       q, k, v = x @ W_qkv^T (+ b)            rotary on q and k (rotate-half), K/V to the cache
       h += paged_attention(q, cache) @ W_o^T
       x = RMSNorm(h) * w_ln2
       h += (silu(x @ W_gate^T) * (x @ W_up^T)) @ W_down^T

   The linears are the skinny kernel's (dense or coded weights), the attention paged_attention; every other step is per
   row in a fixed order, so the layer keeps their row invariance. Values are rounded to the
   storage dtype where the torch layer (models/llama.py) stores them, so both paths compute
   the same function (the bits may differ in the last place). What it replaces is ~40 torch
   calls a layer, whose Python and dispatch overhead dominated decode steps once the
   linears and attention were native. Built by build.py (cpu_kernels.c), called from layer.py. */
#include "common.h"
#include "profile.h"

/* out[t] = round(w * round(h[t] / rms(h[t]))), HF's RMSNorm arithmetic */
static void rms_norm(const void *h, const void *w, void *out, int T, int H, float eps, int is_bf16) {
    const int esize = is_bf16 ? 2 : 4;
    for (int t = 0; t < T; t++) {
        const char *row = (const char *)h + (long)t * H * esize;
        char *out_row = (char *)out + (long)t * H * esize;
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < H; i += 8) {
            __m256 v = load8(row + i * esize, is_bf16);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        const __m256 scale = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / H + eps));
        for (int i = 0; i < H; i += 8) {
            const __m256 normed = round_to8(_mm256_mul_ps(load8(row + i * esize, is_bf16), scale), is_bf16);
            store8(out_row + i * esize, _mm256_mul_ps(load8((const char *)w + i * esize, is_bf16), normed), is_bf16);
        }
    }
}

/* rms_norm for callers outside a layer (a draft head's norms, the final norm): rows of h
   [T, H] contiguous into rows of out spaced out_ld elements apart (a column block of a wider
   tensor). Returns -1 for a width it does not take. */
int rms_norm_rows(const void *h, const void *w, void *out, long out_ld, int T, int H, float eps, int dtype) {
    if (H % 8) return -1;
    const int is_bf16 = dtype == DTYPE_BF16, esize = is_bf16 ? 2 : 4;
    for (int t = 0; t < T; t++)
        rms_norm((const char *)h + (long)t * H * esize, w, (char *)out + t * out_ld * esize, 1, H, eps, is_bf16);
    return 0;
}

/* out[0..8) = round(x * c) + round(r * s) on 8 lanes. Intrinsics, not a scalar loop: the
   compiler may version a plain loop (vector / scalar by a runtime aliasing check on the
   addresses) and fuse the multiply-add differently in each version, so a row's bits would
   depend on where its buffers happen to lie. */
static inline __m256 rotate8(__m256 x, __m256 c, __m256 r, __m256 s, int is_bf16) {
    return _mm256_add_ps(round_to8(_mm256_mul_ps(x, c), is_bf16), round_to8(_mm256_mul_ps(r, s), is_bf16));
}

/* rotate-half rotary of one head (buf: its hd values; hd % 16 == 0) into qkv at base */
static void rotary_head8(void *qkv, long base, const float *buf, const char *cos, const char *sin, int hd,
                         int is_bf16) {
    const int half = hd / 2, esize = is_bf16 ? 2 : 4;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    char *out = (char *)qkv + base * esize;
    for (int d = 0; d < half; d += 8) {
        const __m256 x1 = _mm256_loadu_ps(buf + d), x2 = _mm256_loadu_ps(buf + half + d);
        store8(out + d * esize, rotate8(x1, load8(cos + d * esize, is_bf16), _mm256_xor_ps(x2, sign),
                                        load8(sin + d * esize, is_bf16), is_bf16), is_bf16);
        store8(out + (half + d) * esize, rotate8(x2, load8(cos + (half + d) * esize, is_bf16), x1,
                                                 load8(sin + (half + d) * esize, is_bf16), is_bf16), is_bf16);
    }
}

/* rotate-half rotary, in place, on heads [first, first + count) of each row of qkv (stride ld) */
static void rotary(void *qkv, long ld, int first, int count, const void *cos, const void *sin,
                   int T, int hd, int is_bf16) {
    const int half = hd / 2, esize = is_bf16 ? 2 : 4;
    float buf[MAX_HEAD_DIM];
    for (int t = 0; t < T; t++) {
        for (int head = first; head < first + count; head++) {
            const long base = (long)t * ld + (long)head * hd;
            if (hd % 16 == 0) {
                for (int d = 0; d < hd; d += 8)
                    _mm256_storeu_ps(buf + d, load8((const char *)qkv + (base + d) * esize, is_bf16));
                rotary_head8(qkv, base, buf, (const char *)cos + (long)t * hd * esize,
                             (const char *)sin + (long)t * hd * esize, hd, is_bf16);
                continue;
            }
            for (int d = 0; d < hd; d++) buf[d] = get_elem(qkv, base + d, is_bf16);
            for (int d = 0; d < hd; d++) {
                const float rotated = d < half ? -buf[d + half] : buf[d - half];
                const float a = round_to(buf[d] * get_elem(cos, (long)t * hd + d, is_bf16), is_bf16);
                const float b = round_to(rotated * get_elem(sin, (long)t * hd + d, is_bf16), is_bf16);
                set_elem(qkv, base + d, a + b, is_bf16);
            }
        }
    }
}

/* n values of a qkv row (is_bf16) into a cache row (kv_bf16), rounded as torch's .to() rounds
   where the dtypes differ (store8 rounds as set_elem) */
static void copy_head(char *dst, const char *src, int n, int is_bf16, int kv_bf16) {
    if (kv_bf16 == is_bf16) {
        memcpy(dst, src, (size_t)n * (is_bf16 ? 2 : 4));
        return;
    }
    const int esize = is_bf16 ? 2 : 4, kv_esize = kv_bf16 ? 2 : 4;
    int i = 0;
    for (; i + 8 <= n; i += 8) store8(dst + i * kv_esize, load8(src + i * esize, is_bf16), kv_bf16);
    for (; i < n; i++) set_elem(dst, i, get_elem(src, i, is_bf16), kv_bf16);
}

/* the K and V heads of T qkv rows (ld elements apart, K at k_off, V at v_off) into the cache
   slots out_loc, each head's hd values where kv says */
static void write_cache(const void *qkv, long ld, long k_off, long v_off, void *k_layer, void *v_layer, kv_strides kv,
                        const int64_t *out_loc, int T, int nkv, int hd, int is_bf16, int kv_bf16) {
    const int esize = is_bf16 ? 2 : 4;
    for (int t = 0; t < T; t++) {
        const char *row = (const char *)qkv + (long)t * ld * esize;
        const long slot = out_loc[t] * kv.slot;
        for (int j = 0; j < nkv; j++) {
            copy_head((char *)k_layer + slot + j * kv.head, row + (k_off + (long)j * hd) * esize, hd, is_bf16, kv_bf16);
            copy_head((char *)v_layer + slot + j * kv.head, row + (v_off + (long)j * hd) * esize, hd, is_bf16, kv_bf16);
        }
    }
}

/* The cache lines write_cache will write for rows [0, T), prefetched ahead of it: a new
   token's K/V rows lie in lines nothing read lately, and each of write_cache's stores otherwise
   waited for its line from memory (a decode step's 12 lines a layer, one after another: ~2% of
   a decode step on 1 thread, AVX-512 Zen4) */
static void prefetch_cache_rows(void *k_layer, void *v_layer, kv_strides kv, const int64_t *out_loc, int T, int nkv,
                                int hd, int kv_bf16) {
    const int bytes = hd * (kv_bf16 ? 2 : 4);
    for (int t = 0; t < T; t++)
        for (int j = 0; j < nkv; j++) {
            const long at = out_loc[t] * kv.slot + j * kv.head;
            for (int off = 0; off < bytes; off += 64) {
                _mm_prefetch((const char *)k_layer + at + off, _MM_HINT_T0);
                _mm_prefetch((const char *)v_layer + at + off, _MM_HINT_T0);
            }
        }
}

/* h += y, rounded to the storage dtype; n % 8 == 0 */
static void add_rows(void *out, const void *a, const void *b, long n, int is_bf16) {
    const int esize = is_bf16 ? 2 : 4;
    for (long i = 0; i < n; i += 8)
        store8((char *)out + i * esize, _mm256_add_ps(load8((const char *)a + i * esize, is_bf16),
                                                      load8((const char *)b + i * esize, is_bf16)), is_bf16);
}

static void add_into(void *h, const void *y, long n, int is_bf16) { add_rows(h, h, y, n, is_bf16); }

/* act[t, i] = round(round(silu(gate)) * up), gate_up rows = [gate (I) | up (I)]; I % 8 == 0.
   Each element's arithmetic is the same at any vector width (exp16 = exp8 lane by lane, an
   IEEE divide), so the AVX-512 lanes give the AVX2 bits; rows split over the threads when
   there are enough of them (verification, prefill). */
static void silu_mul_rows(const void *gate_up, void *act, int t0, int t1, int I, int is_bf16) {
    const int esize = is_bf16 ? 2 : 4;
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int t = t0; t < t1; t++) {
        const char *gate = (const char *)gate_up + (long)t * 2 * I * esize, *up = gate + (long)I * esize;
        char *out = (char *)act + (long)t * I * esize;
        int i = 0;
#ifdef __AVX512F__
        if (!is_bf16) {
            const __m512 one16 = _mm512_set1_ps(1.0f);
            const __m512i sign16 = _mm512_set1_epi32((int)0x80000000u);
            for (; i + 16 <= I; i += 16) {
                const __m512 g = _mm512_loadu_ps((const float *)gate + i);
                const __m512 minus_g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), sign16));
                const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one16, exp16(minus_g)));
                _mm512_storeu_ps((float *)out + i, _mm512_mul_ps(silu, _mm512_loadu_ps((const float *)up + i)));
            }
        }
#endif
        for (; i < I; i += 8) {
            const __m256 g = load8(gate + i * esize, is_bf16);
            const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign))));
            store8(out + i * esize, _mm256_mul_ps(round_to8(silu, is_bf16), load8(up + i * esize, is_bf16)), is_bf16);
        }
    }
}

/* silu_mul_rows for rows [0, T) by the current team: rows split over the threads where there are
   enough of them (verification, prefill), else one thread's */
static void silu_mul_team(const void *gate_up, void *act, int T, int I, int is_bf16) {
    const int nthreads = omp_get_num_threads();
    if (nthreads == 1 || T < 4 * nthreads) {
        #pragma omp master
        silu_mul_rows(gate_up, act, 0, T, I, is_bf16);
        #pragma omp barrier
        return;
    }
    #pragma omp for schedule(static)
    for (int t = 0; t < T; t++) silu_mul_rows(gate_up, act, t, t + 1, I, is_bf16);
}

/* Whether T rows are too few to share out over n threads (fewer than 2 a thread: a decode step):
   the row-wise steps then run on the master thread (team_rows), or on each thread's own copy of
   the rows (few_rows_apiece) */
static inline int too_few_rows(int T, int n) { return n > 1 && T < 2 * n; }

/* This thread's rows [*t0, *t1) of a row-wise step over T rows: a contiguous share each, or all of
   them on the master thread where they are too few (a split would cost more than it saves).
   Every row's arithmetic is the same whichever thread runs it. */
static void team_rows(int T, int *t0, int *t1) {
    const int n = omp_get_num_threads(), id = omp_get_thread_num();
    if (too_few_rows(T, n)) {
        *t0 = 0, *t1 = id == 0 ? T : 0;
        return;
    }
    long first, end;
    team_share(T, &first, &end);
    *t0 = (int)first, *t1 = (int)end;
}

/* a layer's intermediate rows, shared by the threads of its team */
typedef struct {
    char *x, *qkv, *attn, *y, *gate_up, *act;
    iq_input linear_input;      /* the integer linears' quantized input rows */
    att_scratch attention;      /* attention's shared partials, prepared before each call */
    int attention_ready;        /* whether attention is prepared (else it allocates its own) */
    int num_own;                /* threads with copies of their own (few_rows_apiece), else 0: */
    char *own_x;                /* their normed inputs, T x H each */
    iq_input *own_inputs;       /* their linears' quantized inputs */
} layer_buffers;

/* Whether each thread of the team norms and quantizes its own copy of a step's input rows: a few
   rows (a decode step), where that costs less than the barrier after one thread's (two barriers a
   norm fewer, one a linear), in buffers b has for this many threads */
static int few_rows_apiece(const layer_buffers *b, int T, int nthreads) {
    return too_few_rows(T, nthreads) && b->num_own >= nthreads;
}

static void layer_buffers_free(layer_buffers *b) {
    free(b->x), free(b->qkv), free(b->attn), free(b->y), free(b->gate_up), free(b->act);
    iq_input_free(&b->linear_input);
    att_scratch_free(&b->attention);
    for (int i = 0; i < b->num_own && b->own_inputs; i++) iq_input_free(&b->own_inputs[i]);
    free(b->own_inputs), free(b->own_x);
}

/* each of nthreads threads' copies (few_rows_apiece) of T rows of H and linear inputs of K */
static int own_buffers_alloc(layer_buffers *b, int T, int H, int K, size_t esize, int nthreads) {
    b->num_own = nthreads, b->own_x = malloc((size_t)nthreads * T * H * esize);
    b->own_inputs = calloc((size_t)nthreads, sizeof(iq_input));
    int failed = !b->own_x || !b->own_inputs;
    for (int i = 0; i < nthreads && !failed; i++) failed = iq_input_alloc(&b->own_inputs[i], T, K);
    return failed ? -1 : 0;
}

/* buffers for T rows of a layer of these dims (decoder_layer's) and nthreads threads; -1 where one
   could not be had */
static int layer_buffers_alloc(layer_buffers *b, const int *dims, int T, int dtype, int nthreads) {
    const size_t esize = dtype == DTYPE_BF16 ? 2 : 4, H = dims[0], I = dims[4];
    const size_t q_width = (size_t)dims[1] * dims[3], qkv_width = q_width + 2 * (size_t)dims[2] * dims[3];
    size_t widest = (size_t)dims[5] > q_width ? (size_t)dims[5] : q_width;     /* the linears' widest input */
    widest = I > widest ? I : widest;
    b->attention = (att_scratch){NULL, NULL, 0, 0};
    b->x = malloc(T * H * esize), b->qkv = malloc(T * qkv_width * esize), b->attn = malloc(T * q_width * esize);
    b->y = malloc(T * H * esize), b->gate_up = malloc(T * 2 * I * esize), b->act = malloc(T * I * esize);
    const int K = (int)((widest + IQ_K - 1) / IQ_K * IQ_K);
    b->num_own = 0, b->own_x = NULL, b->own_inputs = NULL;
    int inputs_failed = iq_input_alloc(&b->linear_input, T, K);
    if (too_few_rows(T, nthreads) && !inputs_failed)
        inputs_failed = own_buffers_alloc(b, T, (int)H, K, esize, nthreads);
    if (b->x && b->qkv && b->attn && b->y && b->gate_up && b->act && !inputs_failed) return 0;
    layer_buffers_free(b);
    return -1;
}

/* decoder_layer by the threads of the current team (every thread calls it with the same
   arguments; one thread outside a region): the row-wise steps by rows (team_rows), the linears
   and attention shared out, a barrier after each step; for a few rows (few_rows_apiece) each
   thread norms its own copy of a linear's input instead, h updated on the master once every
   thread has read it. after: the next layer's qkv linear (H wide inputs), or NULL; each linear's
   prefetches run on into the team's next one. Returns the same status in every thread. */
static int decoder_layer_team(void *h, const void *x_in, const void *const *norms, const linear_weights *linears,
                              const float *qkv_bias, float eps, const int *dims, const void *cos, const void *sin,
                              void *k_layer, void *v_layer, kv_strides kv, const int64_t *out_loc,
                              const int64_t *kv_indices, const uint8_t *mask, const int32_t *row_batch,
                              const int32_t *row_query, int T, int L, int Q, int dtype, int kv_dtype,
                              layer_buffers *buf, const linear_weights *after) {
    const int H = dims[0], nh = dims[1], nkv = dims[2], hd = dims[3], I = dims[4], in_width = dims[5];
    const int is_bf16 = dtype == DTYPE_BF16, esize = is_bf16 ? 2 : 4;
    const int q_width = nh * hd, kv_width = nkv * hd, qkv_width = q_width + 2 * kv_width;
    if (H % 8 || I % 8 || q_width % 8 || hd > MAX_HEAD_DIM || (x_in == NULL && in_width != H)) return -1;
    char *x = buf->x, *qkv = buf->qkv, *attn = buf->attn, *y = buf->y, *gate_up = buf->gate_up, *act = buf->act;
    int status = 0;
    const long row_bytes = (long)H * esize;      /* a row of h, x or y */
    int r0, r1;                       /* this thread's rows of the row-wise steps */
    team_rows(T, &r0, &r1);
    const int own = few_rows_apiece(buf, T, omp_get_num_threads());
    char *xo = own ? buf->own_x + (long)omp_get_thread_num() * T * row_bytes : x;   /* this thread's normed rows */
    const iq_input *in = own ? &buf->own_inputs[omp_get_thread_num()] : &buf->linear_input;
    if (r1 > r0)                      /* this thread's rows of write_cache, below */
        prefetch_cache_rows(k_layer, v_layer, kv, out_loc + r0, r1 - r0, nkv, hd, kv_dtype == DTYPE_BF16);
    double t = profile_clock();       /* the master thread's clock marks each step after its barrier */
    if (own && x_in == NULL) {
        rms_norm(h, norms[0], xo, T, H, eps, is_bf16);
    } else if (!own) {
        if (x_in == NULL && r1 > r0)
            rms_norm((char *)h + r0 * row_bytes, norms[0], x + r0 * row_bytes, r1 - r0, H, eps, is_bf16);
        #pragma omp barrier
    }
    #pragma omp master
    t = profile_mark(PROF_NORM, t);
    status |= linear_forward_team(&linears[0], x_in ? x_in : xo, qkv_bias, qkv, T, qkv_width, in_width, dtype, in,
                                  own, &linears[1], H, q_width);
    #pragma omp master
    {
        t = profile_mark(PROF_QKV, t);
        buf->attention_ready = att_scratch_prepare(&buf->attention, row_batch, T, L, nh, nkv, hd) == 0;
    }
    if (r1 > r0) {
        const long qkv_row = (long)qkv_width * esize, angle_row = (long)hd * esize;
        char *rows = qkv + r0 * qkv_row;
        rotary(rows, qkv_width, 0, nh + nkv, (const char *)cos + r0 * angle_row, (const char *)sin + r0 * angle_row,
               r1 - r0, hd, is_bf16);
        write_cache(rows, qkv_width, q_width, q_width + kv_width, k_layer, v_layer, kv, out_loc + r0, r1 - r0, nkv, hd,
                    is_bf16, kv_dtype == DTYPE_BF16);
    }
    #pragma omp barrier      /* every thread reads the master's attention_ready after it */
    #pragma omp master
    t = profile_mark(PROF_ROTARY, t);
    status |= attention_rows_team(qkv, qkv_width, k_layer, v_layer, kv, attn, kv_indices, mask, row_batch, row_query,
                                  T, L, Q, nh, nkv, hd, dtype, kv_dtype,
                                  buf->attention_ready ? &buf->attention : NULL);
    #pragma omp master
    t = profile_mark(PROF_ATTENTION, t);
    status |= linear_forward_team(&linears[1], attn, NULL, y, T, H, q_width, dtype, in, own, &linears[2], 2 * I, H);
    #pragma omp master
    t = profile_mark(PROF_O, t);
    if (own) {                        /* norm(h + y) from a copy: h is read by every thread here */
        add_rows(xo, h, y, (long)T * H, is_bf16);
        rms_norm(xo, norms[1], xo, T, H, eps, is_bf16);
    } else {
        if (r1 > r0) {
            add_into((char *)h + r0 * row_bytes, y + r0 * row_bytes, (long)(r1 - r0) * H, is_bf16);
            rms_norm((char *)h + r0 * row_bytes, norms[1], x + r0 * row_bytes, r1 - r0, H, eps, is_bf16);
        }
        #pragma omp barrier
    }
    #pragma omp master
    t = profile_mark(PROF_NORM, t);
    status |= linear_forward_team(&linears[2], xo, NULL, gate_up, T, 2 * I, H, dtype, in, own, &linears[3], H, I);
    #pragma omp master
    {
        t = profile_mark(PROF_GATE_UP, t);
        /* the copies' h + y into h: every thread has read both (the linear ended in a barrier),
           and the down projection overwrites y only after silu's barrier */
        if (own) add_into(h, y, (long)T * H, is_bf16);
    }
    silu_mul_team(gate_up, act, T, I, is_bf16);
    #pragma omp master
    t = profile_mark(PROF_SILU, t);
    status |= linear_forward_team(&linears[3], act, NULL, y, T, H, I, dtype, in, own, after, qkv_width, H);
    #pragma omp master
    t = profile_mark(PROF_DOWN, t);
    if (r1 > r0) add_into((char *)h + r0 * row_bytes, y + r0 * row_bytes, (long)(r1 - r0) * H, is_bf16);
    #pragma omp barrier
    #pragma omp master
    profile_mark(PROF_NORM, t);
    return status ? -1 : 0;
}

/* norms: {ln1, ln2} in the storage dtype; linears: {qkv, o, gate_up, down}; qkv_bias float32 or
   NULL; dims: {H, num_heads, num_kv_heads, head_dim, intermediate, qkv input width}. x_in: NULL
   (attention reads ln1(h); the input width is H), or the attention's input [T, input width]
   already formed by the caller (EAGLE-3's midlayer: [ln(embedding), ln(hidden)], 2H wide; ln1
   unused). K/V rows slot_stride and head_stride bytes apart (kv_strides); attention metadata as in
   paged_attention (kv_dtype: the cache's dtype; new K/V are rounded to it as they are written).
   Returns 0, or -1 for shapes it does not take. */
int decoder_layer(void *h, const void *x_in, const void *const *norms, const linear_weights *linears,
                  const float *qkv_bias, float eps, const int *dims,
                  const void *cos, const void *sin, void *k_layer, void *v_layer, long slot_stride, long head_stride,
                  const int64_t *out_loc, const int64_t *kv_indices, const uint8_t *mask, const int32_t *row_batch,
                  const int32_t *row_query, int T, int L, int Q, int dtype, int kv_dtype, int nthreads) {
    const kv_strides kv = {slot_stride, head_stride};
    layer_buffers buf;
    if (layer_buffers_alloc(&buf, dims, T, dtype, nthreads)) return -1;
    int status = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        const int s = decoder_layer_team(h, x_in, norms, linears, qkv_bias, eps, dims, cos, sin, k_layer, v_layer, kv,
                                         out_loc, kv_indices, mask, row_batch, row_query, T, L, Q, dtype, kv_dtype,
                                         &buf, NULL);
        #pragma omp master
        status = s;
    }
    layer_buffers_free(&buf);
    return status;
}

/* Every layer of a model in one call (decode-shaped forwards): layer l takes norms[2l..2l+1],
   linears[4l..4l+3], qkv_biases[l] (NULL: none) and its K/V at k_cache/v_cache + l * layer_bytes;
   aux_out (NULL, or num_layers pointers): where aux_out[l] is set, layer l's input h [T, H] is
   copied there first, its rows aux_ld elements apart (EAGLE-3's captured features: columns of one
   [T, 3H] tensor, the head's input without a concatenation); the rest as in decoder_layer. Saves
   a Python call, its checks and its argument conversions per layer; the layers run in one parallel region
   (a barrier between steps instead of a region per linear and attention: ~150 regions a decode
   step, each ~1 us to start on a 2-core Xeon). */
int decoder_layers(void *h, const void *const *norms, const linear_weights *linears, const float *const *qkv_biases,
                   float eps, const int *dims, int num_layers, const void *cos, const void *sin, char *k_cache,
                   char *v_cache, long layer_bytes, long slot_stride, long head_stride, const int64_t *out_loc,
                   const int64_t *kv_indices, const uint8_t *mask, const int32_t *row_batch, const int32_t *row_query,
                   void *const *aux_out, long aux_ld, int T, int L, int Q, int dtype, int kv_dtype,
                   int nthreads) {
    const kv_strides kv = {slot_stride, head_stride};
    const int esize = dtype == DTYPE_BF16 ? 2 : 4;
    const size_t row_bytes = (size_t)dims[0] * esize;
    layer_buffers buf;
    if (layer_buffers_alloc(&buf, dims, T, dtype, nthreads)) return -1;
    int status = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        int s = 0;
        for (int l = 0; l < num_layers && s == 0; l++) {
            #pragma omp master
            if (aux_out && aux_out[l])
                for (int t = 0; t < T; t++)
                    memcpy((char *)aux_out[l] + t * aux_ld * esize, (const char *)h + t * row_bytes, row_bytes);
            s = decoder_layer_team(h, NULL, norms + 2 * l, linears + 4 * l, qkv_biases[l], eps, dims, cos, sin,
                                   k_cache + l * layer_bytes, v_cache + l * layer_bytes, kv, out_loc, kv_indices, mask,
                                   row_batch, row_query, T, L, Q, dtype, kv_dtype, &buf,
                                   l + 1 < num_layers ? linears + 4 * (l + 1) : NULL);
        }
        #pragma omp master
        status = s;
    }
    layer_buffers_free(&buf);
    return status;
}

/* The model's ends for T rows: h [T, H] = the embedding's rows of ids (vocab rows, the dtype);
   cos/sin [T, hd] = the float32 tables' rows at positions (num_positions rows), rounded to the
   dtype as torch's .to rounds. Returns -1 for an id or position outside its table. */
static int gather_ends(const int64_t *ids, const void *embedding, long vocab, const int64_t *positions,
                       const float *cos_table, const float *sin_table, long num_positions, int T, int H, int hd,
                       int is_bf16, void *h, void *cos, void *sin) {
    const int esize = is_bf16 ? 2 : 4;
    for (int t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= vocab || positions[t] < 0 || positions[t] >= num_positions) return -1;
    for (int t = 0; t < T; t++) {
        memcpy((char *)h + (long)t * H * esize, (const char *)embedding + ids[t] * H * esize, (size_t)H * esize);
        for (int d = 0; d < hd; d++) {
            set_elem(cos, (long)t * hd + d, cos_table[positions[t] * hd + d], is_bf16);
            set_elem(sin, (long)t * hd + d, sin_table[positions[t] * hd + d], is_bf16);
        }
    }
    return 0;
}

/* A decode-shaped forward of the whole model in one call, its ends included: the embedding
   rows, cos and sin as gather_ends gives them, every layer as decoder_layers, then, where
   final_norm is not NULL, out = rms_norm(h) (else h is left for the caller to norm). Exact
   copies and the same kernels as the separate calls, so the same bits; what it saves is a few
   torch calls a forward, each slow after the weights went through the caches. Returns -1 for an
   id or position outside its table, or shapes the layers do not take. */
int model_stack(const int64_t *ids, const void *embedding, long vocab, const int64_t *positions,
                const float *cos_table, const float *sin_table, long num_positions, const void *final_norm,
                float final_eps, void *out, void *h, const void *const *norms, const linear_weights *linears,
                const float *const *qkv_biases, float eps, const int *dims, int num_layers, char *k_cache,
                char *v_cache, long layer_bytes, long slot_stride, long head_stride, const int64_t *out_loc,
                const int64_t *kv_indices, const uint8_t *mask, const int32_t *row_batch, const int32_t *row_query,
                void *const *aux_out, long aux_ld, int T, int L, int Q, int dtype, int kv_dtype, int nthreads) {
    const int H = dims[0], hd = dims[3], is_bf16 = dtype == DTYPE_BF16, esize = is_bf16 ? 2 : 4;
    char *cos = malloc((size_t)T * hd * esize), *sin = malloc((size_t)T * hd * esize);
    int status = gather_ends(ids, embedding, vocab, positions, cos_table, sin_table, num_positions, T, H, hd, is_bf16,
                             h, cos, sin);
    if (status == 0)
        status = decoder_layers(h, norms, linears, qkv_biases, eps, dims, num_layers, cos, sin, k_cache, v_cache,
                                layer_bytes, slot_stride, head_stride, out_loc, kv_indices, mask, row_batch, row_query,
                                aux_out, aux_ld, T, L, Q, dtype, kv_dtype, nthreads);
    if (status == 0 && final_norm) rms_norm(h, final_norm, out, T, H, final_eps, is_bf16);
    free(cos), free(sin);
    return status;
}

/* An EAGLE-3 head's decode-shaped forward in one call (models/eagle3.py): h [T, H] = fc(features
   [T, F]) (fc NULL: the features are H wide, copied), x = [rms_norm(embedding rows of ids) |
   rms_norm(h)] [T, 2H] (in_norm / hidden_norm and their eps), cos and sin as gather_ends gives
   them, then the midlayer as decoder_layer with x_in = x, updating h: the head's output, before
   its final norm. The same kernels as the separate calls, so the same bits. Returns -1 for an id
   or position outside its table, or shapes the layer does not take. */
int eagle3_head(const int64_t *ids, const void *embedding, long vocab, const int64_t *positions,
                const float *cos_table, const float *sin_table, long num_positions, const linear_weights *fc,
                const void *features, int F, const void *in_norm, float in_eps, const void *hidden_norm,
                float hidden_eps, void *h, const void *const *norms, const linear_weights *linears,
                const float *qkv_bias, float eps, const int *dims, void *k_layer, void *v_layer, long slot_stride,
                long head_stride, const int64_t *out_loc, const int64_t *kv_indices, const uint8_t *mask,
                const int32_t *row_batch, const int32_t *row_query, int T, int L, int Q, int dtype, int kv_dtype,
                int nthreads) {
    const int H = dims[0], hd = dims[3], is_bf16 = dtype == DTYPE_BF16, esize = is_bf16 ? 2 : 4;
    if (H % 8 || dims[5] != 2 * H || (!fc && F != H)) return -1;
    char *embeds = malloc((size_t)T * H * esize), *x = malloc((size_t)T * 2 * H * esize);
    char *cos = malloc((size_t)T * hd * esize), *sin = malloc((size_t)T * hd * esize);
    int status = gather_ends(ids, embedding, vocab, positions, cos_table, sin_table, num_positions, T, H, hd, is_bf16,
                             embeds, cos, sin);
    if (status == 0 && fc) status = linear_forward(fc, features, NULL, h, T, H, F, dtype, nthreads);
    else if (status == 0) memcpy(h, features, (size_t)T * H * esize);
    if (status == 0) {
        rms_norm_rows(embeds, in_norm, x, 2 * H, T, H, in_eps, dtype);                 /* the left half */
        rms_norm_rows(h, hidden_norm, x + (long)H * esize, 2 * H, T, H, hidden_eps, dtype);   /* the right */
        status = decoder_layer(h, x, norms, linears, qkv_bias, eps, dims, cos, sin, k_layer, v_layer, slot_stride,
                               head_stride, out_loc, kv_indices, mask, row_batch, row_query, T, L, Q, dtype, kv_dtype,
                               nthreads);
    }
    free(embeds), free(x), free(cos), free(sin);
    return status;
}

/* Index of the first maximum of v[0..n), a NaN counting as the largest (the first NaN wins):
   numpy's argmax, which sampler.argmax_rows gives. */
static long argmax_row(const void *v, long n, int is_bf16) {
    long best = 0;
    float best_value = get_elem(v, 0, is_bf16);
    if (isnan(best_value)) return 0;
    for (long i = 1; i < n; i++) {
        const float x = get_elem(v, i, is_bf16);
        if (isnan(x)) return i;
        if (x > best_value) best = i, best_value = x;
    }
    return best;
}

/* A draft head's last steps in one call (runner/head_runner.py): out_rows [R, H] = h's rows
   logit_rows (NULL: every row, R = T), logits [R, V] = lm_head(rms_norm(out_rows)) (final_norm
   NULL: no norm; bias fp32 or NULL), argmax[r] = the first maximum of logits row r, a NaN
   counting as the largest. The same kernels as the separate calls, so the same bits; what it
   saves is the torch calls between them, each slow after the weights went through the caches.
   Returns -1 for a row outside h, or shapes the kernels do not take. */
int head_logits(const void *h, int T, int H, const int64_t *logit_rows, int R, const void *final_norm,
                float final_eps, const linear_weights *lm_head, const float *bias, int V, void *out_rows,
                void *logits, int64_t *argmax, int dtype, int nthreads) {
    const int is_bf16 = dtype == DTYPE_BF16, esize = is_bf16 ? 2 : 4;
    const size_t row_bytes = (size_t)H * esize;
    if (H % 8 || R < 1 || (!logit_rows && R != T)) return -1;
    for (int r = 0; r < R; r++) {
        const int64_t t = logit_rows ? logit_rows[r] : r;
        if (t < 0 || t >= T) return -1;
        memcpy((char *)out_rows + r * row_bytes, (const char *)h + t * row_bytes, row_bytes);
    }
    const void *x = out_rows;
    char *normed = NULL;
    if (final_norm) {
        if (!(normed = malloc((size_t)R * row_bytes))) return -1;
        rms_norm_rows(out_rows, final_norm, normed, H, R, H, final_eps, dtype);
        x = normed;
    }
    const int status = linear_forward(lm_head, x, bias, logits, R, V, H, dtype, nthreads);
    free(normed);
    if (status == 0)
        for (int r = 0; r < R; r++) argmax[r] = argmax_row((const char *)logits + (size_t)r * V * esize, V, is_bf16);
    return status;
}
