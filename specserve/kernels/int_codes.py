"""GGUF weight blocks repacked for the integer kernel (``int_linear.c``): the ``gguf`` path.

``panels(codes)`` turns a Q4_0 / Q4_1 / Q8_0 matrix's ``BlockCodes`` into the kernel's panels of
16 weight rows (the layout is described in ``int_linear.c``); ``int_format(codes)`` tells which
GGUF type the blocks are (read off their values: Q4_0's mins are -8 x scale, Q8_0's codes are
signed with no min) or None where the kernel cannot hold them exactly (scales or mins that are
not float16 values). ``int_linear(x, panels, fmt, shape)`` runs the kernel.
"""
from __future__ import annotations

import ctypes

import numpy as np
import torch

from specserve.kernels import build
from specserve.kernels.build import DTYPE_CODES
from specserve.kernels.coded import CODE_BLOCK, BlockCodes

PANEL_ROWS = 16
INT_Q4_0, INT_Q4_1, INT_Q8_0 = 1, 2, 3        # int_linear.c's IQ_Q4_0, IQ_Q4_1, IQ_Q8_0
FORMAT_NAMES = {INT_Q4_0: "Q4_0", INT_Q4_1: "Q4_1", INT_Q8_0: "Q8_0"}


def record_bytes(fmt: int) -> int:
    """Bytes of one block of a panel (16 rows x 32 weights): scales, mins, codes."""
    return (64 if fmt == INT_Q4_1 else 32) + (512 if fmt == INT_Q8_0 else 256)


def int_format(codes: BlockCodes) -> int | None:
    """The GGUF type of these blocks as the kernel holds them, or None."""
    scales, mins = codes.scales, codes.mins
    if not _is_float16(scales):
        return None
    if codes.bits == 8:
        return INT_Q8_0 if not mins.any() else None
    if torch.equal(mins, -8 * scales):
        return INT_Q4_0
    return INT_Q4_1 if _is_float16(mins) else None


def panels(codes: BlockCodes, fmt: int) -> torch.Tensor:
    """uint8 [ceil(N / 16), K / 32 * record_bytes(fmt)]: the weights as the kernel reads them
    (rows past N are zero)."""
    num_rows, num_in = codes.shape
    num_blocks, num_panels = num_in // CODE_BLOCK, -(-num_rows // PANEL_ROWS)
    pad = num_panels * PANEL_ROWS - num_rows

    def by_panel(a: np.ndarray) -> np.ndarray:        # [N, ...] -> [P, 16, ...], zero rows appended
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        return a.reshape(num_panels, PANEL_ROWS, *a.shape[1:])

    # codes [P, 16 rows, blocks, 8 chunks, 4] -> [P, blocks, 8 chunks, 16 rows, 4]
    raw = by_panel(codes.codes.numpy().view(np.uint8).reshape(num_rows, num_blocks, 8, 4))
    chunks = raw.transpose(0, 2, 3, 1, 4)
    if fmt != INT_Q8_0:                               # chunk j low nibble, chunk j + 4 high
        chunks = chunks[:, :, :4] | (chunks[:, :, 4:] << 4)
    parts = [by_panel(codes.scales.numpy()).transpose(0, 2, 1).astype(np.float16)]
    if fmt == INT_Q4_1:
        parts.append(by_panel(codes.mins.numpy()).transpose(0, 2, 1).astype(np.float16))
    header = [np.ascontiguousarray(p).view(np.uint8).reshape(num_panels, num_blocks, -1) for p in parts]
    records = np.concatenate([*header, chunks.reshape(num_panels, num_blocks, -1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(records.reshape(num_panels, -1)))


def _is_float16(values: torch.Tensor) -> bool:
    return torch.equal(values.to(torch.float16).float(), values)


def is_available() -> bool:
    return build.load() is not None


def int_linear(x: torch.Tensor, weight_panels: torch.Tensor, fmt: int, shape: tuple[int, int],
               bias32: torch.Tensor | None = None, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for W [N, K] = ``shape`` held as ``panels``, in x's dtype (float32 or
    bfloat16); ``library``: a particular variant (``build.load_variant``), default the loaded one."""
    from specserve.kernels.skinny import LinearWeights, linear_forward

    weights = LinearWeights(0, None, 0, 0, weight_panels.data_ptr(), fmt, 0)
    return linear_forward(x, weights, shape, bias32, library)


def quantize_rows(x: torch.Tensor, fmt: int, library: ctypes.CDLL | None = None):
    """The kernel's quantization of x [M, K]: (q int8 [M, K], d, d * sum(q), int32 start) [M, K / 32]."""
    x = x.contiguous()
    num_rows, num_in = x.shape
    q = torch.empty(num_rows, num_in, dtype=torch.int8)
    d, ds = (torch.empty(num_rows, num_in // CODE_BLOCK) for _ in range(2))
    start = torch.empty(num_rows, num_in // CODE_BLOCK, dtype=torch.int32)
    fn = _quantize_function(library or build.load())
    if fn(x.data_ptr(), num_rows, num_in, DTYPE_CODES[x.dtype], fmt, q.data_ptr(), d.data_ptr(), ds.data_ptr(),
          start.data_ptr()) != 0:
        raise RuntimeError(f"int_quantize_rows rejected x {tuple(x.shape)}")
    return q, d, ds, start


def _quantize_function(library: ctypes.CDLL):
    return build.function_of(library, "int_quantize_rows", [ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                            ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 4)

