/* AMX tiles for the integer linear (int_linear.c includes this): the `avx512_amx` build (AMX-INT8,
   used only where SPECSERVE_AMX=1 asks for it: see build.py), or, with IQ_AMX_EMULATE, the same
   code over a C model of the tile instructions (their semantics as Intel's SDM gives them), so
   that a CPU without AMX tests the layout and the epilogue.

   One TDPBSSD per block of 32 weights: A = the R input rows' int8 codes of the block (R rows of
   32 bytes, side by side in iq_input's layout), B = the panel's 16 weight rows' codes as bytes
   (8 rows of 64: row j is chunk j, byte 4i + t = weight row i's code 4j + t: the panel's own
   layout), C[r][i] = their exact int32 dot product. Codes go in as stored (nibbles with their
   bit planes, 0..63, or int8 codes), so C plus the block's start value (Q4_0, Q5_0, Q6: minus
   the codes' offset times sum(q)) is the integer sum the VNNI tile forms, and the float epilogue
   is the VNNI tile's, lane for lane: the same bits. Formats with a scale per 16 weights (F8H,
   Q6) take one TDPBSSD per half (A 16 bytes a row, B 4 rows). */
#if (defined(__AMX_INT8__) || defined(IQ_AMX_EMULATE)) && IQ_LEVEL >= 2
#define IQ_AMX 1
#define IQ_AMX_MIN_ROWS 4     /* fewer input rows keep the VNNI tile (not yet measured on an AMX CPU) */

/* the tile configuration LDTILECFG reads (palette 1) */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} iq_amx_config;

#ifdef IQ_AMX_EMULATE
/* The tile instructions in C, per thread as the hardware's tile state is. A use the hardware
   would refuse (#UD: no configuration, shapes that do not fit) counts a fault instead. */
static _Thread_local struct {
    iq_amx_config cfg;
    int8_t tile[8][16][64];
    int configured;
} iq_emu;
static int iq_emu_faults;
static void iq_emu_fault(void) { __atomic_add_fetch(&iq_emu_faults, 1, __ATOMIC_RELAXED); }

static void iq_emu_loadconfig(const iq_amx_config *cfg) {
    int ok = cfg->palette == 1;
    for (int n = 0; n < 8; n++) ok &= cfg->rows[n] <= 16 && cfg->colsb[n] <= 64;
    iq_emu.cfg = *cfg;
    memset(iq_emu.tile, 0, sizeof iq_emu.tile);
    iq_emu.configured = ok;
    if (!ok) iq_emu_fault();
}
static void iq_emu_release(void) { iq_emu.configured = 0; }
/* whether tile n may be used (counts a fault if not) */
static int iq_emu_usable(int n) {
    const int ok = iq_emu.configured && iq_emu.cfg.rows[n] > 0 && iq_emu.cfg.colsb[n] > 0;
    if (!ok) iq_emu_fault();
    return ok;
}
static void iq_emu_zero(int n) {
    if (iq_emu_usable(n)) memset(iq_emu.tile[n], 0, sizeof iq_emu.tile[n]);
}
static void iq_emu_load(int n, const void *base, long stride) {
    if (!iq_emu_usable(n)) return;
    memset(iq_emu.tile[n], 0, sizeof iq_emu.tile[n]);
    for (int r = 0; r < iq_emu.cfg.rows[n]; r++)
        memcpy(iq_emu.tile[n][r], (const char *)base + r * stride, iq_emu.cfg.colsb[n]);
}
static void iq_emu_store(int n, void *base, long stride) {
    if (!iq_emu_usable(n)) return;
    for (int r = 0; r < iq_emu.cfg.rows[n]; r++)
        memcpy((char *)base + r * stride, iq_emu.tile[n][r], iq_emu.cfg.colsb[n]);
}
/* C[m].dword[j] += sum over k < A's colsb / 4 and t < 4 of A[m][4k + t] * B[k][4j + t], signed bytes */
static void iq_emu_dpbssd(int c, int a, int b) {
    const iq_amx_config *g = &iq_emu.cfg;
    if (!iq_emu_usable(c) || !iq_emu_usable(a) || !iq_emu_usable(b)) return;
    if (g->rows[c] != g->rows[a] || g->colsb[a] != 4 * g->rows[b] || g->colsb[c] != g->colsb[b] ||
        g->colsb[c] % 4 || g->colsb[a] % 4) {
        iq_emu_fault();
        return;
    }
    for (int m = 0; m < g->rows[c]; m++)
        for (int j = 0; j < g->colsb[c] / 4; j++) {
            int32_t sum;
            memcpy(&sum, &iq_emu.tile[c][m][4 * j], 4);
            for (int k = 0; k < g->colsb[a] / 4; k++)
                for (int t = 0; t < 4; t++)
                    sum += (int32_t)iq_emu.tile[a][m][4 * k + t] * (int32_t)iq_emu.tile[b][k][4 * j + t];
            memcpy(&iq_emu.tile[c][m][4 * j], &sum, 4);
        }
}
#define IQ_AMX_LOADCONFIG(cfg) iq_emu_loadconfig(cfg)
#define IQ_AMX_RELEASE() iq_emu_release()
#define IQ_AMX_ZERO(n) iq_emu_zero(n)
#define IQ_AMX_LOAD(n, base, stride) iq_emu_load(n, base, stride)
#define IQ_AMX_STORE(n, base, stride) iq_emu_store(n, base, stride)
#define IQ_AMX_DPBSSD(c, a, b) iq_emu_dpbssd(c, a, b)

int int_amx_enable(void) { return 0; }
/* for the tests: a tile loaded with no configuration in force (the hardware raises #UD) */
int int_amx_probe_unconfigured(void) {
    _Alignas(64) int8_t row[64] = {0};
    iq_emu_release();
    iq_emu_load(0, row, 64);
    return 0;
}
/* tile uses the hardware would have refused since the library was loaded (tests: 0) */
int int_amx_emulation_faults(void) { return __atomic_load_n(&iq_emu_faults, __ATOMIC_RELAXED); }
#else
#include <sys/syscall.h>
#include <unistd.h>
#define IQ_AMX_LOADCONFIG(cfg) _tile_loadconfig(cfg)
#define IQ_AMX_RELEASE() _tile_release()
#define IQ_AMX_ZERO(n) _tile_zero(n)
#define IQ_AMX_LOAD(n, base, stride) _tile_loadd(n, base, stride)
#define IQ_AMX_STORE(n, base, stride) _tile_stored(n, base, stride)
#define IQ_AMX_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)

/* Linux hands a process the tile data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
   XFEATURE_XTILEDATA); a tile instruction before it faults. 0 once granted, -1 if refused. */
int int_amx_enable(void) { return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : -1; }
int int_amx_emulation_faults(void) { return 0; }
#endif

/* Tiles 0 and 3 hold sums C (R rows of 16 int32), 1 and 4 inputs A, 2 and 5 codes B: two sets,
   so one block's products can run while the other's sums are read out. */
static void iq_amx_configure(iq_amx_state *st, int R, int halves) {
    iq_amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int c = 0; c <= 3; c += 3) {
        cfg.rows[c] = (uint8_t)R, cfg.colsb[c] = 64;
        cfg.rows[c + 1] = (uint8_t)R, cfg.colsb[c + 1] = halves ? 16 : 32;
        cfg.rows[c + 2] = halves ? 4 : 8, cfg.colsb[c + 2] = 64;
    }
    IQ_AMX_LOADCONFIG(&cfg);
    st->rows = R, st->halves = halves;
}
static void iq_amx_release(iq_amx_state *st) {
    if (st->rows) IQ_AMX_RELEASE();
    st->rows = 0;
}

/* block b's codes as B reads them (8 rows of 64 bytes): the panel's own bytes for int8 codes,
   else the nibbles with their bit planes, decoded into buf */
static inline const uint8_t *iq_amx_codes(const uint8_t *codes, int fmt, uint8_t *buf) {
    if (iq_is_signed(fmt)) return codes;
    for (int j = 0; j < 4; j++) {
        __m512i lo, hi;
        iq_chunk_pair(codes, fmt, j, &lo, &hi);
        _mm512_store_si512(buf + 64 * j, lo);
        _mm512_store_si512(buf + 64 * (j + 4), hi);
    }
    return buf;
}

/* the start value the VNNI tile begins row i's sum with, less the int8 codes' offset it adds
   (their bytes go into TDPBSSD as they are): what C lacks of that sum */
static inline int32_t iq_amx_start(int fmt, int32_t start) { return iq_is_signed(fmt) ? 0 : start; }

/* the VNNI tile's float epilogue of a block with one scale, from its int32 sums C (row r's 16 at
   sums[r]) */
static inline __attribute__((always_inline)) void iq_amx_whole_epilogue(
        const int32_t (*sums)[16], int fmt, const iq_input *a, long i0, int R, __m512 dw, __m512 mw, __m512 *acc) {
    for (int r = 0; r < R; r++) {
        const long i = i0 + r;
        const __m512i s = _mm512_add_epi32(_mm512_load_si512(sums[r]),
                                           _mm512_set1_epi32(iq_amx_start(fmt, a->start[i])));
        __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(a->d[i])), _mm512_cvtepi32_ps(s), acc[r]);
        if (iq_has_min(fmt)) v = _mm512_fmadd_ps(mw, _mm512_set1_ps(a->ds[i]), v);
        acc[r] = v;
    }
}

/* R input rows x one panel of a format with one scale per block: blocks two at a time, one per
   tile set */
static inline __attribute__((always_inline)) void iq_amx_whole(const uint8_t *panel, int fmt, const iq_input *a,
                                                               long m0, int R, __m512 *acc) {
    const int rec = iq_record_bytes(fmt), nb = a->nb;
    const long first = iq_block_index(a, m0, 0);
    _Alignas(64) uint8_t codes[2][512];
    _Alignas(64) int32_t sums[2][16][16];
    for (int b = 0; b < nb; b += 2) {
        const int pair = b + 1 < nb;
        const uint8_t *p = panel + (long)b * rec;
        for (int off = 0; off < 2 * rec; off += 64) _mm_prefetch(iq_ahead(a, p, IQ_PREFETCH_BYTES + off), IQ_PREFETCH_HINT);
        const long i0 = iq_next_block(a, first, b), i1 = iq_next_block(a, first, b + 1);
        IQ_AMX_LOAD(1, a->q + i0 * IQ_K, IQ_K);
        IQ_AMX_LOAD(2, iq_amx_codes(p + iq_scale_bytes(fmt), fmt, codes[0]), 64);
        IQ_AMX_ZERO(0);
        IQ_AMX_DPBSSD(0, 1, 2);
        if (pair) {
            IQ_AMX_LOAD(4, a->q + i1 * IQ_K, IQ_K);
            IQ_AMX_LOAD(5, iq_amx_codes(p + rec + iq_scale_bytes(fmt), fmt, codes[1]), 64);
            IQ_AMX_ZERO(3);
            IQ_AMX_DPBSSD(3, 4, 5);
        }
        __m512 dw, mw;
        IQ_AMX_STORE(0, sums[0], 64);
        iq_block_scales16(panel, fmt, nb, b, &dw, &mw);
        iq_amx_whole_epilogue((const int32_t (*)[16])sums[0], fmt, a, i0, R, dw, mw, acc);
        if (pair) {
            IQ_AMX_STORE(3, sums[1], 64);
            iq_block_scales16(panel, fmt, nb, b + 1, &dw, &mw);
            iq_amx_whole_epilogue((const int32_t (*)[16])sums[1], fmt, a, i1, R, dw, mw, acc);
        }
    }
}

/* R input rows x one panel of a format with a scale per 16 weights (F8H, Q6): each block's
   halves in the two tile sets, summed and scaled apart as the VNNI tile does */
static inline __attribute__((always_inline)) void iq_amx_halves(const uint8_t *panel, int fmt, const iq_input *a,
                                                                long m0, int R, __m512 *acc) {
    const int rec = iq_record_bytes(fmt), nb = a->nb;
    const long first = iq_block_index(a, m0, 0);
    _Alignas(64) uint8_t codes[512];
    _Alignas(64) int32_t sums[2][16][16];
    for (int b = 0; b < nb; b++) {
        const uint8_t *p = panel + (long)b * rec;
        for (int off = 0; off < rec; off += 64) _mm_prefetch(iq_ahead(a, p, IQ_PREFETCH_BYTES + off), IQ_PREFETCH_HINT);
        const long i0 = iq_next_block(a, first, b);
        const uint8_t *b_rows = iq_amx_codes(p + iq_scale_bytes(fmt), fmt, codes);
        IQ_AMX_LOAD(1, a->q + i0 * IQ_K, IQ_K);                 /* weights 0..15 */
        IQ_AMX_LOAD(2, b_rows, 64);
        IQ_AMX_ZERO(0);
        IQ_AMX_DPBSSD(0, 1, 2);
        IQ_AMX_LOAD(4, a->q + i0 * IQ_K + 16, IQ_K);            /* weights 16..31 */
        IQ_AMX_LOAD(5, b_rows + 256, 64);
        IQ_AMX_ZERO(3);
        IQ_AMX_DPBSSD(3, 4, 5);
        __m512 dw, mw;
        iq_block_scales16(panel, fmt, nb, b, &dw, &mw);
        IQ_AMX_STORE(0, sums[0], 64);
        IQ_AMX_STORE(3, sums[1], 64);
        for (int r = 0; r < R; r++) {
            const long i = i0 + r;
            const int32_t start_lo = iq_amx_start(fmt, a->start_lo[i]), start = iq_amx_start(fmt, a->start[i]);
            const __m512i s = _mm512_add_epi32(_mm512_load_si512(sums[0][r]), _mm512_set1_epi32(start_lo));
            const __m512i t = _mm512_add_epi32(_mm512_load_si512(sums[1][r]), _mm512_set1_epi32(start - start_lo));
            const __m512 dx = _mm512_set1_ps(a->d[i]);
            __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(s), acc[r]);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(mw, dx), _mm512_cvtepi32_ps(t), v);
        }
    }
}

/* R input rows (from m0, R >= IQ_AMX_MIN_ROWS) x one panel by AMX tiles: out[r][i] as iq_tile's,
   the same bits. st: this thread's tile configuration (set here when R or the kind of format
   changes; released by the caller) */
static inline __attribute__((always_inline)) void iq_amx_panel(const uint8_t *panel, int fmt, const iq_input *a,
                                                               long m0, int R, __m512 *acc) {
    if (iq_has_halves(fmt)) iq_amx_halves(panel, fmt, a, m0, R, acc);
    else iq_amx_whole(panel, fmt, a, m0, R, acc);
}
static void iq_tile_amx(const uint8_t *panel, int fmt, const iq_input *a, long m0, int R, float out[][IQ_ROWS],
                        iq_amx_state *st) {
    const int halves = iq_has_halves(fmt);
    if (st->rows != R || st->halves != halves) iq_amx_configure(st, R, halves);
    __m512 acc[16];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    switch (fmt) {            /* the format a constant in each copy */
#define IQ_AMX_CASE(FMT) case FMT: iq_amx_panel(panel, FMT, a, m0, R, acc); break;
    IQ_AMX_CASE(IQ_Q4_0) IQ_AMX_CASE(IQ_Q4_1) IQ_AMX_CASE(IQ_Q8_0) IQ_AMX_CASE(IQ_F4) IQ_AMX_CASE(IQ_F8)
    IQ_AMX_CASE(IQ_F8H) IQ_AMX_CASE(IQ_Q5_0) IQ_AMX_CASE(IQ_Q5_1) IQ_AMX_CASE(IQ_Q6) IQ_AMX_CASE(IQ_K4)
#undef IQ_AMX_CASE
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(out[r], acc[r]);
}
#else
#define IQ_AMX 0
static void iq_amx_release(iq_amx_state *st) { (void)st; }
static void iq_tile_amx(const uint8_t *panel, int fmt, const iq_input *a, long m0, int R, float out[][IQ_ROWS],
                        iq_amx_state *st) {
    (void)panel, (void)fmt, (void)a, (void)m0, (void)R, (void)out, (void)st;
}
#define IQ_AMX_MIN_ROWS 17
int int_amx_enable(void) { return -1; }
int int_amx_emulation_faults(void) { return 0; }
#endif
