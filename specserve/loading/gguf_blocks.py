"""GGUF quantized blocks as ``BlockCodes`` (codes, scales, mins): the same float32 values as
``gguf.quants.dequantize``, bit for bit, so the CPU kernels can stream the codes instead of dense
weights (``kernels/coded.py``, ``kernels/int_codes.py``).

Each reader takes a tensor's raw blocks (uint8 [num_blocks, block bytes]) and returns, per weight
in row order, an integer code and, per 32 weights (Q6_K: 16), the scale and min with
``value = code * scale + min`` evaluated as GGUF's dequantization evaluates it:

- Q4_0: d (c - 8)               -> code c (4 bits), scale d, min -8 d (an exact product)
- Q4_1, Q5_1: d c + m           -> code c, scale d, min m
- Q5_0: d (c - 16)              -> code c - 16 (8 bits), scale d, min 0
- Q8_0: d c                     -> code c (8 bits), scale d, min 0
- Q4_K, Q5_K: (d sc) c - dmin m -> code c, scale d sc (exact in float32), min -(dmin m)
- Q6_K: (d sc) (c - 32)         -> code c - 32 (8 bits), scale d sc per 16 weights, min 0

The K-quants' sub-block scales are 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) integers times a float16
super-block scale: float32 values, not float16 ones, which the kernels' F formats hold.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K

QK_K = 256       # weights per K-quant super-block

Codes = tuple[np.ndarray, np.ndarray, np.ndarray, int]     # codes, scales, mins [blocks, ...], bits


def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, as float32 [blocks, 1]."""
    return blocks[:, start:start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(packed: np.ndarray) -> np.ndarray:
    """[blocks, groups, 32 or 16] bytes -> [blocks, groups, 2 * that]: low nibbles, then high ones
    (written in place: no temporaries to concatenate, a 7B model's 6.5G codes pass through here)."""
    width = packed.shape[-1]
    out = np.empty((*packed.shape[:-1], 2 * width), np.uint8)
    np.bitwise_and(packed, 15, out=out[..., :width])
    np.right_shift(packed, 4, out=out[..., width:])
    return out


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """[blocks, 4] bytes of a little-endian uint32 -> its low ``count`` bits [blocks, count] (0 or 1)."""
    word = packed.copy().view(np.uint32)
    return ((word >> np.arange(count, dtype=np.uint32)) & 1).astype(np.uint8)


def q4_0(blocks: np.ndarray) -> Codes:
    d = _half(blocks, 0)
    return _nibbles(blocks[:, 2:18]), d, -8 * d, 4


def q4_1(blocks: np.ndarray) -> Codes:
    return _nibbles(blocks[:, 4:20]), _half(blocks, 0), _half(blocks, 2), 4


def q5_0(blocks: np.ndarray) -> Codes:
    d = _half(blocks, 0)
    codes = _nibbles(blocks[:, 6:22]) | (_bits(blocks[:, 2:6], 32) << 4)
    return codes.astype(np.int8) - np.int8(16), d, np.zeros_like(d), 8


def q5_1(blocks: np.ndarray) -> Codes:
    codes = _nibbles(blocks[:, 8:24]) | (_bits(blocks[:, 4:8], 32) << 4)
    return codes.astype(np.int8), _half(blocks, 0), _half(blocks, 2), 8


def q8_0(blocks: np.ndarray) -> Codes:
    d = _half(blocks, 0)
    return blocks[:, 2:34].copy().view(np.int8), d, np.zeros_like(d), 8


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: the 8 sub-blocks' scales d * sc and mins -(dmin * m), float32 [blocks, 8]."""
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return _half(blocks, 0) * sc.astype(np.float32), -(_half(blocks, 2) * m.astype(np.float32))


def q4_k(blocks: np.ndarray) -> Codes:
    """Super-block: d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of codes: 32 bytes per
    pair of sub-blocks (low nibbles the first, high nibbles the second)."""
    scales, mins = _k_scales(blocks)
    codes = _nibbles(blocks[:, 16:144].reshape(-1, 4, 32))
    return codes.reshape(len(blocks), QK_K), scales, mins, 4


def q5_k(blocks: np.ndarray) -> Codes:
    """Q4_K's layout with 32 bytes of high bits (bit j of byte i: weight i of sub-block j) before
    the codes."""
    scales, mins = _k_scales(blocks)
    low = _nibbles(blocks[:, 48:176].reshape(-1, 4, 32)).reshape(-1, 8, 32)
    high = (blocks[:, 16:48, None] >> np.arange(8, dtype=np.uint8)) & 1          # [blocks, 32, 8]
    codes = low | (high.transpose(0, 2, 1) << 4)
    return codes.reshape(len(blocks), QK_K).astype(np.int8), scales, mins, 8


def q6_k(blocks: np.ndarray) -> Codes:
    """Per half super-block (128 weights): 64 bytes of low 4 bits (low nibbles: weights 0..63,
    high nibbles: 64..127) and 32 bytes of high 2 bits (bits 2s, 2s + 1 of byte i: weight
    32s + i); then 16 int8 scales and d."""
    n = len(blocks)
    low = (blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    codes = low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32) * _half(blocks, 208)
    return codes.reshape(n, QK_K).astype(np.int8) - np.int8(32), scales, np.zeros_like(scales), 8


READERS = {Q.Q4_0: q4_0, Q.Q4_1: q4_1, Q.Q5_0: q5_0, Q.Q5_1: q5_1, Q.Q8_0: q8_0,
           Q.Q4_K: q4_k, Q.Q5_K: q5_k, Q.Q6_K: q6_k}
BITS = {Q.Q4_0: 4, Q.Q4_1: 4, Q.Q4_K: 4, Q.Q5_0: 8, Q.Q5_1: 8, Q.Q5_K: 8, Q.Q8_0: 8, Q.Q6_K: 8}
