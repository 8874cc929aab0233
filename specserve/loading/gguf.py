"""Read a GGUF checkpoint as float32 tensors under HF Llama names.

Quantized tensors are dequantized with ``gguf.quants.dequantize``. Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0
and Q4_K / Q5_K / Q6_K tensors also carry their blocks as ``tensor.block_codes``
(``kernels.coded.BlockCodes`` read by ``gguf_blocks``: the same values, which the CPU kernels can
stream in 6-12 bits a weight; see ``models/packed_linear``). llama.cpp's converter permutes
the rows of the Q and K projections of llama-arch models (its rope pairs adjacent dimensions, HF's
``rotate_half`` pairs the two halves of each head); we undo that so the weights match HF.
"""
from __future__ import annotations

import functools
import logging
import os
import re
from typing import Iterator

import numpy as np
import torch

from specserve.config import ModelConfig
from specserve.kernels import block_unpack, os_memory
from specserve.kernels.coded import CODE_BLOCK, RECORD_BYTES, BlockCodes, kernel_format_for
from specserve.loading import gguf_blocks

logger = logging.getLogger(__name__)

WeightIterator = Iterator[tuple[str, torch.Tensor]]

# GGUF architectures whose q/k rows llama.cpp's converter permuted.
_PERMUTED_QK_ARCHS = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

# the layer matrices the model fuses into one linear each (models/llama.py): their blocks stay
# blocks only if the parts share a type
_FUSED_MATRICES = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))

_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_TENSOR = re.compile(r"(\w+)\.(weight|bias)")


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` for ``path``, cached (parsing the metadata takes seconds)."""
    path = os.path.abspath(os.fspath(path))
    return _cached_reader(path, os.stat(path).st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _cached_reader(path: str, mtime_ns: int):
    return _plain_view_reader()(path)


@functools.cache
def _plain_view_reader() -> type:
    """``gguf.GGUFReader`` (pinned in requirements.txt) whose every view of the file goes through a
    plain ndarray view of its memory map, with the views' dtypes made once: the same fields and
    tensors (a test compares them), parsed in 0.48 s against 2.46 for the default model, whose
    tokenizer arrays alone make ~250,000 small views, each of which went through numpy.memmap's
    hooks (2-core AVX-512 Zen4). The model process and the server's front each parse the file."""
    from gguf import GGUFReader

    view_dtypes: dict[tuple, np.dtype] = {}

    class PlainViewReader(GGUFReader):
        def _get(self, offset: int, dtype, count: int = 1, override_order: str | None = None) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            key = (dtype, self.byte_order if override_order is None else override_order)
            view_dtype = view_dtypes.get(key)
            if view_dtype is None:
                view_dtype = view_dtypes[key] = np.dtype(dtype).newbyteorder(key[1])
            return plain[offset:offset + view_dtype.itemsize * int(count)].view(view_dtype)

    return PlainViewReader


def hf_tensor_name(gguf_name: str) -> str:
    """The HF Llama name of a GGUF tensor; an unknown tensor keeps its own name."""
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    match = _GLOBAL_TENSOR.fullmatch(gguf_name)
    if match and match.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[match.group(1)]}.{match.group(2)}"
    return gguf_name


def read_gguf(path: str | os.PathLike, dense_from_blocks: bool = False) -> tuple[ModelConfig, WeightIterator]:
    """``(config, iterator of (HF name, float32 tensor))``; tensors are dequantized lazily.
    ``dense_from_blocks``: a matrix with ``block_codes`` comes as a meta tensor carrying them,
    its values those of ``codes.expand()`` (``StrictLoader`` makes them where it needs them)."""
    reader = open_gguf(path)
    config = ModelConfig.from_gguf(reader)
    return config, _iter_tensors(reader, config, dense_from_blocks)


def _iter_tensors(reader, config: ModelConfig, dense_from_blocks: bool = False) -> WeightIterator:
    arch = config.extra.get("model_type", "llama")
    _log_types_without_kernels(reader)
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        codes = block_codes(tensor)
        if dense_from_blocks and codes is not None and _sample_rows_rebuilt(tensor, codes):
            weight = torch.empty(codes.shape, dtype=torch.float32, device="meta")
        else:
            weight = dequantize_tensor(tensor)
        if arch in _PERMUTED_QK_ARCHS:
            weight = _unpermute_qk(name, weight, config)
            codes = codes and codes.map_rows(lambda rows: _unpermute_qk(name, rows, config))
        if codes is not None:
            weight.block_codes = codes
        _drop_read_pages(reader, tensor.data)
        yield name, weight


def _sample_rows_rebuilt(tensor, codes: BlockCodes, num_rows: int = 8) -> bool:
    """Whether ``num_rows`` rows spread over the matrix, dequantized by gguf-py, equal their
    blocks' values: the check that stands for the whole matrix's where its dense values are
    never made (``gguf_blocks``' readers are tested against gguf-py for every type they read)."""
    rows = np.unique(np.linspace(0, codes.shape[0] - 1, num_rows).astype(np.int64))
    from gguf.quants import dequantize

    reference = torch.from_numpy(np.array(dequantize(np.asarray(tensor.data)[rows], tensor.tensor_type),
                                          dtype=np.float32))
    return torch.equal(codes.map_rows(lambda all_rows: all_rows[torch.from_numpy(rows)]).expand(), reference)


def _drop_read_pages(reader, array: np.ndarray) -> None:
    """A tensor's pages of the file's read-only map dropped once it is read (its weight and
    blocks are copies), so that a load keeps none of the file resident (3.6 GB of a 7B GGUF
    did); never memory outside the map, which a copy could own."""
    mapped = reader.data
    start, end = mapped.ctypes.data, mapped.ctypes.data + mapped.nbytes
    if start <= array.ctypes.data and array.ctypes.data + array.nbytes <= end:
        os_memory.drop_pages(array)


def _log_types_without_kernels(reader) -> None:
    """One warning naming the quantized matrix types that no CPU kernel streams (they load as
    dense float32: 4 bytes a weight to read per token instead of under one)."""
    from gguf import GGMLQuantizationType as Q

    dense = (Q.F32, Q.F16, Q.BF16)
    missing = sorted({t.tensor_type.name for t in reader.tensors
                      if len(t.shape) == 2 and t.tensor_type not in gguf_blocks.READERS and t.tensor_type not in dense})
    if missing:
        logger.warning("GGUF types %s have no integer kernel here: those matrices run as dense float32 "
                       "(slower; the kernels take %s)", ", ".join(missing),
                       ", ".join(t.name for t in gguf_blocks.READERS))


def dequantize_tensor(tensor) -> torch.Tensor:
    """One GGUF tensor as a float32 torch tensor in torch dim order (GGUF lists dims reversed)."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(dim) for dim in reversed(tensor.shape))
    array = np.array(values, dtype=np.float32, copy=True).reshape(shape)
    return torch.from_numpy(array)


def coded_weight_bytes(path: str | os.PathLike, dtype: torch.dtype) -> int:
    """Bytes the CPU kernels' records of this GGUF's block-coded matrices take in ``dtype`` (kept
    beside the dense weights; see ``block_codes``). Reads only the header."""
    total = 0
    for tensor in open_gguf(path).tensors:
        if tensor.tensor_type in gguf_blocks.BITS and len(tensor.shape) == 2:
            num_blocks = int(tensor.n_elements) // CODE_BLOCK
            total += num_blocks * RECORD_BYTES[kernel_format_for(gguf_blocks.BITS[tensor.tensor_type], dtype)]
    return total


def layer_block_weights(path: str | os.PathLike) -> int:
    """How many weights of the decoder layers' linears the integer kernels read straight from
    their blocks (every part of a fused linear of one type with a block reader): those the loader
    keeps as blocks only, with no dense copy (``models/weights.py``, ``codes_only``). Reads only
    the header."""
    matrices: dict[tuple[str, str], tuple] = {}
    for tensor in open_gguf(path).tensors:
        match = _LAYER_TENSOR.fullmatch(tensor.name)
        if match and match.group(3) == "weight" and len(tensor.shape) == 2:
            matrices[match.group(1), match.group(2)] = (tensor.tensor_type, int(tensor.n_elements))
    total = 0
    for layer in {layer for layer, _ in matrices}:
        for group in _FUSED_MATRICES:
            parts = [matrices.get((layer, name)) for name in group]
            if all(parts) and len({kind for kind, _ in parts}) == 1 and parts[0][0] in gguf_blocks.READERS:
                total += sum(count for _, count in parts)
    return total


def block_codes(tensor) -> BlockCodes | None:
    """A quantized matrix's blocks as ``BlockCodes`` (``gguf_blocks``: exactly the values
    ``dequantize_tensor`` computes); None for other tensors."""
    from gguf import GGML_QUANT_SIZES

    reader = gguf_blocks.READERS.get(tensor.tensor_type)
    if reader is None or len(tensor.shape) != 2:
        return None
    num_rows, num_in = (int(dim) for dim in reversed(tensor.shape))
    block_bytes = GGML_QUANT_SIZES[tensor.tensor_type][1]
    blocks = np.asarray(tensor.data).reshape(-1, block_bytes)
    fast = block_unpack.unpack(blocks, tensor.tensor_type)      # the kernels' one pass, where they take the type
    codes, scales, mins, bits = (*fast, gguf_blocks.BITS[tensor.tensor_type]) if fast is not None else reader(blocks)
    as_rows = lambda a: torch.from_numpy(np.ascontiguousarray(a).reshape(num_rows, -1))  # noqa: E731
    return BlockCodes(as_rows(codes), as_rows(scales), as_rows(mins), bits)


def _unpermute_qk(name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
        return unpermute_rope_rows(weight, config.num_attention_heads)
    if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
        return unpermute_rope_rows(weight, config.num_key_value_heads)
    return weight


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's q/k permutation.

    Within each head llama.cpp stores rows in the order (i, half) -- interleaved pairs -- while HF
    stores (half, i). ``weight``: [num_heads * head_dim, ...] (or 1-D for a bias).
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    # [num_heads, head_dim // 2, 2, *rest] -> [num_heads, 2, head_dim // 2, *rest]
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *rest)
    return grouped.transpose(1, 2).reshape(rows, *rest).contiguous()
