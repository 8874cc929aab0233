"""EAGLE (EAGLE-2) draft head, in the published checkpoint layout (``LlamaForCausalLMEagle``).

Keys (a leading ``model.`` is accepted): ``fc.weight`` [H, 2H] and ``fc.bias`` (unless config
``"bias": false``), ``layers.{i}.*`` Llama decoder layers, optional ``embed_tokens.weight`` and
``lm_head.weight`` (else the target's). ``layers.0.input_layernorm.weight``, present in some
checkpoints, is not applied: EAGLE's first layer has no input norm.

    x = fc(cat(embed(ids), hidden))        hidden: target's final normed hidden states [T, H]
    h = layers(x)                           layer 0: h = x + attn(x); h = h + mlp(post_norm(h))
    logits = lm_head(h)                     no final norm
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.models.attention import AttentionMetadata, KVCache
from specserve.models.draft_head import DraftCheckpoint, DraftHead, strip_model_prefix
from specserve.models.llama import LlamaDecoderLayer
from specserve.models.packed_linear import Linear


class EagleDecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer; layer 0 has no input norm (fc's output goes straight to attention)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id)
        if layer_id == 0:
            self.input_layernorm = None

    def forward(self, h: torch.Tensor, cos, sin, cache, meta, backend) -> torch.Tensor:
        x = h if self.input_layernorm is None else self.input_layernorm(h)
        h = h + self.self_attn(x, cos, sin, cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class EagleHead(DraftHead):
    feature_kind = "final"

    def __init__(self, config: ModelConfig, *, fc_bias: bool = True, has_embedding: bool = False,
                 has_lm_head: bool = False) -> None:
        super().__init__(config, feature_size=config.hidden_size, draft_vocab_size=config.vocab_size)
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h) if has_embedding else None
        self.fc = Linear(2 * h, h, bias=fc_bias)
        self.layers = nn.ModuleList(EagleDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.lm_head = Linear(h, config.vocab_size, bias=False) if has_lm_head else None

    @classmethod
    def for_checkpoint(cls, checkpoint: DraftCheckpoint, target_config: ModelConfig) -> "EagleHead":
        names = {strip_model_prefix(n) for n in checkpoint.tensors}
        return cls(ModelConfig.from_hf(checkpoint.raw_config), fc_bias=checkpoint.raw_config.get("bias", True),
                   has_embedding="embed_tokens.weight" in names, has_lm_head="lm_head.weight" in names)

    def own_embedding(self) -> nn.Embedding | None:
        return self.embed_tokens

    def own_lm_head(self) -> Linear | None:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        embeds = self.embed(input_ids).to(hidden.dtype)                          # [T, H]
        h = self.fc(torch.cat([embeds, hidden], dim=-1))                         # [T, 2H] -> [T, H]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin, cache, meta, self.backend)
        return h

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        loader = self._new_loader()
        loader.ignore("layers.0.input_layernorm.weight")     # stored by some checkpoints, never applied
        loader.load((strip_model_prefix(name), tensor) for name, tensor in named_tensors)
