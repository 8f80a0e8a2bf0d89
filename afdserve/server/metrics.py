"""Prometheus metrics of one server: request counts, token counts, latencies, engine state.

Each app owns its own registry (several apps may live in one test process). Engine gauges and step
counts are read from the engine thread's latest stats snapshot when /metrics is scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from afdserve.engine.client import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# CPU test models answer in milliseconds, real models on a busy GPU in seconds: cover both.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

COUNTED_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
UNCOUNTED_PATHS = ("/health", "/metrics")  # probes would drown the API traffic


class EngineCollector(Collector):
    """Gauges and step counters from an EngineStats snapshot (None until the engine is up)."""

    def __init__(self, snapshot: Callable[[], EngineStats | None]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot() or EngineStats()
        yield GaugeMetricFamily(
            "afdserve_requests_running", "Requests scheduled on attention ranks", stats.running
        )
        yield GaugeMetricFamily(
            "afdserve_requests_waiting", "Requests queued on attention ranks", stats.waiting
        )
        yield GaugeMetricFamily(
            "afdserve_kv_cache_usage",
            "Fraction of KV cache blocks in use, averaged over attention ranks",
            stats.kv_cache_usage,
        )
        steps = CounterMetricFamily(
            "afdserve_engine_steps",
            "Engine steps by rank role and run mode",
            labels=["role", "mode"],
        )
        for key, count in sorted(stats.steps.items()):
            role, _, mode = key.partition(":")
            steps.add_metric([role, mode or "unknown"], count)
        yield steps


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], EngineStats | None]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "afdserve_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.aborted = Counter(
            "afdserve_requests_aborted",
            "Engine requests aborted because their client disconnected",
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "afdserve_prompt_tokens", "Prompt tokens admitted to the engine", registry=self.registry
        )
        self.generation_tokens = Counter(
            "afdserve_generation_tokens",
            "Tokens generated and delivered to clients",
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "afdserve_time_to_first_token_seconds",
            "Seconds from submitting a request to the engine to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "afdserve_time_per_output_token_seconds",
            "Mean seconds between generated tokens after the first, per finished request",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(EngineCollector(snapshot))

    def count_request(self, path: str, status: int) -> None:
        endpoint = path if path in COUNTED_ENDPOINTS else "other"
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestCounter:
    """ASGI middleware counting API requests by endpoint and final status. Plain ASGI, not
    BaseHTTPMiddleware, so that nothing stands between a streaming response and its client."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees if the app dies before answering

        async def send_counting(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            self.metrics.count_request(path, status)
