"""One Llama decoder layer in one native call, for decode-shaped forwards (``decoder_layer.c``).

``LayerWeights`` holds a layer's weight pointers (built once per layer: weights do not move
while serving); ``decoder_layer`` updates the residual stream ``h`` in place.
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from specserve.kernels import build
from specserve.kernels.build import DTYPE_CODES


@dataclass
class LayerWeights:
    tensors: tuple[torch.Tensor, ...]       # kept alive: the pointers below point into them
    pointers: ctypes.Array
    qkv_bias: torch.Tensor | None           # float32
    dims: ctypes.Array                      # hidden, heads, kv heads, head dim, intermediate
    eps: float


def is_available() -> bool:
    return _function() is not None


def layer_weights(ln1: torch.Tensor, w_qkv: torch.Tensor, w_o: torch.Tensor, ln2: torch.Tensor,
                  w_gate_up: torch.Tensor, w_down: torch.Tensor, qkv_bias: torch.Tensor | None,
                  num_heads: int, num_kv_heads: int, head_dim: int, eps: float) -> LayerWeights:
    tensors = tuple(t.detach().contiguous() for t in (ln1, w_qkv, w_o, ln2, w_gate_up, w_down))
    pointers = (ctypes.c_void_p * 6)(*(t.data_ptr() for t in tensors))
    dims = (ctypes.c_int * 5)(w_qkv.shape[1], num_heads, num_kv_heads, head_dim, w_down.shape[1])
    bias = None if qkv_bias is None else qkv_bias.detach().float().contiguous()
    return LayerWeights(tensors, pointers, bias, dims, eps)


def decoder_layer(h: torch.Tensor, weights: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
                  k_layer: torch.Tensor, v_layer: torch.Tensor, out_cache_loc: torch.Tensor,
                  kv_indices: torch.Tensor, query_mask: torch.Tensor, row_batch: torch.Tensor,
                  row_query: torch.Tensor) -> None:
    """h [T, H] contiguous (updated in place); cos/sin [T, head_dim] in h's dtype; the new
    tokens' K/V go to ``out_cache_loc`` of k_layer/v_layer [S, kv heads, head_dim]; attention
    metadata as in ``attention.paged_attention``."""
    kv_indices, query_mask = kv_indices.contiguous(), query_mask.contiguous()
    batch, num_queries, num_keys = query_mask.shape
    status = _function()(
        h.data_ptr(), ctypes.addressof(weights.pointers),
        None if weights.qkv_bias is None else weights.qkv_bias.data_ptr(), weights.eps,
        ctypes.addressof(weights.dims), cos.contiguous().data_ptr(), sin.contiguous().data_ptr(),
        k_layer.data_ptr(), v_layer.data_ptr(), out_cache_loc.contiguous().data_ptr(), kv_indices.data_ptr(),
        query_mask.data_ptr(), row_batch.data_ptr(), row_query.data_ptr(), h.shape[0], num_keys, num_queries,
        DTYPE_CODES[h.dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"decoder_layer rejected the layer's shapes {list(weights.dims)}")


@functools.cache
def _function():
    return build.function("decoder_layer", [ctypes.c_void_p] * 3 + [ctypes.c_float] + [ctypes.c_void_p] * 10
                          + [ctypes.c_int] * 5)
