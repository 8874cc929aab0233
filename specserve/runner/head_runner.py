"""HeadRunner: the KV cache, request->slot rows and forward pass of an EAGLE-family
draft head (``models/draft_head.py``). Same slot and row machinery as ModelRunner;
the forward also takes the hidden input of every new token (target features or
the head's own previous outputs)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from specserve.kernels import layer as native_layer
from specserve.models.packed_linear import Linear
from specserve.runner.model_runner import ExtendSpec, ModelRunner, in_inference_mode
from specserve.runner.sampler import argmax_rows


class HeadOutput(NamedTuple):
    hidden: torch.Tensor       # [R, H] the head's output at the logit rows (the next step's input)
    logits: torch.Tensor       # [R, V_draft]
    ids: torch.Tensor          # [R] int64 draft ids: each row's argmax (the first maximum)


class HeadRunner(ModelRunner):
    def __init__(self, head, *, num_kv_slots: int, max_rows: int, max_row_len: int) -> None:   # noqa: super
        cfg = head.config
        param = next(head.parameters())
        self.config, self.dtype, self.device = cfg, param.dtype, param.device
        self.kv_dtype = self.dtype
        self.model = head
        self._init_slots(num_kv_slots, 1, max_rows, max_row_len)

    @in_inference_mode
    def forward(self, specs: list[ExtendSpec], hidden: torch.Tensor) -> HeadOutput:    # type: ignore[override]
        """hidden: [T, F] for the new tokens in spec order. Returns the output hidden, draft-vocab
        logits and argmax of the logit rows (the last ``num_logits`` tokens of each spec)."""
        input_ids, positions, meta, logit_rows = self.prepare(specs)
        out = self.model(input_ids, hidden.to(self.dtype), positions, self.kv_cache, meta)
        return self.logits(out, logit_rows)

    def logits(self, out: torch.Tensor, logit_rows: torch.Tensor | None) -> HeadOutput:
        """The head's output rows ``logit_rows`` (None: all), their logits and argmax: in one native
        call where the final norm and the LM head run native kernels alone (the same bits; each
        torch call between them is slow after the weights went through the caches), else the
        head's own calls."""
        head = self.model
        norm, lm_head = head.final_norm(), head.lm_head_module()
        if _takes_native_logits(out, norm, lm_head, out.shape[0] if logit_rows is None else logit_rows.shape[0]):
            final = None if norm is None else (norm.weight, norm.eps)
            return HeadOutput(*native_layer.head_logits(out, logit_rows, final, lm_head.skinny_weights(),
                                                        lm_head.out_features, lm_head.skinny_bias))
        if logit_rows is not None:
            out = out.index_select(0, logit_rows)
        logits = head.compute_logits(out)
        return HeadOutput(out, logits, argmax_rows(logits))


def _takes_native_logits(out: torch.Tensor, norm, lm_head, rows: int) -> bool:
    """Whether ``native_layer.head_logits`` gives the bits of ``compute_logits``: the norm (if any)
    runs its native kernel and the LM head the skinny (or integer) kernel for these rows."""
    if not isinstance(lm_head, Linear) or rows > lm_head.skinny_max_rows or rows == 0:
        return False
    if norm is not None and not getattr(norm, "native", False):
        return False
    return native_layer.can_run_head_logits(out, None if norm is None else norm.weight)
