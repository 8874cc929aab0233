"""bench http's client and figures against the fake engine's server: closed loop and Poisson
arrivals send every request, streams are timed per chunk, hang-ups are counted as such and
leave the engine, and the figures (percentiles, solo comparisons) are computed as documented."""
from __future__ import annotations

import asyncio
import time

from specserve.bench import http_client as hc
from specserve.bench.http import level_figures, percentile

from .conftest import RunningServer

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]


def test_closed_loop_streams_every_request_and_times_its_chunks(fake_server: RunningServer) -> None:
    records, wall = asyncio.run(hc.run_load(fake_server.base_url, PROMPTS, hc.LoadSpec(2, True, 6, 5)))
    assert len(records) == 5 and wall > 0
    assert sorted(r.prompt_index for r in records) == [0, 0, 1, 1, 2]
    for r in records:
        assert r.status == 200 and r.error is None and r.completion_tokens == 6
        assert r.chunk_times == sorted(r.chunk_times) and r.ttft == r.chunk_times[0]
        assert len(r.itls) == len(r.chunk_times) - 1 >= 1
    figures = level_figures(2, True, records, wall, {r.prompt_index: r.text for r in records})
    assert figures["num_differing_from_solo"] == 0 and figures["status_counts"] == {"200": 5}
    assert figures["output_tokens_per_s"] == 30 / wall


def test_poisson_arrivals_and_hang_ups(fake_server: RunningServer) -> None:
    spec = hc.LoadSpec(3, True, 40, 6, abort_fraction=1.0, request_rate=50.0, seed=2)
    records, _ = asyncio.run(hc.run_load(fake_server.base_url, PROMPTS, spec))
    assert len(records) == 6 and all(r.was_aborted and r.status == 200 for r in records)
    assert all(len(r.chunk_times) <= 20 for r in records)
    deadline = time.monotonic() + 10
    while fake_server.fake.requests and time.monotonic() < deadline:   # hang-ups reach the engine
        time.sleep(0.05)
    assert not fake_server.fake.requests


def test_non_streamed_requests_and_percentiles(fake_server: RunningServer) -> None:
    records, wall = asyncio.run(hc.run_load(fake_server.base_url, PROMPTS, hc.LoadSpec(1, False, 4, 3)))
    assert [r.completion_tokens for r in records] == [4, 4, 4] and all(r.text for r in records)
    assert percentile([1.0, 2.0, 3.0, 4.0, float("nan")], 50) == 2.5
    assert abs(percentile([1.0, 2.0, 3.0], 99) - 2.98) < 1e-12
    figures = level_figures(1, False, records, wall, None)
    assert figures["num_differing_from_solo"] is None and figures["itl_median_s"] != figures["itl_median_s"]


HEALTH_SERVER = """
import http.server, os, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(str(os.getpid()).encode())
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def test_a_peer_server_is_awaited_then_stopped(tmp_path) -> None:
    """``serve`` (how bench http starts ours and vLLM's): yields once ``/health`` answers, and the
    process is gone afterwards; a server that exits first is an error carrying its log."""
    import os
    import sys

    import httpx
    import pytest

    script = tmp_path / "health.py"
    script.write_text(HEALTH_SERVER)
    port = hc.free_port()
    with hc.serve([sys.executable, str(script), str(port)], dict(os.environ), port, tmp_path / "log") as url:
        pid = int(httpx.get(f"{url}/health").text)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(RuntimeError, match="exited"):
        with hc.serve([sys.executable, "-c", "print('no model'); raise SystemExit(3)"], dict(os.environ), port,
                      tmp_path / "log2"):
            pass
    assert "no model" in (tmp_path / "log2").read_text()
