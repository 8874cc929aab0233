"""One of two jax.distributed processes started by test_multihost.py (SPECSERVE_JAX_* set):
--tp-size 2 over one CPU device per process. Process 0 generates and prints the tokens;
process 1 follows its steps until process 0 stops it."""
from __future__ import annotations

import json
import sys

from tests.jax.helpers import greedy, random_prompts, tiny_engine


def main() -> None:
    engine = tiny_engine(sys.argv[1], tp_size=2)        # process 1 returns only by SystemExit
    tokens = greedy(engine, random_prompts(3, seed=11), 16)
    engine.engine.runner.stop_followers()
    print("RESULT " + json.dumps(tokens), flush=True)


if __name__ == "__main__":
    main()
