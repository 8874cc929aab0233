"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5/3, SmolLM).

Config flags cover the differences: qkv bias (Qwen2), per-head q/k RMSNorm
(Qwen3), tied embeddings, rope scaling. Q/K/V and gate/up projections are
fused; ``load_weights`` maps HF checkpoint names onto the fused parameters and
refuses anything it cannot place.
"""
from __future__ import annotations

from typing import Callable, Collection, Iterable

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.kernels import layer as native_layer
from specserve.kernels.coded import BlockCodes
from specserve.models.attention import AttentionMetadata, KVCache, TorchSDPABackend
from specserve.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from specserve.models.packed_linear import Linear
from specserve.models.weights import StrictLoader


class LlamaAttention(nn.Module):
    """``input_size``: width of the q/k/v projections' input (default hidden_size; EAGLE-3's 2H)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, input_size: int | None = None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(input_size or cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, backend: TorchSDPABackend) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)                                             # [T, q + 2kv]
        qk, v = qkv.split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], 1)
        qk = apply_rotary(qk, cos, sin)                                    # q and k heads at once
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, self.layer_id, cache, meta)         # [T, nh * hd]
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, input_size: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id, input_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self._native: native_layer.LayerWeights | None = None
        self._native_linears: tuple[Linear, ...] | None = None   # () where the native layer cannot run

    def forward(self, h: torch.Tensor, cos, sin, cache, meta, backend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))

    def can_run_native(self, num_rows: int) -> bool:
        """Whether ``forward_native`` computes this layer for ``num_rows`` rows: every linear
        routes that many rows to the skinny kernel (so the two paths share their linears) and
        the layer has no parts the native layer lacks (qk-norm, MLP or output biases)."""
        if self._native_linears is None:               # the structure is checked once
            attn, mlp = self.self_attn, self.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            is_supported = (attn.q_norm is None and attn.o_proj.bias is None and mlp.gate_up_proj.bias is None
                            and mlp.down_proj.bias is None and native_layer.is_available())
            self._native_linears = linears if is_supported else ()
        return (bool(self._native_linears) and all(m.skinny_max_rows >= num_rows for m in self._native_linears)
                and not torch.is_grad_enabled())

    def is_integer(self) -> bool:
        """Whether every linear runs the integer kernel (``--quantization gguf``): then every
        forward, prefill too, runs natively, so a row's bits never depend on which path its
        batch took (the torch layer's norms and adds may differ in the last place, which an
        8-bit input quantization can turn into a different code)."""
        return bool(self._native_linears) and all(m.int_panels is not None for m in self._native_linears)

    def runs_native(self, num_rows: int, meta) -> bool:
        """Whether this forward runs natively: kernels built, and decode-shaped (row-invariant)
        or every linear integer."""
        if getattr(meta, "row_batch", None) is None:     # not the serving metadata (e.g. training's)
            return False
        return self.can_run_native(num_rows) and (meta.row_invariant or self.is_integer())

    def forward_native(self, h: torch.Tensor, cos, sin, cache, meta, x_in: torch.Tensor | None = None) -> None:
        """The layer in one native call (``runs_native``); updates ``h`` in place. ``x_in``: the
        attention's input when the caller forms it (ln1 then unused). The weights' addresses
        are taken on the first call: the weights must not be replaced afterwards (serving never
        does)."""
        attn = self.self_attn
        native_layer.decoder_layer(h, self.native_weights(), cos, sin, cache.k[attn.layer_id],
                                   cache.v[attn.layer_id], meta.out_cache_loc, meta.kv_indices, meta.query_mask,
                                   meta.row_batch, meta.row_query, x_in)

    def native_weights(self) -> native_layer.LayerWeights:
        """The layer's weights for the native call, built once (the weights must not be replaced
        afterwards; serving never does)."""
        if self._native is None:
            attn, mlp = self.self_attn, self.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            self._native = native_layer.layer_weights(
                self.input_layernorm.weight, self.post_attention_layernorm.weight,
                tuple(linear.skinny_weights() for linear in linears), attn.qkv_proj.bias,
                attn.o_proj.out_features, mlp.down_proj.in_features, attn.num_heads, attn.num_kv_heads,
                attn.head_dim, self.input_layernorm.eps, input_size=attn.qkv_proj.in_features)
        return self._native


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Target model. ``forward`` returns final (normed) hidden states [T, H];
    ``compute_logits`` turns selected rows into logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rotary: RotaryEmbedding | None = None
        self.backend = TorchSDPABackend()
        self.aux_layer_ids: tuple[int, ...] = ()   # layers whose outputs EAGLE-3 captures
        self._native_stack: native_layer.LayerStack | None = None
        self._stack_limits: tuple[int, bool] | None = None    # (most rows, every linear integer)
        self._stack_calls: tuple | None = None   # (key, stack, model_stack's fixed arguments): _stack_call

    def tie_weights(self) -> None:
        """Share the embedding with the head (call again after moving the module)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_rotary(self, max_position: int, device) -> None:
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling).to(device)
        self._stack_calls = None                # they point at the rotary tables

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        if self._runs_stack_native(input_ids.shape[0], meta):
            return self._forward_stack(input_ids, positions, cache, meta)
        h = self.model.embed_tokens(input_ids)                              # [T, H]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)                 # [T, hd]
        aux: list[torch.Tensor] = []
        for i, layer in enumerate(self.model.layers):
            is_native = layer.runs_native(h.shape[0], meta)
            if i in self.aux_layer_ids:
                aux.append(h.clone() if is_native else h)
            if is_native:
                layer.forward_native(h, cos, sin, cache, meta)
            else:
                h = layer(h, cos, sin, cache, meta, self.backend)
        h = self.model.norm(h)
        return (h, aux) if self.aux_layer_ids else h

    def _forward_stack(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                       meta: AttentionMetadata) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """``forward`` with every layer in one native call, with the model's ends too where
        ``model_stack`` takes them (else torch's embedding, rotary rows and final norm around it)."""
        call = self._stack_call(cache)
        if call is not None and native_layer.ModelEnds.takes_inputs(input_ids, positions):
            h, aux = native_layer.model_stack(input_ids, positions, call, meta.out_cache_loc, meta.kv_indices,
                                              meta.query_mask, meta.row_batch, meta.row_query)
            normed = call.ends.final_norm is not None
        else:
            h = self.model.embed_tokens(input_ids)
            cos, sin = self.rotary.cos_sin(positions, h.dtype)
            aux = native_layer.decoder_layers(h, self._layer_stack(), cos, sin, cache.k, cache.v, meta.out_cache_loc,
                                              meta.kv_indices, meta.query_mask, meta.row_batch, meta.row_query,
                                              self._capture_layers())
            normed = False
        h = h if normed else self.model.norm(h)
        return (h, aux) if self.aux_layer_ids else h

    def _stack_call(self, cache: KVCache) -> native_layer.StackCall | None:
        """``model_stack``'s fixed arguments for this KV cache (None where the model's ends cannot
        run natively), built again only when the stack, the cache, the captured layers or the final
        norm's kernel changed (the weights and rotary tables must not move afterwards; serving
        never moves them, and ``init_rotary`` and ``load_weights`` start over)."""
        key = (cache.k.data_ptr(), cache.v.data_ptr(), self.aux_layer_ids, self.model.norm.native)
        held = self._stack_calls
        if held is None or held[0] != key or held[1] is not self._native_stack:
            stack, ends = self._layer_stack(), self._model_ends()
            call = native_layer.stack_call(stack, ends, cache.k, cache.v, self._capture_layers()) if ends.usable() \
                else None
            held = self._stack_calls = (key, stack, call)
        return held[2]

    def _capture_layers(self) -> tuple[int, ...]:
        """The layers whose inputs a forward captures (``aux_layer_ids`` within the model), ascending."""
        return tuple(sorted({i for i in self.aux_layer_ids if 0 <= i < len(self.model.layers)}))

    def _runs_stack_native(self, num_rows: int, meta: AttentionMetadata) -> bool:
        """Whether every layer runs natively for this forward (then in one call: ``decoder_layers``).
        The layers' limits are read once, on the first decode-shaped forward (serving never
        changes the layers afterwards)."""
        if meta.row_batch is None or torch.is_grad_enabled():
            return False
        if self._stack_limits is None or self._stack_is_stale():
            self._native_stack = None
            layers = self.model.layers
            runs = bool(len(layers)) and all(layer.can_run_native(1) for layer in layers)
            max_rows = min(m.skinny_max_rows for layer in layers for m in layer._native_linears) if runs else 0
            self._stack_limits = (max_rows, runs and all(layer.is_integer() for layer in layers))
        max_rows, is_integer = self._stack_limits
        return num_rows <= max_rows and (meta.row_invariant or is_integer)

    def _stack_is_stale(self) -> bool:
        """A layer dropped or rebuilt its native weights since the stack was built (e.g. its
        code blocks were dropped): the stack's pointers may dangle."""
        stack = self._native_stack
        return stack is not None and any(layer._native is not w for layer, w in zip(self.model.layers, stack.layers))

    def _layer_stack(self) -> native_layer.LayerStack:
        if self._native_stack is None:
            self._native_stack = native_layer.layer_stack(tuple(layer.native_weights() for layer in self.model.layers))
        return self._native_stack

    def _model_ends(self) -> native_layer.ModelEnds:
        """The embedding, rotary tables and final norm for ``model_stack``; the final norm only
        where it runs the native kernel (``RMSNorm.native``)."""
        norm, embedding = self.model.norm, self.model.embed_tokens.weight
        native_norm = norm.native and norm.weight.dtype == embedding.dtype
        return native_layer.ModelEnds(embedding, self.rotary.cos_cached, self.rotary.sin_cached,
                                      norm.weight if native_norm else None, norm.eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)                                         # [T, V]

    # ---- weights --------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], codes_only: Collection[str] = (),
                     codes_suffice: Callable[[BlockCodes], bool] | None = None,
                     on_codes_only: Callable[[nn.Module], None] | None = None) -> None:
        """Strictly (``StrictLoader``); ``codes_only``, ``codes_suffice``, ``on_codes_only``: the
        parameters that keep no dense copy where their GGUF codes suffice (``StrictLoader``)."""
        self._stack_calls = None
        cfg = self.config
        loader = StrictLoader(self, codes_only, codes_suffice, on_codes_only)
        add_fused_decoder_weights(loader, cfg)
        loader.ignore_suffix("rotary_emb.inv_freq")
        if cfg.tie_word_embeddings:
            loader.ignore("lm_head.weight")   # HF semantics: tied models ignore a stored head
        mtp_prefixes = mtp_weight_prefixes(cfg)   # the NEXTN draft's layers, loaded by models/mtp.py
        if mtp_prefixes:
            named_tensors = ((n, t) for n, t in named_tensors if not n.startswith(mtp_prefixes))
        loader.load(named_tensors)


def add_fused_decoder_weights(loader: StrictLoader, cfg: ModelConfig) -> None:
    """Map HF's separate q/k/v and gate/up projections onto the fused parameters."""
    q, kv, inter = (cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim,
                    cfg.intermediate_size)
    loader.add_fused("self_attn.q_proj", "self_attn.qkv_proj", 0, q)
    loader.add_fused("self_attn.k_proj", "self_attn.qkv_proj", q, kv)
    loader.add_fused("self_attn.v_proj", "self_attn.qkv_proj", q + kv, kv)
    loader.add_fused("mlp.gate_proj", "mlp.gate_up_proj", 0, inter)
    loader.add_fused("mlp.up_proj", "mlp.gate_up_proj", inter, inter)


def mtp_weight_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    """Key prefixes of the MTP/NEXTN layers a target checkpoint carries (``num_nextn_predict_layers``):
    DeepSeek-V3 layout ``model.layers.{L + j}.`` (L = num_hidden_layers), MiMo's ``model.mtp_layers.{j}.``."""
    num_layers, num_mtp = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    return tuple(p for j in range(num_mtp)
                 for p in (f"model.layers.{num_layers + j}.", f"model.mtp_layers.{j}."))
