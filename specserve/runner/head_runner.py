"""HeadRunner: the KV cache, request->slot rows and forward pass of an EAGLE-family
draft head (``models/draft_head.py``). Same slot and row machinery as ModelRunner;
the forward also takes the hidden input of every new token (target features or
the head's own previous outputs)."""
from __future__ import annotations

import torch

from specserve.runner.model_runner import ExtendSpec, ModelRunner, in_inference_mode


class HeadRunner(ModelRunner):
    def __init__(self, head, *, num_kv_slots: int, max_rows: int, max_row_len: int) -> None:   # noqa: super
        cfg = head.config
        param = next(head.parameters())
        self.config, self.dtype, self.device = cfg, param.dtype, param.device
        self.kv_dtype = self.dtype
        self.model = head
        self._init_slots(num_kv_slots, 1, max_rows, max_row_len)

    @in_inference_mode
    def forward(self, specs: list[ExtendSpec], hidden: torch.Tensor):          # type: ignore[override]
        """hidden: [T, F] for the new tokens in spec order. Returns (output hidden, draft-vocab
        logits) of the logit rows (the last ``num_logits`` tokens of each spec)."""
        input_ids, positions, meta, logit_rows = self.prepare(specs)
        out = self.model(input_ids, hidden.to(self.dtype), positions, self.kv_cache, meta)
        if logit_rows is not None:
            out = out.index_select(0, logit_rows)
        return out, self.model.compute_logits(out)
