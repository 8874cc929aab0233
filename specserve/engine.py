"""LLMEngine (the synchronous core: add_request / step / abort) and Engine
(the offline API: ``Engine(**server_args).generate(...)``)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.cache.block_pool import BlockPool
from specserve.cache.radix import RadixCache
from specserve.config import ServerArgs
from specserve.core import Request, SamplingParams, StepOutput, TokenResult, new_rid
from specserve.engine_setup import EngineParts, build_engine_parts
from specserve.kernels import skinny
from specserve.models.attention import KVCache
from specserve.runner.model_runner import ExtendSpec
from specserve.runner.openmp_pool import release_thread_team
from specserve.runner.sampler import compute_logprobs, sample_requests
from specserve.scheduler import ScheduledBatch, Scheduler
from specserve.tokenizer import TextStreamer

logger = logging.getLogger(__name__)
PREFAULT_KV_BYTES = 2 * 2**30      # what a server touches of its KV pool at startup


@dataclass
class EngineStats:
    num_requests: int = 0
    num_finished: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_decode_steps: int = 0
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    last_log_time: float = field(default_factory=time.time)
    tokens_since_log: int = 0
    prefill_seconds: float = 0.0        # wall time inside prefill steps
    decode_seconds: float = 0.0         # wall time inside decode steps (plain or speculative)
    decode_tokens: int = 0              # tokens those decode steps emitted

    @property
    def decode_throughput(self) -> float:
        """Tokens per second of decode-step time: what batching multiplies (NaN before any)."""
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    @property
    def avg_spec_accept_length(self) -> float:
        """Tokens emitted per verify pass (accepted drafts + 1 bonus), as SGLang reports."""
        if not self.spec_verify_ct:
            return 1.0
        return (self.spec_accepted_tokens + self.spec_verify_ct) / self.spec_verify_ct


class LLMEngine:
    """Synchronous core. Not thread-safe: one thread calls every method.

    ``detokenize=False`` (the model process of the HTTP server) leaves text to the caller:
    outputs carry token ids only, and a request is detokenized here only when its stop
    strings need the text to decide where it ends."""

    def __init__(self, server_args: ServerArgs, detokenize: bool = True) -> None:
        parts: EngineParts = build_engine_parts(server_args)
        self.server_args = server_args
        self.detokenize = detokenize
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.runner = parts.runner
        self.pool: BlockPool = parts.pool
        self.radix: RadixCache = parts.radix
        self.scheduler: Scheduler = parts.scheduler
        self.context_len = parts.context_len
        self.model_path = parts.model_path
        self.device = parts.device
        self.spec_worker = parts.spec_worker
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.streamers: dict[str, TextStreamer] = {}
        self.stats = EngineStats()
        self._pending_outputs: list[StepOutput] = []
        release_thread_team()   # loading built an OpenMP team here; the thread that steps gets the only one

    # ---- requests -----------------------------------------------------------
    def add_request(self, rid: str | None, input_ids: list[int], sampling: SamplingParams) -> str:
        rid = rid or new_rid()
        self.validate_request(input_ids, sampling)
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        req = Request(rid=rid, input_ids=list(input_ids), sampling=sampling,
                      eos_token_ids=() if sampling.ignore_eos else self.eos_token_ids)
        if sampling.seed is not None:
            req.generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        self.requests[rid] = req
        if self.detokenize or sampling.stop:
            self.streamers[rid] = TextStreamer(self.tokenizer, sampling.stop, sampling.skip_special_tokens)
        self.scheduler.add(req)
        self.stats.num_requests += 1
        self.stats.num_prompt_tokens += len(input_ids)
        return rid

    def validate_request(self, input_ids: list[int], sampling: SamplingParams) -> None:
        """Raise ValueError with a message fit for an HTTP 400."""
        if not input_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in input_ids):
            raise ValueError(f"input token ids must be in [0, {vocab})")
        sampling.validate(vocab)
        if sampling.n != 1:
            raise ValueError("n > 1 must be expanded into separate requests before the engine")
        total = len(input_ids) + sampling.max_new_tokens
        if len(input_ids) >= self.context_len or total > self.context_len:
            raise ValueError(
                f"This model's maximum context length is {self.context_len} tokens. However, you "
                f"requested {total} tokens ({len(input_ids)} in the prompt, "
                f"{sampling.max_new_tokens} for the completion). Please reduce the prompt or max_tokens.")

    def abort_request(self, rid: str) -> None:
        req = self.scheduler.abort(rid)
        if req is not None:
            self._pending_outputs.append(self._final_output(req, [], ""))

    def prefault_kv_cache(self, max_bytes: int | None = PREFAULT_KV_BYTES) -> int:
        """Touch the first ``max_bytes`` of each KV cache now (the target's, and a draft model's
        own; None: all of them); returns the bytes written. See ``KVCache.prefault``: the server
        calls this at startup. Capped because on a CPU the default pool is 30% of the machine's
        memory, and touching it all would make that resident at once."""
        runners = [self.runner, getattr(getattr(self.spec_worker, "proposer", None), "runner", None)]
        caches = [getattr(runner, "kv_cache", None) for runner in runners]
        return sum(cache.prefault(max_bytes) for cache in caches if isinstance(cache, KVCache))

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_outputs)

    # ---- one step -------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        batch = self.scheduler.schedule()
        if batch is None:
            return outputs
        start = time.perf_counter()
        results = self._run_prefill(batch) if batch.is_prefill else self._run_decode(batch)
        step_outputs = self._postprocess(results)
        self._account_step(batch.is_prefill, time.perf_counter() - start, step_outputs)
        outputs.extend(step_outputs)
        return outputs

    def _account_step(self, is_prefill: bool, seconds: float, outputs: list[StepOutput]) -> None:
        if is_prefill:
            self.stats.prefill_seconds += seconds
        else:
            self.stats.decode_seconds += seconds
            self.stats.decode_tokens += sum(len(o.new_token_ids) for o in outputs)

    def _run_prefill(self, batch: ScheduledBatch) -> dict[str, TokenResult]:
        specs = []
        for item in batch.items:
            req = item.req
            start = req.num_computed
            reaches_end = start + item.num_new_tokens == req.seq_len
            row = self.scheduler.row_of[req.rid]
            self.runner.set_row_slots(row, 0, req.kv_slots)   # cached prefix / earlier chunks
            specs.append(ExtendSpec(row=row, prefix_len=start,
                                    token_ids=req.all_ids[start:start + item.num_new_tokens],
                                    new_slots=item.new_slots, num_logits=1 if reaches_end else 0))
        logits = self.runner.forward(specs, is_prefill=True)
        sampled = [item.req for item, spec in zip(batch.items, specs) if spec.num_logits]
        self.scheduler.commit_all(batch.items)
        if self.spec_worker is not None:   # drafters ingest the prompt (draft KV, n-gram cache)
            self.spec_worker.on_prefill(self, batch)
        return self.sample_one_each(sampled, logits)

    def _run_decode(self, batch: ScheduledBatch) -> dict[str, TokenResult]:
        self.stats.num_decode_steps += 1
        if self.spec_worker is not None:
            return self.spec_worker.decode_step(self, batch)
        return self.plain_decode(batch)

    def plain_decode(self, batch: ScheduledBatch) -> dict[str, TokenResult]:
        """One plain decode step: one new token for every request of ``batch``."""
        logits = self.decode_forward(batch.items)
        self.scheduler.commit_all(batch.items)
        return self.sample_one_each(batch.requests, logits)

    def decode_forward(self, items: list) -> torch.Tensor:
        """Logits [len(items), V] of each item's last token, its K/V written to its first new slot."""
        specs = [ExtendSpec(row=self.scheduler.row_of[item.req.rid], prefix_len=item.req.num_computed,
                            token_ids=[item.req.last_id], new_slots=item.new_slots[:1])
                 for item in items]
        return self.runner.forward(specs)

    def sample_one_each(self, reqs: list[Request], logits: torch.Tensor) -> dict[str, TokenResult]:
        if not reqs:
            return {}
        logits = _ban_stop_tokens_before_min_new_tokens(reqs, logits)
        tokens = sample_requests(logits, self.model_config.vocab_size, reqs).tolist()
        results = {req.rid: TokenResult([tok]) for req, tok in zip(reqs, tokens)}
        self._attach_logprobs(reqs, logits, tokens, results)
        return results

    def _attach_logprobs(self, reqs, logits, tokens, results) -> None:
        rows = [i for i, r in enumerate(reqs) if r.sampling.return_logprob]
        if not rows:
            return
        top_n = max(reqs[i].sampling.top_logprobs_num for i in rows)
        index = torch.tensor(rows, device=logits.device)
        chosen, top_ids, top_lps = compute_logprobs(logits.index_select(0, index),
                                                    torch.tensor([tokens[i] for i in rows]), top_n)
        for k, i in enumerate(rows):
            n = reqs[i].sampling.top_logprobs_num
            res = results[reqs[i].rid]
            res.logprobs = [float(chosen[k])]
            res.top_logprobs = [list(zip(top_ids[k, :n].tolist(), top_lps[k, :n].tolist()))]

    # ---- after the forward ------------------------------------------------------
    def _postprocess(self, results: dict[str, TokenResult]) -> list[StepOutput]:
        outputs = []
        for rid, result in results.items():
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            outputs.append(self._append_tokens(req, result))
        self._maybe_log_decode(sum(len(o.new_token_ids) for o in outputs))
        return outputs

    def _append_tokens(self, req: Request, result: TokenResult) -> StepOutput:
        """Append tokens one by one, stopping exactly where a stop condition hits."""
        if req.first_token_time is None:
            req.first_token_time = time.time()
        streamer = self.streamers.get(req.rid)
        accepted: list[int] = []
        text = ""
        stopped_by_string = False
        for i, token in enumerate(result.token_ids):
            if len(req.output_ids) >= req.sampling.max_new_tokens:   # max_new_tokens=0: prompt only
                req.finish("length")
                break
            req.output_ids.append(token)
            accepted.append(token)
            if req.sampling.return_logprob and i < len(result.logprobs):
                req.output_logprobs.append(result.logprobs[i])
                req.output_top_logprobs.append(result.top_logprobs[i])
            delta, matched = streamer.feed([token]) if streamer is not None else ("", None)
            text += delta
            if matched is not None:
                req.finish("stop", matched)
                stopped_by_string = True
                break
            if self._check_stop(req, token):
                break
        self.stats.num_generated_tokens += len(accepted)
        self.stats.tokens_since_log += len(accepted)
        n = len(accepted)
        logprobs = req.output_logprobs[-n:] if req.sampling.return_logprob else []
        top = req.output_top_logprobs[-n:] if req.sampling.return_logprob else []
        if req.is_finished:
            if not stopped_by_string and streamer is not None:
                text += streamer.flush()
            self.scheduler.release(req)
            return self._final_output(req, accepted, text, logprobs, top)
        return StepOutput(req.rid, accepted, False, None, text, self._meta(req), logprobs, top)

    def _check_stop(self, req: Request, token: int) -> bool:
        n_out = len(req.output_ids)
        if n_out >= req.sampling.min_new_tokens and token in req.eos_token_ids:
            req.finish("stop", token)
        elif n_out >= req.sampling.min_new_tokens and token in req.sampling.stop_token_ids:
            req.finish("stop", token)
        elif n_out >= req.sampling.max_new_tokens or req.seq_len >= self.context_len:
            req.finish("length")
        return req.is_finished

    def _final_output(self, req: Request, tokens: list[int], text: str, logprobs=None, top=None,
                      ) -> StepOutput:
        self.requests.pop(req.rid, None)
        self.streamers.pop(req.rid, None)
        self.stats.num_finished += 1
        meta = self._meta(req)
        meta["e2e_latency"] = time.time() - req.arrival_time
        if self.spec_worker is not None:   # the policy's per-request figures (drafted vs plain steps)
            meta.update(self.spec_worker.request_meta(req))
        return StepOutput(req.rid, tokens, True, req.finish_reason, text, meta, logprobs or [], top or [])

    def _meta(self, req: Request) -> dict[str, Any]:
        meta = {"prompt_tokens": len(req.input_ids), "completion_tokens": len(req.output_ids),
                "cached_tokens": req.cached_tokens, "spec_verify_ct": req.spec_verify_ct}
        if req.spec_verify_ct:
            meta["spec_accept_length"] = (req.spec_accepted_tokens + req.spec_verify_ct) / req.spec_verify_ct
        return meta

    def _maybe_log_decode(self, num_new: int) -> None:
        interval = self.server_args.decode_log_interval
        if interval <= 0 or self.stats.num_decode_steps == 0 or self.stats.num_decode_steps % interval:
            return
        now = time.time()
        rate = self.stats.tokens_since_log / max(now - self.stats.last_log_time, 1e-6)
        usage = self.kv_usage()
        used = usage["total"] - usage["free"]
        logger.info("Decode batch. #running-req: %d, #queue-req: %d, #token: %d, token usage: %.2f, "
                    "gen throughput (token/s): %.2f, accept len: %.2f", len(self.scheduler.running),
                    len(self.scheduler.waiting), used, used / max(usage["total"], 1), rate,
                    self.stats.avg_spec_accept_length)
        self.stats.last_log_time, self.stats.tokens_since_log = now, 0

    # ---- introspection ----------------------------------------------------------
    def kv_usage(self) -> dict[str, int]:
        return {"total": self.pool.capacity_tokens, "free": self.pool.num_free_tokens,
                "cached": self.radix.total_size(), "evictable": self.radix.evictable_size()}

    def flush_cache(self) -> bool:
        if self.scheduler.has_work():
            return False
        self.radix.reset()
        return True

    def get_server_info(self) -> dict[str, Any]:
        usage = self.kv_usage()
        return {
            "model_path": self.model_path, "context_length": self.context_len,
            "max_total_num_tokens": usage["total"], "dtype": str(self.runner.dtype).replace("torch.", ""),
            "device": str(self.device), "num_running_reqs": len(self.scheduler.running),
            "num_waiting_reqs": len(self.scheduler.waiting), "kv_usage": usage,
            "num_requests": self.stats.num_requests, "num_generated_tokens": self.stats.num_generated_tokens,
            "avg_spec_accept_length": self.stats.avg_spec_accept_length,
            "speculative_algorithm": self.server_args.speculative_algorithm,
            "quantization": self.server_args.quantization or "unquant",
            "cpu_kernel_variant": skinny.kernel_variant() if self.device == "cpu" else None,
            **(self.spec_worker.server_info() if self.spec_worker is not None else {}),
        }


class Engine:
    """Offline API: ``Engine(**server_args).generate(prompt=..., sampling_params=...)``."""

    def __init__(self, **kwargs: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        self.engine = LLMEngine(self.server_args)
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompt: str | list[str] | None = None, sampling_params: dict | list[dict] | None = None,
                 input_ids: list[int] | list[list[int]] | None = None) -> dict | list[dict]:
        prompts, is_batch = _as_batch(prompt, input_ids, self.tokenizer)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        rids = [self.engine.add_request(None, ids, SamplingParams(**(p or {}))) for ids, p in zip(prompts, params)]
        try:
            results = self._run_until_done(rids)
        finally:
            release_thread_team()   # the next caller, on any thread, owns the only OpenMP team
        ordered = [results[r] for r in rids]
        return ordered if is_batch else ordered[0]

    def _run_until_done(self, rids: list[str]) -> dict[str, dict]:
        results = {rid: {"text": "", "output_ids": [], "meta_info": {}} for rid in rids}
        pending = set(rids)
        while pending:
            for out in self.engine.step():
                if out.rid not in results:
                    continue
                res = results[out.rid]
                res["text"] += out.text_delta
                res["output_ids"].extend(out.new_token_ids)
                if out.finished:
                    res["meta_info"] = dict(out.meta_info, id=out.rid, finish_reason=out.finish_reason)
                    pending.discard(out.rid)
        return results

    def shutdown(self) -> None:
        self.engine = None


def _ban_stop_tokens_before_min_new_tokens(reqs: list[Request], logits: torch.Tensor) -> torch.Tensor:
    """min_new_tokens (SGLang semantics): EOS and stop_token_ids cannot be sampled before it.
    Returns ``logits`` itself when no request needs it, else a masked copy."""
    rows: list[int] = []
    cols: list[int] = []
    for i, req in enumerate(reqs):
        if len(req.output_ids) < req.sampling.min_new_tokens:
            banned = list(req.eos_token_ids) + req.sampling.stop_token_ids
            rows += [i] * len(banned)
            cols += banned
    if not rows:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device))


def _as_batch(prompt, input_ids, tokenizer) -> tuple[list[list[int]], bool]:
    if input_ids is not None:
        if input_ids and isinstance(input_ids[0], list):
            return [list(x) for x in input_ids], True
        return [list(input_ids)], False
    if prompt is None:
        raise ValueError("give prompt or input_ids")
    if isinstance(prompt, list):
        return [tokenizer.encode(p) for p in prompt], True
    return [tokenizer.encode(prompt)], False
