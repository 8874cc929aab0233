"""Run in a subprocess by test_tensor_parallel.py, with XLA_FLAGS forcing host devices
(set before jax is imported): greedy outputs of a model at each --tp-size, as JSON."""
from __future__ import annotations

import json
import sys

from tests.jax.helpers import greedy, random_prompts, tiny_engine


def main() -> None:
    model, tp_sizes = sys.argv[1], [int(t) for t in sys.argv[2].split(",")]
    prompts = random_prompts(4, seed=7)
    outputs = {}
    for tp in tp_sizes:
        engine = tiny_engine(model, tp_size=tp)
        runner = engine.engine.runner
        outputs[tp] = {"devices": len(runner.mesh.devices.flat),
                       "wq_shards": len(runner.params["layers"]["wq"].addressable_shards),
                       "wq_shard_shape": list(runner.params["layers"]["wq"].addressable_shards[0].data.shape),
                       "tokens": greedy(engine, prompts, 24)}
    print("RESULT " + json.dumps(outputs))


if __name__ == "__main__":
    main()
