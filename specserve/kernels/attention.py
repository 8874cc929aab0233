"""Row-invariant paged decode attention (``paged_attention.c``, in the library ``build.py`` builds)."""
from __future__ import annotations

import ctypes
import functools

import numpy as np
import torch

from specserve.kernels import build
from specserve.kernels.build import DTYPE_CODES


def is_available() -> bool:
    return _function() is not None


def can_run(q: torch.Tensor, k_layer: torch.Tensor) -> bool:
    """CPU, float32/bfloat16 queries and cache (not necessarily the same), and no gradient needed
    through it (training runs torch's path)."""
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k_layer.requires_grad)
    return (q.device.type == "cpu" and q.dtype in DTYPE_CODES and k_layer.dtype in DTYPE_CODES
            and q.shape[-1] % 8 == 0 and not needs_grad and is_available())


def paged_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, kv_indices: torch.Tensor,
                    query_mask: torch.Tensor, row_batch: torch.Tensor, row_query: torch.Tensor) -> torch.Tensor:
    """q [T, nh, hd]; k_layer/v_layer [S, nkv, hd] (contiguous); kv_indices [B, L] int64;
    query_mask [B, Q, L] bool (True = attend); row_batch/row_query [T] int32: the request and
    query index of each row. Returns [T, nh * hd] in q's dtype (the cache may hold another one)."""
    q, kv_indices, query_mask = q.contiguous(), kv_indices.contiguous(), query_mask.contiguous()
    num_rows, num_heads, head_dim = q.shape
    out = q.new_empty(num_rows, num_heads * head_dim)
    batch, num_queries, num_keys = query_mask.shape
    status = _function()(
        q.data_ptr(), k_layer.data_ptr(), v_layer.data_ptr(), out.data_ptr(), kv_indices.data_ptr(),
        query_mask.data_ptr(), row_batch.data_ptr(), row_query.data_ptr(), num_rows, num_keys, num_queries,
        num_heads, k_layer.shape[1], head_dim, DTYPE_CODES[q.dtype], DTYPE_CODES[k_layer.dtype],
        torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"paged_attention rejected {num_heads} heads over {k_layer.shape[1]} KV heads "
                           f"of dim {head_dim}")
    return out


def row_metadata_available() -> bool:
    return _metadata_function() is not None


def row_metadata(table: np.ndarray, specs: np.ndarray, pad_slot: int, num_keys: int, max_query: int,
                 num_tokens: int, is_padded: bool) -> tuple[np.ndarray, ...]:
    """The row-invariant path's metadata in one call (``row_metadata.c``): ``table`` [R, W] int64
    contiguous; ``specs`` [B, 4] int64 rows of (table row, prefix length, new tokens, address of a
    contiguous [n, n] bool tree mask or 0). Returns kv_indices [B, num_keys], query_mask
    [B, max_query, num_keys] bool, row_batch and row_query [num_tokens] int32, and where
    ``is_padded`` query_index [B * max_query] and output_index [num_tokens] (else None)."""
    batch = specs.shape[0]
    kv_indices = np.empty((batch, num_keys), dtype=np.int64)
    query_mask = np.empty((batch, max_query, num_keys), dtype=np.bool_)
    row_batch, row_query = np.empty(num_tokens, dtype=np.int32), np.empty(num_tokens, dtype=np.int32)
    query_index = np.empty(batch * max_query, dtype=np.int64) if is_padded else None
    output_index = np.empty(num_tokens, dtype=np.int64) if is_padded else None
    status = _metadata_function()(
        table.ctypes.data, table.shape[1], batch, specs.ctypes.data, pad_slot, num_keys, max_query,
        kv_indices.ctypes.data, query_mask.ctypes.data, row_batch.ctypes.data, row_query.ctypes.data,
        None if query_index is None else query_index.ctypes.data,
        None if output_index is None else output_index.ctypes.data)
    if status != 0:
        raise RuntimeError(f"row_metadata rejected specs {specs.tolist()} for {num_keys} keys, {max_query} queries")
    return kv_indices, query_mask, row_batch, row_query, query_index, output_index


@functools.cache
def _metadata_function():
    return build.function("build_row_metadata", [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
                          + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 6)


@functools.cache
def _function():
    return build.function("paged_attention", [ctypes.c_void_p] * 8 + [ctypes.c_int] * 9)
