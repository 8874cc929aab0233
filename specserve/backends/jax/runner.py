"""JaxModelRunner: the ModelRunner interface (``runner/model_runner.py``) over the JAX model.

The engine, scheduler, speculative workers and sampler call ``forward(specs)`` with
``ExtendSpec`` rows and get torch logits back, as from the torch runner. Inside, the
specs become one padded ``[B, Q]`` batch (``buckets.py``); one jitted step per
(B, Q, logit rows, feature kind) writes K/V into JAX cache arrays indexed by slot
(donated, so in place) and returns logits, converted to torch through numpy.

EAGLE-family drafts stay torch modules (``runner/head_runner.py``) fed the JAX
target's features: ``capture_features`` / ``last_features`` / ``model.aux_layer_ids``
work as on the torch runner; ``model`` is a torch shell with the target's embedding
and lm_head (``target_shell.py``).
"""
from __future__ import annotations

import functools
import logging
from typing import Iterable

import numpy as np
import torch

from specserve.backends.jax import setup  # noqa: F401  (x64, compilation cache: before jax use)
from specserve.backends.jax import multihost, sharding
from specserve.backends.jax.attention import KEY_BLOCK
from specserve.backends.jax.buckets import MIN_ROWS, Buckets
from specserve.backends.jax.model import StaticShape, forward_step
from specserve.backends.jax.params import collect_params
from specserve.backends.jax.target_shell import TargetShell
from specserve.config import ConfigError, ModelConfig
from specserve.models.layers import RotaryEmbedding
from specserve.models.llama import mtp_weight_prefixes

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

logger = logging.getLogger(__name__)

_JAX_DTYPES = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16}


class JaxModelRunner:
    def __init__(self, model_config: ModelConfig, weights: Iterable[tuple[str, torch.Tensor]], *,
                 dtype: torch.dtype, max_position: int, num_kv_slots: int, page_size: int, max_rows: int,
                 max_row_len: int, tp_size: int = 1, buckets: Buckets | None = None) -> None:
        if page_size != 1:
            raise ConfigError("--backend jax supports --page-size 1 only")
        self.config, self.dtype, self.device = model_config, dtype, torch.device("cpu")
        self.buckets = buckets or Buckets()
        self.tp_size = tp_size
        self.mesh = sharding.make_mesh(tp_size)
        self.is_multiprocess = multihost.spans_processes(self.mesh)
        self._jdtype = _JAX_DTYPES[dtype]
        self._load(model_config, weights)
        self._init_rotary(max_position)
        self._init_slots(num_kv_slots, max_rows, max_row_len)
        self.capture_features: str | None = None
        self.last_features: torch.Tensor | None = None
        self._steps: dict[bool, object] = {}
        self.compiled_shapes: set[tuple] = set()
        self.precompile_seconds = 0.0

    # ---- setup ----------------------------------------------------------------------
    def _load(self, cfg: ModelConfig, weights) -> None:
        kept: dict[str, torch.Tensor] = {}

        def keep_shared(named):
            for name, tensor in named:
                if name in ("model.embed_tokens.weight", "lm_head.weight"):
                    kept[name] = tensor
                yield name, tensor

        tree = collect_params(cfg, keep_shared(weights), mtp_weight_prefixes(cfg))
        specs = sharding.param_specs(cfg, self.tp_size, tree["layers"].keys())
        self.params = sharding.put(tree, specs, self.mesh, self._jdtype)
        embed = kept["model.embed_tokens.weight"]
        self._shell_weights = (embed, embed if cfg.tie_word_embeddings else kept["lm_head.weight"])
        self._model: TargetShell | None = None

    @property
    def model(self) -> TargetShell:
        """The torch shell the EAGLE-family heads bind to (built on first use)."""
        if self._model is None:
            self._model = TargetShell(self.config, *self._shell_weights, self.dtype)
        return self._model

    def _init_rotary(self, max_position: int) -> None:
        cfg = self.config
        rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        replicated = NamedSharding(self.mesh, P())
        self.cos_table = jax.device_put(rotary.cos_cached.numpy(), replicated)
        self.sin_table = jax.device_put(rotary.sin_cached.numpy(), replicated)

    def _init_slots(self, num_kv_slots: int, max_rows: int, max_row_len: int) -> None:
        """KV arrays [layers * (slots + 1), kv_heads, head_dim] (zeros: the extra slot per layer
        is the dummy that padding writes and reads) and the host-side request->slot table."""
        cfg = self.config
        self.dummy_slot = num_kv_slots
        self.num_slots = num_kv_slots + 1
        shape = (cfg.num_hidden_layers * self.num_slots, cfg.num_key_value_heads, cfg.head_dim)
        cache_sharding = NamedSharding(self.mesh, sharding.kv_spec(cfg, self.tp_size))
        zeros = jax.jit(lambda: jnp.zeros(shape, self._jdtype), out_shardings=cache_sharding)
        self.k_cache, self.v_cache = zeros(), zeros()
        self.row_width = -(-max_row_len // KEY_BLOCK) * KEY_BLOCK
        self.req_to_token = np.full((max_rows, self.row_width), self.dummy_slot, dtype=np.int32)

    def set_row_slots(self, row: int, start: int, slots: list[int]) -> None:
        if slots:
            self.req_to_token[row, start:start + len(slots)] = slots

    # ---- forward ----------------------------------------------------------------------
    def forward(self, specs, features: str | None = None, *, is_prefill: bool = False):
        """As ``ModelRunner.forward``: logits [sum(num_logits), V] (torch), and with ``features``
        ``(logits, features)``; ``capture_features`` also keeps ``last_features``."""
        batch, token_rows, num_logits = self.pack(specs, is_prefill)
        want_aux = "aux" in (self.capture_features, features)
        if self.is_multiprocess:
            multihost.send_batch(batch, want_aux)
        logits, hidden, layer_inputs = self.run_batch(batch, want_aux)
        logits = torch.from_numpy(_local(logits)[:num_logits].copy())
        if self.capture_features is not None:
            self.last_features = self._features(self.capture_features, hidden, layer_inputs, token_rows)
        if features is None:
            return logits
        if features == self.capture_features:
            return logits, self.last_features
        return logits, self._features(features, hidden, layer_inputs, token_rows)

    def run_batch(self, batch: dict, want_aux: bool):
        """One jitted step over a packed batch: (logits, hidden, layer inputs), replicated."""
        logits, hidden, layer_inputs, self.k_cache, self.v_cache = self._step(want_aux)(
            self.params, self.k_cache, self.v_cache, self.cos_table, self.sin_table, batch)
        self.compiled_shapes.add(_shape_key(batch, want_aux))
        return logits, hidden, layer_inputs

    def stop_followers(self) -> None:
        """Process 0: end the other processes' ``follow`` loops."""
        if self.is_multiprocess:
            multihost.send_stop()

    def follow(self) -> int:
        """Processes other than 0 (jax.distributed): run the steps process 0 sends."""
        return multihost.follow(self, lambda bsz, num_q, num_logits: _padding_batch(
            bsz, num_q, num_logits, self.row_width, self.dummy_slot))

    def _step(self, want_aux: bool):
        if want_aux not in self._steps:
            cfg = self.config
            shape = StaticShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rms_norm_eps,
                                self.num_slots, want_aux)
            replicated = NamedSharding(self.mesh, P())
            out_shardings = (replicated,) * 3 + (self.k_cache.sharding, self.v_cache.sharding)
            self._steps[want_aux] = jax.jit(functools.partial(forward_step, shape=shape), donate_argnums=(1, 2),
                                            out_shardings=out_shardings)
        return self._steps[want_aux]

    def run_empty(self, bsz: int, num_q: int, num_logit_rows: int, want_aux: bool) -> None:
        """One forward of a batch of padding only (it writes and reads the dummy slot): compiles
        the (B, Q, logit rows, feature kind) bucket ahead of serving."""
        logits, _, _ = self.run_batch(_padding_batch(bsz, num_q, num_logit_rows, self.row_width, self.dummy_slot),
                                      want_aux)
        logits.block_until_ready()

    def _features(self, kind: str, hidden, layer_inputs, token_rows: np.ndarray) -> torch.Tensor:
        if kind == "final":
            out = _local(hidden)[token_rows]
        elif kind == "aux":
            aux = self.model.aux_layer_ids
            if not aux:
                raise ValueError("features 'aux' needs model.aux_layer_ids")
            stacked = _local(layer_inputs)
            out = np.concatenate([stacked[i][token_rows] for i in aux], axis=-1)
        else:
            raise ValueError(f"unknown features kind {kind!r}")
        return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).to(self.dtype)   # numpy has no bf16

    def pack(self, specs, is_prefill: bool = False) -> tuple[dict, np.ndarray, int]:
        """The padded batch arrays, the flat rows of the real tokens (spec order) and the
        number of real logit rows. Writes the specs' slots into their rows first."""
        bsz, num_q = self.buckets.shape(len(specs), max(len(s.token_ids) for s in specs), is_prefill)
        arrays = _empty_batch(bsz, num_q, self.row_width, self.dummy_slot)
        token_rows, logit_rows = [], []
        for b, spec in enumerate(specs):
            self.set_row_slots(spec.row, spec.prefix_len, spec.new_slots)
            rows = _fill_request(arrays, b, num_q, spec, self.req_to_token[spec.row])
            token_rows.extend(rows)
            logit_rows.extend(rows[len(rows) - spec.num_logits:] if spec.num_logits else [])
        num_keys = int((arrays["prefix_len"] + arrays["extend_len"]).max())
        arrays["num_blocks"] = np.int32(-(-num_keys // KEY_BLOCK))
        width = max(bsz if all(s.num_logits <= 1 for s in specs) else bsz * num_q, MIN_ROWS)
        arrays["logit_rows"] = np.zeros(width, np.int32)
        arrays["logit_rows"][:len(logit_rows)] = logit_rows
        return arrays, np.asarray(token_rows, dtype=np.int64), len(logit_rows)


def _empty_batch(bsz: int, num_q: int, row_width: int, dummy_slot: int) -> dict:
    num_tokens = bsz * num_q
    return {"tokens": np.zeros(num_tokens, np.int32), "positions": np.zeros(num_tokens, np.int32),
            "out_loc": np.full(num_tokens, dummy_slot, np.int32),
            "prefix_len": np.zeros(bsz, np.int32), "extend_len": np.zeros(bsz, np.int32),
            "tree_mask": np.zeros((bsz, num_q, num_q), bool),
            "kv_slots": np.full((bsz, row_width), dummy_slot, np.int32)}


def _padding_batch(bsz: int, num_q: int, num_logit_rows: int, row_width: int, dummy_slot: int) -> dict:
    """A batch of padding only (it writes and reads the dummy slot)."""
    batch = _empty_batch(bsz, num_q, row_width, dummy_slot)
    batch["num_blocks"] = np.int32(1)
    batch["logit_rows"] = np.zeros(num_logit_rows, np.int32)
    return batch


def _local(array) -> np.ndarray:
    """A replicated output's value on this process (jax.distributed: not fully addressable)."""
    return np.asarray(array.addressable_data(0))


def _fill_request(arrays: dict, b: int, num_q: int, spec, row_slots: np.ndarray) -> list[int]:
    """Request ``b``'s part of the batch; returns its tokens' flat rows."""
    n, start = len(spec.token_ids), b * num_q
    arrays["tokens"][start:start + n] = spec.token_ids
    arrays["positions"][start:start + n] = (spec.positions if spec.positions is not None
                                            else range(spec.prefix_len, spec.prefix_len + n))
    arrays["out_loc"][start:start + n] = spec.new_slots
    arrays["prefix_len"][b], arrays["extend_len"][b] = spec.prefix_len, n
    mask = np.tril(np.ones((n, n), bool)) if spec.tree_mask is None else spec.tree_mask.cpu().numpy()
    arrays["tree_mask"][b, :n, :n] = mask
    total = spec.prefix_len + n
    arrays["kv_slots"][b, :total] = row_slots[:total]
    return list(range(start, start + n))


def _shape_key(batch: dict, want_aux: bool) -> tuple:
    return batch["tree_mask"].shape[:2] + (batch["logit_rows"].shape[0], want_aux)
