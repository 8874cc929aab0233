"""One Llama decoder layer in one native call, for decode-shaped forwards (``decoder_layer.c``).

``LayerWeights`` holds a layer's weight pointers (built once per layer: weights do not move
while serving); ``decoder_layer`` updates the residual stream ``h`` in place. The linears come
as ``skinny.LinearWeights`` (dense weights, maybe code blocks too).
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.kernels import build
from specserve.kernels.attention import kv_strides
from specserve.kernels.build import DTYPE_CODES
from specserve.kernels.skinny import LinearWeights


@dataclass
class LayerWeights:
    tensors: tuple[torch.Tensor, ...]       # kept alive: the pointers below point into them
    norms: ctypes.Array                     # ln1, ln2
    linears: ctypes.Array                   # qkv, o, gate_up, down (their tensors: the caller's)
    qkv_bias: torch.Tensor | None           # float32
    dims: ctypes.Array                      # hidden, heads, kv heads, head dim, intermediate, qkv input width
    eps: float


def is_available() -> bool:
    return _function() is not None


def layer_weights(ln1: torch.Tensor, ln2: torch.Tensor, linears: tuple[LinearWeights, ...],
                  qkv_bias: torch.Tensor | None, hidden_size: int, intermediate_size: int,
                  num_heads: int, num_kv_heads: int, head_dim: int, eps: float,
                  input_size: int | None = None) -> LayerWeights:
    """``linears``: qkv, o, gate_up and down, whose tensors must outlive the result;
    ``input_size``: qkv's input width when the caller forms that input (``decoder_layer``'s
    ``x_in``; default ``hidden_size``)."""
    tensors = tuple(t.detach().contiguous() for t in (ln1, ln2))
    norms = (ctypes.c_void_p * 2)(*(t.data_ptr() for t in tensors))
    dims = (ctypes.c_int * 6)(hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
                              input_size or hidden_size)
    bias = None if qkv_bias is None else qkv_bias.detach().float().contiguous()
    return LayerWeights(tensors, norms, (LinearWeights * 4)(*linears), bias, dims, eps)


def decoder_layer(h: torch.Tensor, weights: LayerWeights, cos: torch.Tensor, sin: torch.Tensor,
                  k_layer: torch.Tensor, v_layer: torch.Tensor, out_cache_loc: torch.Tensor,
                  kv_indices: torch.Tensor, query_mask: torch.Tensor, row_batch: torch.Tensor,
                  row_query: torch.Tensor, x_in: torch.Tensor | None = None) -> None:
    """h [T, H] contiguous (updated in place); cos/sin [T, head_dim] in h's dtype; the new
    tokens' K/V go to ``out_cache_loc`` of k_layer/v_layer [S, kv heads, head_dim]; attention
    metadata as in ``attention.paged_attention``. ``x_in`` [T, input width] contiguous: the
    attention's input formed by the caller (then the layer's first norm is not applied)."""
    x_in = None if x_in is None else x_in.contiguous()
    status = _function()(
        h.data_ptr(), None if x_in is None else x_in.data_ptr(), *_weight_arguments(weights),
        cos.contiguous().data_ptr(), sin.contiguous().data_ptr(),
        *_cache_arguments(h, k_layer, v_layer, out_cache_loc, kv_indices, query_mask, row_batch, row_query))
    if status != 0:
        raise RuntimeError(f"decoder_layer rejected the layer's shapes {list(weights.dims)}")


def _weight_arguments(weights: LayerWeights) -> tuple:
    """A layer's norms, linears, qkv bias, eps and dims, as decoder_layer.c's functions take them."""
    return (ctypes.addressof(weights.norms), ctypes.addressof(weights.linears),
            None if weights.qkv_bias is None else weights.qkv_bias.data_ptr(), weights.eps,
            ctypes.addressof(weights.dims))


def _cache_arguments(h: torch.Tensor, k_layer: torch.Tensor, v_layer: torch.Tensor, out_cache_loc: torch.Tensor,
                     kv_indices: torch.Tensor, query_mask: torch.Tensor, row_batch: torch.Tensor,
                     row_query: torch.Tensor) -> tuple:
    """One layer's K/V, the attention metadata, the row count, dtypes and threads of a call with
    rows ``h``, as decoder_layer.c's one-layer functions take them."""
    kv_indices, query_mask = kv_indices.contiguous(), query_mask.contiguous()
    batch, num_queries, num_keys = query_mask.shape
    return (k_layer.data_ptr(), v_layer.data_ptr(), *kv_strides(k_layer, v_layer),
            out_cache_loc.contiguous().data_ptr(), kv_indices.data_ptr(),
            query_mask.data_ptr(), row_batch.data_ptr(), row_query.data_ptr(), h.shape[0], num_keys, num_queries,
            DTYPE_CODES[h.dtype], DTYPE_CODES[k_layer.dtype], torch.get_num_threads())


@dataclass
class LayerStack:
    """Every layer's weights, for ``decoder_layers`` (one native call for the whole stack)."""
    layers: tuple[LayerWeights, ...]        # kept alive: the arrays below point into them
    norms: ctypes.Array
    linears: ctypes.Array
    qkv_biases: ctypes.Array
    dims: ctypes.Array
    eps: float
    aux_pointers: dict = field(default_factory=dict)   # capture layers -> their pointer array (_aux_pointers)


def layer_stack(layers: tuple[LayerWeights, ...]) -> LayerStack:
    """The layers (same shapes and eps) as one stack."""
    norms = (ctypes.c_void_p * (2 * len(layers)))(*(p for w in layers for p in w.norms))
    linears = (LinearWeights * (4 * len(layers)))(*(lw for w in layers for lw in w.linears))
    biases = (ctypes.c_void_p * len(layers))(*(None if w.qkv_bias is None else w.qkv_bias.data_ptr()
                                               for w in layers))
    return LayerStack(layers, norms, linears, biases, layers[0].dims, layers[0].eps)


class CapturedInputs(Sequence):
    """The captured layer inputs ([T, H] each, ascending layers) as views of ``joined``
    [T, n * H], their concatenation (what an EAGLE-3 head reads; the views are made when read,
    ~15 us less Python a forward than making them each time); without captures empty, ``joined``
    None."""

    def __init__(self, joined: torch.Tensor | None, count: int) -> None:
        self.joined, self._count = joined, count

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, index):
        if self.joined is None:
            raise IndexError("no captured inputs")
        return self.joined.view(self.joined.shape[0], self._count, -1).unbind(1)[index]


def decoder_layers(h: torch.Tensor, stack: LayerStack, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, out_cache_loc: torch.Tensor, kv_indices: torch.Tensor,
                   query_mask: torch.Tensor, row_batch: torch.Tensor, row_query: torch.Tensor,
                   capture: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """``decoder_layer`` for every layer of the stack in turn; k_cache/v_cache [layers, S, kv heads,
    head_dim], each layer's as ``attention.kv_strides`` takes it. Returns the inputs of the layers
    in ``capture`` (ascending), copies of h (``CapturedInputs``)."""
    aux_out = _aux_pointers(stack, capture)
    captured = _captures(h, aux_out, capture)
    static = _stack_static(stack, k_cache, v_cache)
    status = _stack_function()(h.data_ptr(), *static[:6], cos.contiguous().data_ptr(), sin.contiguous().data_ptr(),
                               *static[6:], *_stack_dynamic(h, k_cache, out_cache_loc, kv_indices, query_mask,
                                                            row_batch, row_query, aux_out, len(capture)))
    if status != 0:
        raise RuntimeError(f"decoder_layers rejected the layers' shapes {list(stack.dims)}")
    return captured


@dataclass
class ModelEnds:
    """What ``model_stack`` adds around the layers: the embedding table [vocab, H] (the layers'
    dtype), rotary tables [positions, head_dim] (float32) and the final norm (None: the caller
    norms the output itself)."""
    embedding: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor
    final_norm: torch.Tensor | None
    final_eps: float

    def usable(self) -> bool:
        """Whether ``model_stack`` can run these ends (with inputs it ``takes_inputs``; else the
        caller's torch ends run)."""
        return (self.embedding.is_contiguous() and self.embedding.dtype in DTYPE_CODES
                and self.cos_table.dtype == torch.float32 and self.cos_table.is_contiguous()
                and self.sin_table.is_contiguous()
                and (self.final_norm is None or self.final_norm.dtype == self.embedding.dtype))

    @staticmethod
    def takes_inputs(input_ids: torch.Tensor, positions: torch.Tensor) -> bool:
        """Whether ``model_stack`` takes these inputs: int64 ids and positions, one per token."""
        return (input_ids.dtype == torch.int64 and positions.dtype == torch.int64 and input_ids.dim() == 1
                and positions.shape == input_ids.shape)


@dataclass(frozen=True)
class StackCall:
    """``model_stack``'s arguments that stay the same from call to call for one layer stack,
    model ends, KV cache and capture, as the native function takes them (built once: serving
    moves none of them; each call then passes only its inputs and metadata: ~30 us less Python
    a forward in a served step on the Xeon)."""
    stack: LayerStack                        # kept alive: the pointers below point into these
    ends: ModelEnds
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    capture: tuple[int, ...]
    embedding_arguments: tuple               # the embedding and its rows
    rotary_arguments: tuple                  # the cos and sin tables and their rows
    final_arguments: tuple                   # the final norm (or NULL) and its eps
    layer_arguments: tuple                   # _stack_static's
    aux_out: ctypes.Array | None             # capture pointers (set each call)


def stack_call(stack: LayerStack, ends: ModelEnds, k_cache: torch.Tensor, v_cache: torch.Tensor,
               capture: tuple[int, ...] = ()) -> StackCall:
    """``model_stack``'s fixed arguments: the layers, the model's ends (``ends.usable`` must
    hold), k_cache/v_cache [layers, S, kv heads, head_dim] as ``decoder_layers`` takes them, and
    the layers whose inputs each call captures (ascending)."""
    final = (None, ends.final_eps) if ends.final_norm is None else (ends.final_norm.data_ptr(), ends.final_eps)
    return StackCall(stack, ends, k_cache, v_cache, capture, (ends.embedding.data_ptr(), ends.embedding.shape[0]),
                     (ends.cos_table.data_ptr(), ends.sin_table.data_ptr(), ends.cos_table.shape[0]), final,
                     _stack_static(stack, k_cache, v_cache), _aux_pointers(stack, capture))


def model_stack(input_ids: torch.Tensor, positions: torch.Tensor, call: StackCall, out_cache_loc: torch.Tensor,
                kv_indices: torch.Tensor, query_mask: torch.Tensor, row_batch: torch.Tensor,
                row_query: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The embedding of ``input_ids``, ``decoder_layers`` at ``positions`` and the final norm in
    one native call (``ModelEnds.takes_inputs`` must hold): returns (the output [T, H], normed
    when ``call.ends.final_norm`` is set; the captured layer inputs). The same bits as the
    separate calls."""
    embedding = call.ends.embedding
    h = embedding.new_empty(input_ids.shape[0], embedding.shape[1])
    out = h if call.ends.final_norm is None else torch.empty_like(h)
    captured = _captures(h, call.aux_out, call.capture)
    status = _model_function()(
        input_ids.contiguous().data_ptr(), *call.embedding_arguments, positions.contiguous().data_ptr(),
        *call.rotary_arguments, *call.final_arguments, out.data_ptr(), h.data_ptr(), *call.layer_arguments,
        *_stack_dynamic(h, call.k_cache, out_cache_loc, kv_indices, query_mask, row_batch, row_query, call.aux_out,
                        len(call.capture)))
    if status != 0:
        raise RuntimeError(f"model_stack rejected ids, positions or the layers' shapes {list(call.stack.dims)}")
    return out, captured


@dataclass(frozen=True)
class Eagle3Weights:
    """An EAGLE-3 head's arguments to ``eagle3_head`` that stay the same from call to call, as
    the native function takes them (built once: serving never moves the head's weights; each
    call then passes only its inputs: its Python 66 -> ~24 us in a served step on the Xeon)."""
    ends: ModelEnds                          # kept alive: the embedding and rotary pointers below
    fc: LinearWeights | None                 # kept alive: fc_address points at it
    layer: LayerWeights
    norm_tensors: tuple[torch.Tensor, torch.Tensor]
    embedding_arguments: tuple               # the embedding and its rows
    rotary_arguments: tuple                  # the cos and sin tables and their rows
    fc_address: int | None
    norm_arguments: tuple                    # in_norm, eps, hidden_norm, eps
    weight_arguments: tuple                  # _weight_arguments(layer)
    width: int                               # H: the head's hidden size


def eagle3_weights(ends: ModelEnds, fc: LinearWeights | None, in_norm: tuple[torch.Tensor, float],
                   hidden_norm: tuple[torch.Tensor, float], layer: LayerWeights) -> Eagle3Weights:
    """``eagle3_head``'s fixed arguments: the model's ends (``ends.final_norm`` is not read), fc
    (None: the head takes H-wide features only), both norms (weight, eps) and the midlayer."""
    norms = (in_norm[0].contiguous(), hidden_norm[0].contiguous())
    return Eagle3Weights(ends, fc, layer, norms, (ends.embedding.data_ptr(), ends.embedding.shape[0]),
                         (ends.cos_table.data_ptr(), ends.sin_table.data_ptr(), ends.cos_table.shape[0]),
                         None if fc is None else ctypes.addressof(fc),
                         (norms[0].data_ptr(), in_norm[1], norms[1].data_ptr(), hidden_norm[1]),
                         _weight_arguments(layer), layer.dims[0])


def eagle3_head(input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor, weights: Eagle3Weights,
                k_layer: torch.Tensor, v_layer: torch.Tensor, out_cache_loc: torch.Tensor, kv_indices: torch.Tensor,
                query_mask: torch.Tensor, row_batch: torch.Tensor, row_query: torch.Tensor) -> torch.Tensor:
    """An EAGLE-3 head's forward in one native call (``decoder_layer.c``'s ``eagle3_head``): fc of
    the features (those H wide go as they are), the embedding's rows of ``input_ids``, both
    normed side by side, the midlayer at ``positions``. Returns the head's output [T, H] before its
    final norm, with the bits of the separate calls. ``ModelEnds.takes_inputs`` must hold, and
    ``weights.fc`` be set for features wider than H; the rest in the midlayer's dtype."""
    features = features.contiguous()
    h = features.new_empty(input_ids.shape[0], weights.width)
    fc = weights.fc_address if features.shape[1] != weights.width else None
    status = _eagle3_function()(
        input_ids.contiguous().data_ptr(), *weights.embedding_arguments, positions.contiguous().data_ptr(),
        *weights.rotary_arguments, fc, features.data_ptr(), features.shape[1], *weights.norm_arguments,
        h.data_ptr(), *weights.weight_arguments,
        *_cache_arguments(h, k_layer, v_layer, out_cache_loc, kv_indices, query_mask, row_batch, row_query))
    if status != 0:
        raise RuntimeError(f"eagle3_head rejected ids, positions or the midlayer's shapes {list(weights.layer.dims)}")
    return h


def head_logits(h: torch.Tensor, logit_rows: torch.Tensor | None, final_norm: tuple[torch.Tensor, float] | None,
                lm_head: LinearWeights, vocab: int, bias32: torch.Tensor | None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A draft head's last steps in one native call (``decoder_layer.c``'s ``head_logits``): the
    rows ``logit_rows`` of ``h`` [T, H] (None: all), their logits ``lm_head(norm(rows))`` [R, vocab]
    (``final_norm`` (weight, eps) or None) and each row's argmax [R] int64, a NaN counting as the
    largest (``sampler.argmax_rows``). The bits of the separate calls: the skinny kernel's
    ``linear_forward`` and ``rms_norm``; ``can_run_head_logits`` must hold."""
    if logit_rows is not None:
        logit_rows = logit_rows.to(torch.int64).contiguous()
    rows = h.shape[0] if logit_rows is None else logit_rows.shape[0]
    out, logits = h.new_empty(rows, h.shape[1]), h.new_empty(rows, vocab)
    ids = torch.empty(rows, dtype=torch.int64)
    norm, eps = (None, 0.0) if final_norm is None else (final_norm[0].data_ptr(), final_norm[1])
    status = _head_logits_function()(
        h.data_ptr(), h.shape[0], h.shape[1], None if logit_rows is None else logit_rows.data_ptr(), rows, norm, eps,
        ctypes.byref(lm_head), None if bias32 is None else bias32.data_ptr(), vocab, out.data_ptr(),
        logits.data_ptr(), ids.data_ptr(), DTYPE_CODES[h.dtype], torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"head_logits rejected rows of {tuple(h.shape)} or the LM head's shape")
    return out, logits, ids


def can_run_head_logits(h: torch.Tensor, final_norm: torch.Tensor | None) -> bool:
    """Whether ``head_logits`` takes ``h`` (CPU, no gradient, 2-D, contiguous, float32/bfloat16, width a
    multiple of 8, at least one row) and the norm's weight (None, or contiguous in h's dtype), the kernels built."""
    return (h.device.type == "cpu" and not torch.is_grad_enabled() and h.dim() == 2 and h.shape[0] > 0
            and h.is_contiguous() and h.dtype in DTYPE_CODES and h.shape[1] % 8 == 0
            and (final_norm is None or (final_norm.dtype == h.dtype and final_norm.is_contiguous()))
            and _head_logits_function() is not None)


def _stack_static(stack: LayerStack, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
    """decoder_layers' and model_stack's arguments for the layers and the K/V caches (decoder_layers
    takes cos and sin after the sixth)."""
    layer_bytes = k_cache.stride(0) * k_cache.element_size()      # where layer l + 1 starts after layer l
    if v_cache.stride(0) != k_cache.stride(0):
        raise ValueError("the K and V caches' layers lie differently")
    return (ctypes.addressof(stack.norms), ctypes.addressof(stack.linears), ctypes.addressof(stack.qkv_biases),
            stack.eps, ctypes.addressof(stack.dims), len(stack.layers), k_cache.data_ptr(), v_cache.data_ptr(),
            layer_bytes, *kv_strides(k_cache[0], v_cache[0]))


def _stack_dynamic(h: torch.Tensor, k_cache: torch.Tensor, out_cache_loc: torch.Tensor, kv_indices: torch.Tensor,
                   query_mask: torch.Tensor, row_batch: torch.Tensor, row_query: torch.Tensor,
                   aux_out: ctypes.Array | None, num_captured: int) -> tuple:
    """The arguments after _stack_static's: the metadata, the capture pointers and width, the row
    and key counts, dtypes and threads."""
    kv_indices, query_mask = kv_indices.contiguous(), query_mask.contiguous()
    batch, num_queries, num_keys = query_mask.shape
    return (out_cache_loc.contiguous().data_ptr(), kv_indices.data_ptr(), query_mask.data_ptr(),
            row_batch.data_ptr(), row_query.data_ptr(), aux_out, num_captured * h.shape[1], h.shape[0], num_keys,
            num_queries, DTYPE_CODES[h.dtype], DTYPE_CODES[k_cache.dtype], torch.get_num_threads())


def _captures(h: torch.Tensor, aux_out: ctypes.Array | None, capture: tuple[int, ...]) -> "CapturedInputs":
    """Fresh copies for the inputs of the layers in ``capture`` (the features outlive the forward),
    their addresses set in ``aux_out``, the stack's capture pointers (``_aux_pointers``)."""
    if not capture:
        return CapturedInputs(None, 0)
    width = h.shape[1]
    joined = h.new_empty(h.shape[0], len(capture) * width)
    base, step = joined.data_ptr(), width * joined.element_size()
    for i, layer_id in enumerate(capture):
        aux_out[layer_id] = base + i * step
    return CapturedInputs(joined, len(capture))


def _aux_pointers(stack: LayerStack, capture: tuple[int, ...]) -> ctypes.Array | None:
    """The stack's array of capture pointers for these layers (one per layer, NULL where not
    captured), made once: only ``capture``'s entries are ever set in it. None without captures."""
    if not capture:
        return None
    array = stack.aux_pointers.get(capture)
    if array is None:
        array = stack.aux_pointers[capture] = (ctypes.c_void_p * len(stack.layers))()
    return array


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """HF's RMSNorm of the rows of ``x`` [T, H] (contiguous; ``weight`` in its dtype) in one native
    call, into ``out`` (default a new tensor; or any [T, H] view whose rows are contiguous, such
    as a column block of a wider tensor). Per row, so row-invariant; the bits may differ from
    torch's in the last place."""
    out = torch.empty_like(x) if out is None else out
    status = _norm_function()(x.data_ptr(), weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0],
                              x.shape[1], eps, DTYPE_CODES[x.dtype])
    if status != 0:
        raise RuntimeError(f"rms_norm rejected width {x.shape[1]}")
    return out


def can_run_norm(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``rms_norm`` takes these: CPU, no gradient, same float32/bfloat16 dtype, 2-D
    contiguous, width a multiple of 8, kernels built."""
    return (x.device.type == "cpu" and not torch.is_grad_enabled() and x.dim() == 2 and x.is_contiguous()
            and x.dtype in DTYPE_CODES and weight.dtype == x.dtype and x.shape[1] % 8 == 0
            and weight.is_contiguous() and _norm_function() is not None)


@build.cached_lookup
def _norm_function():
    return build.function("rms_norm_rows", [ctypes.c_void_p] * 3 + [ctypes.c_long, ctypes.c_int, ctypes.c_int,
                                                                     ctypes.c_float, ctypes.c_int])


@build.cached_lookup
def _stack_function():
    return build.function("decoder_layers", _STACK_HEAD + [ctypes.c_void_p] * 2 + _STACK_TAIL)


@build.cached_lookup
def _model_function():
    return build.function("model_stack", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                          ctypes.c_float, ctypes.c_void_p]
                          + _STACK_HEAD + _STACK_TAIL)


@build.cached_lookup
def _eagle3_function():
    return build.function("eagle3_head", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p,
                                          ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_float,
                                          ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p]
                          + _CACHE_ARGUMENTS)


@build.cached_lookup
def _head_logits_function():
    return build.function("head_logits", [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                          ctypes.c_void_p, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                          ctypes.c_int, ctypes.c_int])


# decoder_layers' arguments before cos and sin (h .. num_layers) and after them (k_cache ..)
_STACK_HEAD = [ctypes.c_void_p] * 4 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
_STACK_TAIL = ([ctypes.c_void_p] * 2 + [ctypes.c_long] * 3 + [ctypes.c_void_p] * 6 + [ctypes.c_long]
               + [ctypes.c_int] * 6)
# _cache_arguments' types: K and V, their kv_strides, the metadata, rows, sizes, dtypes, threads
_CACHE_ARGUMENTS = [ctypes.c_void_p] * 2 + [ctypes.c_long] * 2 + [ctypes.c_void_p] * 5 + [ctypes.c_int] * 6


@build.cached_lookup
def _function():
    return build.function("decoder_layer", [ctypes.c_void_p] * 5 + [ctypes.c_float] + [ctypes.c_void_p] * 3
                          + _CACHE_ARGUMENTS)


PROFILE_OPS = ("norms + adds", "qkv", "rotary + kv write", "attention", "o_proj", "gate_up", "silu", "down",
               "input quantization")     # profile.h's order; the quantization is inside the linears' times


def profile(enable: bool) -> dict[str, float]:
    """Seconds per op of the native layers since the last call (then reset); ``enable`` turns the
    clock on or off from now. Empty where the kernels are not built."""
    fn = build.function("layer_profile", [ctypes.c_int, ctypes.c_void_p])
    if fn is None:
        return {}
    seconds = (ctypes.c_double * len(PROFILE_OPS))()
    fn(int(enable), ctypes.addressof(seconds))
    return dict(zip(PROFILE_OPS, seconds))
