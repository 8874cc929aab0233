"""A deterministic stand-in for ``specserve.engine.LLMEngine`` (same interface, no model).

Tokenizer: one token per UTF-8 byte (ids 0..255), plus BOS=256 and EOS=257.
Generation: the output echoes the prompt's tokens from position ``seed % len``
(0 without a seed), two tokens per step (like speculative decoding accepting
one draft token), and emits EOS after one full echo unless ``ignore_eos``.
A prompt containing ``CRASH`` makes the next ``step()`` raise once.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specserve.config import ServerArgs
from specserve.core import SamplingParams, StepOutput

BOS_ID, EOS_ID = 256, 257
FAKE_VOCAB_SIZE = 260
FAKE_CONTEXT_LEN = 256
TOKENS_PER_STEP = 2
CRASH_MARKER = "CRASH"


class FakeTokenizer:
    eos_token_ids = (EOS_ID,)
    vocab_size = FAKE_VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(t for t in ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class FakeRequest:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    cached_tokens: int
    output_ids: list[int] = field(default_factory=list)
    emitted_text_len: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    verify_steps: int = 0
    aborted: bool = False

    def next_token(self) -> int:
        offset = self.sampling.seed or 0
        return self.input_ids[(offset + len(self.output_ids)) % len(self.input_ids)]


@dataclass
class FakeModelConfig:
    vocab_size: int = FAKE_VOCAB_SIZE


class FakeLLMEngine:
    """Same public surface as LLMEngine; records adds and aborts for the tests."""

    def __init__(self, server_args: ServerArgs | None = None, step_delay_s: float = 0.0) -> None:
        self.server_args = server_args or ServerArgs(model_path="fake-model")
        self.tokenizer = FakeTokenizer()
        self.model_config = FakeModelConfig()
        self.context_len = FAKE_CONTEXT_LEN
        self.step_delay_s = step_delay_s
        self.requests: dict[str, FakeRequest] = {}
        self.added: list[tuple[str, list[int], SamplingParams]] = []
        self.aborted: list[str] = []
        self.seen_prompts: list[list[int]] = []
        self.num_steps = 0
        self.crash_next_step = False
        self._owner_thread: int | None = None

    # ---- LLMEngine interface -----------------------------------------------------------
    def add_request(self, rid: str, input_ids: list[int], sampling: SamplingParams) -> None:
        self._check_thread()
        if not input_ids:
            raise ValueError("the prompt is empty")
        if any(not 0 <= t < FAKE_VOCAB_SIZE for t in input_ids):
            raise ValueError(f"token ids must be in [0, {FAKE_VOCAB_SIZE})")
        if len(input_ids) + sampling.max_new_tokens > self.context_len:
            raise ValueError(f"prompt ({len(input_ids)} tokens) + max_new_tokens "
                             f"({sampling.max_new_tokens}) exceeds the context length {self.context_len}")
        sampling.validate(FAKE_VOCAB_SIZE)
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        if CRASH_MARKER in self.tokenizer.decode(input_ids):
            self.crash_next_step = True
        self.requests[rid] = FakeRequest(rid, list(input_ids), sampling, self._cached_prefix(input_ids))
        self.seen_prompts.append(list(input_ids))
        self.added.append((rid, list(input_ids), sampling))

    def abort_request(self, rid: str) -> None:
        self._check_thread()
        request = self.requests.get(rid)
        if request is not None:
            request.aborted = True
            self.aborted.append(rid)

    def step(self) -> list[StepOutput]:
        self._check_thread()
        self.num_steps += 1
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.crash_next_step:
            self.crash_next_step = False
            raise RuntimeError("simulated engine failure")
        outputs = [self._advance(request) for request in list(self.requests.values())]
        for output in outputs:
            if output.finished:
                del self.requests[output.rid]
        return outputs

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def get_server_info(self) -> dict[str, Any]:
        return {"num_running_reqs": len(self.requests), "num_waiting_reqs": 0,
                "avg_spec_accept_length": float(TOKENS_PER_STEP), "engine": "fake"}

    def flush_cache(self) -> bool:
        if self.requests:
            return False
        self.seen_prompts.clear()
        return True

    def kv_usage(self) -> dict[str, int]:
        used = sum(len(r.input_ids) + len(r.output_ids) for r in self.requests.values())
        return {"total": 4096, "free": 4096 - used, "cached": 0}

    # ---- fake generation ---------------------------------------------------------------
    def _check_thread(self) -> None:
        """The real engine is not thread-safe: fail loudly if two threads drive it."""
        ident = threading.get_ident()
        if self._owner_thread is None:
            self._owner_thread = ident
        assert self._owner_thread == ident, "LLMEngine called from two threads"

    def _cached_prefix(self, input_ids: list[int]) -> int:
        best = 0
        for seen in self.seen_prompts:
            common = 0
            for a, b in zip(seen, input_ids):
                if a != b:
                    break
                common += 1
            best = max(best, common)
        return min(best, len(input_ids) - 1)

    def _advance(self, request: FakeRequest) -> StepOutput:
        if request.aborted:
            return self._output(request, [], {"type": "abort"})
        new_ids: list[int] = []
        finish = None
        request.verify_steps += 1
        for _ in range(TOKENS_PER_STEP):
            finish = self._append_one(request, new_ids)
            if finish is not None:
                break
        return self._output(request, new_ids, finish)

    def _append_one(self, request: FakeRequest, new_ids: list[int]) -> dict[str, Any] | None:
        sampling = request.sampling
        if len(request.output_ids) >= sampling.max_new_tokens:
            return {"type": "length", "length": sampling.max_new_tokens}
        echoed_once = len(request.output_ids) >= len(request.input_ids)
        token = EOS_ID if echoed_once and not sampling.ignore_eos else request.next_token()
        request.output_ids.append(token)
        new_ids.append(token)
        if token == EOS_ID:
            return {"type": "stop", "matched": EOS_ID}
        if token in sampling.stop_token_ids:
            return {"type": "stop", "matched": token}
        matched = next((s for s in sampling.stop if s in self._full_text(request)), None)
        if matched is not None:
            return {"type": "stop", "matched": matched}
        if len(request.output_ids) >= sampling.max_new_tokens:
            return {"type": "length", "length": sampling.max_new_tokens}
        return None

    def _full_text(self, request: FakeRequest) -> str:
        return self.tokenizer.decode(request.output_ids)

    def _final_text(self, request: FakeRequest, finish: dict[str, Any] | None) -> str:
        """Text that is final now: stop strings cut; text that may start a stop string held back."""
        text = self._full_text(request)
        stop = finish.get("matched") if finish else None
        if isinstance(stop, str):
            return text[:text.index(stop)]
        if finish is not None:
            return text
        hold = max((k for s in request.sampling.stop for k in range(1, len(s))
                    if text.endswith(s[:k])), default=0)
        return text[:len(text) - hold]

    def _output(self, request: FakeRequest, new_ids: list[int], finish: dict[str, Any] | None) -> StepOutput:
        final_text = self._final_text(request, finish)
        delta = final_text[request.emitted_text_len:]
        request.emitted_text_len = len(final_text)
        meta = {"prompt_tokens": len(request.input_ids), "completion_tokens": len(request.output_ids),
                "cached_tokens": request.cached_tokens, "spec_verify_ct": request.verify_steps,
                "spec_accept_length": len(request.output_ids) / max(request.verify_steps, 1)}
        if finish is not None:
            meta["e2e_latency"] = time.perf_counter() - request.arrival
        logprobs = [-0.5] * len(new_ids) if request.sampling.return_logprob else []
        top = ([[(t, -0.5), ((t + 1) % 256, -1.5)][:request.sampling.top_logprobs_num] for t in new_ids]
               if request.sampling.return_logprob else [])
        return StepOutput(rid=request.rid, new_token_ids=new_ids, finished=finish is not None,
                          finish_reason=finish, text_delta=delta, meta_info=meta,
                          new_logprobs=logprobs, new_top_logprobs=top)
