"""Paged attention behind a small backend interface.

One metadata object serves prefill, decode and tree verification: each request
in the batch has ``prefix_len`` tokens already in the KV cache and
``extend_len`` new tokens whose K/V are written at ``out_cache_loc``. The new
tokens attend to the whole prefix and, among themselves, either causally or
under a custom ``tree_mask`` (speculative verification).

The torch SDPA backend gathers each request's K/V by slot index and runs one
``scaled_dot_product_attention`` with an explicit boolean mask. GQA is handled
by folding the query heads of a group into the query axis, so K/V are never
repeated.

Decode-shaped forwards (at most ``ROW_INVARIANT_MAX_QUERY`` new tokens a request)
run ``row_invariant_attention`` over a key axis padded to a multiple of
``KEY_BLOCK``: its result for a query row does not depend on the other rows, on
padding or on masked tree branches, which makes greedy speculative decoding
bit-identical to plain decoding, in bfloat16 too. On CPUs where the native kernel
builds (``specserve/kernels/paged_attention.c``), every forward runs it instead, prefill
included: the same per-row guarantee (so a prompt's KV does not depend on the prompts
prefilled beside it), with K/V read from the cache by slot (no gathers) and no padding
work, so decode rows and trees need not be split into groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels import attention as attention_kernel
from specserve.kernels import huge_pages
from specserve.models.row_invariant_attention import KEY_BLOCK, row_invariant_attention

ROW_INVARIANT_MAX_QUERY = 64


@dataclass
class AttentionMetadata:
    out_cache_loc: torch.Tensor          # [T] int64 slots for the new tokens' K/V
    kv_indices: torch.Tensor             # [B, L] int64 slots to read (prefix + new), padded
    mask: torch.Tensor | None            # [B, 1, g * Q, L] bool (True = attend); None = attend to all
    query_index: torch.Tensor | None     # [B * Q] rows of the flat [T] input; None if T == B * Q
    output_index: torch.Tensor | None    # [T] rows of the padded [B * Q] output; None if T == B * Q
    batch_size: int
    max_query_len: int
    row_invariant: bool = False          # keys padded to KEY_BLOCK: use row_invariant_attention
    parts: list[tuple[torch.Tensor, "AttentionMetadata"]] | None = None   # (rows of [T], metadata) groups
    # for the native row-invariant kernel (set on CPU where it builds):
    query_mask: torch.Tensor | None = None    # [B, Q, L] bool, the mask before the GQA repeat
    row_batch: torch.Tensor | None = None     # [T] int32: each new token's request
    row_query: torch.Tensor | None = None     # [T] int32: its query index within the request
    num_kv_groups: int = 1                    # query heads per KV head (for ``grouped_mask``)

    def grouped_mask(self) -> torch.Tensor | None:
        """``mask``, formed from ``query_mask`` on first use where only that was built (the
        native kernel reads ``query_mask``; torch's path needs the GQA-repeated one)."""
        if self.mask is None and self.query_mask is not None:
            self.mask = self.query_mask.unsqueeze(1).repeat(1, 1, self.num_kv_groups, 1)
        return self.mask


class KVCache:
    """K and V tensors for every layer: [num_layers, num_slots, num_kv_heads, head_dim].

    On a CPU they are views of [num_layers, num_kv_heads, num_slots, head_dim] (head-major): a
    KV head's keys of a request are one stream of memory, which the CPU's prefetchers follow,
    instead of a head_dim-wide piece of every slot (one decode row's attention over 30 layers in
    a C harness, 2 threads, 2-core AVX-512 Xeon: 0.37-0.40 -> 0.31-0.33 ms at 256 keys, 1.23-1.32
    -> 0.96-1.14 ms at 1,024; inside the model's forward the gain is smaller, a few percent of
    attention). Indexing by slot works alike."""

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, num_zeroed_tail: int = 1) -> None:
        # Left uninitialized (no memory is touched until used): a slot is only ever
        # read after it was written, except the zeroed tail slots used for padding.
        shape = (num_layers, num_slots, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":       # a request's slots lie in few pages: few TLB misses
            head_major = (num_layers, num_kv_heads, num_slots, head_dim)
            self.k, self.v = (huge_pages.empty(head_major, dtype).transpose(1, 2) for _ in range(2))
        else:
            self.k = torch.empty(shape, dtype=dtype, device=device)
            self.v = torch.empty(shape, dtype=dtype, device=device)
        self.k[:, num_slots - num_zeroed_tail:].zero_()
        self.v[:, num_slots - num_zeroed_tail:].zero_()
        self.num_slots = num_slots

    def prefault(self, max_bytes: int | None = None) -> int:
        """Write the first slots of the cache (all of it, or as many slots as ``max_bytes``
        holds) once, now; returns the bytes written. The first write to a page the process has
        never touched costs a page fault: 20-100 us per token's 60 K/V rows measured on a 2-core
        VM, where the hypervisor also backs the page. Without this, that cost falls into the
        decode steps of whichever requests reach fresh slots, and a server with a prefix cache
        keeps finished requests' pages, so for a long while every new token lands on a fresh
        one. A fresh pool hands out its lowest slots first (``BlockPool``), so a partial
        prefault covers the first traffic. Zeros are harmless: a slot is written before it is
        read."""
        slot_bytes = 2 * self.k[:, :1].numel() * self.k.element_size()
        num = self.num_slots if max_bytes is None else min(self.num_slots, max_bytes // slot_bytes)
        self.k[:, :num].zero_()
        self.v[:, :num].zero_()
        return num * slot_bytes

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def build_metadata(prefix_lens: list[int], extend_lens: list[int], kv_indices: torch.Tensor,
                   out_cache_loc: torch.Tensor, tree_masks: list[torch.Tensor | None] | None = None,
                   num_kv_groups: int = 1, pad_slot: int | None = None) -> AttentionMetadata:
    """Metadata for one forward. ``kv_indices`` [B, >= max(prefix+extend)] holds each
    request's slots in token order (entries past its length are ignored).
    ``num_kv_groups`` = query heads per KV head; the mask is laid out for it.
    ``pad_slot`` (a zeroed KV slot) enables the row-invariant path for forwards of
    at most ``ROW_INVARIANT_MAX_QUERY`` new tokens a request."""
    device = kv_indices.device
    batch_size, max_q = len(extend_lens), max(extend_lens)
    total_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    max_len = max(total_lens)
    row_invariant = pad_slot is not None and max_q <= ROW_INVARIANT_MAX_QUERY
    uses_kernel = device.type == "cpu" and attention_kernel.is_available()   # every forward, prefill too
    if row_invariant and not uses_kernel and max_q > 1 and min(extend_lens) == 1:
        return _split_metadata(prefix_lens, extend_lens, kv_indices, out_cache_loc, tree_masks,
                               num_kv_groups, pad_slot)
    if row_invariant:
        kv_indices = _padded_key_slots(kv_indices, total_lens, pad_slot)
        max_len = kv_indices.shape[1]
    kv_indices = kv_indices[:, :max_len]
    is_dense = all(e == max_q for e in extend_lens)
    query_index = output_index = None
    if not is_dense:
        query_index, output_index = _padding_indices(extend_lens, max_q, device)
    has_tree = tree_masks is not None and any(m is not None for m in tree_masks)
    needs_mask = uses_kernel or row_invariant or has_tree or max_q > 1 or len(set(total_lens)) > 1
    mask = query_mask = None
    if needs_mask:
        mask = _causal_mask(prefix_lens, extend_lens, max_q, max_len, device)
        if has_tree:
            _apply_tree_masks(mask, prefix_lens, tree_masks)
        query_mask = mask.squeeze(1)                                          # [B, Q, L]
        if num_kv_groups > 1:
            mask = mask.repeat(1, 1, num_kv_groups, 1)                        # [B, 1, g*Q, L]
    meta = AttentionMetadata(out_cache_loc, kv_indices, mask, query_index, output_index,
                             batch_size, max_q, row_invariant)
    if uses_kernel:
        meta.query_mask = query_mask
        meta.row_batch, meta.row_query = _query_rows(extend_lens, device)
    return meta


def _query_rows(extend_lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each new token's request and query index, in the flat [T] order."""
    row_batch = [b for b, e in enumerate(extend_lens) for _ in range(e)]
    row_query = [j for e in extend_lens for j in range(e)]
    return (torch.tensor(row_batch, dtype=torch.int32, device=device),
            torch.tensor(row_query, dtype=torch.int32, device=device))


def _split_metadata(prefix_lens, extend_lens, kv_indices, out_cache_loc, tree_masks, num_kv_groups,
                    pad_slot) -> AttentionMetadata:
    """Decode rows (one new token) and wider requests (verification trees) attend in two
    groups, so one tree does not pad every decode row of the batch to its width. Results
    are the same bits (row-invariant attention); only the padding work goes."""
    device = kv_indices.device
    starts = [0]
    for e in extend_lens[:-1]:
        starts.append(starts[-1] + e)
    parts = []
    for group in ([b for b, e in enumerate(extend_lens) if e == 1], [b for b, e in enumerate(extend_lens) if e > 1]):
        rows = torch.tensor([t for b in group for t in range(starts[b], starts[b] + extend_lens[b])], device=device)
        index = torch.tensor(group, device=device)
        masks = None if tree_masks is None else [tree_masks[b] for b in group]
        part = build_metadata([prefix_lens[b] for b in group], [extend_lens[b] for b in group],
                              kv_indices.index_select(0, index), out_cache_loc.index_select(0, rows), masks,
                              num_kv_groups, pad_slot)
        parts.append((rows, part))
    return AttentionMetadata(out_cache_loc, kv_indices, None, None, None, len(extend_lens), max(extend_lens),
                             True, parts)


def _padded_key_slots(kv_indices: torch.Tensor, total_lens: list[int], pad_slot: int) -> torch.Tensor:
    """[B, L'] slots, L' = max length rounded up to KEY_BLOCK; every key past a request's
    length reads ``pad_slot`` (zeros), so masked keys never hold stale or NaN data."""
    padded_len = -(-max(total_lens) // KEY_BLOCK) * KEY_BLOCK
    width = min(padded_len, kv_indices.shape[1])
    slots = torch.full((kv_indices.shape[0], padded_len), pad_slot, dtype=kv_indices.dtype,
                       device=kv_indices.device)
    lens = torch.tensor(total_lens, device=kv_indices.device)[:, None]
    live = torch.arange(width, device=kv_indices.device)[None, :] < lens
    slots[:, :width] = torch.where(live, kv_indices[:, :width], pad_slot)
    return slots


def _padding_indices(extend_lens: list[int], max_q: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.tensor([0] + extend_lens[:-1], device=device).cumsum(0)   # [B]
    lens = torch.tensor(extend_lens, device=device)                           # [B]
    offs = torch.arange(max_q, device=device)                                 # [Q]
    valid = offs[None, :] < lens[:, None]                                     # [B, Q]
    query_index = torch.where(valid, starts[:, None] + offs[None, :], 0).reshape(-1)
    output_index = valid.reshape(-1).nonzero().squeeze(1)
    return query_index, output_index


def _causal_mask(prefix_lens, extend_lens, max_q, max_len, device) -> torch.Tensor:
    prefix = torch.tensor(prefix_lens, device=device)[:, None, None]         # [B, 1, 1]
    extend = torch.tensor(extend_lens, device=device)[:, None, None]
    q_pos = torch.arange(max_q, device=device)[None, :, None]                 # [1, Q, 1]
    k_pos = torch.arange(max_len, device=device)[None, None, :]               # [1, 1, L]
    q_pos = torch.minimum(q_pos, extend - 1)      # padded query rows copy the last real row
    mask = k_pos <= prefix + q_pos                                            # [B, Q, L]
    return mask.unsqueeze(1)                                                  # [B, 1, Q, L]


def _apply_tree_masks(mask: torch.Tensor, prefix_lens: list[int], tree_masks) -> None:
    for b, tree_mask in enumerate(tree_masks):
        if tree_mask is None:
            continue
        n, p = tree_mask.shape[0], prefix_lens[b]
        mask[b, 0, :n, p:p + n] = tree_mask


class TorchSDPABackend:
    """Attention with torch SDPA over gathered paged K/V (CPU and CUDA)."""

    name = "torch_sdpa"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, nh, hd]; k, v: [T, nkv, hd] (new tokens). Returns [T, nh * hd]."""
        k_layer, v_layer = cache.k[layer_id], cache.v[layer_id]
        k_layer.index_copy_(0, meta.out_cache_loc, k.to(k_layer.dtype))    # --kv-cache-dtype may differ
        v_layer.index_copy_(0, meta.out_cache_loc, v.to(v_layer.dtype))
        if meta.row_batch is not None and attention_kernel.can_run(q, k_layer):
            return attention_kernel.paged_attention(q, k_layer, v_layer, meta.kv_indices, meta.query_mask,
                                                    meta.row_batch, meta.row_query)
        if meta.parts is None:
            return self._attend(q, k_layer, v_layer, meta)
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        for rows, part in meta.parts:
            out.index_copy_(0, rows, self._attend(q.index_select(0, rows), k_layer, v_layer, part))
        return out

    @staticmethod
    def _attend(q: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q: [T, nh, hd] of ``meta``'s requests, whose K/V are in the cache. Returns [T, nh * hd]."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv = k_layer.shape[1]
        group = num_heads // num_kv
        bsz, max_q = meta.batch_size, meta.max_query_len
        if meta.query_index is not None:
            q = q.index_select(0, meta.query_index)
        # [B, Q, nkv, group, hd] -> [B, nkv, group * Q, hd]
        q = q.view(bsz, max_q, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(bsz, num_kv, group * max_q, head_dim)
        keys = _gather(k_layer, meta.kv_indices).transpose(1, 2).to(q.dtype)    # [B, nkv, L, hd]
        values = _gather(v_layer, meta.kv_indices).transpose(1, 2).to(q.dtype)
        if meta.row_invariant:
            out = row_invariant_attention(q, keys, values, meta.grouped_mask())
        else:
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.grouped_mask())  # [B, nkv, g*Q, hd]
        out = out.view(bsz, num_kv, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(bsz * max_q, num_heads * head_dim)
        if meta.output_index is not None:
            out = out.index_select(0, meta.output_index)
        return out


def _gather(layer: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """layer[slots] ([B, L, nkv, hd]); index_select is ~3x faster than advanced indexing on
    CPU and hardly slows down when a request's slots are scattered over the pool."""
    return layer.index_select(0, slots.reshape(-1)).view(*slots.shape, *layer.shape[1:])


def get_backend(name: str | None) -> TorchSDPABackend:
    if name in (None, "torch_sdpa", "torch_native", "sdpa"):
        return TorchSDPABackend()
    raise ValueError(f"--attention-backend {name!r} is not available (supported: torch_sdpa)")
