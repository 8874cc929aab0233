"""Weights as code blocks: every 32 consecutive weights of a row are ``scale * code + min``.

This is how GGUF's Q4_0 / Q4_1 / Q8_0 tensors define their values, so a model loaded from
such a file can keep its linear weights in this form (~6 bits a weight instead of 16 or
32) and have the skinny kernel (``coded_linear.c``) rebuild each float32 value exactly,
then round it to bfloat16 as torch does: the same bits as the dense weight, fewer bytes to
stream per decode step. ``BlockCodes`` holds the codes as loaded; ``records`` lays them
out for the kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

CODE_BLOCK = 32
SUB_BLOCK_16 = 16         # Q6_K's weights per scale
CODED_AFFINE4, CODED_AFFINE8, CODED_TABLE4 = 1, 2, 3       # coded_linear.c's formats
RECORD_BYTES = {CODED_AFFINE4: 24, CODED_AFFINE8: 40, CODED_TABLE4: 48}   # its coded_record_bytes


def kernel_format_for(bits: int, dtype: torch.dtype) -> int:
    """The ``coded_linear.c`` format for ``bits``-bit codes of weights of ``dtype``: 4-bit codes
    look bfloat16 values up in a per-block table, float32 ones are computed; 8-bit ones are
    computed."""
    if bits == 8:
        return CODED_AFFINE8
    return CODED_TABLE4 if dtype == torch.bfloat16 else CODED_AFFINE4


@dataclass
class BlockCodes:
    """Weights [N, K] = ``codes * scales + mins`` per block of 32 along K (float32 arithmetic,
    as in GGUF's dequantization: the product rounds once, then the sum). 8-bit codes may have a
    scale and min per 16 weights instead (GGUF's Q6_K: ``sub_block`` 16)."""

    codes: torch.Tensor        # [N, K] uint8 (bits 4: 0..15) or int8 (bits 8)
    scales: torch.Tensor       # [N, K / sub_block] float32
    mins: torch.Tensor         # [N, K / sub_block] float32
    bits: int

    def __post_init__(self) -> None:
        num_rows, num_in = self.codes.shape
        sub_blocks = (CODE_BLOCK, SUB_BLOCK_16) if self.bits == 8 else (CODE_BLOCK,)
        if num_in % CODE_BLOCK or self.scales.shape not in [(num_rows, num_in // n) for n in sub_blocks] \
                or self.mins.shape != self.scales.shape or self.bits not in (4, 8):
            raise ValueError(f"inconsistent block codes: codes {tuple(self.codes.shape)}, scales "
                             f"{tuple(self.scales.shape)}, mins {tuple(self.mins.shape)}, bits {self.bits}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)

    @property
    def sub_block(self) -> int:
        """Weights per scale: 32, or 16 (Q6_K)."""
        return self.codes.shape[1] // self.scales.shape[1]

    def expand(self) -> torch.Tensor:
        """The float32 weights [N, K]."""
        num_rows, num_in = self.codes.shape
        blocks = self.codes.reshape(num_rows, -1, self.sub_block).float()
        return (blocks * self.scales[..., None] + self.mins[..., None]).reshape(num_rows, num_in)

    def rebuilds(self, tensor: torch.Tensor, chunk_values: int = 1 << 20) -> bool:
        """Whether these blocks give ``tensor``'s values in its dtype, bit for bit up to the sign of
        zeros (which no FMA chain starting from +0, the kernels', can tell apart). By chunks of rows
        (~4 MB of float32 each): one temporary the size of a 7B model's matrix cost a page fault
        per 4 KiB, most of its load's time."""
        if tensor.dim() != 2 or self.shape != tuple(tensor.shape):
            return False
        step = max(1, chunk_values // tensor.shape[1])
        return all(torch.equal(self.map_rows(lambda rows: rows[r:r + step]).expand().to(tensor.dtype), tensor[r:r + step])
                   for r in range(0, tensor.shape[0], step))

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BlockCodes:
        """The same row transformation (e.g. a permutation) applied to codes, scales and mins."""
        return BlockCodes(fn(self.codes), fn(self.scales), fn(self.mins), self.bits)

    @staticmethod
    def cat(parts: list[BlockCodes]) -> BlockCodes | None:
        """Row-wise concatenation; None if the parts differ in bits, width or sub-block."""
        if len({(p.bits, p.shape[1], p.sub_block) for p in parts}) != 1:
            return None
        return BlockCodes(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                          torch.cat([p.mins for p in parts]), parts[0].bits)

    def kernel_format(self, dtype: torch.dtype) -> int:
        return kernel_format_for(self.bits, dtype)

    def has_records(self) -> bool:
        """Whether ``coded_linear.c`` takes these blocks (one scale per 32 weights)."""
        return self.sub_block == CODE_BLOCK

    def records(self, dtype: torch.dtype) -> torch.Tensor:
        """uint8 [N, K / 32 * record bytes]: one record per block in the layout
        ``coded_linear.c`` reads for ``kernel_format(dtype)``."""
        num_rows, num_in = self.codes.shape
        num_blocks = num_in // CODE_BLOCK
        codes = self.codes.numpy().view(np.uint8).reshape(num_rows, num_blocks, CODE_BLOCK)
        if self.bits == 4:
            codes = _pack_nibbles(codes, self.kernel_format(dtype)).reshape(num_rows, num_blocks, 16)
        if self.kernel_format(dtype) == CODED_TABLE4:
            header = self._bfloat16_tables().numpy().view(np.uint8)           # [N, blocks, 16, 2]
            header = np.ascontiguousarray(header.reshape(num_rows, num_blocks, 16, 2).transpose(0, 1, 3, 2))
        else:
            header = np.stack([self.scales.numpy(), self.mins.numpy()], axis=-1).astype(np.float32).view(np.uint8)
        records = np.concatenate([header.reshape(num_rows, num_blocks, -1), codes], axis=-1)
        return torch.from_numpy(np.ascontiguousarray(records.reshape(num_rows, -1)))

    def _bfloat16_tables(self) -> torch.Tensor:
        """int16 [N, blocks, 16]: the bfloat16 bits of each block's value for codes 0..15."""
        values = torch.arange(16, dtype=torch.float32) * self.scales[..., None] + self.mins[..., None]
        return values.to(torch.bfloat16).view(torch.int16)


def _pack_nibbles(codes: np.ndarray, kernel_format: int) -> np.ndarray:
    """Two 4-bit codes a byte, [..., 32] -> [..., 16]. CODED_TABLE4 (a lookup, then byte
    interleaving): byte j holds weight (j // 4) * 8 + j % 4 (low nibble) and that + 4 (high).
    CODED_AFFINE4 (widened 8 bytes at a time): byte 8h + j holds weight 16h + j (low) and
    16h + j + 8 (high), so one mask and one shift give 8 weights in order each."""
    if kernel_format == CODED_TABLE4:
        groups = codes.reshape(*codes.shape[:-1], 4, 2, 4)
        return groups[..., 0, :] | (groups[..., 1, :] << 4)
    halves = codes.reshape(*codes.shape[:-1], 2, 2, 8)
    return halves[..., 0, :] | (halves[..., 1, :] << 4)


def q8_0_codes(weight: torch.Tensor) -> BlockCodes:
    """GGUF's Q8_0 blocks of a float matrix [N, K] (K a multiple of 32), bit for bit as
    llama.cpp's quantize_row_q8_0: per block of 32, d = max|w| / 127, codes = w * (1 / d)
    rounded half away from zero, d stored in float16 (a block of zeros: d 0, codes 0)."""
    num_rows, num_in = weight.shape
    blocks = weight.detach().float().reshape(num_rows, num_in // CODE_BLOCK, CODE_BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inverse = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    scaled = blocks * inverse
    magnitude = scaled.abs()
    whole = torch.floor(magnitude)
    codes = torch.sign(scaled) * (whole + torch.floor(2 * (magnitude - whole)))
    scales = d.squeeze(-1).to(torch.float16).float()
    return BlockCodes(codes.to(torch.int8).reshape(num_rows, num_in), scales, torch.zeros_like(scales), 8)
