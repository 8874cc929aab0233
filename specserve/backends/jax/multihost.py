"""Several JAX processes (``jax.distributed``): one serves, the others follow.

The mesh of ``--tp-size`` then spans devices of several processes, and every process
must run the same jitted steps in the same order. Process 0 runs the whole server
(scheduler, API, speculative workers); before each step its runner broadcasts the
padded batch (a small header with the bucket, then the arrays); the other processes
build the runner, precompile the same plan in the same order, then only ``follow``:
receive each batch and run the step on their devices. A follower ends when process 0
does (the collective fails) or on a stop header.
"""
from __future__ import annotations

import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

logger = logging.getLogger(__name__)

_HEADER_FIELDS = 5          # batch bucket, query bucket, logit rows, EAGLE-3 features, stop


def spans_processes(mesh) -> bool:
    return any(d.process_index != jax.process_index() for d in mesh.devices.flat)


def is_leader() -> bool:
    return jax.process_index() == 0


def send_batch(batch: dict, want_aux: bool) -> None:
    """Process 0: the step's batch to every process."""
    header = np.array([batch["tree_mask"].shape[0], batch["tree_mask"].shape[1], batch["logit_rows"].shape[0],
                       int(want_aux), 0], np.int32)
    multihost_utils.broadcast_one_to_all(header)
    multihost_utils.broadcast_one_to_all(batch)


def send_stop() -> None:
    multihost_utils.broadcast_one_to_all(np.array([0, 0, 0, 0, 1], np.int32))


def follow(runner, empty_batch) -> int:
    """The other processes: run every step process 0 sends, until a stop header. Returns
    the number of steps run. ``empty_batch(bsz, num_q, logit_rows)`` gives the arrays' shapes."""
    steps = 0
    while True:
        header = np.asarray(multihost_utils.broadcast_one_to_all(np.zeros(_HEADER_FIELDS, np.int32)))
        bsz, num_q, num_logits, want_aux, stop = (int(v) for v in header)
        if stop:
            logger.info("jax.distributed follower %d: stop after %d steps", jax.process_index(), steps)
            return steps
        batch = multihost_utils.broadcast_one_to_all(empty_batch(bsz, num_q, num_logits))
        runner.run_batch({k: np.asarray(v) for k, v in batch.items()}, bool(want_aux))
        steps += 1
