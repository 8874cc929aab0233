"""Fixtures: specserve's app on the fake engine, served by uvicorn on a free loopback port."""
from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from specserve.config import ServerArgs
from specserve.server.api import create_app
from specserve.server.async_engine import AsyncEngine

from .fake_engine import FakeLLMEngine


def wait_until(predicate, timeout: float = 5.0) -> bool:
    """Whether predicate() holds within timeout seconds (polled every 10 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RunningServer:
    base_url: str
    fake: FakeLLMEngine
    async_engine: AsyncEngine

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, timeout=30.0, **kwargs)


@contextlib.contextmanager
def serve_fake(api_key: str | None = None) -> Iterator[RunningServer]:
    port = free_port()
    server_args = ServerArgs(model_path="fake-model", host="127.0.0.1", port=port, api_key=api_key)
    fake = FakeLLMEngine(server_args)
    async_engine = AsyncEngine(fake)
    app = create_app(async_engine, server_args)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    try:
        yield RunningServer(f"http://127.0.0.1:{port}", fake, async_engine)
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="session")
def fake_server() -> Iterator[RunningServer]:
    with serve_fake() as running:
        yield running


@pytest.fixture()
def client(fake_server: RunningServer) -> Iterator[httpx.Client]:
    with fake_server.client() as http:
        yield http
