"""AsyncEngine: serves a synchronous ``LLMEngine`` to asyncio code from a thread of the same
process, and what it shares with the HTTP server's ``EngineClient`` (``engine_client.py``,
which runs the engine in a process of its own): request groups, sub-requests, errors.

The HTTP server uses EngineClient; AsyncEngine serves the API tests' fake engine and
callers who embed the engine in their own process. One background thread owns the engine:
it drains a thread-safe inbox of commands (add, abort, call), then runs ``engine.step()``
and hands each ``StepOutput`` to the asyncio queue of the request group it belongs to
(``loop.call_soon_threadsafe``). When the engine has nothing to do the thread sleeps on an
Event; posting a command wakes it.

A request group is one API call: ``len(prompts) * n`` engine sub-requests whose
outputs are merged into one stream of ``IndexedOutput(index, output)``, where
``index = prompt_index * n + sample_index`` (the OpenAI choice index).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from specserve.core import SamplingParams, StepOutput
from specserve.server.metrics import ServerMetrics

if TYPE_CHECKING:
    from specserve.engine import LLMEngine

logger = logging.getLogger(__name__)
T = TypeVar("T")
_CRASH_BACKOFF_S = 0.05


class EngineError(RuntimeError):
    """The engine failed while serving a request (HTTP 500); the server keeps serving."""


class EngineUnavailable(EngineError):
    """The model process is gone (HTTP 503): nothing can be served until a restart."""


@dataclass
class IndexedOutput:
    index: int
    output: StepOutput


@dataclass
class SubRequest:
    """Everything needed to add one engine request."""

    rid: str
    index: int
    input_ids: list[int]
    sampling: SamplingParams


@dataclass
class LiveRequest:
    """Bookkeeping for one sub-request in the engine: where its outputs go, its metrics."""

    group: "RequestGroup"
    index: int
    arrival_time: float = field(default_factory=time.perf_counter)
    has_first_token: bool = False

    def record(self, metrics: ServerMetrics, output: StepOutput) -> None:
        elapsed = time.perf_counter() - self.arrival_time
        if output.new_token_ids and not self.has_first_token:
            self.has_first_token = True
            metrics.observe_first_token(elapsed)
        metrics.observe_tokens(len(output.new_token_ids))
        if output.finished:
            reason = (output.finish_reason or {}).get("type", "unknown")
            metrics.observe_finished(reason, elapsed, output.meta_info or {})


@dataclass
class _AddGroup:
    group: "RequestGroup"
    sub_requests: list[SubRequest]
    accepted: asyncio.Future


@dataclass
class _Abort:
    rids: list[str]


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    result: asyncio.Future


def expand_sub_requests(prompts: list[list[int]], sampling: SamplingParams, base_rid: str) -> list[SubRequest]:
    """One sub-request per (prompt, sample); sample j gets seed + j when a seed is set."""
    num_samples = sampling.n
    single = len(prompts) == 1 and num_samples == 1
    subs = []
    for prompt_index, input_ids in enumerate(prompts):
        for sample_index in range(num_samples):
            index = prompt_index * num_samples + sample_index
            seed = None if sampling.seed is None else sampling.seed + sample_index
            sub_sampling = dataclasses.replace(sampling, n=1, seed=seed, stop=list(sampling.stop),
                                               stop_token_ids=list(sampling.stop_token_ids))
            rid = base_rid if single else f"{base_rid}-{index}"
            subs.append(SubRequest(rid, index, list(input_ids), sub_sampling))
    return subs


async def accepted_group(group: "RequestGroup", accepted: asyncio.Future) -> "RequestGroup":
    """``group`` once the engine has taken its sub-requests (re-raises the engine's refusal);
    a caller that goes away while waiting aborts them."""
    try:
        await accepted
    except asyncio.CancelledError:
        group.abort()
        raise
    return group


def _resolve(future: asyncio.Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a future's outcome unless its waiter already went away (runs on the asyncio loop)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the request's event loop is closed: nobody is listening
        pass


class RequestGroup:
    """Async iterator over the merged outputs of one API call's sub-requests."""

    def __init__(self, abort_rids: Callable[[list[str]], None], rids: list[str],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.rids = rids
        self.loop = loop
        self._abort_rids = abort_rids
        self._queue: asyncio.Queue[IndexedOutput | BaseException] = asyncio.Queue()
        self._unfinished = set(range(len(rids)))
        self._closed = False

    @property
    def is_finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> "RequestGroup":
        return self

    async def __anext__(self) -> IndexedOutput:
        if self.is_finished or self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._closed = True
            raise item
        if item.output.finished:
            self._unfinished.discard(item.index)
        return item

    def abort(self) -> None:
        """Abort the unfinished sub-requests (frees their KV). Safe to call twice; never blocks."""
        if self._closed:
            return
        self._closed = True
        unfinished = [self.rids[i] for i in sorted(self._unfinished)]
        if unfinished:
            self._abort_rids(unfinished)

    # called on the asyncio loop (through call_soon_threadsafe from the engine thread)
    def _put(self, item: IndexedOutput | BaseException) -> None:
        self._queue.put_nowait(item)


class AsyncEngine:
    """Runs ``llm_engine.step()`` in one background thread; all engine calls happen there."""

    def __init__(self, llm_engine: "LLMEngine", metrics: ServerMetrics | None = None) -> None:
        self.engine = llm_engine
        self.metrics = metrics or ServerMetrics(model_name_of(llm_engine))
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._live: dict[str, LiveRequest] = {}   # touched by the loop thread only
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._stopping = False

    # ---- public API (asyncio side) ---------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def context_len(self) -> int:
        return self.engine.context_len

    @property
    def model_path(self) -> str | None:
        return getattr(self.engine, "model_path", None)

    @property
    def vocab_size(self) -> int | None:
        return getattr(getattr(self.engine, "model_config", None), "vocab_size", None)

    @property
    def model_pid(self) -> int:
        """The process that runs the model: this one."""
        return os.getpid()

    @property
    def health_error(self) -> str | None:
        """Why the engine cannot serve, or None while it can."""
        return None

    @property
    def num_active_requests(self) -> int:
        return len(self._live)

    def start(self) -> None:
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
                self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    async def submit(self, prompts: list[list[int]], sampling: SamplingParams,
                     rid: str | None = None, stream: bool = True) -> RequestGroup:
        """Add ``len(prompts) * sampling.n`` sub-requests; raises ValueError if the engine rejects any.
        ``stream`` is EngineClient's hint; this in-thread engine delivers every step either way."""
        self.start()
        loop = asyncio.get_running_loop()
        subs = expand_sub_requests(prompts, sampling, rid or uuid.uuid4().hex)
        group = RequestGroup(lambda rids: self._post(_Abort(rids)), [s.rid for s in subs], loop)
        accepted = loop.create_future()
        self._post(_AddGroup(group, subs, accepted))
        return await accepted_group(group, accepted)

    async def generate(self, input_ids: list[int], sampling: SamplingParams,
                       rid: str | None = None) -> AsyncIterator[StepOutput]:
        """Stream one request's outputs. With n > 1 the sub-requests' outputs interleave
        (their rids are ``f"{rid}-{i}"``). Closing the iterator early aborts the request."""
        group = await self.submit([input_ids], sampling, rid)
        try:
            async for item in group:
                yield item.output
        finally:
            group.abort()

    async def query(self, method: str) -> Any:
        """``engine.<method>()`` on the engine thread (get_server_info, flush_cache, kv_usage)."""
        return await self.call(lambda engine: getattr(engine, method)())

    async def call(self, fn: Callable[["LLMEngine"], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps and return its result."""
        self.start()
        loop = asyncio.get_running_loop()
        result = loop.create_future()
        self._post(_Call(fn, loop, result))
        return await result

    # ---- engine thread ---------------------------------------------------------------
    def _post(self, command: Any) -> None:
        self._inbox.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        while not self._stopping:
            self._drain_inbox()
            if self._stopping:
                break
            if self._has_work():
                self._step_once()
            else:
                self._wakeup.wait()
                self._wakeup.clear()
        self._fail_all(EngineError("the server is shutting down"))

    def _has_work(self) -> bool:
        try:
            return bool(self.engine.has_unfinished())
        except Exception as exc:  # noqa: BLE001 - a broken engine must not kill the loop
            self._on_engine_crash(exc)
            return False

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _AddGroup):
                self._add_group(command)
            elif isinstance(command, _Abort):
                self._abort(command.rids)
            elif isinstance(command, _Call):
                self._run_call(command)

    def _add_group(self, command: _AddGroup) -> None:
        group, added = command.group, []
        try:
            for sub in command.sub_requests:
                if sub.rid in self._live:
                    raise ValueError(f"request id {sub.rid!r} is already in use")
                self.engine.add_request(sub.rid, sub.input_ids, sub.sampling)
                self._live[sub.rid] = LiveRequest(group, sub.index)
                added.append(sub.rid)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            self._abort(added)
            error = exc if isinstance(exc, ValueError) else EngineError(f"engine.add_request failed: {exc}")
            if not isinstance(exc, ValueError):
                logger.exception("engine.add_request failed")
            _call_soon(group.loop, _resolve, command.accepted, None, error)
            return
        _call_soon(group.loop, _resolve, command.accepted, True, None)

    def _abort(self, rids: list[str]) -> None:
        for rid in rids:
            if self._live.pop(rid, None) is None:
                continue
            self.metrics.observe_aborted()
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.exception("engine.abort_request(%r) failed", rid)

    def _run_call(self, command: _Call) -> None:
        try:
            result, error = command.fn(self.engine), None
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            result, error = None, exc
        _call_soon(command.loop, _resolve, command.result, result, error)

    def _step_once(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the running requests, keep serving
            self._on_engine_crash(exc)
            return
        for output in outputs:
            self._dispatch(output)

    def _dispatch(self, output: StepOutput) -> None:
        live = self._live.get(output.rid)
        if live is None:  # aborted by its client, or unknown
            return
        live.record(self.metrics, output)
        if output.finished:
            del self._live[output.rid]
        _call_soon(live.group.loop, live.group._put, IndexedOutput(live.index, output))

    def _on_engine_crash(self, exc: Exception) -> None:
        logger.exception("engine step failed; failing %d running request(s)", len(self._live))
        rids = list(self._live)
        self._fail_all(EngineError(f"engine failure: {type(exc).__name__}: {exc}"))
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.debug("abort after crash failed for %r", rid, exc_info=True)
        self._wakeup.wait(_CRASH_BACKOFF_S)  # no hot loop if the engine stays broken

    def _fail_all(self, error: BaseException) -> None:
        groups = {id(live.group): live.group for live in self._live.values()}
        self._live.clear()
        for group in groups.values():
            _call_soon(group.loop, group._put, error)


def model_name_of(llm_engine: Any) -> str:
    """served_model_name, else the --model-path given, else the file the engine resolved."""
    args = getattr(llm_engine, "server_args", None)
    name = getattr(args, "served_model_name", None) or getattr(args, "model_path", None)
    resolved = getattr(llm_engine, "model_path", None)
    if not name and resolved:
        name = os.path.basename(str(resolved).rstrip("/"))
    return str(name or "default")
