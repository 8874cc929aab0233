"""GGUF blocks of Q4_0, Q4_1 and Q8_0 unpacked by the kernels (``block_unpack.c``): the codes,
scales and mins ``loading/gguf_blocks.py``'s readers give, in one pass instead of numpy's
strided ones (the largest part of loading a 7B GGUF). None where the kernels are not built or
the type is another one: the numpy readers then do it."""
from __future__ import annotations

import ctypes

import numpy as np
from gguf import GGMLQuantizationType as Q

from specserve.kernels import build

FAST_TYPES = {Q.Q4_0: np.uint8, Q.Q4_1: np.uint8, Q.Q8_0: np.int8}     # and the dtype of their codes


def unpack(blocks: np.ndarray, tensor_type) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """blocks: uint8 [num_blocks, block bytes] of ``tensor_type`` -> codes [num_blocks, 32],
    scales and mins float32 [num_blocks, 1]; None where the kernels cannot."""
    fn = build.function("gguf_unpack_blocks", [ctypes.c_void_p, ctypes.c_long, ctypes.c_int] + [ctypes.c_void_p] * 3)
    if fn is None or tensor_type not in FAST_TYPES:
        return None
    blocks = np.ascontiguousarray(blocks)
    num_blocks = blocks.shape[0]
    codes = np.empty((num_blocks, 32), FAST_TYPES[tensor_type])
    scales, mins = np.empty((num_blocks, 1), np.float32), np.empty((num_blocks, 1), np.float32)
    if fn(blocks.ctypes.data, num_blocks, int(tensor_type), codes.ctypes.data, scales.ctypes.data,
          mins.ctypes.data) != 0:
        return None
    return codes, scales, mins
