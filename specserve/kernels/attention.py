"""Row-invariant paged decode attention (``paged_attention.c``, in the library ``build.py`` builds)."""
from __future__ import annotations

import ctypes

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


def kv_strides(k_layer: torch.Tensor, v_layer: torch.Tensor) -> tuple[int, int]:
    """(bytes from one slot to the next, from one KV head to the next) of a layer's K and V
    [slots, kv heads, head_dim], as the C kernels take them (``kv_strides``): slot-major
    (contiguous) or head-major (a view of [kv heads, slots, head_dim], the CPU cache's layout)
    alike; a head's values must be contiguous and V must lie as K does."""
    if k_layer.stride() != v_layer.stride() or k_layer.stride(-1) != 1 or k_layer.dtype != v_layer.dtype:
        raise ValueError(f"K/V rows the kernels cannot read: strides {k_layer.stride()} and {v_layer.stride()}")
    size = k_layer.element_size()
    return k_layer.stride(0) * size, k_layer.stride(1) * size


def paged_attention(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, kv_indices: torch.Tensor,
                    query_mask: torch.Tensor, row_batch: torch.Tensor, row_query: torch.Tensor,
                    library=None) -> torch.Tensor:
    """q [T, nh, hd]; k_layer/v_layer [S, nkv, hd] (each head's values contiguous, V laid out as K:
    ``kv_strides``); kv_indices [B, L] int64;
    query_mask [B, Q, L] bool (True = attend); row_batch/row_query [T] int32: the request and
    query index of each row. Returns [T, nh * hd] in q's dtype (the cache may hold another one).
    ``library``: a particular kernel variant (``build.load_variant``), default the loaded one."""
    q, kv_indices, query_mask = q.contiguous(), kv_indices.contiguous(), query_mask.contiguous()
    num_rows, num_heads, head_dim = q.shape
    out = q.new_empty(num_rows, num_heads * head_dim)
    batch, num_queries, num_keys = query_mask.shape
    fn = _function() if library is None else build.function_of(library, "paged_attention", _ARGTYPES)
    status = fn(
        q.data_ptr(), k_layer.data_ptr(), v_layer.data_ptr(), *kv_strides(k_layer, v_layer), out.data_ptr(),
        kv_indices.data_ptr(),
        query_mask.data_ptr(), row_batch.data_ptr(), row_query.data_ptr(), num_rows, num_keys, num_queries,
        num_heads, k_layer.shape[1], head_dim, DTYPE_CODES[q.dtype], DTYPE_CODES[k_layer.dtype],
        torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"paged_attention rejected {num_heads} heads over {k_layer.shape[1]} KV heads "
                           f"of dim {head_dim}")
    return out


_ARGTYPES = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 9


@build.cached_lookup
def _function():
    return build.function("paged_attention", _ARGTYPES)
