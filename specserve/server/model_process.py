"""The model process: the scheduler and model loop as the main thread of its own process.

Started by the front (``engine_client.EngineClient``) with multiprocessing's spawn. Nothing
of HTTP, JSON or detokenization runs here, so the loop never waits for the GIL, and every
OpenMP parallel region starts from this one thread (see ``runner/openmp_pool.py`` for why
that matters). Between steps it drains the front's messages; when idle it blocks on them.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
from typing import Any

import zmq

from specserve.config import ConfigError, ServerArgs
from specserve.runner.gc_freeze import freeze_long_lived_objects
from specserve.server import ipc
from specserve.server.stream_batching import StreamBatcher

logger = logging.getLogger("specserve.model")
IDLE_POLL_MS = 1000          # how often an idle loop checks that its front is still there
CRASH_BACKOFF_S = 0.05       # no hot loop when the engine stays broken
PR_SET_PDEATHSIG = 1


def run_model_process(server_args: ServerArgs, endpoints: ipc.Endpoints, front_pid: int) -> None:
    """Entry point of the spawned process."""
    _exit_with_front(endpoints)
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # Ctrl-C reaches the front, which stops us in order
    from specserve.launch_server import configure_logging

    configure_logging(server_args.log_level)
    context = zmq.Context()
    inbox = context.socket(zmq.PULL)
    inbox.connect(endpoints.to_model)
    outbox = context.socket(zmq.PUSH)
    outbox.setsockopt(zmq.SNDHWM, 0)
    outbox.connect(endpoints.to_front)
    engine = _build_engine(server_args, outbox)
    if engine is not None:
        ModelLoop(engine, inbox, outbox, front_pid).run()
    outbox.close(linger=2000)
    inbox.close(linger=0)
    context.term()
    if os.getppid() != front_pid:
        endpoints.remove_files()     # the front is gone and cannot


def _exit_with_front(endpoints: ipc.Endpoints) -> None:
    """Linux: the kernel sends us SIGTERM if the front dies, even by SIGKILL. On SIGTERM (that, or
    the front's own terminate) the sockets' folder goes too, which a killed front leaves behind;
    then the signal ends us as it would have."""
    def on_sigterm(signum: int, frame: Any) -> None:
        endpoints.remove_files()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass   # elsewhere the idle loop's parent check still ends us


def _build_engine(server_args: ServerArgs, outbox: zmq.Socket) -> Any:
    from specserve.engine import LLMEngine

    try:
        engine = LLMEngine(server_args, detokenize=False)
    except ConfigError as exc:
        outbox.send(ipc.encode(ipc.StartupFailed(str(exc), is_config_error=True)))
        return None
    except Exception as exc:  # noqa: BLE001 - reported to the front, which prints it and exits
        logger.exception("the model failed to load")
        outbox.send(ipc.encode(ipc.StartupFailed(f"{type(exc).__name__}: {exc}", is_config_error=False)))
        return None
    start = time.perf_counter()
    touched = engine.prefault_kv_cache()
    logger.info("KV cache reserved: %.2f GiB touched in %.1f s", touched / 2**30, time.perf_counter() - start)
    freeze_long_lived_objects("model process")
    tokenizer_path = server_args.tokenizer_path or engine.model_path
    outbox.send(ipc.encode(ipc.Ready(str(engine.model_path), str(tokenizer_path), engine.context_len,
                                     engine.model_config.vocab_size, os.getpid())))
    return engine


class ModelLoop:
    """Receive, step, send: one thread owns the engine."""

    def __init__(self, engine: Any, inbox: zmq.Socket, outbox: zmq.Socket, front_pid: int) -> None:
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.front_pid = front_pid
        self.is_stopping = False
        self.batcher = StreamBatcher(engine.server_args.stream_interval)

    def run(self) -> None:
        while not self.is_stopping:
            has_work = self.engine.has_unfinished()
            self._receive(timeout_ms=0 if has_work else IDLE_POLL_MS)
            if self.is_stopping:
                break
            if self.engine.has_unfinished():
                self._step()
            elif os.getppid() != self.front_pid:
                logger.warning("the front process is gone; the model process exits")
                break
        self._abort_all()

    def _receive(self, timeout_ms: int) -> None:
        if not self.inbox.poll(timeout_ms):
            return
        while not self.is_stopping:
            try:
                message = ipc.decode_to_model(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            self._handle(message)

    def _handle(self, message: Any) -> None:
        if isinstance(message, ipc.AddRequests):
            self._add(message)
        elif isinstance(message, ipc.Abort):
            for rid in message.rids:
                self.engine.abort_request(rid)
                self.batcher.forget(rid)
        elif isinstance(message, ipc.Query):
            self._answer(message)
        elif isinstance(message, ipc.Shutdown):
            self.is_stopping = True

    def _add(self, message: ipc.AddRequests) -> None:
        added: list[str] = []
        try:
            for request in message.requests:
                self.engine.add_request(request.rid, request.input_ids, request.sampling)
                added.append(request.rid)
                if not request.stream:
                    self.batcher.hold_until_finished(request.rid)
        except Exception as exc:  # noqa: BLE001 - reported to the front
            for rid in added:
                self.engine.abort_request(rid)
            is_engine_error = not isinstance(exc, ValueError)
            if is_engine_error:
                logger.exception("engine.add_request failed")
            self._send(ipc.Accepted(message.ticket, str(exc), is_engine_error))
            return
        self._send(ipc.Accepted(message.ticket))

    def _answer(self, query: ipc.Query) -> None:
        if query.method not in ipc.QUERY_METHODS:
            self._send(ipc.QueryResult(query.ticket, error=f"unknown query {query.method!r}"))
            return
        try:
            value = getattr(self.engine, query.method)()
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            self._send(ipc.QueryResult(query.ticket, error=f"{type(exc).__name__}: {exc}"))
            return
        self._send(ipc.QueryResult(query.ticket, value=ipc.plain(value)))

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - fail the running requests, keep serving
            self._fail_running(exc)
            return
        outputs = self.batcher.take(outputs)
        if outputs:
            self._send(ipc.Outputs(outputs))

    def _fail_running(self, exc: Exception) -> None:
        rids = list(self.engine.requests)
        logger.exception("engine step failed; failing %d running request(s)", len(rids))
        self._abort_all()
        self._send(ipc.Failed(rids, f"engine failure: {type(exc).__name__}: {exc}"))
        time.sleep(CRASH_BACKOFF_S)

    def _abort_all(self) -> None:
        """Abort every request the engine holds; one that fails to abort is logged, not raised."""
        for rid in list(self.engine.requests):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.debug("abort of %r failed", rid, exc_info=True)

    def _send(self, message: Any) -> None:
        self.outbox.send(ipc.encode(message))
