"""``--quantization w8a8_int8`` on a float (safetensors) checkpoint: every linear is rounded to
Q8_0 blocks at load and runs the integer kernels; greedy output stays close to the float model's
and speculative output (the target drafting for itself) equals plain decoding on that path."""
from __future__ import annotations

import pytest
import torch

from specserve.engine import Engine
from specserve.kernels import int_codes
from tiny_llama import random_weights, tiny_config, write_tiny_model

pytestmark = pytest.mark.skipif(not int_codes.is_available(), reason="CPU kernels not built here")
KW = {"dtype": "float32", "max_total_tokens": 2048, "context_length": 256}
PROMPTS = [[1, 5, 9, 2], [3, 3, 7, 11, 4, 8], [12, 6]]
PARAMS = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = tiny_config()
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "target", random_weights(cfg, seed=3)))


def test_every_linear_runs_the_integer_kernel(model):
    engine = Engine(model_path=model, quantization="w8a8_int8", **KW)
    net = engine.engine.runner.model
    linears = [m for m in net.modules() if hasattr(m, "int_panels") and hasattr(m, "in_features")]
    assert linears and all(m.int_panels is not None for m in linears)
    exact = Engine(model_path=model, **KW)
    ours = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=[PARAMS] * 3)]
    float_path = [o["output_ids"] for o in exact.generate(input_ids=PROMPTS, sampling_params=[PARAMS] * 3)]
    agree = sum(a == b for x, y in zip(ours, float_path) for a, b in zip(x, y)) / sum(map(len, float_path))
    assert agree > 0.5            # Q8_0 weights and int8 inputs: close to the float model, not its bits


def test_speculative_output_equals_plain_on_the_w8a8_path(model):
    plain = Engine(model_path=model, quantization="w8a8_int8", **KW)
    spec = Engine(model_path=model, quantization="w8a8_int8", speculative_algorithm="STANDALONE",
                  speculative_draft_model_path=model, speculative_policy="always", speculative_num_steps=3,
                  speculative_eagle_topk=1, speculative_num_draft_tokens=4, **KW)
    ours = spec.generate(input_ids=PROMPTS, sampling_params=[PARAMS] * 3)
    assert [o["output_ids"] for o in ours] == [o["output_ids"] for o in plain.generate(
        input_ids=PROMPTS, sampling_params=[PARAMS] * 3)]
    drafted = spec.engine.get_server_info()["spec_draft_tokens"]
    accepted = sum(o["meta_info"]["spec_verify_ct"] * (o["meta_info"]["spec_accept_length"] - 1) for o in ours)
    assert drafted > 0 and round(accepted) == drafted     # the same weights and path: every draft accepted
    assert torch.is_tensor(spec.engine.spec_worker.proposer.runner.model.lm_head.int_panels)


def test_the_layers_dense_copies_are_dropped_and_nothing_changes(model, monkeypatch):
    """The decoder layers' integer-kernel linears keep their panels alone (their dense float copies,
    ~4 bytes a weight, become meta tensors); the embedding and the head keep theirs; the output is
    that of a model that keeps every copy."""
    from specserve.runner import model_runner

    engine = Engine(model_path=model, quantization="w8a8_int8", **KW)
    net = engine.engine.runner.model
    layer_linears = [m for m in net.model.layers.modules() if hasattr(m, "int_panels") and hasattr(m, "in_features")]
    assert layer_linears and all(m.weight.is_meta for m in layer_linears)
    assert not net.lm_head.weight.is_meta and not net.model.embed_tokens.weight.is_meta
    monkeypatch.setattr(model_runner, "drop_dense_weights", lambda modules: 0)
    keeping = Engine(model_path=model, quantization="w8a8_int8", **KW)
    assert not any(m.weight.is_meta for m in keeping.engine.runner.model.modules() if hasattr(m, "int_panels"))
    outputs = [[o["output_ids"] for o in e.generate(input_ids=PROMPTS, sampling_params=[PARAMS] * 3)]
               for e in (engine, keeping)]
    assert outputs[0] == outputs[1]
