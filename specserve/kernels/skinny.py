"""The skinny linear kernel (``skinny_linear.c``, in the library ``build.py`` builds).

``skinny_linear(x, weight, bias)`` computes ``F.linear`` for float32 or bfloat16 CPU tensors
with few rows: the weights stream from memory once per call for every row, and each row's
result is bit-for-bit independent of the other rows (see the C file). ``linear_forward``
takes a ``LinearWeights``: the dense weight and, optionally, the same weights as code
blocks (``coded.py``), which it streams instead for inputs of up to ``coded_max_rows`` rows.
"""
from __future__ import annotations

import ctypes

import torch

from specserve.kernels import build
from specserve.kernels.build import DTYPE_CODES


class LinearWeights(ctypes.Structure):
    """skinny_linear.c's ``linear_weights``; the tensors it points into must outlive it."""

    _fields_ = [("dense", ctypes.c_void_p), ("coded", ctypes.c_void_p),
                ("coded_format", ctypes.c_int32), ("coded_max_rows", ctypes.c_int32),
                ("int_panels", ctypes.c_void_p), ("int_format", ctypes.c_int32), ("reserved", ctypes.c_int32)]


def linear_weights(dense: torch.Tensor, records: torch.Tensor | None = None, coded_format: int = 0,
                   coded_max_rows: int = 0, int_panels: torch.Tensor | None = None,
                   int_format: int = 0) -> LinearWeights:
    """``dense`` [N, K] contiguous; ``records``: the code blocks (``BlockCodes.records``);
    ``int_panels``: the GGUF blocks for the integer kernel (``int_codes.panels``), which then
    computes every input."""
    coded = None if records is None else records.data_ptr()
    max_rows = min(coded_max_rows, 2**31 - 1) if coded else 0           # ALL_ROWS fits no int32
    panels = None if int_panels is None else int_panels.data_ptr()
    return LinearWeights(dense.data_ptr(), coded, coded_format if coded else 0, max_rows, panels,
                         int_format if panels else 0, 0)


def is_available() -> bool:
    return _function() is not None


def kernel_variant() -> str:
    """The ISA variant of the CPU kernels in use ("avx512_bf16", "avx512_vnni", "avx2"), or "none"."""
    return build.variant_name()


def can_run(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``skinny_linear(x, weight)`` applies (the caller checks grad mode)."""
    return (x.device.type == "cpu" and x.dtype == weight.dtype and x.dtype in DTYPE_CODES
            and weight.shape[1] % 8 == 0 and is_available())


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias32: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of shape [..., K] and a contiguous ``weight``
    [N, K] of x's dtype; ``bias32`` is the bias in float32 (or None)."""
    return linear_forward(x, linear_weights(weight), weight.shape, bias32)


def linear_forward(x: torch.Tensor, weights: LinearWeights, shape: tuple[int, int],
                   bias32: torch.Tensor | None = None, library: ctypes.CDLL | None = None) -> torch.Tensor:
    """``F.linear`` over the weights ``weights`` describes, of ``shape`` [N, K], in x's dtype;
    ``library``: a particular kernel variant (``build.load_variant``), default the loaded one."""
    x = x.contiguous()
    num_out, num_in = shape
    num_rows = x.numel() // num_in
    out = torch.empty(*x.shape[:-1], num_out, dtype=x.dtype)
    if num_rows == 0:
        return out
    fn = _function() if library is None else build.function_of(library, "linear_forward", _ARGTYPES)
    status = fn(
        ctypes.byref(weights), x.data_ptr(), None if bias32 is None else bias32.data_ptr(), out.data_ptr(),
        num_rows, num_out, num_in, DTYPE_CODES[x.dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"skinny linear rejected x {tuple(x.shape)} for weights of shape {tuple(shape)}")
    return out


_ARGTYPES = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 5


@build.cached_lookup
def _function():
    return build.function("linear_forward", _ARGTYPES)
