"""The default model (a Q4_1 GGUF) keeps its linears' code blocks, and decoding over them gives
exactly the tokens decoding over the dense weights gives, in float32 and bfloat16."""
from __future__ import annotations

import pytest
import torch

from specserve.engine import Engine
from specserve.kernels import skinny
from specserve.loading.gguf import coded_weight_bytes
from specserve.models.packed_linear import Linear, has_packed_kernels

pytestmark = pytest.mark.skipif(not skinny.is_available(), reason="skinny kernel not built here (no AVX2 or no C compiler)")
PROMPTS = ["Write a haiku about autumn leaves.", "List three facts about the Moon."]


def _decode(engine: Engine) -> list[list[int]]:
    params = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    return [engine.generate(prompt=p, sampling_params=params)["output_ids"] for p in PROMPTS]


def _drop_codes(model: torch.nn.Module) -> None:
    """Back to the dense weights everywhere (the native layers take their pointers anew)."""
    for module in model.modules():
        if isinstance(module, Linear) and module.coded_records is not None:
            module.native_weights = skinny.linear_weights(module.weight.detach())
            module.coded_records = None
        if hasattr(module, "_native"):
            module._native = None


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    has_packed_kernels(torch.bfloat16), reason="bfloat16 linears run oneDNN on this CPU (AVX-512 BW and up), "
                                               "not the skinny kernel over codes: no codes are kept in bfloat16"))])
def test_coded_weights_decode_the_dense_tokens(default_gguf_path, dtype):
    engine = Engine(model_path=default_gguf_path, dtype=dtype, max_total_tokens=512, context_length=128)
    try:
        model = engine.engine.runner.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        num_layers = model.config.num_hidden_layers
        assert len(linears) == 4 * num_layers + 1                       # + the tied lm_head
        assert all(m.coded_records is not None for m in linears)
        kept = sum(m.coded_records.numel() for m in linears)
        assert kept == coded_weight_bytes(default_gguf_path, getattr(torch, dtype))   # what the KV budget counts
        coded = _decode(engine)
        _drop_codes(model)
        assert _decode(engine) == coded
    finally:
        engine.shutdown()
