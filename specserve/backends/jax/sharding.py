"""``--tp-size``: tensor parallelism over the devices JAX sees, with ``jax.sharding``.

A 1-D mesh with axis ``tp``. As SGL-JAX (and Megatron) split a Llama: the q/k/v and
gate/up projections by output columns (attention heads, MLP columns), the o and down
projections by input rows, the KV cache by KV heads, the lm_head by vocabulary
columns; embeddings and norms are replicated. ``jit`` propagates the shardings and
inserts the all-reduces. Where the heads do not divide by ``tp`` (SmolLM2-135M has 9
query and 3 KV heads), attention stays replicated and only the MLP (and lm_head) split.

On one CPU host, ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` (set before
jax is imported) gives N devices. Across hosts, every host runs the same server
command with ``SPECSERVE_JAX_COORDINATOR=host0:port``, ``SPECSERVE_JAX_NUM_PROCESSES``
and ``SPECSERVE_JAX_PROCESS_ID``; ``maybe_initialize_distributed`` then calls
``jax.distributed.initialize`` and ``jax.devices()`` lists every host's devices;
process 0 serves and the others follow its steps (``multihost.py``).
"""
from __future__ import annotations

import logging
import os

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from specserve.config import ConfigError, ModelConfig

logger = logging.getLogger(__name__)

TP_AXIS = "tp"
_COLUMN_SPLIT = ("wq", "wk", "wv", "bq", "bk", "bv")       # attention: split by heads
_ROW_SPLIT = ("wo",)
_MLP_COLUMN_SPLIT = ("wg", "wu", "bg", "bu")
_MLP_ROW_SPLIT = ("wd",)


def maybe_initialize_distributed() -> None:
    """Multi-host: ``jax.distributed.initialize`` from the SPECSERVE_JAX_* variables, if set."""
    coordinator = os.environ.get("SPECSERVE_JAX_COORDINATOR")
    if not coordinator or jax.distributed.is_initialized():
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")      # CPU collectives across processes
    jax.distributed.initialize(coordinator_address=coordinator,
                               num_processes=int(os.environ["SPECSERVE_JAX_NUM_PROCESSES"]),
                               process_id=int(os.environ["SPECSERVE_JAX_PROCESS_ID"]))
    logger.info("jax.distributed: process %d of %d, %d devices in all", jax.process_index(),
                jax.process_count(), jax.device_count())


def make_mesh(tp_size: int) -> Mesh:
    devices = jax.devices()
    if tp_size > len(devices):
        raise ConfigError(f"--tp-size {tp_size}: JAX sees {len(devices)} device(s) ({devices[0].platform}); on a "
                          f"CPU set XLA_FLAGS=--xla_force_host_platform_device_count={tp_size} before starting")
    return Mesh(np.array(devices[:tp_size]), (TP_AXIS,))


def splits_attention(cfg: ModelConfig, tp_size: int) -> bool:
    return cfg.num_attention_heads % tp_size == 0 and cfg.num_key_value_heads % tp_size == 0


def param_specs(cfg: ModelConfig, tp_size: int, layer_keys) -> dict:
    """PartitionSpecs for the parameter tree of ``params.collect_params``."""
    split_attn = splits_attention(cfg, tp_size)
    split_mlp = cfg.intermediate_size % tp_size == 0
    if tp_size > 1 and not split_attn:
        logger.warning("--tp-size %d: %d query / %d KV heads do not divide; attention is replicated, "
                       "the MLP is split", tp_size, cfg.num_attention_heads, cfg.num_key_value_heads)
    layers = {}
    for key in layer_keys:
        if (key in _COLUMN_SPLIT and split_attn) or (key in _MLP_COLUMN_SPLIT and split_mlp):
            layers[key] = P(None, None, TP_AXIS) if key.startswith("w") else P(None, TP_AXIS)
        elif (key in _ROW_SPLIT and split_attn) or (key in _MLP_ROW_SPLIT and split_mlp):
            layers[key] = P(None, TP_AXIS, None)
        else:
            layers[key] = P()
    lm_head = P(None, TP_AXIS) if cfg.vocab_size % tp_size == 0 else P()
    return {"embed": P(), "norm": P(), "lm_head": lm_head, "layers": layers}


def kv_spec(cfg: ModelConfig, tp_size: int) -> P:
    """KV cache [layers * slots, kv_heads, head_dim]: split by KV heads where attention is."""
    return P(None, TP_AXIS, None) if splits_attention(cfg, tp_size) else P()


def put(tree, specs, mesh: Mesh, dtype):
    """Place a numpy tree on the mesh with the given specs, cast to ``dtype``."""
    return jax.tree.map(lambda a, spec: jax.device_put(a.astype(dtype), NamedSharding(mesh, spec)), tree, specs)
