"""The policy's startup timing (``measure_target_cost``) forwards its widths after a context:
the timed forward attends to that context (its logits are those of the same positions in one
forward over all of it), and every slot it took goes back to the pool."""
from __future__ import annotations

import torch

from specserve.engine import Engine
from specserve.runner.model_runner import forward_on_free_slots, forwards_after_context
from tiny_llama import random_weights, tiny_config, write_tiny_model


def test_forwards_after_a_context_attend_to_it_and_return_their_slots(tmp_path):
    model = write_tiny_model(tmp_path / "tiny", random_weights(tiny_config(), seed=5))
    core = Engine(model_path=str(model), dtype="float32", max_total_tokens=512, context_length=256).engine
    runner, pool = core.runner, core.pool
    free = pool.num_free_tokens
    context = [3, 1, 4, 1, 5]
    whole = forward_on_free_slots(runner, pool, context + [0, 0])       # logits at all 7 positions
    with forwards_after_context(runner, pool, context, 4) as forward:
        after = forward(2)                                              # positions 5 and 6
    assert pool.num_free_tokens == free
    torch.testing.assert_close(after, whole[5:7], atol=1e-4, rtol=1e-4)
    with forwards_after_context(runner, pool, [], 4) as forward:
        alone = forward(2)
    assert not torch.allclose(alone, whole[5:7], atol=1e-2)
    assert pool.num_free_tokens == free
