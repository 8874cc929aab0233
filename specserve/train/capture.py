"""Step (b) of draft training: run the target over prompt + answer of every regenerated
record and store what the draft heads learn from, per token:

* ``tokens``     [N] int32   the sequence itself
* ``aux``        [N, 3H]     inputs of the target layers ``aux_layer_ids`` (EAGLE3 feature)
* ``final``      [N, H]      final-normed hidden state (EAGLE feature and regression target)
* ``topk_ids``   [N, K] int32, ``topk_logp`` [N, K] float16: the target's top-K next-token
  ids and log-probs at every position (soft labels; full logits would be V floats a token)

Features are float16 (or bfloat16 stored as uint16 bits). Shards are folders of ``.npy``
files (memory-mappable) plus ``records.npy`` [R, 4] int64 rows ``(index, offset, length,
prompt_len)``; a shard is written under a temporary name and renamed when complete, so
an interrupted run resumes after the last complete shard. The target runs through
``ModelRunner`` (the serving path: float32, or the integer GGUF kernels with
``quantization="gguf"``), several records per batched prefill.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from specserve.config import ModelConfig
from specserve.loading.loader import read_checkpoint, resolve_model_path
from specserve.runner.model_runner import ExtendSpec, ModelRunner

logger = logging.getLogger(__name__)

CONFIG_NAME = "capture_config.json"
SHARD_PREFIX = "shard_"
FEATURE_DTYPES = ("float16", "bfloat16")
FEATURE_KINDS = ("aux", "final")
FLOAT16_MAX = 65504.0


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default: inputs of layers 2, L // 2 and L - 3 (low, middle, high)."""
    ids = (2, num_layers // 2, num_layers - 3)
    if len(set(ids)) != 3 or min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(f"the default EAGLE3 aux layers {ids} do not fit a {num_layers}-layer target; "
                         f"pass --aux-layer-ids with three distinct layers in [0, {num_layers})")
    return ids


@dataclass
class CaptureConfig:
    model_path: str | None
    answers_path: str | list[str]     # one regenerate JSONL, or several (comma-separated or a list)
    out_dir: str
    aux_layer_ids: tuple[int, ...] | None = None   # None: default_aux_layer_ids(L)
    features: tuple[str, ...] = FEATURE_KINDS
    top_k: int = 32
    feature_dtype: str = "float16"
    batch_tokens: int = 2048       # tokens per batched prefill
    shard_tokens: int = 32768      # tokens per shard on disk
    max_seq_len: int = 2048        # longer records are truncated (prompt + answer)
    max_records: int | None = None
    device: str = "cpu"
    target_dtype: str = "float32"  # bfloat16: ~3x faster on CPUs with AMX; features within bf16 rounding
    quantization: str | None = None  # "gguf": the integer kernels `make serve` runs (CPU, GGUF targets)

    def __post_init__(self) -> None:
        bad = [f for f in self.features if f not in FEATURE_KINDS]
        if bad or not self.features:
            raise ValueError(f"--capture-features: unknown {bad}; choose from {FEATURE_KINDS}")
        if self.feature_dtype not in FEATURE_DTYPES:
            raise ValueError(f"--feature-dtype must be one of {FEATURE_DTYPES}; got {self.feature_dtype!r}")
        for name in ("top_k", "batch_tokens", "shard_tokens", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


@dataclass
class CaptureInfo:
    """Written once into ``capture_config.json``; a resumed run must agree with it."""

    model_path: str
    hidden_size: int
    vocab_size: int
    num_layers: int
    aux_layer_ids: list[int]
    features: list[str]
    top_k: int
    feature_dtype: str
    answers_path: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "CaptureInfo":
        path = Path(folder) / CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(f"no capture found in {folder} ({CONFIG_NAME} missing); "
                                    f"run --stage capture first")
        return cls(**json.loads(path.read_text()))


# ---- records -------------------------------------------------------------------------

def answer_files(answers: str | os.PathLike | list) -> list[Path]:
    """A list of answer files from a path, a comma-separated string of paths, or a list."""
    if isinstance(answers, (list, tuple)):
        return [Path(p) for p in answers]
    return [Path(p) for p in str(answers).split(",") if p.strip()]


def read_records(answers: str | os.PathLike | list, skip: set[int] | None = None,
                 limit: int | None = None) -> Iterator[dict]:
    """Records of regenerate JSONL file(s) in file order, without those in ``skip``. ``limit``
    counts records from the start (done or not), so it is stable on resume. Record indices
    must be unique across the files (reference-answer records start at 1,000,000)."""
    skip = skip or set()
    seen = 0
    for path in answer_files(answers):
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                if limit is not None and seen >= limit:
                    return
                seen += 1
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:   # a line still being written by a running regenerate
                    logger.warning("skipping an incomplete line in %s", path)
                    continue
                if record["index"] not in skip:
                    yield record


def record_tokens(record: dict, max_seq_len: int) -> tuple[list[int], int]:
    """(prompt + answer truncated to max_seq_len, prompt length)."""
    prompt = list(record["input_ids"])
    ids = (prompt + list(record["output_ids"]))[:max_seq_len]
    return ids, min(len(prompt), len(ids))


def batches(records: Iterator[dict], batch_tokens: int, max_seq_len: int) -> Iterator[list[tuple[dict, list[int], int]]]:
    """Groups of (record, ids, prompt_len) with at most ``batch_tokens`` tokens (a longer
    record goes alone)."""
    group, size = [], 0
    for record in records:
        ids, prompt_len = record_tokens(record, max_seq_len)
        if group and size + len(ids) > batch_tokens:
            yield group
            group, size = [], 0
        group.append((record, ids, prompt_len))
        size += len(ids)
    if group:
        yield group


# ---- the target ----------------------------------------------------------------------

class TargetFeatures:
    """The target behind ``ModelRunner`` set up to return every token's features."""

    def __init__(self, model_path: str | None, aux_layer_ids: tuple[int, ...] | None, *,
                 max_tokens: int, max_seq_len: int, max_rows: int = 256, device: str = "cpu",
                 model_config: ModelConfig | None = None, weights=None,
                 dtype: torch.dtype = torch.float32, quantization: str | None = None) -> None:
        if model_config is None:
            model_config, weights = read_checkpoint(resolve_model_path(model_path))
        self.config = model_config
        num_slots = max(max_tokens, max_seq_len)
        self.runner = ModelRunner(model_config, weights, dtype=dtype, device=device,
                                  max_position=max_seq_len + 1, num_kv_slots=num_slots, page_size=1,
                                  max_rows=max_rows, max_row_len=max_seq_len + 1,
                                  quantization=quantization if device == "cpu" else None)
        self.aux_layer_ids = tuple(sorted(aux_layer_ids or default_aux_layer_ids(model_config.num_hidden_layers)))
        self.runner.model.aux_layer_ids = self.aux_layer_ids
        self.runner.capture_features = "final"     # left in last_features by every forward
        self.max_rows = max_rows

    def __call__(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logits [T, V], aux [T, 3H], final [T, H]) for the concatenated sequences."""
        if len(sequences) > self.max_rows:
            raise ValueError(f"{len(sequences)} sequences in one batch; at most {self.max_rows}")
        specs, offset = [], 0
        for row, ids in enumerate(sequences):
            n = len(ids)
            specs.append(ExtendSpec(row=row, prefix_len=0, token_ids=ids,
                                    new_slots=list(range(offset, offset + n)), num_logits=n))
            offset += n
        logits, aux = self.runner.forward(specs, features="aux")
        final, self.runner.last_features = self.runner.last_features, None
        return logits, aux, final


def topk_logprobs(logits: torch.Tensor, k: int, chunk: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` (ids int32, log-probs float32) per row, computed in float32 row chunks."""
    ids, logps = [], []
    for start in range(0, logits.shape[0], chunk):
        logp = torch.log_softmax(logits[start:start + chunk].float(), dim=-1)
        values, indices = logp.topk(k, dim=-1)
        ids.append(indices.to(torch.int32))
        logps.append(values)
    return torch.cat(ids), torch.cat(logps)


# ---- shards --------------------------------------------------------------------------

def to_storage(x: torch.Tensor, feature_dtype: str) -> np.ndarray:
    """float16 array (values beyond its range clamped, with a warning), or bfloat16 bits
    as uint16. SmolLM2's massive activations reach ~25k, inside float16's 65504."""
    if feature_dtype == "bfloat16":
        return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    peak = float(x.abs().max()) if x.numel() else 0.0
    if peak > FLOAT16_MAX:
        logger.warning("target feature magnitude %.0f clamped to float16's range "
                       "(--feature-dtype bfloat16 keeps it)", peak)
        x = x.clamp(-FLOAT16_MAX, FLOAT16_MAX)
    return x.to(torch.float16).numpy()


def from_storage(array: np.ndarray) -> torch.Tensor:
    """Inverse of ``to_storage`` (a float16 or bfloat16 tensor sharing or copying the memory)."""
    tensor = torch.from_numpy(np.array(array, copy=True))     # a private, writable copy of mmap rows
    return tensor.view(torch.bfloat16) if array.dtype == np.uint16 else tensor


class ShardWriter:
    """Accumulates captured records and writes them as shard folders."""

    def __init__(self, folder: Path, shard_tokens: int) -> None:
        self.folder, self.shard_tokens = folder, shard_tokens
        self.next_shard = 1 + max((shard_number(p) for p in list_shards(folder)), default=-1)
        self._reset()

    def _reset(self) -> None:
        self.arrays: dict[str, list[np.ndarray]] = {}
        self.records: list[tuple[int, int, int, int]] = []
        self.num_tokens = 0

    def add(self, index: int, prompt_len: int, arrays: dict[str, np.ndarray]) -> None:
        length = len(arrays["tokens"])
        self.records.append((index, self.num_tokens, length, prompt_len))
        for name, value in arrays.items():
            self.arrays.setdefault(name, []).append(value)
        self.num_tokens += length
        if self.num_tokens >= self.shard_tokens:
            self.flush()

    def flush(self) -> None:
        if not self.records:
            return
        final = self.folder / f"{SHARD_PREFIX}{self.next_shard:05d}"
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name, parts in self.arrays.items():
            np.save(tmp / f"{name}.npy", np.concatenate(parts))
        np.save(tmp / "records.npy", np.asarray(self.records, dtype=np.int64).reshape(-1, 4))
        os.replace(tmp, final)
        self.next_shard += 1
        self._reset()


def list_shards(folder: Path) -> list[Path]:
    return sorted(p for p in Path(folder).glob(f"{SHARD_PREFIX}*") if p.is_dir() and not p.name.endswith(".tmp"))


def shard_number(path: Path) -> int:
    return int(path.name[len(SHARD_PREFIX):])


def captured_indices(folder: Path) -> set[int]:
    return {int(i) for shard in list_shards(folder) for i in np.load(shard / "records.npy")[:, 0]}


# ---- the stage -----------------------------------------------------------------------

def _check_or_write_info(out: Path, info: CaptureInfo) -> None:
    path = out / CONFIG_NAME
    if path.is_file():
        old = CaptureInfo.load(out)
        keys = ("hidden_size", "vocab_size", "num_layers", "aux_layer_ids", "features", "top_k", "feature_dtype")
        diff = [k for k in keys if getattr(old, k) != getattr(info, k)]
        if diff:
            raise ValueError(f"{out} holds a capture with different {', '.join(diff)} "
                             f"({[getattr(old, k) for k in diff]}); use another --work-dir or delete it")
        return
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(info), indent=1))


def capture(cfg: CaptureConfig, target: TargetFeatures | None = None) -> int:
    """Capture every record of ``cfg.answers_path`` not captured yet; returns tokens captured."""
    out = Path(cfg.out_dir)
    for leftover in out.glob(f"{SHARD_PREFIX}*.tmp"):
        shutil.rmtree(leftover)
    target = target or TargetFeatures(cfg.model_path, cfg.aux_layer_ids, max_tokens=cfg.batch_tokens,
                                      max_seq_len=cfg.max_seq_len, device=cfg.device,
                                      dtype=getattr(torch, cfg.target_dtype), quantization=cfg.quantization)
    mcfg = target.config
    info = CaptureInfo(model_path=str(cfg.model_path or "default"), hidden_size=mcfg.hidden_size,
                       vocab_size=mcfg.vocab_size, num_layers=mcfg.num_hidden_layers,
                       aux_layer_ids=list(target.aux_layer_ids), features=list(cfg.features), top_k=cfg.top_k,
                       feature_dtype=cfg.feature_dtype,
                       answers_path=",".join(map(str, answer_files(cfg.answers_path))))
    _check_or_write_info(out, info)
    done = captured_indices(out)
    writer = ShardWriter(out, cfg.shard_tokens)
    records = read_records(cfg.answers_path, skip=done, limit=cfg.max_records)
    captured = num_records = 0
    with tqdm(desc="capture", unit="tok", dynamic_ncols=True) as bar:
        for group in batches(records, cfg.batch_tokens, cfg.max_seq_len):
            for row_group in _split_rows(group, target.max_rows):
                captured += _capture_group(target, row_group, cfg, writer)
            num_records += len(group)
            bar.update(sum(len(ids) for _, ids, _ in group))
            bar.set_postfix(records=len(done) + num_records, shards=writer.next_shard)
    writer.flush()
    return captured


def _split_rows(group, max_rows: int):
    for start in range(0, len(group), max_rows):
        yield group[start:start + max_rows]


def _capture_group(target: TargetFeatures, group, cfg: CaptureConfig, writer: ShardWriter) -> int:
    with torch.inference_mode():
        logits, aux, final = target([ids for _, ids, _ in group])
        topk_ids, topk_logp = (x.cpu() for x in topk_logprobs(logits, cfg.top_k))
    del logits
    offset = 0
    for record, ids, prompt_len in group:
        n = len(ids)
        rows = slice(offset, offset + n)
        arrays = {"tokens": np.asarray(ids, dtype=np.int32),
                  "topk_ids": topk_ids[rows].numpy(),
                  "topk_logp": topk_logp[rows].to(torch.float16).numpy()}
        if "aux" in cfg.features:
            arrays["aux"] = to_storage(aux[rows].cpu(), cfg.feature_dtype)
        if "final" in cfg.features:
            arrays["final"] = to_storage(final[rows].cpu(), cfg.feature_dtype)
        writer.add(int(record["index"]), prompt_len, arrays)
        offset += n
    return offset
