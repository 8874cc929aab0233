"""Typed configuration: ServerArgs (every CLI flag, SGLang names) and ModelConfig.

ServerArgs is the one bridge between argparse, ``Engine(**kwargs)`` and the
rest of the code. ModelConfig normalizes foreign metadata (HF config.json,
GGUF keys) once.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SPEC_ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}      # SGLang's other spellings


def cache_root() -> Path:
    """Where specserve keeps what it fetches or builds: ``$SPECSERVE_CACHE`` or ``~/.cache/specserve``."""
    return Path(os.environ.get("SPECSERVE_CACHE") or Path.home() / ".cache" / "specserve")


class ConfigError(ValueError):
    """A bad flag or flag combination; the message names the flag."""


@dataclass
class ServerArgs:
    # model
    model_path: str | None = None
    tokenizer_path: str | None = None
    served_model_name: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    trust_remote_code: bool = False
    load_format: str = "auto"
    revision: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    # server
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    decode_log_interval: int = 40
    random_seed: int | None = None
    # parallelism
    tp_size: int = 1
    dp_size: int = 1
    # compute backend (specserve/backends/jax: the JAX model runner; jax.sharding for --tp-size)
    backend: str = field(default="torch", metadata={
        "group": "runtime and kernels", "choices": ("torch", "jax"),
        "help": "Model runner: torch, or jax (pip install -e .[jax]; --tp-size shards it over JAX devices)."})
    precompile_token_paddings: str | None = field(default=None, metadata={
        "group": "runtime and kernels",
        "help": "--backend jax: prefill tokens-per-request buckets compiled before serving, e.g. '16,64,256,512' "
                "(SGL-JAX's flag). Default: 16,64,128,256,512."})
    precompile_bs_paddings: str | None = field(default=None, metadata={
        "group": "runtime and kernels",
        "help": "--backend jax: batch-size buckets of decode and verify compiled before serving, e.g. '1,2,4,8' "
                "(SGL-JAX's flag). Default: 1,2,4,8,16,32,64 up to --max-running-requests."})
    disable_precompile: bool = field(default=False, metadata={
        "group": "runtime and kernels",
        "help": "--backend jax: compile each bucket on first use instead of before serving."})
    enable_dp_attention: bool = False
    # memory and scheduling
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    max_total_tokens: int | None = None
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int | None = None
    page_size: int = 1
    schedule_policy: str = "fcfs"
    disable_radix_cache: bool = False
    stream_interval: int = 1
    # attention and compilation
    attention_backend: str | None = None
    enable_torch_compile: bool = False
    torch_compile_max_bs: int | None = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    disable_overlap_schedule: bool = False
    # speculative decoding (see specserve/speculative)
    speculative_algorithm: str | None = None
    speculative_draft_model_path: str | None = None
    speculative_draft_model_revision: str | None = None
    speculative_draft_load_format: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_accept_threshold_single: float = 1.0
    speculative_accept_threshold_acc: float = 1.0
    speculative_token_map: str | None = None
    speculative_attention_mode: str = "prefill"
    speculative_draft_model_quantization: str | None = None
    speculative_draft_attention_backend: str | None = None
    speculative_moe_runner_backend: str | None = None
    speculative_moe_a2a_backend: str | None = None
    enable_multi_layer_eagle: bool = False
    speculative_policy: str = "auto"
    speculative_ngram_min_match_window_size: int = 3     # SGLang: 1 (see flags.py)
    speculative_ngram_max_match_window_size: int = 12
    speculative_ngram_min_bfs_breadth: int = 1
    speculative_ngram_max_bfs_breadth: int = 10
    speculative_ngram_match_type: str = "BFS"
    speculative_ngram_branch_length: int = 18
    speculative_ngram_capacity: int = 10_000_000
    speculative_ngram_corpus: str | None = None          # not in SGLang (see flags.py)
    speculative_ngram_assist: int = 0                    # not in SGLang (see flags.py)

    def __post_init__(self) -> None:
        self._validate_basic()

    def _validate_basic(self) -> None:
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        check_choices(self)
        if self.tp_size < 1 or (self.tp_size != 1 and self.backend != "jax"):
            raise ConfigError("--tp-size: only 1 is supported with --backend torch (tensor parallelism runs "
                              "with --backend jax)")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError(f"--device must be auto, cpu or cuda; got {self.device!r}")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ConfigError("--mem-fraction-static must be in (0, 1)")
        if self.page_size < 1:
            raise ConfigError("--page-size must be >= 1")
        if self.kv_cache_dtype not in ("auto", "bf16", "bfloat16"):
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype}: only auto and bf16/bfloat16 are "
                              "implemented here (no fp8/fp4 KV kernels in this build)")
        if self.max_running_requests is not None and self.max_running_requests < 1:
            raise ConfigError("--max-running-requests must be >= 1")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ConfigError("--max-total-tokens must be >= 1")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size == 0:
            raise ConfigError("--chunked-prefill-size must be positive, or -1 to disable")
        if self.context_length is not None and self.context_length < 2:
            raise ConfigError("--context-length must be >= 2")
        if self.port <= 0 or self.port > 65535:
            raise ConfigError("--port must be in [1, 65535]")
        if self.schedule_policy != "fcfs":
            raise ConfigError("--schedule-policy: only 'fcfs' is supported")
        check_counts(self)
        if self.speculative_algorithm is not None:
            algo = self.speculative_algorithm.upper()
            if algo not in SPEC_ALGORITHMS:
                raise ConfigError(f"--speculative-algorithm must be one of {', '.join(SPEC_ALGORITHMS)}; "
                                  f"got {self.speculative_algorithm!r}")
            self.speculative_algorithm = algo
        self._validate_ngram_assist()

    def _validate_ngram_assist(self) -> None:
        assist, algorithm = self.speculative_ngram_assist, self.speculative_algorithm
        if assist and (assist < 2 or algorithm in (None, "NGRAM")):
            raise ConfigError("--speculative-ngram-assist takes 0 (off) or the n-gram trees' nodes (>= 2), with "
                              f"--speculative-algorithm EAGLE, EAGLE3, NEXTN or STANDALONE; got {assist}"
                              + (f" with {algorithm}" if algorithm else " without an algorithm"))
        if self.speculative_ngram_corpus is not None and algorithm != "NGRAM" and not assist:
            raise ConfigError("--speculative-ngram-corpus applies to --speculative-algorithm NGRAM or "
                              "--speculative-ngram-assist only")

    def resolved_device(self) -> str:
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device

    # ---- argparse bridge -------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Every field as a flag, grouped and described as ``specserve/flags.py`` declares."""
        from specserve.cli_args import add_server_flags

        add_server_flags(parser, dataclasses.fields(ServerArgs))

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "ServerArgs":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


def check_choices(args: ServerArgs) -> None:
    """Values of flags with a fixed set (``flags.FLAG_DOCS``), case as the set spells them."""
    from specserve.flags import FLAG_DOCS, normalize_choice

    for f in dataclasses.fields(args):
        doc = FLAG_DOCS.get(f.name)
        choices = doc.choices if doc else f.metadata.get("choices")
        value = getattr(args, f.name)
        if not choices or value is None:
            continue
        normalized = normalize_choice(str(value), choices)
        if normalized not in choices:
            raise ConfigError(f"--{f.name.replace('_', '-')} must be one of {', '.join(choices)}; got {value!r}")
        setattr(args, f.name, normalized)


def check_counts(args: ServerArgs) -> None:
    """Sizes SGLang takes as positive counts."""
    for name in ("dp_size", "stream_interval", "cuda_graph_max_bs", "torch_compile_max_bs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1; got {value}")
    if args.decode_log_interval < 0:
        raise ConfigError(f"--decode-log-interval must be >= 0; got {args.decode_log_interval}")


@dataclass
class ModelConfig:
    """Architecture of a Llama-family decoder, normalized from HF or GGUF."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")

    @property
    def num_nextn_predict_layers(self) -> int:
        """MTP/NEXTN layers shipped in the checkpoint after the decoder layers (DeepSeek-V3, MiMo)."""
        return int(self.extra.get("num_nextn_predict_layers") or 0)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        model_type = cfg.get("model_type", "llama")
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            rope_scaling=_rope_scaling(cfg),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", model_type in ("qwen2", "mimo")
                                   or arch == "MiMoForCausalLM"),
            mlp_bias=cfg.get("mlp_bias", False),
            qk_norm=model_type in ("qwen3",) or cfg.get("qk_norm", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            extra={k: cfg[k] for k in ("eagle_config", "draft_vocab_size", "num_nextn_predict_layers",
                                        "model_type") if k in cfg},
        )

    @classmethod
    def from_gguf(cls, reader: Any) -> "ModelConfig":
        """From a GGUF file's ``{arch}.*`` metadata; ``reader`` is a ``gguf.GGUFReader`` or a path.

        Weights are dequantized on load, so ``torch_dtype`` is float32. ``eos_token_ids`` starts with
        ``tokenizer.ggml.eos_token_id``, followed by the other end-of-generation control tokens.
        """
        reader = _open_gguf_reader(reader)
        arch = _gguf_value(reader, "general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            raise ConfigError(f"GGUF architecture {arch!r} is not supported; supported: "
                              f"{', '.join(GGUF_ARCHITECTURES)}")

        def key(name: str, default: Any = None) -> Any:
            return _gguf_value(reader, f"{arch}.{name}", default)

        tensor_names = {t.name for t in reader.tensors}
        hidden, heads = key("embedding_length"), key("attention.head_count")
        eos_id = _gguf_value(reader, "tokenizer.ggml.eos_token_id")
        return cls(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=key("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
            hidden_size=hidden,
            intermediate_size=key("feed_forward_length"),
            num_hidden_layers=key("block_count"),
            num_attention_heads=heads,
            num_key_value_heads=key("attention.head_count_kv") or heads,
            head_dim=key("attention.key_length") or hidden // heads,
            rms_norm_eps=_shortest_float32(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=_shortest_float32(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(reader, arch),
            max_position_embeddings=key("context_length", 4096),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=end_of_generation_ids(eos_id, _gguf_control_tokens(reader)),
            torch_dtype="float32",
            extra={"model_type": arch},
        )

    def to_hf(self) -> dict[str, Any]:
        """An HF-style config.json for this architecture."""
        return {
            "architectures": [self.architecture], "model_type": self.extra.get("model_type", "llama"),
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling, "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias, "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": self.torch_dtype, "hidden_act": "silu",
        }


def _rope_scaling(cfg: dict[str, Any]) -> dict[str, Any] | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    return dict(scaling, rope_type=kind)


# ---- GGUF metadata helpers (for ModelConfig.from_gguf and the tokenizer) ---------------------

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Control tokens that end a generation when present (llama.cpp's "end of generation" set).
END_OF_GENERATION_TOKENS = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
    "<|end_of_text|>", "<EOT>", "<|return|>", "<\uff5cend\u2581of\u2581sentence\uff5c>",
)


def end_of_generation_ids(eos_token_id: int | None, special_token_ids: dict[str, int]) -> tuple[int, ...]:
    """The eos id first, then the ids of the known end-of-turn / end-of-text special tokens."""
    ids = [eos_token_id] if eos_token_id is not None else []
    for name in END_OF_GENERATION_TOKENS:
        token_id = special_token_ids.get(name)
        if token_id is not None and token_id not in ids:
            ids.append(token_id)
    return tuple(ids)


def _open_gguf_reader(reader: Any) -> Any:
    if isinstance(reader, (str, bytes)) or hasattr(reader, "__fspath__"):
        from gguf import GGUFReader

        return GGUFReader(reader)
    return reader


def _gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _gguf_control_tokens(reader: Any) -> dict[str, int]:
    """``{token text: id}`` of the tokens the GGUF marks as control (token_type 3)."""
    tokens = _gguf_value(reader, "tokenizer.ggml.tokens", [])
    types = _gguf_value(reader, "tokenizer.ggml.token_type", [])
    return {tokens[i]: i for i, kind in enumerate(types) if kind == 3}


def _gguf_rope_scaling(reader: Any, arch: str) -> dict[str, Any] | None:
    kind = _gguf_value(reader, f"{arch}.rope.scaling.type")
    factor = _gguf_value(reader, f"{arch}.rope.scaling.factor")
    if kind is None and _gguf_value(reader, f"{arch}.rope.scale_linear") is not None:
        kind, factor = "linear", _gguf_value(reader, f"{arch}.rope.scale_linear")
    if kind in (None, "none") or (kind == "linear" and factor in (None, 0.0, 1.0)):
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "factor": _shortest_float32(factor or 1.0)}
    original = _gguf_value(reader, f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling["original_max_position_embeddings"] = original
    return scaling


def _shortest_float32(value: float) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999974e-06 -> 1e-05)."""
    import numpy as np

    return float(str(np.float32(value)))
