"""NEXTN / MTP draft heads: the multi-token-prediction layer shipped inside a target checkpoint.

DeepSeek-V3 layout (config ``num_nextn_predict_layers``), under ``model.layers.{L}.`` with
L = num_hidden_layers: ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H], ``shared_head.norm``, optional
``shared_head.head`` and ``embed_tokens`` (else the target's), plus a Llama decoder layer.

    x = eh_proj(cat(enorm(embed(ids)), hnorm(hidden)));  h = decoder_layer(x)
    logits = head(shared_head.norm(h))

MiMo layout (``MiMoForCausalLM``), under ``model.mtp_layers.0.``: ``token_layernorm``,
``hidden_layernorm``, ``input_proj`` [H, 2H], ``final_layernorm``, plus a (Qwen2, qkv bias)
decoder layer; embedding and lm_head are the target's.

    x = input_proj(cat(hidden_layernorm(hidden), token_layernorm(embed(ids))))   (hidden first)
    h = decoder_layer(x);  logits = lm_head(final_layernorm(h))

Only the first MTP layer is used. ``hidden`` is the target's final normed hidden state; the
returned ``h`` (before the final norm) is fed back for the next draft step.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.models.attention import AttentionMetadata, KVCache
from specserve.models.draft_head import DraftCheckpoint, DraftHead
from specserve.models.layers import RMSNorm
from specserve.models.llama import LlamaDecoderLayer
from specserve.models.packed_linear import Linear

LAYOUTS = ("nextn_deepseek", "nextn_mimo")


class DeepseekNextNLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig, *, has_embedding: bool, has_head: bool) -> None:
        super().__init__(cfg, 0)
        h = cfg.hidden_size
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.shared_head.head = Linear(h, cfg.vocab_size, bias=False) if has_head else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h) if has_embedding else None

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))


class MiMoMtpLayer(LlamaDecoderLayer):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, 0)
        h = cfg.hidden_size
        self.token_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.input_proj = Linear(2 * h, h, bias=False)
        self.final_layernorm = RMSNorm(h, cfg.rms_norm_eps)

    def project(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.input_proj(torch.cat([self.hidden_layernorm(hidden), self.token_layernorm(embeds)], dim=-1))


class NextNHead(DraftHead):
    """The first MTP layer of a target checkpoint; parameter names are the checkpoint's own keys."""

    feature_kind = "final"

    def __init__(self, target_config: ModelConfig, layout: str = "nextn_deepseek", *,
                 has_embedding: bool = False, has_head: bool = False) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"unknown MTP layout {layout!r} (known: {', '.join(LAYOUTS)})")
        config = dataclasses.replace(target_config, num_hidden_layers=1)
        super().__init__(config, feature_size=config.hidden_size, draft_vocab_size=config.vocab_size)
        self.layout = layout
        self.model = nn.Module()
        if layout == "nextn_deepseek":
            self.layer_key = str(target_config.num_hidden_layers)
            self.model.layers = nn.ModuleDict({self.layer_key: DeepseekNextNLayer(
                config, has_embedding=has_embedding, has_head=has_head)})
        else:
            self.model.mtp_layers = nn.ModuleList([MiMoMtpLayer(config)])

    @classmethod
    def for_checkpoint(cls, checkpoint: DraftCheckpoint, target_config: ModelConfig) -> "NextNHead":
        source = ModelConfig.from_hf(checkpoint.raw_config)
        if (source.hidden_size, source.num_hidden_layers) != (target_config.hidden_size,
                                                              target_config.num_hidden_layers):
            raise ValueError(f"MTP layers in {checkpoint.path} belong to another model than the target")
        prefix = f"model.layers.{target_config.num_hidden_layers}."
        names = set(checkpoint.tensors)
        return cls(target_config, checkpoint.kind, has_embedding=prefix + "embed_tokens.weight" in names,
                   has_head=prefix + "shared_head.head.weight" in names)

    @property
    def mtp_layer(self) -> DeepseekNextNLayer | MiMoMtpLayer:
        if self.layout == "nextn_deepseek":
            return self.model.layers[self.layer_key]
        return self.model.mtp_layers[0]

    def own_embedding(self) -> nn.Embedding | None:
        return getattr(self.mtp_layer, "embed_tokens", None)

    def own_lm_head(self) -> Linear | None:
        layer = self.mtp_layer
        return layer.shared_head.head if self.layout == "nextn_deepseek" else None

    def final_norm(self) -> nn.Module:
        layer = self.mtp_layer
        return layer.shared_head.norm if self.layout == "nextn_deepseek" else layer.final_layernorm

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        layer = self.mtp_layer
        x = layer.project(self.embed(input_ids).to(hidden.dtype), hidden)             # [T, 2H] -> [T, H]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        return LlamaDecoderLayer.forward(layer, x, cos, sin, cache, meta, self.backend)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._new_loader().load(named_tensors)
