"""JAX backend (``--backend jax``): a Llama-family target written in JAX behind the
ModelRunner interface, so the scheduler, radix/paged KV cache, API and speculative
workers run unchanged. Install with ``pip install -e .[jax]`` (``make install-jax``).

Modules: ``engine_hook`` (what ``engine_setup`` calls), ``runner`` (JaxModelRunner: KV
slots, torch logits), ``buckets`` (padded shapes, SGL-JAX's precompile flags),
``precompile`` (buckets compiled ahead of serving), ``model`` (the jitted forward),
``attention`` (paged tree-mask attention), ``params`` (checkpoint tensors -> stacked
arrays, strict), ``sharding`` (``--tp-size`` over ``jax.sharding``, ``jax.distributed``),
``target_shell`` (the torch embedding / lm_head the EAGLE heads share), ``setup``
(process-wide JAX settings). Nothing here is imported unless ``--backend jax`` is given.
"""
from __future__ import annotations

import importlib.util


def is_available() -> bool:
    """Whether jax and jaxlib are installed (the ``jax`` extra)."""
    return importlib.util.find_spec("jax") is not None and importlib.util.find_spec("jaxlib") is not None


def missing_reason() -> str:
    return "the JAX backend needs jax and jaxlib: pip install -e .[jax] (or make install-jax)"
