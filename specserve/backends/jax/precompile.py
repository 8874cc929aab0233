"""Compile the jitted step for every bucket serving will use, before serving (SGL-JAX's
precompile), with a progress bar. What is left out compiles on first use.

The plan: prefill of one request at each token padding; decode at each batch padding;
with speculation, verify at each batch padding times the tree width, and one request's
verify at the widths the speculative policy times at startup.
"""
from __future__ import annotations

import logging
import time

from tqdm import tqdm

from specserve.backends.jax.buckets import MIN_ROWS

logger = logging.getLogger(__name__)

VERIFY_WIDTHS = (4, 8, 16, 64)      # one request's verify widths the policy's cost curve times


def precompile_plan(buckets, *, max_running: int, chunk_size: int, spec_width: int) -> list[tuple[int, int, int]]:
    """(B, Q, logit rows) of every bucket to compile."""
    plan = []
    for tokens in buckets.token_paddings:
        if tokens <= chunk_size:
            plan.append((*buckets.shape(1, tokens, is_prefill=True), MIN_ROWS))
    for bs in buckets.bs_paddings:
        if bs > max_running:
            continue
        bsz, num_q = buckets.shape(bs, 1)
        plan.append((bsz, num_q, bsz))
        if spec_width > 1:
            bsz, num_q = buckets.shape(bs, spec_width)
            plan.append((bsz, num_q, bsz * num_q))
    if spec_width > 1:
        for width in VERIFY_WIDTHS:
            bsz, num_q = buckets.shape(1, width)
            plan.append((bsz, num_q, bsz * num_q))
    return list(dict.fromkeys(plan))            # in order, without repeats


def precompile(runner, plan: list[tuple[int, int, int]], want_aux: bool) -> float:
    """Compile (and run once) every bucket of ``plan``; returns the seconds it took."""
    start = time.perf_counter()
    for bsz, num_q, num_logits in tqdm(plan, desc="JAX precompile", unit="bucket"):
        runner.run_empty(bsz, num_q, num_logits, want_aux)
    seconds = time.perf_counter() - start
    logger.info("JAX precompile: %d buckets (B x Q x logit rows) in %.1fs", len(plan), seconds)
    return seconds
