"""EngineClient: the front process's handle on the model process.

``EngineClient.launch(server_args)`` spawns ``model_process.run_model_process`` and waits until
the model is loaded (or reports why it could not be), loading the tokenizer here meanwhile. On the
asyncio loop it offers what the HTTP API needs (``submit``, ``query``, ``health_error``, ...,
the same as ``AsyncEngine``): requests go out as messages, outputs come back as token ids and
are detokenized here, so text work never delays the model loop. If the model process dies,
every waiting request fails with ``EngineUnavailable`` (HTTP 503) and ``/health`` says so.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import threading
import uuid
from dataclasses import dataclass
from typing import Any

import zmq

from specserve.config import ServerArgs
from specserve.core import SamplingParams, StepOutput
from specserve.server import ipc
from specserve.server.async_engine import (
    EngineError, EngineUnavailable, IndexedOutput, LiveRequest, RequestGroup, accepted_group,
    expand_sub_requests, model_name_of,
)
from specserve.server.metrics import ServerMetrics
from specserve.server.model_process import run_model_process
from specserve.tokenizer import TextStreamer, Tokenizer

logger = logging.getLogger(__name__)
STARTUP_POLL_MS = 200
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)   # enums cost a call each
SHUTDOWN_WAIT_S = 10.0


class StartupError(RuntimeError):
    """The model process could not start; ``is_config_error`` means a flag was at fault."""

    def __init__(self, message: str, is_config_error: bool) -> None:
        super().__init__(message)
        self.is_config_error = is_config_error


@dataclass
class _Stream:
    """A live sub-request on the front: its group, metrics and incremental detokenizer."""

    live: LiveRequest
    streamer: Any
    has_matched_stop: bool = False

    def text_of(self, output: StepOutput) -> str:
        """The text the engine would have produced for these tokens (same streamer, fed the
        same way: token by token, stopping at a stop string, flushed at the end)."""
        text = ""
        for token in output.new_token_ids:
            if self.has_matched_stop:
                break
            delta, matched = self.streamer.feed([token])
            text += delta
            self.has_matched_stop = matched is not None
        reason = (output.finish_reason or {}).get("type")
        if output.finished and not self.has_matched_stop and reason != "abort":
            text += self.streamer.flush()
        return text


class EngineClient:
    """The model process, seen from the front's asyncio loop."""

    def __init__(self, server_args: ServerArgs, process: Any, endpoints: ipc.Endpoints,
                 context: zmq.Context, to_model: zmq.Socket, from_model: zmq.Socket, ready: ipc.Ready,
                 tokenizer: Tokenizer | None = None) -> None:
        self.server_args = server_args
        self.process = process
        self.endpoints = endpoints
        self.model_path = ready.model_path
        self.context_len = ready.context_len
        self.vocab_size = ready.vocab_size
        self.model_pid = ready.pid
        self.tokenizer = tokenizer or Tokenizer.load(ready.tokenizer_path)
        self.metrics = ServerMetrics(model_name_of(self))
        self._context, self._to_model, self._from_model = context, to_model, from_model
        self._streams: dict[str, _Stream] = {}
        self._waiting: dict[int, tuple[asyncio.Future, Any]] = {}   # ticket -> (future, rids or None)
        self._tickets = itertools.count()
        self._death: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- start and stop --------------------------------------------------------------
    @classmethod
    def launch(cls, server_args: ServerArgs) -> "EngineClient":
        """Spawn the model process and wait until it serves; raises StartupError."""
        endpoints = ipc.Endpoints.new()
        context = zmq.Context()
        to_model = context.socket(zmq.PUSH)
        to_model.setsockopt(zmq.SNDHWM, 0)
        to_model.bind(endpoints.to_model)
        from_model = context.socket(zmq.PULL)
        from_model.bind(endpoints.to_front)
        process = multiprocessing.get_context("spawn").Process(
            target=run_model_process, args=(server_args, endpoints, os.getpid()),
            name="specserve-model", daemon=True)
        process.start()
        prefetch = TokenizerPrefetch.start_for(server_args)
        try:
            ready = _wait_until_ready(process, from_model)
        except StartupError:
            _close(process, context, endpoints)
            raise
        tokenizer = prefetch.tokenizer_for(ready.tokenizer_path) if prefetch else None
        return cls(server_args, process, endpoints, context, to_model, from_model, ready, tokenizer)

    def start(self) -> None:
        """Begin reading the model process's messages on the running asyncio loop."""
        if self._loop is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._from_model.getsockopt(zmq.FD), self._on_messages)
        self._loop.add_reader(self.process.sentinel, self._on_model_exit)
        self._on_messages()   # anything that arrived before the loop watched the descriptor

    def shutdown(self) -> None:
        """Ask the model process to stop, wait for it, then make sure it is gone."""
        if self._loop is not None:
            self._loop.remove_reader(self.process.sentinel)
            self._loop.remove_reader(self._from_model.getsockopt(zmq.FD))
        if self.process.is_alive():
            self._send(ipc.Shutdown())
        self._fail_everything(EngineUnavailable("the server is shutting down"))
        _close(self.process, self._context, self.endpoints)

    # ---- what the API calls ----------------------------------------------------------
    @property
    def health_error(self) -> str | None:
        return self._death

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    async def submit(self, prompts: list[list[int]], sampling: SamplingParams,
                     rid: str | None = None, stream: bool = True) -> RequestGroup:
        """Add ``len(prompts) * sampling.n`` sub-requests; ValueError if the engine rejects any.
        ``stream=False``: the model process sends the first token and then only the end."""
        self._check_alive()
        loop = asyncio.get_running_loop()
        subs = expand_sub_requests(prompts, sampling, rid or uuid.uuid4().hex)
        rids = [sub.rid for sub in subs]
        if any(r in self._streams for r in rids):
            raise ValueError(f"request id {rids[0]!r} is already in use")
        group = RequestGroup(self._abort, rids, loop)
        for sub in subs:
            self._streams[sub.rid] = self._new_stream(group, sub.index, sub.sampling)
        requests = [ipc.AddRequest(s.rid, s.input_ids, s.sampling, stream) for s in subs]
        accepted = self._ask(ipc.AddRequests, requests, rids=rids)
        return await accepted_group(group, accepted)

    async def query(self, method: str) -> Any:
        """``engine.<method>()`` in the model process, between steps."""
        self._check_alive()
        return await self._ask(ipc.Query, method)

    # ---- messages out ------------------------------------------------------------------
    def _new_stream(self, group: RequestGroup, index: int, sampling: SamplingParams) -> _Stream:
        streamer = TextStreamer(self.tokenizer, sampling.stop, sampling.skip_special_tokens)
        return _Stream(LiveRequest(group, index), streamer)

    def _ask(self, message_type: type, payload: Any, rids: list[str] | None = None) -> asyncio.Future:
        ticket = next(self._tickets)
        future = asyncio.get_running_loop().create_future()
        self._waiting[ticket] = (future, rids)
        self._send(message_type(ticket, payload))
        return future

    def _abort(self, rids: list[str]) -> None:
        live = [rid for rid in rids if self._streams.pop(rid, None) is not None]
        for _ in live:
            self.metrics.observe_aborted()
        if live and self._death is None:
            self._send(ipc.Abort(live))

    def _send(self, message: Any) -> None:
        self._to_model.send(ipc.encode(message), zmq.NOBLOCK)

    def _check_alive(self) -> None:
        if self._death is not None:
            raise EngineUnavailable(self._death)

    # ---- messages in -------------------------------------------------------------------
    def _on_messages(self) -> None:
        """The socket's descriptor became readable: take every message waiting. ZMQ signals its
        descriptor on edges: read EVENTS (which re-arms the edge) and take a message while it
        says one is waiting. (zmq.asyncio does this too, but its futures cost more than all the
        rest of a streamed token's handling; draining until EAGAIN costs an exception a wake-up.)"""
        socket = self._from_model
        while socket.getsockopt(_EVENTS) & _POLLIN:
            try:
                data = socket.recv(_NOBLOCK)
            except zmq.Again:
                continue
            try:
                self._handle(ipc.decode_to_front(data))
            except Exception:  # noqa: BLE001 - one bad message must not stop the reader
                logger.exception("failed to handle a message from the model process")

    def _handle(self, message: Any) -> None:
        if isinstance(message, ipc.Outputs):
            for output in message.outputs:
                self._deliver(output)
        elif isinstance(message, ipc.Accepted):
            self._on_accepted(message)
        elif isinstance(message, ipc.QueryResult):
            future, _ = self._waiting.pop(message.ticket, (None, None))
            if future is not None and not future.done():
                _settle(future, message.value, EngineError(message.error) if message.error else None)
        elif isinstance(message, ipc.Failed):
            self._fail(message.rids, EngineError(message.message))

    def _deliver(self, output: StepOutput) -> None:
        stream = self._streams.get(output.rid)
        if stream is None:   # aborted by its client
            return
        output.text_delta = stream.text_of(output)
        stream.live.record(self.metrics, output)
        if output.finished:
            del self._streams[output.rid]
        stream.live.group._put(IndexedOutput(stream.live.index, output))

    def _on_accepted(self, message: ipc.Accepted) -> None:
        future, rids = self._waiting.pop(message.ticket, (None, None))
        error = None
        if message.error is not None:
            error = EngineError(message.error) if message.is_engine_error else ValueError(message.error)
            for rid in rids or []:
                self._streams.pop(rid, None)
        if future is not None and not future.done():
            _settle(future, True, error)

    def _fail(self, rids: list[str], error: EngineError) -> None:
        groups = {}
        for rid in rids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                groups[id(stream.live.group)] = stream.live.group
        for group in groups.values():
            group._put(error)

    def _on_model_exit(self) -> None:
        self._loop.remove_reader(self.process.sentinel)
        self.process.join(0.1)
        self._death = f"the model process exited unexpectedly ({_exit_description(self.process.exitcode)})"
        logger.error("%s; restart the server", self._death)
        self._fail_everything(EngineUnavailable(self._death))

    def _fail_everything(self, error: EngineError) -> None:
        self._fail(list(self._streams), error)
        waiting, self._waiting = self._waiting, {}
        for future, _ in waiting.values():
            if not future.done():
                future.set_exception(error)


def _settle(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class TokenizerPrefetch(threading.Thread):
    """The tokenizer loaded on a thread of the front while the model process loads the model, where
    the front can tell its path alone (a local --tokenizer-path or --model-path, or the default
    model's file once fetched). Loaded after the model instead, it added its whole time to the
    server's startup: ~3.5 s of ~17 for the default model (its GGUF's 49,152 tokens and 48,900
    merges parsed), on a 2-core AVX-512 Zen4."""

    def __init__(self, path: str) -> None:
        super().__init__(name="tokenizer-prefetch", daemon=True)   # a failed startup need not wait
        self.path = path
        self.tokenizer: Tokenizer | None = None

    @classmethod
    def start_for(cls, server_args: ServerArgs) -> "TokenizerPrefetch | None":
        from specserve.loading.default_model import default_model_path

        path = server_args.tokenizer_path or server_args.model_path or str(default_model_path())
        if not os.path.exists(path):
            return None
        prefetch = cls(path)
        prefetch.start()
        return prefetch

    def run(self) -> None:
        try:
            self.tokenizer = Tokenizer.load(self.path)
        except Exception:  # noqa: BLE001 - left to the load after Ready, which reports it
            self.tokenizer = None

    def tokenizer_for(self, path: str) -> Tokenizer | None:
        """The prefetched tokenizer if it is ``path``'s (the model process's answer), else None."""
        if path != self.path:
            return None
        self.join()
        return self.tokenizer


def _wait_until_ready(process: Any, from_model: zmq.Socket) -> ipc.Ready:
    while True:
        if from_model.poll(STARTUP_POLL_MS):
            message = ipc.decode_to_front(from_model.recv())
            if isinstance(message, ipc.Ready):
                return message
            if isinstance(message, ipc.StartupFailed):
                raise StartupError(message.message, message.is_config_error)
        elif not process.is_alive():
            raise StartupError(f"the model process exited while loading the model "
                               f"({_exit_description(process.exitcode)})", is_config_error=False)


def _exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by signal {-exitcode}"
    return f"exit status {exitcode}"


def _close(process: Any, context: zmq.Context, endpoints: ipc.Endpoints) -> None:
    process.join(SHUTDOWN_WAIT_S)
    if process.is_alive():
        logger.warning("the model process did not stop in %.0f s; terminating it", SHUTDOWN_WAIT_S)
        process.terminate()
        process.join(5)
    if process.is_alive():
        process.kill()
        process.join()
    context.destroy(linger=0)
    endpoints.remove_files()

