"""The skinny linear kernel (``skinny_linear.c``, in the library ``build.py`` builds).

``skinny_linear(x, weight, bias)`` computes ``F.linear`` for float32 or bfloat16 CPU tensors
with few rows: the weights stream from memory once per call for every row, and each row's
result is bit-for-bit independent of the other rows (see the C file).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from specserve.kernels import build
from specserve.kernels.build import DTYPE_CODES


def is_available() -> bool:
    return _function() is not None


def can_run(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear(x, weight)`` applies (the caller checks grad mode)."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in DTYPE_CODES
            and weight.shape[1] % 8 == 0 and is_available())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape [..., K] and a contiguous ``weight``
    [N, K] of x's dtype; ``bias32`` is the bias in float32 (or None)."""
    x = x.contiguous()
    num_out, num_in = weight.shape
    num_rows = x.numel() // num_in
    out = torch.empty(*x.shape[:-1], num_out, dtype=x.dtype)
    if num_rows == 0:
        return out
    status = _function()(
        x.data_ptr(), weight.data_ptr(), None if bias32 is None else bias32.data_ptr(), out.data_ptr(),
        num_rows, num_out, num_in, DTYPE_CODES[x.dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"skinny_linear rejected shapes x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    return out


@functools.cache
def _function():
    return build.function("skinny_linear", [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5)
