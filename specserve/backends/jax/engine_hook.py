"""``--backend jax`` in ``engine_setup.build_engine_parts``: the JaxModelRunner built from
ServerArgs, its buckets precompiled before serving."""
from __future__ import annotations

import logging

import torch

from specserve.backends.jax import is_available, missing_reason
from specserve.config import ConfigError, ModelConfig, ServerArgs

logger = logging.getLogger(__name__)


def build_jax_runner(args: ServerArgs, cfg: ModelConfig, weights, *, dtype: torch.dtype, max_position: int,
                     num_kv_slots: int, max_rows: int, max_row_len: int, chunk_size: int, spec_width: int,
                     spec_algorithm: str | None):
    if not is_available():
        raise ConfigError(f"--backend jax: {missing_reason()}")
    if args.resolved_device() != "cpu":
        raise ConfigError("--backend jax: pass --device cpu (JAX places the model on the devices it sees; the "
                          "scheduler's and sampler's tensors stay on the CPU)")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"--backend jax: --dtype {str(dtype).replace('torch.', '')} is not supported "
                          f"(float32 or bfloat16)")
    from specserve.backends.jax.buckets import DEFAULT_BS_PADDINGS, DEFAULT_TOKEN_PADDINGS, Buckets, parse_paddings
    from specserve.backends.jax.precompile import precompile, precompile_plan
    from specserve.backends.jax.runner import JaxModelRunner
    from specserve.backends.jax import multihost
    from specserve.backends.jax.sharding import maybe_initialize_distributed

    try:
        buckets = Buckets(parse_paddings(args.precompile_bs_paddings, DEFAULT_BS_PADDINGS, "--precompile-bs-paddings"),
                          parse_paddings(args.precompile_token_paddings, DEFAULT_TOKEN_PADDINGS,
                                         "--precompile-token-paddings"))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    maybe_initialize_distributed()
    runner = JaxModelRunner(cfg, weights, dtype=dtype, max_position=max_position, num_kv_slots=num_kv_slots,
                            page_size=args.page_size, max_rows=max_rows, max_row_len=max_row_len,
                            tp_size=args.tp_size, buckets=buckets)
    logger.info("JAX backend: %d device(s) %s, --tp-size %d", len(runner.mesh.devices.flat),
                runner.mesh.devices.flat[0].platform, args.tp_size)
    if not args.disable_precompile:
        plan = precompile_plan(buckets, max_running=max_rows, chunk_size=chunk_size, spec_width=spec_width)
        runner.precompile_seconds = precompile(runner, plan, want_aux=spec_algorithm == "EAGLE3")
    if runner.is_multiprocess and not multihost.is_leader():
        logger.info("jax.distributed: this process follows process 0's steps (it serves nothing itself)")
        runner.follow()
        raise SystemExit(0)
    return runner
