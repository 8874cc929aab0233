"""Build everything an LLMEngine needs from ServerArgs: model, tokenizer,
KV budget, pool, prefix cache, scheduler, speculative worker."""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

import torch

from specserve.cache.block_pool import BlockPool
from specserve.cache.radix import RadixCache
from specserve.config import ConfigError, ModelConfig, ServerArgs
from specserve.kernels import skinny
from specserve.loading.default_model import is_default_model
from specserve.flag_notes import startup_notes
from specserve.flags import LOCAL_ATTENTION_BACKENDS
from specserve.loading.hub import resolve_file
from specserve.loading.loader import (check_architecture, check_load_format, checkpoint_format, read_checkpoint,
                                      resolve_model_path)
from specserve.models.attention import KVCache, get_backend
from specserve.models.packed_linear import (Q8_ON_LOAD_QUANTIZATION, has_packed_kernels, keeps_blocks_only,
                                           warm_up_packed_linears)
from specserve.runner.memory import MemoryBudgetError, plan_kv_budget
from specserve.runner.model_runner import ModelRunner, model_bytes, resolve_dtype, resolve_kv_dtype
from specserve.scheduler import Scheduler
from specserve.speculative.params import resolve_spec_params
from specserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

CPU_CHUNKED_PREFILL = 512
CUDA_CHUNKED_PREFILL = 8192
# While requests decode, a CPU prefill step takes at most this many tokens: about as long as a
# decode step of 16 requests here, so a burst of prompts delays each running stream's next token
# by one short step at a time. Measured (Intel Xeon AVX-512 VNNI, 2 threads, gguf + NGRAM, 16
# streams of chat prompts): 128 tokens gave inter-token p99 / median 4.7, 64 gave 3.1, 32 gives
# 2.2 at the same throughput (the steps between prompts carry 16 decode rows either way).
CPU_PREFILL_BUDGET_WHILE_DECODING = 32
DEFAULT_MAX_RUNNING = {"cpu": 64, "cuda": 256}
WARM_UP_MAX_ROWS = 96     # forward widths whose oneDNN kernels are built at startup


@dataclass
class EngineParts:
    model_path: str
    model_config: ModelConfig
    tokenizer: Tokenizer
    runner: ModelRunner
    pool: BlockPool
    radix: RadixCache
    scheduler: Scheduler
    context_len: int
    device: str
    spec_worker: Any


def build_engine_parts(args: ServerArgs) -> EngineParts:
    device = args.resolved_device()
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available")
    if args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    args = _prepare_args(args, device)
    model_path = args.model_path or _default_model()
    cfg, weights = _read_target(args, model_path, device)
    tokenizer = _load_tokenizer(args, model_path)
    dtype = resolve_dtype(args.dtype, cfg, device)
    context_len = _context_len(args, cfg)
    args = _with_shipped_draft(args, model_path, device, dtype)
    args = _with_ngram_corpus(args, model_path)
    spec = resolve_spec_params(args, cfg)
    _check_token_map(args, spec, cfg)
    spec_width = spec.tree_cap if spec else 1   # KV slots per decode step per request
    try:
        draft = _read_draft(args, spec, cfg, tokenizer)
    except (OSError, ValueError, ConfigError) as exc:
        _fall_back_to_plain(args, exc)
        spec = draft = None
    if draft is not None and draft[2] is not None and args.speculative_token_map is not None:
        raise ConfigError(f"--speculative-token-map: the draft {args.speculative_draft_model_path} carries its own "
                          f"(pruned) vocabulary; leave the token map out")
    kv_dtype = resolve_kv_dtype(args.kv_cache_dtype, dtype)
    kv_bpt = KVCache.bytes_per_token(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
    extra_bytes, extra_bpt = _draft_bytes(draft, spec, cfg, dtype)
    extra_bytes += _coded_weight_bytes(model_path, device, dtype, args.quantization, cfg)
    try:
        weight_bytes = model_bytes(cfg, dtype) - _dense_bytes_not_kept(model_path, args, device, dtype)
        budget = plan_kv_budget(device=device, model_bytes=weight_bytes + extra_bytes,
                                bytes_per_token=kv_bpt + extra_bpt,
                                min_tokens=context_len + spec_width, mem_fraction_static=args.mem_fraction_static,
                                max_total_tokens=args.max_total_tokens)
    except MemoryBudgetError as exc:
        raise ConfigError(f"{exc} With speculation, fewer --speculative-num-draft-tokens also help.") from None
    num_pages = budget.num_tokens // args.page_size
    if num_pages * args.page_size < context_len + spec_width:
        context_len = num_pages * args.page_size - spec_width
        if context_len < 2:
            raise ConfigError(f"--max-total-tokens {args.max_total_tokens} is too small to serve any request")
        logger.warning("context length lowered to %d to fit --max-total-tokens", context_len)
    max_running = args.max_running_requests or DEFAULT_MAX_RUNNING["cuda" if device.startswith("cuda") else "cpu"]
    try:
        backend = get_backend(args.attention_backend if args.attention_backend in LOCAL_ATTENTION_BACKENDS else None)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    pending_corpus = _start_corpus_load(args) if spec is not None else None    # every flag checked by now
    runner = _build_runner(args, cfg, weights, dtype, device, backend, context_len, spec_width,
                           num_pages * args.page_size, max_running, spec, kv_dtype)
    pool = BlockPool(num_pages, args.page_size)
    radix = RadixCache(pool, disabled=args.disable_radix_cache)
    logger.info("model %s loaded: %s on %s, KV cache %d tokens (%s, %.2f GiB), context %d",
                model_path, str(dtype).replace("torch.", ""), device, num_pages * args.page_size,
                str(kv_dtype).replace("torch.", ""), num_pages * args.page_size * kv_bpt / 2**30, context_len)
    spec_worker = None
    if spec is not None:
        from specserve.speculative.base import ProposerContext, create_spec_worker

        draft_checkpoint, draft_vocab_ids = (None, None) if draft is None else (draft[:2], draft[2])
        try:
            spec_worker = create_spec_worker(ProposerContext(args, spec, cfg, runner, pool, max_running,
                                                             context_len, draft_checkpoint, model_path,
                                                             draft_vocab_ids=draft_vocab_ids,
                                                             pending_ngram_corpus=pending_corpus))
        except (OSError, ValueError, KeyError, ConfigError) as exc:
            _fall_back_to_plain(args, exc)
            runner.capture_features, runner.model.aux_layer_ids = None, ()
    scheduler = Scheduler(pool, radix, max_running_requests=max_running, chunk_size=_chunk_size(args, device),
                          num_rows=max_running, decode_width=spec_width if spec_worker else 1,
                          prefill_budget_while_decoding=None if device.startswith("cuda")
                          else CPU_PREFILL_BUDGET_WHILE_DECODING)
    return EngineParts(model_path, cfg, tokenizer, runner, pool, radix, scheduler, context_len, device,
                       spec_worker)


def _build_runner(args: ServerArgs, cfg: ModelConfig, weights, dtype: torch.dtype, device: str, attention,
                  context_len: int, spec_width: int, num_kv_slots: int, max_running: int, spec,
                  kv_dtype: torch.dtype):
    """The model runner ``--backend`` names: torch (``ModelRunner``), or jax (``backends/jax``,
    imported only then: nothing on the torch path imports jax)."""
    max_position, max_row_len = context_len + spec_width + 1, context_len + spec_width + args.page_size
    if args.backend == "jax":
        from specserve.backends.jax.engine_hook import build_jax_runner

        if kv_dtype != dtype:
            raise ConfigError("--kv-cache-dtype: --backend jax keeps its cache in the model's dtype (use auto)")
        return build_jax_runner(args, cfg, weights, dtype=dtype, max_position=max_position,
                                num_kv_slots=num_kv_slots, max_rows=max_running, max_row_len=max_row_len,
                                chunk_size=_chunk_size(args, device), spec_width=spec_width,
                                spec_algorithm=spec.algorithm if spec else None)
    runner = ModelRunner(cfg, weights, dtype=dtype, device=device, max_position=max_position,
                         num_kv_slots=num_kv_slots, page_size=args.page_size, max_rows=max_running,
                         max_row_len=max_row_len, quantization=args.quantization if device == "cpu" else None,
                         kv_dtype=kv_dtype)
    runner.model.backend = attention
    logger.info("CPU kernels: %s variant, --quantization %s", skinny.kernel_variant(), args.quantization or "unquant")
    warm_up_packed_linears(runner.model, min(max_running * spec_width, WARM_UP_MAX_ROWS))
    return runner


def _prepare_args(args: ServerArgs, device: str) -> ServerArgs:
    """Log what inapplicable flags do here; resolve paths; check the draft's load format."""
    for line in startup_notes(args):
        logger.info("%s", line)
    args = _local_paths(args, device)
    if args.speculative_draft_model_path is not None:
        check_load_format(args.speculative_draft_model_path, args.speculative_draft_load_format,
                          "--speculative-draft-load-format")
    return args


def _local_paths(args: ServerArgs, device: str) -> ServerArgs:
    """Hub ids of the model, tokenizer, draft and token map resolved to local paths (ConfigError
    naming the flag otherwise); ``--dtype float16`` on a CPU mapped to float32, logged."""
    changes: dict[str, Any] = {}
    if args.model_path is not None:
        changes["model_path"] = resolve_model_path(args.model_path, args.revision)
    if args.tokenizer_path is not None:
        changes["tokenizer_path"] = resolve_model_path(args.tokenizer_path, args.revision, "--tokenizer-path")
    if args.speculative_draft_model_path is not None:
        changes["speculative_draft_model_path"] = resolve_model_path(
            args.speculative_draft_model_path, args.speculative_draft_model_revision,
            "--speculative-draft-model-path")
    if args.speculative_token_map is not None:
        changes["speculative_token_map"] = resolve_file(args.speculative_token_map, "--speculative-token-map",
                                                        args.speculative_draft_model_revision)
    if args.dtype == "float16" and device == "cpu":
        logger.info("--dtype float16: this CPU build has no fast float16 kernels; running float32 "
                    "(what --dtype auto picks on CPU)")
        changes["dtype"] = "float32"
    return dataclasses.replace(args, **changes) if changes else args


def _default_model() -> str:
    try:
        return resolve_model_path(None)
    except (OSError, RuntimeError) as exc:
        raise ConfigError(f"the default model could not be fetched ({' '.join(str(exc).split())[:300]}); "
                          f"pass --model-path") from None


def _read_target(args: ServerArgs, model_path: str, device: str):
    """(config, weights) of the target, with every problem a ConfigError naming --model-path. On
    the integer path its GGUF matrices come as their blocks (``dense_from_blocks``): the loader
    makes dense values only for the weights that keep them."""
    try:
        check_load_format(model_path, args.load_format)
        cfg, weights = read_checkpoint(model_path, dense_from_blocks=_blocks_only(args, device))
    except ConfigError:
        raise
    except (OSError, ValueError, KeyError) as exc:
        reason = f"config.json lacks {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ConfigError(f"--model-path {args.model_path or model_path}: {reason}") from None
    check_architecture(cfg, model_path)
    return cfg, weights


def _load_tokenizer(args: ServerArgs, model_path: str) -> Tokenizer:
    flag, path = ("--tokenizer-path", args.tokenizer_path) if args.tokenizer_path else ("--model-path", model_path)
    try:
        return Tokenizer.load(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{flag} {path}: {exc} (point --tokenizer-path at the tokenizer files)") from None


def _with_shipped_draft(args: ServerArgs, model_path: str, device: str, dtype: torch.dtype) -> ServerArgs:
    """The default model with EAGLE3 / EAGLE / STANDALONE and no draft path: the shipped draft
    (for EAGLE with the shipped FR-Spec map unless --speculative-token-map is given), and, with
    S/K/N left unset, the shape measured fastest for it (SGLang picks one per model)."""
    if args.speculative_draft_model_path or not is_default_model(model_path):
        return args
    from specserve.drafts import measured_shape, shipped_draft

    path = shipped_draft(args.speculative_algorithm)
    if path is None:
        return args
    logger.info("--speculative-algorithm %s: using the shipped draft %s", args.speculative_algorithm, path)
    args = dataclasses.replace(args, speculative_draft_model_path=str(path))
    args = _with_shipped_token_map(args)
    shape = measured_shape(args.speculative_algorithm, device, dtype, args.quantization)
    if shape is None or any(v is not None for v in (args.speculative_num_steps, args.speculative_eagle_topk,
                                                    args.speculative_num_draft_tokens)):
        return args
    logger.info("speculative shape (steps, topk, draft tokens) = %s: measured fastest for the shipped draft",
                shape)
    steps, topk, num_draft_tokens = shape
    return dataclasses.replace(args, speculative_num_steps=steps, speculative_eagle_topk=topk,
                               speculative_num_draft_tokens=num_draft_tokens)


def _uses_ngram(args: ServerArgs) -> bool:
    return args.speculative_algorithm == "NGRAM" or bool(args.speculative_ngram_assist)


def _start_corpus_load(args: ServerArgs):
    """NGRAM's corpus read and indexed beside the target's loading (``ngram.start_corpus_load``)."""
    if not _uses_ngram(args):
        return None
    from specserve.speculative.ngram import start_corpus_load

    return start_corpus_load(args)


def _with_ngram_corpus(args: ServerArgs, model_path: str) -> ServerArgs:
    """NGRAM's corpus (also an assisting NGRAM's): the given folder (checked here, so a wrong path is a
    flag error), none for `none`, and unset with the default model the shipped corpus of its own answers."""
    corpus = args.speculative_ngram_corpus
    if not _uses_ngram(args) or (corpus or "").lower() == "none":
        return args
    from specserve.speculative.ngram_corpus import is_corpus_folder

    if corpus is not None:
        if not is_corpus_folder(corpus):
            raise ConfigError(f"--speculative-ngram-corpus {corpus}: no corpus folder there (config.json and "
                              "corpus.safetensors; `python -m specserve.train.ngram_corpus` makes one)")
        return args
    from specserve.drafts import SHIPPED_NGRAM_CORPUS

    if not is_default_model(model_path) or not is_corpus_folder(SHIPPED_NGRAM_CORPUS):
        return args
    logger.info("NGRAM: drafting also from the shipped corpus %s where the cache has no match "
                "(--speculative-ngram-corpus none: without it)", SHIPPED_NGRAM_CORPUS)
    return dataclasses.replace(args, speculative_ngram_corpus=str(SHIPPED_NGRAM_CORPUS))


def _with_shipped_token_map(args: ServerArgs) -> ServerArgs:
    """The shipped EAGLE head proposes from the shipped FR-Spec map by default: its LM head then
    covers the 8,192 most frequent ids instead of 49,152 (a draft step ~0.6 ms cheaper; (1,1,2)
    ran 0.97x plain instead of 0.84x on a 2-core AVX-512 Xeon, the same accept length). EAGLE3
    and STANDALONE drafts carry their own pruned vocabularies."""
    from specserve.drafts import FRSPEC_TOKEN_MAP

    if (args.speculative_algorithm or "").upper() != "EAGLE" or args.speculative_token_map is not None:
        return args
    if not FRSPEC_TOKEN_MAP.is_file():
        return args
    logger.info("--speculative-algorithm EAGLE: the shipped draft proposes from the shipped FR-Spec map %s "
                "(--speculative-token-map; pass --speculative-draft-model-path to choose the draft yourself)",
                FRSPEC_TOKEN_MAP)
    return dataclasses.replace(args, speculative_token_map=str(FRSPEC_TOKEN_MAP))


def _check_token_map(args: ServerArgs, spec, cfg: ModelConfig) -> None:
    """A bad --speculative-token-map stops startup (ConfigError naming the flag) rather than
    turning speculation off like a draft that fails to load. EAGLE3 ignores the map (logged)."""
    if spec is None or args.speculative_token_map is None or spec.algorithm not in ("STANDALONE", "EAGLE"):
        return
    from specserve.speculative.token_map import read_token_map

    read_token_map(args.speculative_token_map, cfg.vocab_size, spec.topk)


def _fall_back_to_plain(args: ServerArgs, exc: Exception) -> None:
    """A draft that cannot load turns speculation off rather than stopping the server."""
    logger.error("speculative decoding disabled, serving with plain decoding: the %s draft (%s) could not "
                 "be loaded: %s", args.speculative_algorithm, args.speculative_draft_model_path, exc)


def _read_draft(args: ServerArgs, spec, cfg: ModelConfig, tokenizer: Tokenizer):
    """(config, weights, vocabulary ids or None) of the STANDALONE draft model, checked against
    the target's vocabulary (a pruned-vocabulary draft: its ``d2t`` against the target's ids)."""
    if spec is None or spec.algorithm != "STANDALONE":
        return None
    from specserve.speculative.token_map import split_draft_vocab

    path = args.speculative_draft_model_path
    draft_cfg, weights = read_checkpoint(path)
    weights, vocab_ids = split_draft_vocab(weights)
    if vocab_ids is not None:
        _check_draft_vocab(path, vocab_ids, draft_cfg, cfg)
        return draft_cfg, weights, vocab_ids
    if draft_cfg.vocab_size != cfg.vocab_size:
        raise ConfigError(f"--speculative-draft-model-path {path}: vocabulary size {draft_cfg.vocab_size} "
                          f"differs from the target's {cfg.vocab_size}")
    try:
        draft_tokenizer = Tokenizer.load(path)
    except FileNotFoundError:
        logger.warning("draft model %s has no tokenizer; only its vocabulary size was checked", path)
        return draft_cfg, weights, None
    if draft_tokenizer.backend.get_vocab(with_added_tokens=True) != tokenizer.backend.get_vocab(
            with_added_tokens=True):
        raise ConfigError(f"--speculative-draft-model-path {path}: its tokenizer differs from the target's")
    return draft_cfg, weights, None


def _check_draft_vocab(path: str, vocab_ids: torch.Tensor, draft_cfg: ModelConfig, cfg: ModelConfig) -> None:
    flag = f"--speculative-draft-model-path {path}"
    if vocab_ids.numel() != draft_cfg.vocab_size:
        raise ConfigError(f"{flag}: its d2t maps {vocab_ids.numel()} ids, its vocabulary has {draft_cfg.vocab_size}")
    in_range = 0 <= int(vocab_ids.min()) and int(vocab_ids.max()) < cfg.vocab_size
    if not in_range or vocab_ids.unique().numel() != vocab_ids.numel():
        raise ConfigError(f"{flag}: its d2t does not map to distinct ids of the target's vocabulary "
                          f"of {cfg.vocab_size}")


def _draft_bytes(draft, spec, cfg: ModelConfig, dtype: torch.dtype) -> tuple[int, int]:
    """(weight bytes, KV bytes per token) the draft model adds to the memory budget."""
    if spec is not None and spec.algorithm in ("EAGLE", "EAGLE3"):   # one decoder layer, target-sized
        layer_bytes = model_bytes(dataclasses.replace(cfg, num_hidden_layers=1, vocab_size=0), dtype)
        head_bytes = cfg.vocab_size * cfg.hidden_size * torch.empty((), dtype=dtype).element_size()
        return 2 * layer_bytes + head_bytes, KVCache.bytes_per_token(1, cfg.num_key_value_heads, cfg.head_dim,
                                                                     dtype)
    if draft is None:
        return 0, 0
    dcfg = draft[0]
    return model_bytes(dcfg, dtype), KVCache.bytes_per_token(dcfg.num_hidden_layers, dcfg.num_key_value_heads,
                                                             dcfg.head_dim, dtype)


def _coded_weight_bytes(model_path: str, device: str, dtype: torch.dtype, quantization: str | None,
                        cfg: ModelConfig) -> int:
    """The code blocks a GGUF's quantized matrices keep beside their dense weights where the
    CPU kernels run (``models/packed_linear.py``); with w8a8_int8, the Q8_0 blocks of every
    weight (34 bytes per 32: an upper bound, embeddings counted). A draft's blocks are a
    draft's size again at most, left to the budget's slack."""
    if device != "cpu" or not skinny.is_available():
        return 0
    if quantization == Q8_ON_LOAD_QUANTIZATION:
        return model_bytes(cfg, torch.int8) * 34 // 32
    if checkpoint_format(model_path) != "gguf":
        return 0
    if dtype == torch.bfloat16 and has_packed_kernels(dtype):     # bfloat16 linears run oneDNN, not codes
        return 0
    from specserve.loading.gguf import coded_weight_bytes

    return coded_weight_bytes(model_path, dtype)


def _blocks_only(args: ServerArgs, device: str) -> bool:
    """Whether the target's decoder layers keep their GGUF blocks alone (``keeps_blocks_only``, on
    the torch backend: the JAX one makes its own weights)."""
    return args.backend != "jax" and keeps_blocks_only(args.quantization, device)


def _dense_bytes_not_kept(model_path: str, args: ServerArgs, device: str, dtype: torch.dtype) -> int:
    """The dense bytes of the decoder layers' linears that the integer path never holds (their
    GGUF blocks suffice: ``codes_only_weights``)."""
    if not _blocks_only(args, device) or checkpoint_format(model_path) != "gguf":
        return 0
    from specserve.loading.gguf import layer_block_weights

    return layer_block_weights(model_path) * torch.empty((), dtype=dtype).element_size()


def _context_len(args: ServerArgs, cfg: ModelConfig) -> int:
    if args.context_length is None:
        return cfg.max_position_embeddings
    if args.context_length > cfg.max_position_embeddings:
        logger.warning("--context-length %d exceeds the model's %d positions", args.context_length,
                       cfg.max_position_embeddings)
    return args.context_length


def _chunk_size(args: ServerArgs, device: str) -> int:
    size = args.chunked_prefill_size
    if size is None:
        return CUDA_CHUNKED_PREFILL if device.startswith("cuda") else CPU_CHUNKED_PREFILL
    return args.max_prefill_tokens if size < 0 else size
