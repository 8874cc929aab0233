"""Captured records as training batches: memory-mapped shards, records packed into rows
of ``seq_len`` tokens (several short records per row, long ones truncated), a fixed
shuffle per epoch, and a held-out validation set.

A batch holds per-row base tensors; the unrolled steps read them shifted (step ``j`` at
index ``i`` consumes token ``i + 1 + j`` and is scored against the target at position
``i + 1 + j``), see ``step_view``.
"""
from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch

from specserve.train.capture import CaptureInfo, from_storage, list_shards


@dataclass
class Record:
    shard: int
    offset: int
    length: int
    prompt_len: int
    index: int


class CaptureDataset:
    """Every captured record of a capture folder, read lazily from memory maps."""

    def __init__(self, folder: str | os.PathLike, feature: str) -> None:
        self.folder = Path(folder)
        self.info = CaptureInfo.load(self.folder)
        if feature not in self.info.features:
            raise ValueError(f"the capture in {folder} has no {feature!r} features (it has {self.info.features}); "
                             f"capture again with --capture-features including {feature}")
        self.feature = feature
        self.shards: list[dict[str, np.ndarray]] = []
        self.records: list[Record] = []
        for number, path in enumerate(list_shards(self.folder)):
            names = ["tokens", "topk_ids", "topk_logp"] + [f for f in self.info.features]
            self.shards.append({n: np.load(path / f"{n}.npy", mmap_mode="r") for n in names})
            for index, offset, length, prompt_len in np.load(path / "records.npy"):
                self.records.append(Record(number, int(offset), int(length), int(prompt_len), int(index)))
        if not self.records:
            raise ValueError(f"the capture in {folder} holds no records; run --stage capture first")

    def __len__(self) -> int:
        return len(self.records)

    @property
    def num_tokens(self) -> int:
        return sum(r.length for r in self.records)

    def read(self, record: Record, length: int, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
        shard = self.shards[record.shard]
        rows = slice(record.offset, record.offset + length)
        return {n: from_storage(shard[n][rows]) for n in names}


@dataclass
class Batch:
    """B packed rows of L tokens. ``segment`` -1 marks padding."""

    tokens: torch.Tensor        # [B, L] int64
    positions: torch.Tensor     # [B, L] int64, restarting at 0 for each record
    segment: torch.Tensor       # [B, L] int64 record slot within the row; -1 = padding
    is_answer: torch.Tensor     # [B, L] bool: the target's prediction here is of an answer token
    feature: torch.Tensor       # [B, L, F] the draft's step-0 input features (float32)
    final: torch.Tensor | None  # [B, L, H] target final hidden (EAGLE regression target)
    topk_ids: torch.Tensor      # [B, L, K] int64 target top-k ids
    topk_logp: torch.Tensor     # [B, L, K] float32 their log-probs

    def to(self, device) -> "Batch":
        return Batch(**{k: (v.to(device, non_blocking=True) if v is not None else None)
                        for k, v in self.__dict__.items()})

    @property
    def num_tokens(self) -> int:
        return int((self.segment >= 0).sum())


def shift(x: torch.Tensor, by: int, fill) -> torch.Tensor:
    """x[:, i + by] at index i along dim 1 (``fill`` past the row end)."""
    if by == 0:
        return x
    pad = x.new_full((x.shape[0], by) + tuple(x.shape[2:]), fill)
    return torch.cat([x[:, by:], pad], dim=1)


def step_view(batch: Batch, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids [B, L], loss mask [B, L], rope positions [B, L]) of unrolled step ``step``:
    index i consumes token i + 1 + step of the same record; its loss is live where that
    token exists and the target's prediction there is of an answer token."""
    by = 1 + step
    same = (shift(batch.segment, by, -1) == batch.segment) & (batch.segment >= 0)
    ids = torch.where(same, shift(batch.tokens, by, 0), 0)
    mask = same & shift(batch.is_answer, by, False)
    return ids, mask, batch.positions + step


def pack_rows(lengths: list[int], seq_len: int, num_open: int = 8) -> list[list[tuple[int, int]]]:
    """Rows of (record number, kept length): first fit among the last ``num_open`` rows,
    records longer than ``seq_len`` truncated."""
    rows: list[list[tuple[int, int]]] = []
    room: list[int] = []
    for number, length in enumerate(lengths):
        length = min(length, seq_len)
        start = max(0, len(rows) - num_open)
        slot = next((r for r in range(start, len(rows)) if room[r] >= length), None)
        if slot is None:
            rows.append([])
            room.append(seq_len)
            slot = len(rows) - 1
        rows[slot].append((number, length))
        room[slot] -= length
    return rows


class BatchLoader:
    """Deterministic batches for (epoch, step): the records of ``record_ids`` shuffled
    with ``seed + epoch``, packed into rows, ``batch_size`` rows a batch."""

    def __init__(self, data: CaptureDataset, record_ids: list[int], *, seq_len: int, batch_size: int,
                 seed: int, with_final: bool = False, shuffle: bool = True) -> None:
        self.data, self.record_ids = data, record_ids
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.with_final, self.shuffle = with_final, shuffle
        self._plans: dict[int, list[list[list[tuple[int, int]]]]] = {}

    def plan(self, epoch: int) -> list[list[list[tuple[int, int]]]]:
        """Batches of rows of (record id, kept length) for ``epoch``."""
        if epoch not in self._plans:
            order = list(self.record_ids)
            if self.shuffle:
                random.Random(self.seed + epoch).shuffle(order)
            rows = pack_rows([self.data.records[r].length for r in order], self.seq_len)
            rows = [[(order[n], length) for n, length in row] for row in rows]
            self._plans = {epoch: [rows[i:i + self.batch_size] for i in range(0, len(rows), self.batch_size)]}
        return self._plans[epoch]

    def steps_per_epoch(self) -> int:
        return len(self.plan(0))

    def batches(self, epoch: int, start: int = 0) -> Iterator[Batch]:
        for rows in self.plan(epoch)[start:]:
            yield self.make_batch(rows)

    def make_batch(self, rows: list[list[tuple[int, int]]]) -> Batch:
        data, seq_len, bsz = self.data, self.seq_len, len(rows)
        info = data.info
        feat_dim = len(info.aux_layer_ids) * info.hidden_size if data.feature == "aux" else info.hidden_size
        out = {"tokens": torch.zeros(bsz, seq_len, dtype=torch.int64),
               "positions": torch.zeros(bsz, seq_len, dtype=torch.int64),
               "segment": torch.full((bsz, seq_len), -1, dtype=torch.int64),
               "is_answer": torch.zeros(bsz, seq_len, dtype=torch.bool),
               "feature": torch.zeros(bsz, seq_len, feat_dim),
               "final": torch.zeros(bsz, seq_len, info.hidden_size) if self.with_final else None,
               "topk_ids": torch.zeros(bsz, seq_len, info.top_k, dtype=torch.int64),
               "topk_logp": torch.full((bsz, seq_len, info.top_k), -1e4)}
        names = ("tokens", "topk_ids", "topk_logp", data.feature) + (("final",) if self.with_final else ())
        for b, row in enumerate(rows):
            col = 0
            for slot, (record_id, length) in enumerate(row):
                record = data.records[record_id]
                arrays = data.read(record, length, tuple(dict.fromkeys(names)))
                cols = slice(col, col + length)
                out["tokens"][b, cols] = arrays["tokens"].long()
                out["positions"][b, cols] = torch.arange(length)
                out["segment"][b, cols] = slot
                out["is_answer"][b, cols] = torch.arange(length) >= record.prompt_len - 1
                out["feature"][b, cols] = arrays[data.feature].float()
                if self.with_final:
                    out["final"][b, cols] = arrays["final"].float()
                out["topk_ids"][b, cols] = arrays["topk_ids"].long()
                out["topk_logp"][b, cols] = arrays["topk_logp"].float()
                col += length
        return Batch(**out)


def split_records(num_records: int, num_val: int, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, validation ids): ``num_val`` records held out with a fixed seed."""
    order = list(range(num_records))
    random.Random(seed ^ 0x5EED).shuffle(order)
    num_val = min(num_val, max(num_records - 1, 0))
    return sorted(order[num_val:]), sorted(order[:num_val])
