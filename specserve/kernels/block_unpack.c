/* GGUF blocks of Q4_0, Q4_1 and Q8_0 as codes, scales and mins per block of 32 weights: what
   loading/gguf_blocks.py's readers give, in one pass over the file's bytes (their numpy passes
   over the blocks were ~40% of loading a 7B GGUF). Built by build.py (cpu_kernels.c), called
   from block_unpack.py. */
#include "common.h"

enum { GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8 };    /* GGML's type numbers */

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* raw: num_blocks blocks of gguf_type, back to back. codes [num_blocks, 32]: Q4_0 and Q4_1 the
   low nibbles of the block's 16 code bytes, then the high ones (0..15); Q8_0 its int8 codes.
   scales, mins [num_blocks] float32: the block's float16 d; min -8 d (Q4_0, an exact product),
   m (Q4_1) or 0 (Q8_0). Returns -1 for another type. */
int gguf_unpack_blocks(const uint8_t *raw, long num_blocks, int gguf_type, uint8_t *codes, float *scales,
                       float *mins) {
    const int block_bytes = gguf_type == GGML_Q4_0 ? 18 : gguf_type == GGML_Q4_1 ? 20 : gguf_type == GGML_Q8_0 ? 34 : 0;
    if (!block_bytes) return -1;
    const int code_start = gguf_type == GGML_Q4_1 ? 4 : 2;
    #pragma omp parallel for schedule(static)
    for (long b = 0; b < num_blocks; b++) {
        const uint8_t *blk = raw + b * block_bytes, *c = blk + code_start;
        uint8_t *out = codes + b * 32;
        const float d = half_at(blk);
        scales[b] = d;
        if (gguf_type == GGML_Q8_0) {
            memcpy(out, c, 32);
            mins[b] = 0.0f;
            continue;
        }
        for (int i = 0; i < 16; i++) out[i] = c[i] & 15, out[16 + i] = c[i] >> 4;
        mins[b] = gguf_type == GGML_Q4_0 ? -8.0f * d : half_at(blk + 2);
    }
    return 0;
}
