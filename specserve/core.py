"""Request-level data: sampling parameters, requests, step outputs.

Pure Python (torch only for the per-request generator). Nothing here knows
about models, caches or HTTP.
"""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

_GREEDY_EPS = 1e-5


@dataclass
class SamplingParams:
    """Per-request decoding parameters (SGLang's native names)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    seed: int | None = None
    n: int = 1
    return_logprob: bool = False
    top_logprobs_num: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the offending field."""
        checks = [
            (self.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
            (self.min_new_tokens >= 0, "min_new_tokens must be >= 0"),
            (0.0 <= self.temperature <= 100.0, "temperature must be in [0, 100]"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k == -1 or self.top_k >= 1, "top_k must be -1 (disabled) or >= 1"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 2.0, "repetition_penalty must be in (0, 2]"),
            (1 <= self.n <= 64, "n must be in [1, 64]"),
            (0 <= self.top_logprobs_num <= 20, "top_logprobs must be in [0, 20]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids out of range [0, {vocab_size}): {bad}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_rid_counter = itertools.count()


def new_rid() -> str:
    return f"req-{next(_rid_counter)}-{int(time.time() * 1000) % 100000}"


@dataclass
class Request:
    """One sequence being generated. The scheduler owns its KV bookkeeping.

    ``kv_slots[i]`` is the KV-pool slot holding token ``i`` of ``all_ids``;
    ``len(kv_slots) == num_computed`` between steps.
    """

    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: dict[str, Any] | None = None
    kv_slots: list[int] = field(default_factory=list)
    num_computed: int = 0          # tokens whose KV is in the cache
    cached_tokens: int = 0         # prompt tokens served by the prefix cache
    prefix_node: Any = None        # radix-cache node locked by this request
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    generator: torch.Generator | None = None
    arrival_time: float = field(default_factory=time.time)
    first_token_time: float | None = None
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0  # draft tokens accepted (bonus excluded)
    spec_state: Any = None         # proposer-private per-request state

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def last_id(self) -> int:
        """``all_ids[-1]`` without joining the lists (every request, every decode step)."""
        return self.output_ids[-1] if self.output_ids else self.input_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def is_prefilling(self) -> bool:
        """True while prompt tokens remain to be computed (chunked prefill)."""
        return self.num_computed < len(self.input_ids)

    def finish(self, reason: str, matched: Any = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = {"type": reason}
        if matched is not None:
            self.finish_reason["matched"] = matched


@dataclass
class TokenResult:
    """Tokens a step produced for one request (a decode step may yield several)."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class StepOutput:
    """What one engine step produced for one request."""

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: dict[str, Any] | None = None
    text_delta: str = ""           # newly final text (stop strings cut, held back while ambiguous)
    meta_info: dict[str, Any] = field(default_factory=dict)  # prompt/completion/cached tokens, spec stats
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
