"""EAGLE-3 draft head, in the published checkpoint layout (``LlamaForCausalLMEagle3``).

Keys (a leading ``model.`` is accepted): ``fc.weight`` [H, 3H], ``midlayer.{input_layernorm,
hidden_norm, post_attention_layernorm}.weight``, ``midlayer.self_attn.{q,k,v}_proj.weight`` with
input width 2H, ``midlayer.self_attn.o_proj.weight``, ``midlayer.mlp.*``, ``norm.weight``,
``lm_head.weight`` [draft_vocab, H], ``d2t`` [draft_vocab] (target id = i + d2t[i]; needed when
draft_vocab_size != vocab_size), ``t2d`` (ignored), optional ``embed_tokens.weight``.

    hidden = fc(hidden) if hidden is the target's 3H features (else the previous draft step's output)
    x = cat(input_layernorm(embed(ids)), hidden_norm(hidden))               [T, 2H]
    h = hidden + attn(x);  h = h + mlp(post_attention_layernorm(h))         returned (pre-norm)
    logits = lm_head(norm(h))
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.kernels import layer as native_layer
from specserve.models.attention import AttentionMetadata, KVCache
from specserve.models.draft_head import DraftCheckpoint, DraftHead, draft_vocab_ids, strip_model_prefix
from specserve.models.layers import RMSNorm
from specserve.models.llama import LlamaDecoderLayer
from specserve.models.packed_linear import Linear
from specserve.models.weights import WeightLoadError


def eagle3_aux_layer_ids(num_target_layers: int, eagle_config: dict | None = None) -> tuple[int, ...]:
    """Target layers whose input EAGLE-3 captures (SGLang's ``layers_to_capture``): from
    ``eagle_aux_hidden_state_layer_ids`` [a, b, c] (outputs of those layers) -> (a+1, b+1, c+1),
    else (2, L // 2, L - 3)."""
    ids = (eagle_config or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return tuple(int(i) + 1 for i in ids)
    return 2, num_target_layers // 2, num_target_layers - 3


class Eagle3DecoderLayer(LlamaDecoderLayer):
    """Attention over [normed embedding, normed hidden] (2H wide); the residual is the hidden."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, 0, input_size=2 * cfg.hidden_size)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, cos, sin, cache, meta,
                backend) -> torch.Tensor:
        x = self._attention_input(embeds, hidden)                                            # [T, 2H]
        if self.runs_native(x.shape[0], meta):      # the rest in one native call, from x
            h = hidden.clone(memory_format=torch.contiguous_format)
            self.forward_native(h, cos, sin, cache, meta, x_in=x)
            return h
        h = hidden + self.self_attn(x, cos, sin, cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


    def _attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[input_layernorm(embeds), hidden_norm(hidden)]; with native norms written straight into
        the two halves (no concatenation)."""
        first, second = self.input_layernorm, self.hidden_norm
        if not (first.native and native_layer.can_run_norm(embeds, first.weight)
                and native_layer.can_run_norm(hidden, second.weight)):
            return torch.cat([first(embeds), second(hidden)], dim=-1)
        width = embeds.shape[1]
        x = embeds.new_empty(embeds.shape[0], 2 * width)
        native_layer.rms_norm(embeds, first.weight, first.eps, out=x[:, :width])
        native_layer.rms_norm(hidden, second.weight, second.eps, out=x[:, width:])
        return x


class Eagle3Head(DraftHead):
    feature_kind = "aux"

    def __init__(self, config: ModelConfig, *, target_hidden_size: int | None = None,
                 has_embedding: bool = False, has_lm_head: bool = True) -> None:
        if config.num_hidden_layers != 1:
            raise ValueError(f"EAGLE3 draft heads have one decoder layer; config says {config.num_hidden_layers}")
        h, vocab = config.hidden_size, config.vocab_size
        draft_vocab = int(config.extra.get("draft_vocab_size") or vocab)
        super().__init__(config, feature_size=3 * (target_hidden_size or h), draft_vocab_size=draft_vocab)
        eagle_config = config.extra.get("eagle_config") or {}
        if eagle_config.get("eagle_aux_hidden_state_layer_ids"):
            self.aux_layer_ids = eagle3_aux_layer_ids(0, eagle_config)
        self.embed_tokens = nn.Embedding(vocab, h) if has_embedding else None
        self.fc = Linear(self.feature_size, h, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        if draft_vocab != vocab:
            has_lm_head = True       # the target's head has the wrong rows: the checkpoint must carry one
        self.lm_head = Linear(h, draft_vocab, bias=False) if has_lm_head else None
        self.register_buffer("d2t", None)     # [draft_vocab] int64; None = identity
        self._native_call: native_layer.Eagle3Weights | None = None     # None: not built (yet)
        self._cache_views: tuple | None = None             # (cache.k, cache.v, the midlayer's K and V)

    @classmethod
    def for_checkpoint(cls, checkpoint: DraftCheckpoint, target_config: ModelConfig) -> "Eagle3Head":
        raw = checkpoint.raw_config
        names = {strip_model_prefix(n) for n in checkpoint.tensors}
        target_hidden = raw.get("target_hidden_size") or (raw.get("eagle_config") or {}).get("target_hidden_size")
        return cls(ModelConfig.from_hf(raw), target_hidden_size=target_hidden,
                   has_embedding="embed_tokens.weight" in names, has_lm_head="lm_head.weight" in names)

    def own_embedding(self) -> nn.Embedding | None:
        return self.embed_tokens

    def own_lm_head(self) -> Linear | None:
        return self.lm_head

    def final_norm(self) -> nn.Module:
        return self.norm

    def init_rotary(self, max_position: int, device) -> None:
        super().init_rotary(max_position, device)
        self._native_call = None              # it points at the rotary tables

    def bind_target(self, target) -> None:
        super().bind_target(target)
        self._native_call = None              # it may point at the target's embedding
        if not self.aux_layer_ids:
            self.aux_layer_ids = eagle3_aux_layer_ids(target.config.num_hidden_layers)
        _check_aux_layer_ids(self.aux_layer_ids, target.config.num_hidden_layers)

    def set_token_map(self, token_map) -> None:
        raise ValueError("EAGLE3 heads carry their own draft vocabulary (d2t); a token map does not apply")

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.d2t is None else ids + self.d2t[ids]

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        call = self._one_call(input_ids, hidden, positions, meta)
        if call is not None:
            k_layer, v_layer = self._layer_kv(cache)
            return native_layer.eagle3_head(input_ids, positions, hidden, call, k_layer, v_layer,
                                            meta.out_cache_loc, meta.kv_indices, meta.query_mask, meta.row_batch,
                                            meta.row_query)
        if hidden.shape[-1] != self.hidden_size:
            hidden = self.fc(hidden)                                             # [T, 3H] -> [T, H]
        embeds = self.embed(input_ids).to(hidden.dtype)                          # [T, H]
        cos, sin = self.rotary.cos_sin(positions, hidden.dtype)
        return self.midlayer(embeds, hidden, cos, sin, cache, meta, self.backend)

    def _one_call(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata) -> native_layer.Eagle3Weights | None:
        """``native_layer.eagle3_head``'s fixed arguments if it gives this forward the bits of the
        separate calls (else None): the midlayer runs natively (``runs_native``) with native norms,
        fc (where the input needs it) on the skinny kernel, the model's ends as ``model_stack``
        takes them, in the norms' dtype. The arguments are built once the head can run in one call
        (serving never changes its layers), fc's weight checked each call."""
        rows = input_ids.shape[0]
        if not self.midlayer.runs_native(rows, meta):
            return None
        call = self._native_call
        if call is None or call.fc is not self.fc.skinny_weights():
            call = self._native_call = self._native_weights()
        if call is None or hidden.dim() != 2 or not hidden.is_contiguous() or hidden.dtype != call.ends.embedding.dtype:
            return None
        if hidden.shape[1] != self.hidden_size and rows > self.fc.skinny_max_rows:
            return None
        return call if native_layer.ModelEnds.takes_inputs(input_ids, positions) else None

    def _native_weights(self) -> native_layer.Eagle3Weights | None:
        """``eagle3_head``'s fixed arguments, or None where the head cannot run in one call."""
        mid, ends = self.midlayer, self._ends()
        first, second = mid.input_layernorm, mid.hidden_norm
        if not (first.native and second.native and self.fc.bias is None and ends.usable()
                and ends.embedding.dtype == first.weight.dtype == second.weight.dtype):
            return None
        return native_layer.eagle3_weights(ends, self.fc.skinny_weights(), (first.weight, first.eps),
                                           (second.weight, second.eps), mid.native_weights())

    def _layer_kv(self, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """The midlayer's K and V of ``cache`` (views made once per cache tensors)."""
        held = self._cache_views
        if held is None or held[0] is not cache.k or held[1] is not cache.v:
            layer_id = self.midlayer.self_attn.layer_id
            held = self._cache_views = (cache.k, cache.v, cache.k[layer_id], cache.v[layer_id])
        return held[2], held[3]

    def _ends(self) -> native_layer.ModelEnds:
        """The embedding (its own or the target's) and rotary tables, for ``eagle3_head``."""
        module = self.own_embedding()
        embedding = (module if module is not None else self._shared_module("embed_tokens")).weight
        return native_layer.ModelEnds(embedding, self.rotary.cos_cached, self.rotary.sin_cached, None, 0.0)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = self._new_loader()
        vocab_maps: dict[str, torch.Tensor] = {}

        def weights():
            for name, tensor in named_tensors:
                name = strip_model_prefix(name)
                if name in ("d2t", "t2d"):
                    vocab_maps[name] = tensor
                else:
                    yield name, tensor

        loader.load(weights())
        self.set_d2t(vocab_maps.get("d2t"))

    def set_d2t(self, d2t: torch.Tensor | None) -> None:
        """The draft vocabulary: draft id i <-> target id i + d2t[i] (None: the full vocabulary)."""
        vocab, draft_vocab = self.config.vocab_size, self.draft_vocab_size
        if d2t is None:
            if draft_vocab != vocab:
                raise WeightLoadError(f"checkpoint is missing tensor 'd2t' (draft_vocab_size {draft_vocab} "
                                      f"!= vocab_size {vocab})")
            self.d2t = None
            return
        if tuple(d2t.shape) != (draft_vocab,) or d2t.is_floating_point():
            raise WeightLoadError(f"checkpoint tensor 'd2t' has shape {tuple(d2t.shape)} and dtype {d2t.dtype}, "
                                  f"expected ({draft_vocab},) integers")
        target_ids = draft_vocab_ids(d2t)
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab:
            raise WeightLoadError(f"checkpoint tensor 'd2t' maps draft ids outside the vocabulary [0, {vocab})")
        self.d2t = d2t.to(device=self.fc.weight.device, dtype=torch.int64)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        tensors = super().checkpoint_tensors()
        if self.d2t is not None:
            tensors["d2t"] = self.d2t.detach().cpu()
            t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
            t2d[self.draft_to_target(torch.arange(self.draft_vocab_size, device=self.d2t.device)).cpu()] = True
            tensors["t2d"] = t2d
        return tensors


def _check_aux_layer_ids(ids: tuple[int, ...], num_target_layers: int) -> None:
    if len(ids) != 3 or len(set(ids)) != 3 or min(ids) < 0 or max(ids) >= num_target_layers:
        raise ValueError(f"EAGLE3 aux layer ids {ids} must be 3 distinct target layers in [0, {num_target_layers})"
                         f" (the target has too few layers, or eagle_aux_hidden_state_layer_ids is wrong)")
