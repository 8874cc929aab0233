/* Weight-streaming linear for decode-shaped inputs (few rows), AVX2 + FMA:
       y[M,N] = x[M,K] @ w[N,K]^T (+ bias), float32 accumulation, float32 or bfloat16 x/w/y.
   Weights are read once per call, in blocks of NB rows, each block against all M input rows
   (MB at a time), so a verify over a few tokens costs about what one token costs while the
   weights stream from memory. bfloat16 weights are widened in registers (no float32 copy).
   Row invariance: every output is one chain of FMAs over k (8 lanes) and the same horizontal
   sum, whatever M, the row grouping or the thread count, so a row's bits never depend on the
   other rows of the call (greedy speculative output == plain decoding, batched == alone).
   Weights may also come as code blocks (coded_linear.c): the same values, fewer bytes.
   Built by build.py (cpu_kernels.c), called from skinny.py and decoder_layer.c. */
#include "common.h"

#define NB 4           /* weight rows per block */
#define MB 3           /* input rows per dense block */
#define CODED_FUSED_ROWS 8   /* most input rows a coded block takes (more: expanded once, then dense blocks) */
#define FUSED_INPUT_BYTES 40960   /* float32 input rows that fused coded blocks keep in L1 */
#define OUT_ROWS 8     /* rows of a block's results, max(MB, CODED_FUSED_ROWS) */
#define PF_BLOCKS 4    /* prefetch distance, in weight blocks */

#include "coded_linear.c"
#include "int_linear.c"

/* A linear's weights: dense [N, K] in the storage dtype and, optionally, the same values as
   code blocks (coded_format: coded_linear.c's formats), used for inputs of up to
   coded_max_rows rows; or GGUF blocks repacked for the integer kernel (int_linear.c), used
   for every input when set (the `gguf` quantization path). */
typedef struct {
    const void *dense;
    const uint8_t *coded;
    int32_t coded_format;
    int32_t coded_max_rows;
    const uint8_t *int_panels;
    int32_t int_format;
    int32_t reserved;
} linear_weights;

/* NB weight rows (stride K, element type T, loader LOAD) x R input rows (fp32, stride K).
   pf: the same region of a later block to prefetch (NULL: none); pf_step: k per cache line. */
#define DEFINE_BLOCK(NAME, T, LOAD, R)                                                        \
static inline void NAME(const float *x, const T *w, int K, const T *pf, int pf_step,         \
                        float out[NB][OUT_ROWS]) {                                             \
    __m256 acc[NB][R];                                                                        \
    for (int i = 0; i < NB; i++)                                                              \
        for (int j = 0; j < R; j++) acc[i][j] = _mm256_setzero_ps();                          \
    for (int k = 0; k < K; k += 8) {                                                          \
        if (pf && k % pf_step == 0)                                                           \
            for (int i = 0; i < NB; i++) _mm_prefetch((const char *)(pf + (long)i * K + k), _MM_HINT_T0); \
        __m256 xv[R];                                                                         \
        for (int j = 0; j < R; j++) xv[j] = _mm256_loadu_ps(x + (long)j * K + k);            \
        for (int i = 0; i < NB; i++) {                                                        \
            __m256 wv = LOAD(w + (long)i * K + k);                                            \
            for (int j = 0; j < R; j++) acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);   \
        }                                                                                     \
    }                                                                                         \
    for (int i = 0; i < NB; i++)                                                              \
        for (int j = 0; j < R; j++) out[i][j] = hsum8(acc[i][j]);                             \
}
DEFINE_BLOCK(f32_1, float, load_f32, 1)
DEFINE_BLOCK(f32_2, float, load_f32, 2)
DEFINE_BLOCK(f32_3, float, load_f32, 3)
DEFINE_BLOCK(bf16_1, uint16_t, load_bf16, 1)
DEFINE_BLOCK(bf16_2, uint16_t, load_bf16, 2)
DEFINE_BLOCK(bf16_3, uint16_t, load_bf16, 3)

static void f32_rows(const float *x, const float *w, int K, const float *pf, int r, float out[NB][OUT_ROWS]) {
    if (r == 3) f32_3(x, w, K, pf, 16, out);
    else if (r == 2) f32_2(x, w, K, pf, 16, out);
    else f32_1(x, w, K, pf, 16, out);
}
static void bf16_rows(const float *x, const uint16_t *w, int K, const uint16_t *pf, int r, float out[NB][OUT_ROWS]) {
    if (r == 3) bf16_3(x, w, K, pf, 32, out);
    else if (r == 2) bf16_2(x, w, K, pf, 32, out);
    else bf16_1(x, w, K, pf, 32, out);
}

/* Whether coded weights run fused over all M input rows: up to 4 rows always; up to
   CODED_FUSED_ROWS while those rows stay in L1 (each weight row reads them all) */
static inline int fuses_rows(int M, int K) {
    return M <= 4 || (M <= CODED_FUSED_ROWS && (long)M * K * 4 <= FUSED_INPUT_BYTES);
}

/* one block of NB weight rows (row_bytes apart; format: CODED_NONE for dense) against all M
   input rows, into res[M][NB] */
static void weight_block(const float *xf, const void *w, long row_bytes, int format, int M, int K, int is_bf16,
                         const void *pf, float *scratch, float *res) {
    float out[NB][OUT_ROWS];
    if (format && !fuses_rows(M, K)) {      /* several row groups: expand the codes once (to scratch) */
        expand_rows((const uint8_t *)w, row_bytes, K, (const uint8_t *)pf, format, is_bf16, scratch);
        w = scratch, format = CODED_NONE, is_bf16 = 0, pf = NULL;
    }
    const int group_rows = format ? CODED_FUSED_ROWS : MB;
    const int num_mblocks = (M + group_rows - 1) / group_rows;
    for (int m = 0, blk = 0; m < M; blk++) {
        const int r = (M - m) / (num_mblocks - blk) + ((M - m) % (num_mblocks - blk) != 0);
        const float *xm = xf + (long)m * K;
        const void *pf_m = m == 0 ? pf : NULL;
        if (format) coded_rows(xm, (const uint8_t *)w, row_bytes, K, (const uint8_t *)pf_m, r, format, is_bf16, out);
        else if (is_bf16) bf16_rows(xm, (const uint16_t *)w, K, (const uint16_t *)pf_m, r, out);
        else f32_rows(xm, (const float *)w, K, (const float *)pf_m, r, out);
        for (int j = 0; j < r; j++)
            for (int i = 0; i < NB; i++) res[(long)(m + j) * NB + i] = out[i][j];
        m += r;
    }
}

/* y = x @ w^T (+ bias) over weights w in format (CODED_NONE: dense in the dtype), by the threads
   of the current team (as int_linear_team: every thread of a region calls it, or one thread) */
static int run_linear_team(const void *x, const void *w, int format, const float *bias, void *y,
                           int M, int N, int K, int dtype) {
    const int is_bf16 = dtype == DTYPE_BF16;
    if (K % 8 || M < 1 || N < 1 || (format && (K % CODE_BLOCK || !coded_supports(format, is_bf16)))) return -1;
    const long row_bytes = format ? coded_row_bytes(K, format) : (long)K * (is_bf16 ? 2 : 4);
    float *xf = (float *)x;
    if (is_bf16) {
        #pragma omp single copyprivate(xf)
        {
            xf = (float *)malloc((size_t)M * K * 4);
            for (long i = 0; i < (long)M * K; i += 8) _mm256_storeu_ps(xf + i, load_bf16((const uint16_t *)x + i));
        }
    }
    const int nblocks = (N + NB - 1) / NB;
    void *tail = malloc((size_t)NB * row_bytes);
    float *res = (float *)malloc((size_t)M * NB * 4);
    float *scratch = format ? (float *)malloc((size_t)NB * K * 4) : NULL;
    #pragma omp for schedule(static)
    for (int b = 0; b < nblocks; b++) {
        const int n = b * NB, nb = N - n < NB ? N - n : NB;
        const char *wb = (const char *)w + (long)n * row_bytes;
        const char *pf = b + PF_BLOCKS < nblocks ? wb + (long)PF_BLOCKS * NB * row_bytes : NULL;
        if (nb < NB) {                    /* last partial block: pad with zero rows */
            memset(tail, 0, (size_t)NB * row_bytes);
            memcpy(tail, wb, (size_t)nb * row_bytes);
            wb = (const char *)tail;
        }
        weight_block(xf, wb, row_bytes, format, M, K, is_bf16, pf, scratch, res);
        for (int m = 0; m < M; m++)
            for (int i = 0; i < nb; i++) {
                float v = res[(long)m * NB + i] + (bias ? bias[n + i] : 0.f);
                if (is_bf16) ((uint16_t *)y)[(long)m * N + n + i] = f32_to_bf16(v);
                else ((float *)y)[(long)m * N + n + i] = v;
            }
    }
    free(tail);
    free(res);
    free(scratch);
    if (is_bf16) {
        #pragma omp single nowait
        free(xf);
    }
    return 0;
}

/* the integer kernel where the weights have panels; else the coded weights for up to
   coded_max_rows rows, else the dense ones (the same bits); by the current team's threads
   (scratch, own_scratch: the integer kernel's input buffers for these rows, as int_linear_team
   takes them; next: the linear the team runs after this one, next_N x next_K, or NULL) */
static int linear_forward_team(const linear_weights *lw, const void *x, const float *bias, void *y,
                               int M, int N, int K, int dtype, const iq_input *scratch, int own_scratch,
                               const linear_weights *next, int next_N, int next_K) {
    if (lw->int_panels && lw->int_format) {
        const iq_next_linear after = {next && next->int_format ? next->int_panels : NULL,
                                      next ? next->int_format : 0, next_N, next_K};
        return int_linear_team(lw->int_panels, lw->int_format, x, bias, y, M, N, K, dtype, scratch, own_scratch,
                               &after);
    }
    if (lw->coded && lw->coded_format && M <= lw->coded_max_rows)
        return run_linear_team(x, lw->coded, lw->coded_format, bias, y, M, N, K, dtype);
    return run_linear_team(x, lw->dense, CODED_NONE, bias, y, M, N, K, dtype);
}

/* linear_forward_team in a region of its own */
int linear_forward(const linear_weights *lw, const void *x, const float *bias, void *y,
                   int M, int N, int K, int dtype, int nthreads) {
    int status = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        const int s = linear_forward_team(lw, x, bias, y, M, N, K, dtype, NULL, 0, NULL, 0, 0);
        #pragma omp master
        status = s;
    }
    return status;
}

/* dtype: 0 float32, 1 bfloat16 (x, w and y share it). bias: fp32 or NULL. K % 8 == 0. Dense weights
   through linear_forward. */
int skinny_linear(const void *x, const void *w, const float *bias, void *y,
                  int M, int N, int K, int dtype, int nthreads) {
    const linear_weights dense = {w, NULL, 0, 0, NULL, 0, 0};
    return linear_forward(&dense, x, bias, y, M, N, K, dtype, nthreads);
}
