"""The HTTP side of ``specserve bench http``: a server subprocess and a load of streaming
(or not) OpenAI completion requests at a fixed concurrency, timed per chunk.

The load is sent with aiohttp, as SGLang's ``bench_serving`` does. The client shares the
machine with the server, so its CPU per streamed token comes out of the model's time: 0.37 ms
with httpx, 0.19 with aiohttp parsing each event as it came; on uvloop (when installed, as
uvicorn's ``standard`` extra installs it) and parsing the events once the stream has ended
(each keeps its arrival time), 0.14 (2-core AVX-512 VNNI Xeon; per-request setup included)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx

READY_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 600


@dataclass
class HttpRecord:
    """One request as the client saw it (seconds from the request's own start)."""

    prompt_index: int
    status: int = 0
    ttft: float = float("nan")
    chunk_times: list[float] = field(default_factory=list)
    latency: float = float("nan")
    completion_tokens: int = 0
    text: str = ""
    was_aborted: bool = False
    error: str | None = None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tokens_per_second(self) -> float:
        return self.completion_tokens / self.latency if self.latency > 0 else float("nan")


def run(coroutine):
    """``asyncio.run`` on uvloop when it is installed (less of the client's CPU per token)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def server_process(server_args: list[str], threads: int | None, log_path: Path) -> Iterator[str]:
    """``python -m specserve.launch_server`` on a free loopback port; yields its base URL,
    then stops it with SIGTERM (as a user would) and waits for both processes to exit."""
    port = free_port()
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    command = [sys.executable, "-m", "specserve.launch_server", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", *server_args]
    with serve(command, env, port, log_path) as base_url:
        yield base_url


@contextlib.contextmanager
def serve(command: list[str], env: dict[str, str], port: int, log_path: Path) -> Iterator[str]:
    """Runs ``command`` (a server listening on loopback ``port``) in a process group of its own
    until its ``/health`` answers 200; yields its base URL, then sends it SIGTERM and waits for it
    (the whole group is killed if it has not exited within a minute)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        base_url = f"http://127.0.0.1:{port}"
        try:
            _wait_until_healthy(process, base_url, log_path)
            yield base_url
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


def _wait_until_healthy(process: subprocess.Popen, base_url: str, log_path: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode}); log: {log_path}\n"
                               + log_path.read_text()[-2000:])
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {READY_TIMEOUT_S} s; log: {log_path}")


def completion_body(ids: list[int], max_new_tokens: int, stream: bool) -> dict[str, Any]:
    body = {"model": "default", "prompt": ids, "max_tokens": max_new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send_one(session: aiohttp.ClientSession, prompt_index: int, ids: list[int], max_new_tokens: int,
                   stream: bool, abort_after_chunks: int | None = None) -> HttpRecord:
    record = HttpRecord(prompt_index)
    body = completion_body(ids, max_new_tokens, stream)
    start = time.perf_counter()
    try:
        async with session.post("/v1/completions", json=body) as response:
            record.status = response.status
            if response.status != 200:
                record.error = (await response.text(errors="replace"))[:300]
            elif stream:
                await _read_stream(response, record, start, abort_after_chunks)
            else:
                _read_full(await response.json(), record, start)
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.latency = time.perf_counter() - start
    return record


def _read_full(payload: dict, record: HttpRecord, start: float) -> None:
    record.text = payload["choices"][0]["text"]
    record.completion_tokens = payload["usage"]["completion_tokens"]
    record.ttft = time.perf_counter() - start


async def _read_stream(response: aiohttp.ClientResponse, record: HttpRecord, start: float,
                       abort_after_chunks: int | None) -> None:
    """SSE events from the raw bytes as they arrive (aiohttp's C parser; no per-line iterator),
    each stamped with its arrival time and parsed after the stream ends. With
    ``abort_after_chunks``, hangs up after that many data events."""
    pending, arrived = b"", []
    try:
        async for data in response.content.iter_any():
            now = time.perf_counter() - start
            *events, pending = (pending + data).split(b"\n\n")
            arrived.extend((now, event) for event in events
                           if event.startswith(b"data: ") and event != b"data: [DONE]")
            if abort_after_chunks is not None and len(arrived) >= abort_after_chunks:
                record.was_aborted = True
                response.close()     # hangs up mid-stream
                return
    finally:
        for now, event in arrived:
            _take_chunk(json.loads(event[6:]), record, now)


def _take_chunk(chunk: dict, record: HttpRecord, now: float) -> None:
    if "error" in chunk:
        record.error = str(chunk["error"])[:300]
        return
    if chunk.get("usage"):
        record.completion_tokens = chunk["usage"]["completion_tokens"]
    for choice in chunk.get("choices") or []:
        if choice.get("text"):
            record.text += choice["text"]
            if not record.chunk_times:
                record.ttft = now
            record.chunk_times.append(now)


@dataclass
class LoadSpec:
    concurrency: int
    stream: bool
    max_new_tokens: int
    num_requests: int
    duration_s: float | None = None     # keep sending (cycling the prompts) until this much time passed
    abort_fraction: float = 0.0         # this share of streams closes the connection mid-stream
    seed: int = 0
    request_rate: float | None = None   # open loop: Poisson arrivals at this rate, at most `concurrency` in flight


async def run_load(base_url: str, id_lists: list[list[int]], spec: LoadSpec, progress=None
                   ) -> tuple[list[HttpRecord], float]:
    """Closed loop (``spec.concurrency`` clients, each sending its next request when the last
    one ends) or, with ``spec.request_rate``, Poisson arrivals with at most ``concurrency`` in
    flight, as SGLang's bench_serving. Returns the records and the wall time."""
    rng = random.Random(spec.seed)
    counter = iter(range(10**9))
    records: list[HttpRecord] = []
    start = time.perf_counter()

    def next_index() -> int | None:
        n = next(counter)
        if spec.duration_s is not None:
            return n if time.perf_counter() - start < spec.duration_s else None
        return n if n < spec.num_requests else None

    async def send(client: aiohttp.ClientSession, n: int) -> None:
        index = n % len(id_lists)
        abort_at = None
        if spec.stream and rng.random() < spec.abort_fraction:
            abort_at = rng.randint(1, max(1, spec.max_new_tokens // 2))
        records.append(await send_one(client, index, id_lists[index], spec.max_new_tokens, spec.stream, abort_at))
        if progress is not None:
            progress.update(1)

    async def client_loop(client: aiohttp.ClientSession) -> None:
        while (n := next_index()) is not None:
            await send(client, n)

    async def arrivals(client: aiohttp.ClientSession) -> None:
        in_flight = asyncio.Semaphore(spec.concurrency)

        async def bounded(n: int) -> None:
            async with in_flight:
                await send(client, n)

        tasks = []
        while (n := next_index()) is not None:
            tasks.append(asyncio.create_task(bounded(n)))
            await asyncio.sleep(rng.expovariate(spec.request_rate))
        await asyncio.gather(*tasks)

    connector = aiohttp.TCPConnector(limit=spec.concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(base_url, connector=connector, timeout=timeout) as client:
        if spec.request_rate:
            await arrivals(client)
        else:
            await asyncio.gather(*(client_loop(client) for _ in range(spec.concurrency)))
    return records, time.perf_counter() - start


def server_info(base_url: str) -> dict[str, Any]:
    return httpx.get(f"{base_url}/get_server_info", timeout=30).json()


def server_state(base_url: str) -> dict[str, Any]:
    info = server_info(base_url)
    usage = info.get("kv_usage") or {}
    held = usage.get("total", 0) - usage.get("free", 0) - usage.get("evictable", 0)
    return {"num_running_reqs": info.get("num_running_reqs"), "num_waiting_reqs": info.get("num_waiting_reqs"),
            "kv_tokens_held_by_requests": held, "kv_usage": usage}
