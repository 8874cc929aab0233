"""What the EAGLE-family draft heads read from their target, in torch.

The draft heads (``models/draft_head.py``) are torch modules run by
``runner/head_runner.py`` on the same shipped folders as on the torch backend; they
share the target's embedding and lm_head (``DraftHead.bind_target``). With the JAX
backend the target lives in JAX, so this shell holds torch copies of those two
weights (the same checkpoint tensors), the config, and ``aux_layer_ids`` (the layers
whose inputs EAGLE-3 reads; ``JaxModelRunner`` captures them).
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.models.packed_linear import Linear, pack_linears_for_cpu


class TargetShell(nn.Module):
    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, lm_head: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding.from_pretrained(embed.to(dtype), freeze=True)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.lm_head.weight = nn.Parameter(lm_head.to(dtype), requires_grad=False)
        self.aux_layer_ids: tuple[int, ...] = ()
        pack_linears_for_cpu(self)
