"""Prometheus metrics for the HTTP server.

Every ``ServerMetrics`` owns its own ``CollectorRegistry`` so that several apps
(tests, benchmarks) can live in one process without duplicate-name errors.
Names follow SGLang's (``sglang:*``) with a ``specserve:`` prefix.
"""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

PREFIX = "specserve:"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ACCEPT_LENGTH_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 10.0)

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]


class ServerMetrics:
    """Counters, histograms and gauges for one server instance."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        self.num_requests = Counter(
            PREFIX + "num_requests", "Finished generation requests (sub-requests), by finish reason.",
            labels + ["finish_reason"], registry=self.registry)
        self.http_requests = Counter(
            PREFIX + "http_requests", "HTTP requests by route and status code.",
            ["path", "status"], registry=self.registry)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated.", labels, registry=self.registry)
        self.cached_tokens = Counter(
            PREFIX + "cached_tokens", "Prompt tokens served by the prefix cache.", labels,
            registry=self.registry)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from request arrival to its first token.",
            labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from request arrival to its last token.",
            labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.num_running_reqs = Gauge(
            PREFIX + "num_running_reqs", "Requests being decoded.", labels, registry=self.registry)
        self.num_queue_reqs = Gauge(
            PREFIX + "num_queue_reqs", "Requests waiting to be scheduled.", labels, registry=self.registry)
        self.token_usage = Gauge(
            PREFIX + "token_usage", "Fraction of KV-cache token slots in use.", labels,
            registry=self.registry)
        self.cached_token_usage = Gauge(
            PREFIX + "cached_token_usage", "Fraction of KV-cache token slots held by the prefix cache.",
            labels, registry=self.registry)
        self.spec_accept_length = Gauge(
            PREFIX + "spec_accept_length", "Average tokens per verify step (speculative decoding).",
            labels, registry=self.registry)
        self.spec_accept_histogram = Gauge(
            PREFIX + "spec_accept_histogram",
            "Verify passes by number of accepted draft tokens (engine-wide, since start).",
            labels + ["accept_len"], registry=self.registry)
        self.spec_accept_length_per_request = Histogram(
            PREFIX + "spec_accept_length_per_request",
            "Per-request average accept length (tokens per verify step).",
            labels, buckets=ACCEPT_LENGTH_BUCKETS, registry=self.registry)

        # observe_tokens runs once per streamed chunk: its labelled child is looked up here, once
        self._generation_tokens_of_model = self.generation_tokens.labels(model_name)

    # ---- per-request events (called from the asyncio side) ---------------------
    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.labels(self.model_name).observe(seconds)

    def observe_tokens(self, num_generated: int) -> None:
        if num_generated:
            self._generation_tokens_of_model.inc(num_generated)

    def observe_finished(self, finish_reason: str, e2e_seconds: float, meta_info: dict[str, Any]) -> None:
        model = self.model_name
        self.num_requests.labels(model, finish_reason).inc()
        self.e2e_request_latency.labels(model).observe(e2e_seconds)
        self.prompt_tokens.labels(model).inc(int(meta_info.get("prompt_tokens") or 0))
        self.cached_tokens.labels(model).inc(int(meta_info.get("cached_tokens") or 0))
        accept_length = meta_info.get("spec_accept_length")
        if meta_info.get("spec_verify_ct") and accept_length:
            self.spec_accept_length_per_request.labels(model).observe(float(accept_length))
            self.spec_accept_length.labels(model).set(float(accept_length))

    def observe_aborted(self) -> None:
        self.num_requests.labels(self.model_name, "abort").inc()

    def observe_http(self, path: str, status: int) -> None:
        self.http_requests.labels(path, str(status)).inc()

    # ---- scrape-time snapshot ----------------------------------------------------
    def set_engine_state(self, num_running: int, num_waiting: int, kv_usage: dict[str, Any] | None,
                         avg_spec_accept_length: float | None,
                         spec_accept_histogram: list[int] | None = None) -> None:
        model = self.model_name
        self.num_running_reqs.labels(model).set(num_running)
        self.num_queue_reqs.labels(model).set(num_waiting)
        if kv_usage and kv_usage.get("total"):
            total = kv_usage["total"]
            held = total - kv_usage.get("free", 0) - kv_usage.get("evictable", 0)  # evictable counts as free
            self.token_usage.labels(model).set(max(held, 0) / total)
            self.cached_token_usage.labels(model).set(kv_usage.get("cached", 0) / total)
        if avg_spec_accept_length:
            self.spec_accept_length.labels(model).set(float(avg_spec_accept_length))
        for accept_len, count in enumerate(spec_accept_histogram or []):
            self.spec_accept_histogram.labels(model, str(accept_len)).set(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
