"""Linear layers with a CPU fast path: weights prepacked once for oneDNN.

On CPU, ``torch.ops.mkldnn._linear_pointwise`` over a prepacked weight runs
bfloat16 matmuls about 1.6x faster than ``F.linear`` (the same result bits)
and float32 matmuls over many rows about 1.5x faster. For float32 inputs of up
to 3 rows plain ``F.linear`` (MKL) costs about what one row costs, while the
packed kernel costs 1.6x more from 2 rows on, so those keep ``F.linear``: a
speculative verify over 2-3 tokens then costs about one decode step. Packing copies the
weight: call ``pack_linears_for_cpu`` after the weights are final.

Row invariance: a bfloat16 row's result must not depend on how many rows share the
call (greedy speculative output == plain decoding). oneDNN's one-row kernel can round
differently from its many-row kernel (seen on AMD EPYC for the 1536-wide down
projection; the many-row kernel agrees with itself from 2 rows on). Packing probes
bfloat16 layers shape by shape and, where one row disagrees for any layer of a
shape, runs single rows of that shape as two (the same cost there). float32 keeps
its fast paths: its rounding differences are far below what flips a greedy choice
in practice.

Where the skinny kernel (``specserve/kernels``, AVX2) builds, inputs of few rows use it
instead: it streams the weights once for all rows, so verifying a few tokens costs about
what decoding one costs, and every row's bits are independent of the other rows.
float32 layers use it up to ``FLOAT32_SKINNY_MAX_ROWS`` rows (oneDNN wins beyond, on
prefill). CPUs without oneDNN bfloat16 kernels (AVX2 only: no AVX512-BW/VL/DQ, no
AVX-NE-CONVERT) run ``F.linear`` in bfloat16 through a reference loop, 3-50x slower than
float32; there bfloat16 layers use the skinny kernel for every row count (prefill too), or,
where it cannot be built, a packed float32 copy of the weight, rounding results to bfloat16.

Weights loaded from a quantized GGUF (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) carry their
code blocks (``weight.block_codes``, ``kernels/coded.py``). Where the skinny kernel runs, packing
keeps those with a scale per 32 weights (all but Q6_K), checked to rebuild the weight bit for
bit, and the kernel streams the codes (6-12 bits a weight) instead
of the dense weight: the same result bits, a fraction of the memory traffic. Measured on an
AVX2 AMD EPYC, one thread, all of the default model's linears: float32 one row 2.5x faster,
8 rows 1.1x, 32 rows 1.1x; bfloat16 one row 1.3x, 4 rows 1.0x, 32 rows 1.2x.

``quantization="gguf"`` (SGLang's name; ``--quantization gguf``) trades those exact bits for
speed: linears whose weights carry GGUF blocks (any of the types above) run the integer kernel
(``kernels/int_linear.c``) for every input, prefill too: each input row is quantized to 8 bits
per block of 32 and multiplied in integer SIMD against the blocks, as llama.cpp does. Results then
differ from the dequantized float32 model (greedy output differs from HF float32 the way
llama.cpp's does) but stay row invariant: a row's bits never depend on the other rows, so
speculative output equals plain decoding on this path too. Other linears keep the paths above.

``quantization="w8a8_int8"`` first rounds the float linears that carry no GGUF blocks to Q8_0
blocks (``quantize_linears_q8_0``, llama.cpp's rounding), then runs them like ``gguf``. Drafts
beside a gguf target get it by default (``speculative/base.draft_quantization``): an EAGLE3
head's linears are ~10M weights, 39 MB to stream per draft step in float32, ~10 MB in Q8_0.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from specserve.kernels import huge_pages, int_codes, skinny
from specserve.kernels.coded import CODE_BLOCK, BlockCodes, q8_0_codes

logger = logging.getLogger(__name__)

FLOAT32_PLAIN_MAX_ROWS = 3
FLOAT32_SKINNY_MAX_ROWS = 32
ALL_ROWS = 2**62
INTEGER_QUANTIZATION = "gguf"       # --quantization value of the integer kernels
Q8_ON_LOAD_QUANTIZATION = "w8a8_int8"   # every linear to GGUF Q8_0 blocks at load, then the integer kernels


class Linear(nn.Linear):
    """``nn.Linear`` that uses a oneDNN-prepacked copy of its weight once packed."""

    packed_weight: torch.Tensor | None = None
    plain_max_rows: int = 0            # inputs of up to this many rows use F.linear
    pads_single_row: bool = False      # one row runs as two (the many-row kernel's rounding)
    compute_dtype: torch.dtype | None = None   # set: no kernels for the weight's dtype here
    compute_bias: torch.Tensor | None = None   # the bias in compute_dtype
    skinny_max_rows: int = 0           # inputs of up to this many rows use the skinny kernel
    skinny_bias: torch.Tensor | None = None    # the bias in float32, for the skinny kernel
    coded_records: torch.Tensor | None = None  # the weight's code blocks, laid out for the kernel
    coded_format: int = 0                      # their coded_linear.c format
    native_weights: skinny.LinearWeights | None = None   # what the skinny kernel reads
    int_panels: torch.Tensor | None = None     # the GGUF blocks for the integer kernel (gguf path)
    int_format: int = 0                        # their int_codes format
    int_panels_in_huge_pages: bool = False     # moved by _gather_int_panels (never again)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.skinny_max_rows * self.in_features and not torch.is_grad_enabled():
            return skinny.linear_forward(x, self.skinny_weights(), self.weight.shape, self.skinny_bias)
        if self.compute_dtype is not None:
            return self._packed(x.to(self.compute_dtype), self.compute_bias).to(x.dtype)
        if self.packed_weight is None or x.shape[0] <= self.plain_max_rows:
            return F.linear(x, self.weight, self.bias)
        return self._packed(x, self.bias)

    def _packed(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.pads_single_row and x.shape[0] == 1:
            return torch.ops.mkldnn._linear_pointwise(torch.cat([x, x]), self.packed_weight, bias,
                                                      "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, bias, "none", [], "")

    def skinny_weights(self) -> skinny.LinearWeights:
        """The weights as the skinny kernel takes them. A weight replaced since packing drops
        the code blocks (they described the old one)."""
        native = self.native_weights
        if native is None or (native.dense or 0) != self.weight.data_ptr():   # a dropped weight's is 0
            self.coded_records = self.int_panels = None
            native = self.native_weights = skinny.linear_weights(self.weight.detach())
        return native

    def unpack(self) -> None:
        """Back to ``F.linear`` on ``self.weight`` (before training, or before changing it)."""
        self.packed_weight = self.compute_dtype = self.compute_bias = self.skinny_bias = None
        self.coded_records = self.native_weights = self.int_panels = None
        self.int_panels_in_huge_pages = False
        self.plain_max_rows, self.pads_single_row, self.skinny_max_rows, self.int_format = 0, False, 0, 0


def can_pack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@functools.cache
def has_packed_kernels(dtype: torch.dtype) -> bool:
    """Whether oneDNN packs (and so has fast kernels for) ``dtype`` weights on this CPU."""
    if not can_pack():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
    except RuntimeError:              # e.g. bfloat16 on an AVX2-only CPU
        return False
    return True


def pack_linears_for_cpu(model: nn.Module, quantization: str | None = None) -> int:
    """Prepack every CPU float32/bfloat16 ``Linear`` of ``model`` (or route it to the skinny
    kernel; with ``quantization="gguf"``, those with GGUF blocks to the integer kernel);
    returns how many."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, Linear) and weight.is_meta:
            pack_codes_only(module)
            continue
        if not isinstance(module, Linear) or weight.device.type != "cpu":
            continue
        if weight.dtype not in (torch.float32, torch.bfloat16):
            continue
        count += 1
        if _keeps_integer(module) or (quantization == INTEGER_QUANTIZATION and _use_integer(module)):
            continue                   # every input runs the integer kernel
        if _use_skinny(module) and module.skinny_max_rows == ALL_ROWS:
            continue                   # nothing to pack: every input runs the skinny kernel
        if has_packed_kernels(weight.dtype):
            module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
            module.plain_max_rows = FLOAT32_PLAIN_MAX_ROWS if weight.dtype == torch.float32 else 0
        elif has_packed_kernels(torch.float32):
            _pack_in_float32(module)
    _pad_single_rows_per_shape(model)
    _gather_int_panels(model)
    logger.debug("prepacked %d linear layers for oneDNN", count)
    return count


def codes_only_weights(model: nn.Module, quantization: str | None, device: str) -> list[str]:
    """The parameters that need no dense copy at load (``StrictLoader``'s ``codes_only``) when
    their GGUF blocks suffice (``integer_kernel_takes``): the decoder layers' linear weights, with
    the integer kernels chosen and built here (not a head, whose rows a token map may take)."""
    if not keeps_blocks_only(quantization, device):
        return []
    return [f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, Linear) and name.startswith("model.layers.")]


def keeps_blocks_only(quantization: str | None, device: str) -> bool:
    """Whether the decoder layers' linears keep their GGUF blocks alone (``codes_only_weights``):
    the integer kernels chosen, on a CPU that has them built."""
    return quantization == INTEGER_QUANTIZATION and device == "cpu" and int_codes.is_available()


def integer_kernel_takes(codes: BlockCodes) -> bool:
    """Whether the integer kernel runs on these blocks as they are (``_use_integer`` then packs
    them without a dense weight)."""
    return int_codes.is_available() and int_codes.int_format(codes) is not None


def pack_codes_only(module: Linear, arena: huge_pages.Arena | None = None) -> None:
    """A linear loaded without its dense weight (``codes_only_weights``): its blocks into panels
    (the loader calls it as each such weight is whole, so that only one weight's blocks are held
    at a time), those moved into ``arena`` (huge pages) at once, unless packed already."""
    if _keeps_integer(module):
        return
    in_arena = []

    def allocate(shape: tuple[int, int]) -> torch.Tensor | None:     # the panels packed straight into the arena
        out = arena.allocate(shape) if arena is not None else None
        in_arena.append(out is not None)
        return out

    if not _use_integer(module, allocate):
        raise RuntimeError(f"a linear of shape {tuple(module.weight.shape)} was loaded without its dense "
                           f"weight, and its blocks cannot be packed for the integer kernel")
    module.int_panels_in_huge_pages = any(in_arena)     # the native weights point at them already


def _gather_int_panels(model: nn.Module) -> None:
    """The integer kernels' panels of ``model``'s linears moved into one block backed by huge
    pages (``kernels/huge_pages.py``) before any native layer points at them; panels moved once
    stay put (a linear shared with a model packed earlier may be pointed at already)."""
    modules = [m for m in model.modules()
               if isinstance(m, Linear) and m.int_panels is not None and not m.int_panels_in_huge_pages]
    copies = huge_pages.gather([m.int_panels for m in modules])
    for module, panels in zip(modules, copies or []):
        _set_int_panels(module, panels, module.int_format, in_huge_pages=True)


def drop_dense_weights(modules: Iterable[nn.Module]) -> int:
    """The dense float copy of every integer-kernel ``Linear`` among ``modules`` (and their
    submodules) replaced by a meta tensor of its shape and dtype; returns the bytes freed. The
    integer kernel computes every input from the panels (``_use_integer`` checked them against
    the dense weight), so the copy is only memory: 424 MB of the default model's 540 in float32,
    ~4 bytes a weight of any GGUF. For linears nothing else reads (a model's decoder layers; not
    a head whose rows a token map may take): anything that computes with it fails loudly."""
    freed = 0
    for module in (m for root in modules for m in root.modules()):
        if isinstance(module, Linear) and module.int_panels is not None and not module.weight.is_meta:
            weight = module.weight
            freed += weight.numel() * weight.element_size()
            module.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"),
                                         requires_grad=False)
            _set_int_panels(module, module.int_panels, module.int_format, module.int_panels_in_huge_pages)
    return freed


def _set_int_panels(module: Linear, panels: torch.Tensor, fmt: int, in_huge_pages: bool) -> None:
    """``module``'s integer-kernel panels, and the native weights that point at them."""
    module.int_panels, module.int_format, module.int_panels_in_huge_pages = panels, fmt, in_huge_pages
    module.native_weights = skinny.linear_weights(module.weight.detach(), int_panels=panels, int_format=fmt)


def quantize_linears_q8_0(model: nn.Module) -> int:
    """Round every CPU float ``Linear`` weight of ``model`` (input width a multiple of 32, no
    code blocks yet) to GGUF Q8_0 blocks in place, the blocks kept as its ``block_codes``, so
    ``pack_linears_for_cpu(model, "gguf")`` runs them on the integer kernel; returns how many.
    What ``--quantization w8a8_int8`` does (and a draft without GGUF blocks beside a gguf target):
    a quarter of float32's bytes to stream, within Q8_0's rounding of the checkpoint's values."""
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (not isinstance(module, Linear) or weight.device.type != "cpu" or module.int_panels is not None
                or weight.dtype not in (torch.float32, torch.bfloat16) or module.in_features % CODE_BLOCK
                or getattr(weight, "block_codes", None) is not None):
            continue
        codes = q8_0_codes(weight)
        with torch.no_grad():
            weight.copy_(codes.expand().to(weight.dtype))
        weight.block_codes = codes
        count += 1
    logger.debug("quantized %d linear layers to Q8_0 blocks", count)
    return count


def integer_quantization(model: nn.Module, quantization: str | None) -> str | None:
    """The ``pack_linears_for_cpu`` argument for a ``--quantization`` value: w8a8_int8 rounds the
    linears without GGUF blocks to Q8_0 blocks here, then every block runs the integer kernels."""
    if quantization == Q8_ON_LOAD_QUANTIZATION:
        quantize_linears_q8_0(model)
        return INTEGER_QUANTIZATION
    return quantization


def runs_integer(model: nn.Module) -> bool:
    """Whether any of ``model``'s linears runs the integer kernels (after ``pack_linears_for_cpu``)."""
    return any(isinstance(m, Linear) and m.int_panels is not None for m in model.modules())


def _use_skinny(module: Linear) -> bool:
    """Route few-row inputs (bfloat16 without oneDNN kernels: all inputs) to the skinny kernel."""
    weight = module.weight
    if not weight.is_contiguous() or not skinny.can_run(weight[:1], weight):
        return False
    if weight.dtype == torch.float32:
        module.skinny_max_rows = FLOAT32_SKINNY_MAX_ROWS
    elif not has_packed_kernels(weight.dtype):
        module.skinny_max_rows = ALL_ROWS
    else:
        return False
    module.skinny_bias = None if module.bias is None else module.bias.detach().float()
    codes = getattr(weight, "block_codes", None)
    if codes is not None and codes.has_records() and codes.rebuilds(weight.detach()):
        module.coded_records = codes.records(weight.dtype)
        module.coded_format = codes.kernel_format(weight.dtype)
        del weight.block_codes             # the records hold them now (a byte a weight less kept)
    elif module.native_weights is None or module.native_weights.dense != weight.data_ptr():
        module.coded_records = None        # no codes, or those of a replaced weight
    module.native_weights = skinny.linear_weights(weight.detach(), module.coded_records, module.coded_format,
                                                  module.skinny_max_rows)
    return True


def _keeps_integer(module: Linear) -> bool:
    """Packed for the integer kernel before, and the weight is the same: stays so (packing again,
    e.g. a draft head's, must not move a shared layer off the path)."""
    native = module.native_weights
    return module.int_panels is not None and native is not None and (native.dense or 0) == module.weight.data_ptr()


def _use_integer(module: Linear, allocate=None) -> bool:
    """Route every input to the integer kernel over the weight's GGUF blocks, if it has blocks
    the kernel takes and the kernels are built here (``allocate``: where the panels go, as
    ``int_codes.panels`` takes it)."""
    weight = module.weight
    codes = getattr(weight, "block_codes", None)
    if codes is None or not weight.is_contiguous() or not int_codes.is_available():
        return False
    fmt = int_codes.int_format(codes)
    if fmt is None or not (weight.is_meta or codes.rebuilds(weight.detach())):   # meta: the loader checked them
        return False
    _set_int_panels(module, int_codes.panels(codes, fmt, allocate=allocate), fmt,
                    in_huge_pages=False)   # _gather_int_panels may move them
    module.coded_records, module.packed_weight, module.skinny_max_rows = None, None, ALL_ROWS
    module.skinny_bias = None if module.bias is None else module.bias.detach().float()
    del weight.block_codes                 # the panels hold them now
    return True


def _pack_in_float32(module: Linear) -> None:
    if not _warned_upcast:
        _warned_upcast.append(True)
        logger.warning("this CPU has no oneDNN kernels for %s matmuls (they need AVX-512): those layers "
                       "compute in float32; --dtype float32 runs faster here", module.weight.dtype)
    module.compute_dtype = torch.float32
    module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach().float(), 1)
    module.compute_bias = None if module.bias is None else module.bias.detach().float()


_warned_upcast: list[bool] = []


def _shape_key(module: Linear) -> tuple:
    return module.in_features, module.out_features, module.weight.dtype, module.bias is not None


def _pad_single_rows_per_shape(model: nn.Module) -> None:
    """The one-row rounding difference belongs to oneDNN's kernel for a shape, while each
    layer's probe sees it only with some probability: one flagged layer flags its shape."""
    packed = [m for m in model.modules() if isinstance(m, Linear) and m.packed_weight is not None
              and m.weight.dtype == torch.bfloat16]
    flagged: set[tuple] = set()
    for module in packed:                  # a shape already flagged needs no more probes
        if _shape_key(module) not in flagged and not _is_one_row_invariant(module):
            flagged.add(_shape_key(module))
    for module in packed:
        module.pads_single_row = _shape_key(module) in flagged


@torch.inference_mode()
def _is_one_row_invariant(module: Linear, num_rows: int = 16, num_trials: int = 6) -> bool:
    """Whether a row computed alone gets the same bits as inside a call of ``num_rows``."""
    generator = torch.Generator().manual_seed(0)
    for _ in range(num_trials):
        x = torch.randn(num_rows, module.in_features, generator=generator).to(module.weight.dtype)
        together = module(x)
        if any(not torch.equal(module(x[i:i + 1]), together[i:i + 1]) for i in range(num_rows)):
            return False
    return True


@torch.inference_mode()
def warm_up_packed_linears(model: nn.Module, max_rows: int) -> int:
    """Run every packed layer shape once at each row count up to ``max_rows``. oneDNN builds
    a kernel per input shape on first use (about 0.5 ms on this CPU), which would otherwise
    land on serving steps whenever a batch or a verify tree reaches a new width.
    Returns the number of distinct layer shapes warmed."""
    seen: set[tuple] = set()
    for module in model.modules():
        if not isinstance(module, Linear) or module.packed_weight is None:
            continue
        key = _shape_key(module)
        if key in seen:
            continue
        seen.add(key)
        x = torch.zeros(max_rows, module.in_features, dtype=module.weight.dtype)
        for num_rows in range(min(module.skinny_max_rows, max_rows) + 1, max_rows + 1):
            module(x[:num_rows])
    return len(seen)
