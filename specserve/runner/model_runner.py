"""ModelRunner: owns the model, its KV tensors and the request→slot table,
and turns a list of per-request extends into one forward pass."""
from __future__ import annotations

import contextlib
import functools
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import numpy as np
import torch

from specserve.config import ModelConfig
from specserve.kernels import attention as attention_kernel
from specserve.kernels import huge_pages, os_memory
from specserve.models.attention import KVCache, build_metadata
from specserve.models.cpu_metadata import build_cpu_metadata
from specserve.models.layers import use_native_norms
from specserve.models.llama import LlamaForCausalLM
from specserve.models.packed_linear import (codes_only_weights, drop_dense_weights, integer_kernel_takes,
                                           integer_quantization, pack_codes_only, pack_linears_for_cpu,
                                           runs_integer)
from specserve.models.weights import built_on_meta

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """``--kv-cache-dtype``: auto = the model's dtype; bf16/bfloat16."""
    return torch.bfloat16 if kv_cache_dtype in ("bf16", "bfloat16") else dtype


def resolve_dtype(dtype: str, model_config: ModelConfig, device: str) -> torch.dtype:
    """``auto``: float32 on CPU; on CUDA the checkpoint's float16, else bfloat16.

    CPU bfloat16 is faster but its matmul kernels change with the number of rows
    (more than 32 rows take another kernel), so prefix-cache hits, chunked prefill,
    batching and speculative verification can change greedy outputs. float32
    keeps greedy output identical across all of them, so it is the CPU default.
    """
    if dtype != "auto":
        return _DTYPES[dtype]
    if not device.startswith("cuda"):
        return torch.float32
    stored = model_config.torch_dtype.replace("torch.", "")
    return torch.float16 if stored == "float16" else torch.bfloat16


def in_inference_mode(fn):
    """``torch.inference_mode()`` around ``fn``, entered only where it is not on already: a speculative
    step runs its verification and draft forwards in one (entering and leaving cost ~10 us a call)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)
    return wrapper


@dataclass
class ExtendSpec:
    """New tokens for one request in one forward pass."""

    row: int                           # the request's row in the req→slot table
    prefix_len: int                    # tokens already in the KV cache
    token_ids: list[int]
    new_slots: list[int]               # KV slots for token_ids, in order
    positions: list[int] | None = None # rope positions; None = prefix_len + i
    tree_mask: torch.Tensor | None = None  # [n, n] bool among the new tokens; None = causal
    num_logits: int = 1                # logits for the last num_logits tokens (0: none)


class ModelRunner:
    def __init__(self, model_config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]],
                 *, dtype: torch.dtype, device: str, max_position: int, num_kv_slots: int,
                 page_size: int, max_rows: int, max_row_len: int, quantization: str | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.config, self.dtype, self.device = model_config, dtype, torch.device(device)
        self.kv_dtype = kv_dtype or dtype
        self.model = build_model(model_config, weights, dtype, device, max_position, quantization)
        self._init_slots(num_kv_slots, page_size, max_rows, max_row_len)

    def _init_slots(self, num_kv_slots: int, page_size: int, max_rows: int, max_row_len: int) -> None:
        """KV tensors (plus one zeroed dummy page at the end, for padded reads) and the
        request->slot table, for ``self.config`` in ``self.kv_dtype`` on ``self.device``."""
        cfg = self.config
        self.dummy_slot = num_kv_slots
        self.kv_cache = KVCache(cfg.num_hidden_layers, num_kv_slots + page_size,
                                cfg.num_key_value_heads, cfg.head_dim, self.kv_dtype, self.device,
                                num_zeroed_tail=page_size)
        self.req_to_token = torch.full((max_rows, max_row_len), self.dummy_slot,
                                       dtype=torch.int64, device=self.device)
        self.num_kv_groups = cfg.num_attention_heads // cfg.num_key_value_heads
        # the native kernel's metadata comes from a numpy view of the table (same memory)
        self._table = (self.req_to_token.numpy() if self.device.type == "cpu" and attention_kernel.is_available()
                       else None)
        self.capture_features: str | None = None     # "final" | "aux": keep last_features of every forward
        self.last_features: torch.Tensor | None = None

    def set_row_slots(self, row: int, start: int, slots: list[int]) -> None:
        if not slots:
            return
        if self._table is not None:
            self._table[row, start:start + len(slots)] = slots
        else:
            self.req_to_token[row, start:start + len(slots)] = torch.tensor(slots, dtype=torch.int64,
                                                                            device=self.device)

    @in_inference_mode
    def forward(self, specs: list[ExtendSpec], features: str | None = None, *, is_prefill: bool = False):
        """One forward over every spec. Returns logits [sum(num_logits), V].

        ``is_prefill``: prompt tokens (the engine's prefill), which always take the general
        path; other forwards of at most 64 new tokens a request take the row-invariant one
        (decode and verification), so a prompt's KV does not depend on whether it was
        prefilled alone or beside longer prompts.

        ``features`` also returns the target features of every new token (all rows,
        in spec order), as the EAGLE-family drafts consume them:
        ``"final"``: the final-normed hidden states [T, H] (EAGLE, NEXTN);
        ``"aux"``: the inputs of the layers in ``model.aux_layer_ids``, concatenated
        [T, len(aux) * H] (EAGLE3). Returns ``(logits, features)`` then.
        With ``capture_features`` set, every forward also leaves that kind of
        features in ``last_features`` (an EAGLE drafter reads them after prefill
        and verification).
        """
        input_ids, positions, meta, logit_rows = self.prepare(specs, is_prefill)
        out = self.model(input_ids, positions, self.kv_cache, meta)
        hidden, aux = out if isinstance(out, tuple) else (out, [])
        selected = hidden if logit_rows is None else hidden.index_select(0, logit_rows)
        logits = self.model.compute_logits(selected)
        if self.capture_features is not None:
            self.last_features = _features(self.capture_features, hidden, aux)
        if features is None:
            return logits
        if features == self.capture_features:
            return logits, self.last_features
        return logits, _features(features, hidden, aux)

    def prepare(self, specs: list[ExtendSpec], is_prefill: bool = False):
        """Write the specs' slots into their rows; flat inputs, attention metadata and logit rows."""
        input_ids, positions, out_loc, logit_rows = self._flatten(specs)
        for spec in specs:
            self.set_row_slots(spec.row, spec.prefix_len, spec.new_slots)
        pad_slot = None if is_prefill else self.dummy_slot
        if self._table is not None:
            meta = build_cpu_metadata([s.prefix_len for s in specs], [len(s.token_ids) for s in specs], self._table,
                                      [s.row for s in specs], out_loc, [s.tree_mask for s in specs],
                                      self.num_kv_groups, pad_slot)
            return input_ids, positions, meta, logit_rows
        rows = torch.tensor([s.row for s in specs], device=self.device)
        meta = build_metadata([s.prefix_len for s in specs], [len(s.token_ids) for s in specs],
                              self.req_to_token.index_select(0, rows), out_loc,
                              [s.tree_mask for s in specs], self.num_kv_groups,
                              pad_slot=pad_slot)
        return input_ids, positions, meta, logit_rows

    def _flatten(self, specs: list[ExtendSpec]):
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        for spec in specs:
            n = len(spec.token_ids)
            start = len(ids)
            ids.extend(spec.token_ids)
            pos.extend(spec.positions if spec.positions is not None
                       else range(spec.prefix_len, spec.prefix_len + n))
            slots.extend(spec.new_slots)
            logit_rows.extend(range(start + n - spec.num_logits, start + n))
        rows = None if len(logit_rows) == len(ids) else self._index_tensor(logit_rows)
        return self._index_tensor(ids), self._index_tensor(pos), self._index_tensor(slots), rows

    def _index_tensor(self, values: list[int]) -> torch.Tensor:
        if self.device.type == "cpu":       # through numpy: ~5x cheaper than torch.tensor for short lists
            return torch.from_numpy(np.asarray(values, dtype=np.int64))
        return torch.tensor(values, dtype=torch.int64, device=self.device)


def forward_on_free_slots(runner: ModelRunner, pool, token_ids: list[int], is_prefill: bool = False) -> torch.Tensor:
    """Logits at every position of ``token_ids`` (no prefix) forwarded on row 0 of an idle
    runner over fresh slots of ``pool``, which go back after: startup timing, benchmarks."""
    slots = pool.extend_slots([], len(token_ids))
    if slots is None:
        raise ValueError(f"the KV pool cannot hold {len(token_ids)} tokens: raise --max-total-tokens")
    try:
        spec = ExtendSpec(row=0, prefix_len=0, token_ids=token_ids, new_slots=slots, num_logits=len(token_ids))
        return runner.forward([spec], is_prefill=is_prefill)
    finally:
        pool.release_slots(slots)


@contextlib.contextmanager
def forwards_after_context(runner: ModelRunner, pool, context_ids: list[int],
                           max_width: int) -> Iterator[Callable[[int], torch.Tensor]]:
    """``forward(width)``: logits at every position of ``width`` new tokens (id 0; <= max_width)
    forwarded on row 0 of an idle runner after the tokens ``context_ids``, prefilled once; over
    fresh slots of ``pool``, which go back after. Startup timing at a decode step's attention cost."""
    context_len = len(context_ids)
    slots = pool.extend_slots([], context_len + max_width)
    if slots is None:
        raise ValueError(f"the KV pool cannot hold {context_len + max_width} tokens: raise --max-total-tokens")
    try:
        context, scratch = slots[:context_len], slots[context_len:]
        if context_len:
            runner.forward([ExtendSpec(row=0, prefix_len=0, token_ids=list(context_ids), new_slots=context)],
                           is_prefill=True)

        def forward(width: int) -> torch.Tensor:
            return runner.forward([ExtendSpec(row=0, prefix_len=context_len, token_ids=[0] * width,
                                              new_slots=scratch[:width], num_logits=width)])

        yield forward
    finally:
        pool.release_slots(slots)


def _features(kind: str, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
    if kind == "final":
        return hidden
    if kind == "aux":
        if not aux:
            raise ValueError("features 'aux' needs model.aux_layer_ids")
        joined = getattr(aux, "joined", None)           # the native stack's captures: already one tensor
        return joined if joined is not None else torch.cat(aux, dim=-1)
    raise ValueError(f"unknown features kind {kind!r}")


def build_model(cfg: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype,
                device: str, max_position: int, quantization: str | None = None) -> LlamaForCausalLM:
    """Materialize the model directly in ``dtype`` on ``device`` and load weights strictly;
    ``quantization`` "gguf": CPU linears with GGUF blocks run the integer kernels; "w8a8_int8":
    those without blocks are rounded to Q8_0 blocks first, so every linear runs them. With "gguf"
    the decoder layers' dense weights are never written where their blocks suffice
    (``codes_only_weights``): ``to_empty``'s pages for them are never touched, so never resident."""
    with built_on_meta():
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype).to_empty(device=device)      # in dtype at once: no float32 copy to convert
    model.tie_weights()
    pack = functools.partial(pack_codes_only, arena=huge_pages.Arena())
    model.load_weights(weights, codes_only_weights(model, quantization, device), integer_kernel_takes, pack)
    model.init_rotary(max_position, device)
    pack_linears_for_cpu(model, integer_quantization(model, quantization))
    if runs_integer(model):
        use_native_norms(model)
    drop_dense_weights(model.model.layers)
    os_memory.trim_heap()     # the dequantized tensors freed among the blocks kept (~150 MB of the default model)
    return model.eval()


def model_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Parameter bytes of a Llama-family model (tied embeddings counted once)."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * i + 2 * h
    total = cfg.num_hidden_layers * per_layer + v * h * (1 if cfg.tie_word_embeddings else 2) + h
    return total * torch.empty((), dtype=dtype).element_size()
