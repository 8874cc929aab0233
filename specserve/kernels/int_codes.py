"""GGUF weight blocks repacked for the integer kernel (``int_linear.c``): the ``gguf`` path.

``panels(codes)`` turns a matrix's ``BlockCodes`` into the kernel's panels of 16 weight rows (the
layout is described in ``int_linear.c``); ``int_format(codes)`` tells which kernel format holds
the blocks exactly, read off their values. Where scales and mins are float16 values, as GGUF
stores them: Q4_0 (mins -8 x scale), Q4_1, Q5_0 (codes -16..15, no min), Q5_1 (codes 0..31) and
Q8_0 (other 8-bit codes, no min); K4 where 4-bit codes' scales and mins factor exactly into a
float16 per 256 weights times a 6-bit integer per 32, as Q4_K stores them. Otherwise the
float32-scaled formats: F4 (4-bit codes),
F8 (8-bit codes: Q5_K) and, with a scale per 16 weights and no min, Q6 (codes -32..31: Q6_K,
as 6 bits) or F8H (other 8-bit codes).
``int_linear(x, panels, fmt, shape)`` runs the kernel.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np
import torch

from specserve.kernels import build
from specserve.kernels.build import DTYPE_CODES
from specserve.kernels.coded import CODE_BLOCK, BlockCodes

PANEL_ROWS = 16
INT_Q4_0, INT_Q4_1, INT_Q8_0 = 1, 2, 3        # int_linear.c's IQ_Q4_0, IQ_Q4_1, IQ_Q8_0
INT_F4, INT_F8, INT_F8H = 4, 5, 6             # its IQ_F4, IQ_F8, IQ_F8H: float32 scales
INT_Q5_0, INT_Q5_1 = 7, 8                     # its IQ_Q5_0, IQ_Q5_1: nibbles and a plane of fifth bits
INT_Q6 = 9                                    # its IQ_Q6: F8H's scales, nibbles and two bit planes
INT_K4 = 10                                   # its IQ_K4: Q4_K's 6-bit scales, float16 per super-block
K_SUPER = 8                                   # blocks of 32 per K-quant super-block (256 weights)
FORMAT_NAMES = {INT_Q4_0: "Q4_0", INT_Q4_1: "Q4_1", INT_Q8_0: "Q8_0", INT_F4: "F4", INT_F8: "F8", INT_F8H: "F8H",
                INT_Q5_0: "Q5_0", INT_Q5_1: "Q5_1", INT_Q6: "Q6", INT_K4: "K4"}
FLOAT32_SCALED = (INT_F4, INT_F8, INT_F8H, INT_Q6)
HALF_SCALED = (INT_F8H, INT_Q6)               # a scale per 16 weights
WITH_MINS = (INT_Q4_1, INT_Q5_1, INT_F4, INT_F8, INT_K4)
BIT_PLANES = {INT_Q5_0: 1, INT_Q5_1: 1, INT_Q6: 2}           # code bits above the nibble, as planes
CODE_OFFSET = {INT_Q5_0: 16, INT_Q6: 32}                     # stored code = c + offset (unsigned)
NIBBLE_CODED = (INT_Q4_0, INT_Q4_1, INT_F4, INT_K4) + tuple(BIT_PLANES)
HEADER_BYTES = {INT_Q4_0: 32, INT_Q4_1: 64, INT_Q8_0: 32, INT_F4: 128, INT_F8: 128, INT_F8H: 128, INT_Q5_0: 32,
                INT_Q5_1: 64, INT_Q6: 128, INT_K4: 32}


def record_bytes(fmt: int) -> int:
    """Bytes of one block of a panel (16 rows x 32 weights): scales, mins, codes."""
    return HEADER_BYTES[fmt] + (256 if fmt in NIBBLE_CODED else 512) + 64 * BIT_PLANES.get(fmt, 0)


def int_format(codes: BlockCodes) -> int | None:
    """The kernel format that holds these blocks exactly (None: 16-weight sub-blocks with mins)."""
    scales, mins = codes.scales, codes.mins
    if codes.sub_block != CODE_BLOCK:
        if mins.any():
            return None
        return INT_Q6 if -32 <= int(codes.codes.min()) and int(codes.codes.max()) <= 31 else INT_F8H
    if codes.bits == 8:
        return _eight_bit_format(codes)
    if _is_float16(scales) and torch.equal(mins, -8 * scales):
        return INT_Q4_0
    if _is_float16(scales) and _is_float16(mins):
        return INT_Q4_1
    return INT_K4 if k_quant_factors(codes) is not None else INT_F4


def k_quant_factors(codes: BlockCodes) -> tuple[np.ndarray, ...] | None:
    """(d, sc, dmin, m) with scales = d * sc and mins = -(dmin * m) exactly: d, dmin float16 per
    super-block of 256 weights [N, K / 256], sc, m integers 0..63 per block [N, K / 32]; None if
    the blocks do not factor so (not Q4_K's, or K not a multiple of 256)."""
    num_rows, num_in = codes.shape
    if codes.bits != 4 or num_in % (K_SUPER * CODE_BLOCK):
        return None
    d, sc = _factor(codes.scales.numpy())
    dmin, m = _factor(-codes.mins.numpy())
    if d is None or dmin is None:
        return None
    return d, sc, dmin, m


def _factor(values: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
    """values [N, blocks] >= 0 as float16 [N, blocks / 8] times integers 0..63, exactly: the
    super-block's largest value is tried as d * 63, then * 62 ... (the quantizer gives the
    largest sub-block scale 63 in practice; any exact factoring will do)."""
    if (values < 0).any():
        return None, None
    blocks = values.reshape(values.shape[0], -1, K_SUPER).astype(np.float32)
    top = blocks.max(-1)
    d = np.zeros_like(top, dtype=np.float16)
    ints = np.zeros(blocks.shape, np.uint8)
    solved = top == 0
    for q in range(63, 0, -1):
        if solved.all():
            break
        cand = (top / np.float32(q)).astype(np.float16)
        cand32 = cand.astype(np.float32)[..., None]
        with np.errstate(divide="ignore", invalid="ignore"):
            k = np.rint(blocks / cand32)
        ok = (~solved) & (cand32[..., 0] > 0) & np.all((k >= 0) & (k <= 63) & (cand32 * k == blocks), axis=-1)
        d[ok], ints[ok] = cand[ok], k[ok].astype(np.uint8)
        solved |= ok
    if not solved.all():
        return None, None
    return d, ints.reshape(values.shape)


def _eight_bit_format(codes: BlockCodes) -> int:
    """8-bit codes: Q5_0 or Q5_1 where they fit 5 bits (fewer bytes to stream), else Q8_0 or F8."""
    low, high = int(codes.codes.min()), int(codes.codes.max())
    if not _is_float16(codes.scales):
        return INT_F8
    if not codes.mins.any():
        return INT_Q5_0 if -16 <= low and high <= 15 else INT_Q8_0
    return INT_Q5_1 if 0 <= low and high <= 31 and _is_float16(codes.mins) else INT_F8


def panels(codes: BlockCodes, fmt: int, in_numpy: bool = False,
           allocate: Callable[[tuple[int, int]], torch.Tensor | None] | None = None) -> torch.Tensor:
    """uint8 [ceil(N / 16), K / 32 * record_bytes(fmt) (+ K4's super-block tail)]: the weights as
    the kernel reads them (rows past N are zero). The code bytes are packed by the loaded kernels'
    ``int_pack_codes`` where there are kernels, else (or ``in_numpy``) by numpy. ``allocate(shape)``:
    where to write them (e.g. a huge-page arena's memory), or None for a tensor of their own."""
    num_rows, num_in = codes.shape
    num_blocks, num_panels = num_in // CODE_BLOCK, -(-num_rows // PANEL_ROWS)
    pad = num_panels * PANEL_ROWS - num_rows

    def by_panel(a: np.ndarray) -> np.ndarray:        # [N, ...] -> [P, 16, ...], zero rows appended
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        return a.reshape(num_panels, PANEL_ROWS, *a.shape[1:])

    factors = k_quant_factors(codes) if fmt == INT_K4 else None
    pack = None if in_numpy else _pack_function()
    parts = _header(codes, fmt, by_panel, factors) + ([] if pack else _code_chunks(codes, fmt, by_panel))
    body_bytes = num_blocks * record_bytes(fmt)
    shape = (num_panels, body_bytes + (num_blocks // 8 * 64 if factors is not None else 0))
    out = allocate(shape) if allocate is not None else None
    out = torch.empty(shape, dtype=torch.uint8) if out is None else out
    records = out.numpy()
    body, at = records[:, :body_bytes].reshape(num_panels, num_blocks, -1), 0
    for part in parts:                                # headers (and numpy's code bytes) into place
        part = np.ascontiguousarray(part).view(np.uint8).reshape(num_panels, num_blocks, -1)
        body[:, :, at:at + part.shape[-1]] = part
        at += part.shape[-1]
    if factors is not None:                           # the super-blocks' float16 d[16], dmin[16] after the records
        d, _, dmin, _ = factors
        tail = np.concatenate([by_panel(d).transpose(0, 2, 1), by_panel(dmin).transpose(0, 2, 1)], axis=-1)
        records[:, body_bytes:] = np.ascontiguousarray(tail).view(np.uint8).reshape(num_panels, -1)
    if pack:                                          # the code bytes in C, after the headers
        source = codes.codes.contiguous() if codes.codes.element_size() == 1 else codes.codes.to(torch.int8)
        if pack(source.data_ptr(), num_rows, num_in, fmt, CODE_OFFSET.get(fmt, 0), out.data_ptr(), shape[1]) != 0:
            raise RuntimeError(f"int_pack_codes rejected codes {tuple(codes.shape)} as format {fmt}")
    return out


def _pack_function():
    """The loaded kernels' int_pack_codes, or None without them."""
    return build.function("int_pack_codes", [ctypes.c_void_p, ctypes.c_long, ctypes.c_long, ctypes.c_int,
                                             ctypes.c_int, ctypes.c_void_p, ctypes.c_long])


def _header(codes: BlockCodes, fmt: int, by_panel, factors: tuple[np.ndarray, ...] | None) -> list[np.ndarray]:
    """A record's scales (F8H, Q6: those of the first halves, then of the second), then its
    mins: [P, blocks, 16] each, float16 or float32; K4: the 6-bit ``factors`` as bytes."""
    dtype = np.float32 if fmt in FLOAT32_SCALED else np.float16
    as_header = lambda a: by_panel(a).transpose(0, 2, 1).astype(dtype)    # noqa: E731
    if factors is not None:                           # the blocks' 6-bit scales and mins, a byte each
        _, sc, _, m = factors
        return [by_panel(sc).transpose(0, 2, 1), by_panel(m).transpose(0, 2, 1)]
    scales = codes.scales.numpy()
    parts = [as_header(scales[:, 0::2]), as_header(scales[:, 1::2])] if fmt in HALF_SCALED else [as_header(scales)]
    if fmt in WITH_MINS:
        parts.append(as_header(codes.mins.numpy()))
    return parts


def _code_chunks(codes: BlockCodes, fmt: int, by_panel) -> list[np.ndarray]:
    """A record's code chunks (4-bit: chunk j low nibble, chunk j + 4 high), then for the 5- and
    6-bit formats each plane of higher bits: chunk j's, bit 4i + t = row i's weight 4j + t."""
    num_rows, num_in = codes.shape
    stored = codes.codes.numpy().astype(np.int16) + CODE_OFFSET.get(fmt, 0)     # Q5_0: 0..31, Q6: 0..63
    raw = by_panel(stored.astype(np.int8).view(np.uint8).reshape(num_rows, num_in // CODE_BLOCK, 8, 4))
    chunks = raw.transpose(0, 2, 3, 1, 4)             # [P, blocks, 8 chunks, 16 rows, 4]
    planes = [np.packbits(((chunks >> (4 + k)) & 1).reshape(*chunks.shape[:3], 64), axis=-1, bitorder="little")
              for k in range(BIT_PLANES.get(fmt, 0))]
    if fmt in NIBBLE_CODED:
        chunks = chunks & 15
        chunks = chunks[:, :, :4] | (chunks[:, :, 4:] << 4)
    return [chunks.reshape(*chunks.shape[:2], -1)] + planes


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

