"""Prometheus metrics of one server, under vLLM's names (`vllm:*`, each with a `model_name` label)
so that dashboards written for vLLM read them; the mapping is in docs/serving.md. Metrics vLLM has
no name for keep the `afdserve_` prefix: HTTP requests by endpoint and status, aborts, rejections,
the frontend's waiting bound, engine steps.

Each app owns its own registry (several apps may live in one test process). Engine gauges and step
counts are read from the engine thread's latest stats snapshot when /metrics is scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from afdserve.frontend.client import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# CPU test models answer in milliseconds, real models on a busy GPU in seconds: cover both.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)
RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0)
# Token counts of one request, vLLM's 1-2-5 series up to a long context.
TOKEN_BUCKETS = tuple(float(m * 10**e) for e in range(6) for m in (1, 2, 5))
# Tokens of one engine step: vLLM's iteration_tokens buckets.
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort", "error")
# Why the server refused a request without running it (afdserve_requests_rejected_total).
REJECT_REASONS = (
    "waiting_requests",
    "waiting_tokens",
    "concurrency",
    "draining",
    "unavailable",
    "body_too_large",
    "body_timeout",
    "prompt_too_large",
)

# Why the server closed a connection for want of a slot (slots.py).
SHED_REASONS = ("reading_share", "connection_cap", "per_client")

COUNTED_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
UNCOUNTED_PATHS = ("/health", "/metrics")  # probes would drown the API traffic


class EngineCollector(Collector):
    """Gauges and step counters from an EngineStats snapshot (None until the engine is up)."""

    def __init__(self, snapshot: Callable[[], EngineStats | None], model: Callable[[], str]):
        self.snapshot, self.model = snapshot, model
        self._scheduled: dict[int, int] = {}  # at the previous scrape, for the imbalance gauge

    def collect(self) -> Iterator[Metric]:
        stats = self.snapshot() or EngineStats()
        label = [self.model()]
        for name, doc, value in (
            ("vllm:num_requests_running", "Requests scheduled on attention ranks", stats.running),
            ("vllm:num_requests_waiting", "Requests queued on attention ranks", stats.waiting),
            (
                "vllm:kv_cache_usage_perc",
                "Fraction of KV cache blocks in use (0-1), averaged over attention ranks",
                stats.kv_cache_usage,
            ),
            # vLLM's older name of the same gauge, which its Grafana dashboard reads.
            (
                "vllm:gpu_cache_usage_perc",
                "Fraction of KV cache blocks in use (0-1), averaged over attention ranks",
                stats.kv_cache_usage,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(label, value)
            yield gauge
        steps = CounterMetricFamily(
            "afdserve_engine_steps",
            "Engine steps by rank role and run mode",
            labels=["role", "mode"],
        )
        for key, count in sorted(stats.steps.items()):
            role, _, mode = key.partition(":")
            steps.add_metric([role, mode or "unknown"], count)
        yield steps
        # vLLM's prefix-cache counters, in tokens; `engine` is vLLM's label of one engine core,
        # here one attention rank.
        for name, doc, per_rank in (
            (
                "vllm:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                stats.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                stats.prefix_cache_hits,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
            for rank, tokens in sorted(per_rank.items()):
                counter.add_metric([*label, str(rank)], tokens)
            yield counter
        preemptions = CounterMetricFamily(
            "vllm:num_preemptions",
            "Sequences preempted by recompute, per attention rank",
            labels=["model_name", "engine"],
        )
        for rank, count in sorted(stats.preemptions.items()):
            preemptions.add_metric([*label, str(rank)], count)
        yield preemptions
        yield iteration_histogram(stats.iteration_tokens, label)
        if stats.spec_decode:
            yield from spec_decode_counters(stats, label)
        if stats.cache_config:
            names = sorted(stats.cache_config)
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "The KV cache's configuration (labels; value 1)",
                labels=names,
            )
            info.add_metric([stats.cache_config[n] for n in names], 1.0)
            yield info
        yield from self._afd(stats)

    def _afd(self, stats: EngineStats) -> Iterator[Metric]:
        """Per attention rank: busy and waiting seconds, boundary bytes, scheduled tokens, and
        how unevenly the tokens since the previous scrape fell on the ranks."""
        ranks = sorted(stats.scheduled_tokens)
        per_rank = (
            (
                "afdserve:rank_busy_seconds",
                "Wall seconds in the step's forward (FFN ranks: their FFN half), not waiting",
                {r: stats.forward_s[r] - stats.wait_s.get(r, 0.0) for r in ranks},
            ),
            (
                "afdserve:rank_wait_seconds",
                "Wall seconds waiting for the FFN rank's replies (FFN ranks: for the tiles; CPU: "
                "blocking waits; CUDA: ~0)",
                stats.wait_s,
            ),
            ("afdserve:a2e_bytes", "Hidden-row bytes sent to the FFN rank", stats.a2e_bytes),
            ("afdserve:e2a_bytes", "Hidden-row bytes received from the FFN rank", stats.e2a_bytes),
            (
                "afdserve:scheduled_tokens",
                "Tokens computed (FFN ranks: real rows received)",
                stats.scheduled_tokens,
            ),
        )
        ffn = sorted(stats.ffn_forward_s)
        ffn_figures = {
            "afdserve:rank_busy_seconds": {
                r: stats.ffn_forward_s[r] - stats.ffn_wait_s.get(r, 0.0) for r in ffn
            },
            "afdserve:rank_wait_seconds": stats.ffn_wait_s,
            "afdserve:scheduled_tokens": stats.ffn_tokens,
        }
        for name, doc, values in per_rank:
            counter = CounterMetricFamily(name, doc, labels=["rank", "role"])
            for rank in ranks:
                counter.add_metric([str(rank), "attention"], values.get(rank, 0))
            for rank in ffn if name in ffn_figures else ():
                counter.add_metric([str(rank), "ffn"], ffn_figures[name].get(rank, 0))
            yield counter
        gauge = GaugeMetricFamily(
            "afdserve:attention_imbalance",
            "Max over mean of the tokens each attention rank computed since the previous "
            "scrape (1: even; 0: none computed)",
            labels=["role"],
        )
        gauge.add_metric(["attention"], imbalance(self._scheduled, stats.scheduled_tokens))
        self._scheduled = dict(stats.scheduled_tokens)
        yield gauge


def imbalance(before: dict[int, int], now: dict[int, int]) -> float:
    """max / mean of each rank's tokens between two cumulative readings; 0 when none ran."""
    deltas = [count - before.get(rank, 0) for rank, count in now.items()]
    total = sum(deltas)
    return max(deltas) * len(deltas) / total if total > 0 else 0.0


def spec_decode_counters(stats: EngineStats, label: list[str]) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters, per attention rank (`engine`), and the accepted
    drafts at each position (`position`: 0 is the first draft)."""
    for name, doc, attr in (
        ("vllm:spec_decode_num_drafts", "Sequences verified with drafts", "num_drafts"),
        ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed", "num_draft_tokens"),
        ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted", "num_accepted_tokens"),
    ):
        counter = CounterMetricFamily(name, doc, labels=["model_name", "engine"])
        for rank, spec in sorted(stats.spec_decode.items()):
            counter.add_metric([*label, str(rank)], getattr(spec, attr))
        yield counter
    per_pos = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each position",
        labels=["model_name", "engine", "position"],
    )
    for rank, spec in sorted(stats.spec_decode.items()):
        for position, count in enumerate(spec.accepted_per_pos):
            per_pos.add_metric([*label, str(rank), str(position)], count)
    yield per_pos


def iteration_histogram(steps: dict[int, int], label: list[str]) -> HistogramMetricFamily:
    """vllm:iteration_tokens_total from {tokens: steps}, cumulative buckets as Prometheus's."""
    buckets, total = [], 0
    for bound in ITERATION_BUCKETS:
        buckets.append((str(float(bound)), sum(n for t, n in steps.items() if t <= bound)))
    buckets.append(("+Inf", sum(steps.values())))
    total = sum(t * n for t, n in steps.items())
    family = HistogramMetricFamily(
        "vllm:iteration_tokens_total",
        "Tokens computed per engine step (each attention rank's)",
        labels=["model_name"],
    )
    family.add_metric(label, buckets, total)
    return family


class ServerMetrics:
    """The server's metrics in their own registry; one method per observation."""

    def __init__(
        self,
        snapshot: Callable[[], EngineStats | None],
        model: Callable[[], str],
        waiting: Callable[[], tuple[int, int]] = lambda: (0, 0),
    ) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        self._declare_http(waiting)
        self._declare_tokens()
        self._declare_latencies()
        self._declare_recovery()  # before the request sizes: /metrics keeps its order
        self._declare_requests()
        self.registry.register(EngineCollector(snapshot, model))
        # process_* (CPU, memory, open files of the frontend process), as vLLM's /metrics has.
        ProcessCollector(registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry)

    def _declare_http(self, waiting: Callable[[], tuple[int, int]]) -> None:
        """What the HTTP side counts: requests, aborts, refusals, the frontend's waiting bound."""
        registry = self.registry
        self.requests = Counter(
            "afdserve_requests",
            "HTTP requests by endpoint and status code",
            ["endpoint", "status"],
            registry=registry,
        )
        self.aborted = Counter(
            "afdserve_requests_aborted",
            "Engine requests aborted before they finished: client gone or request timed out",
            registry=registry,
        )
        self._rejected = Counter(
            "afdserve_requests_rejected",
            "HTTP requests the server refused to run, by reason",
            ["reason"],
            registry=registry,
        )
        for reason in REJECT_REASONS:  # present at 0, so that rates start from the beginning
            self._rejected.labels(reason)
        self._shed = Counter(
            "afdserve_connections_shed",
            "Connections closed for want of a slot: a slow one beyond the reading share or at "
            "the connection cap, or a new one beyond its address's cap",
            ["reason"],
            registry=registry,
        )
        for reason in SHED_REASONS:
            self._shed.labels(reason)
        Gauge(
            "afdserve_waiting_requests",
            "Engine requests admitted by the frontend that have no token yet",
            registry=registry,
        ).set_function(lambda: waiting()[0])
        Gauge(
            "afdserve_waiting_tokens",
            "Prompt tokens of afdserve_waiting_requests",
            registry=registry,
        ).set_function(lambda: waiting()[1])

    def _declare_tokens(self) -> None:
        """vLLM's token and finished-request counters."""
        registry, labels = self.registry, ["model_name"]
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens admitted to the engine", labels, registry=registry
        )
        self._generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens", labels, registry=registry
        )
        self._success = Counter(
            "vllm:request_success",
            "Finished engine requests by finish reason",
            ["model_name", "finished_reason"],
            registry=registry,
        )

    def _declare_latencies(self) -> None:
        """vLLM's per-token and per-request latency histograms."""
        self._ttft = self._histogram(
            "vllm:time_to_first_token_seconds",
            "Seconds from submitting a request to the engine to its first generated token",
            TTFT_BUCKETS,
        )
        self._itl = self._histogram(
            "vllm:inter_token_latency_seconds",
            "Seconds between consecutive tokens delivered for one request",
            TPOT_BUCKETS,
        )
        # vLLM's older name of the same observation, which many dashboards still read.
        self._tpot = self._histogram(
            "vllm:time_per_output_token_seconds",
            "Seconds between consecutive tokens delivered for one request",
            TPOT_BUCKETS,
        )
        self._e2e = self._histogram(
            "vllm:e2e_request_latency_seconds",
            "Seconds from the HTTP request's arrival to its last token",
            REQUEST_BUCKETS,
        )
        self._queue = self._histogram(
            "vllm:request_queue_time_seconds",
            "Seconds from a request's arrival at its attention rank's engine to the first step "
            "that computes any of its tokens",
            REQUEST_BUCKETS,
        )

    def _declare_requests(self) -> None:
        """vLLM's histograms of each finished request: its sizes and its two phases."""
        self._request_prompt = self._histogram(
            "vllm:request_prompt_tokens", "Prompt tokens of each finished request", TOKEN_BUCKETS
        )
        self._request_generation = self._histogram(
            "vllm:request_generation_tokens",
            "Generated tokens of each finished request",
            TOKEN_BUCKETS,
        )
        self._max_tokens = self._histogram(
            "vllm:request_max_num_generation_tokens",
            "The max_tokens each finished request asked for",
            TOKEN_BUCKETS,
        )
        self._prefill = self._histogram(
            "vllm:request_prefill_time_seconds",
            "Seconds from a request's first scheduled step to its first token (its rank's clock)",
            REQUEST_BUCKETS,
        )
        self._decode = self._histogram(
            "vllm:request_decode_time_seconds",
            "Seconds from a request's first token to its last, as the frontend received them",
            REQUEST_BUCKETS,
        )

    def _declare_recovery(self) -> None:
        """Requests resumed after an engine failure, and how long serving stopped."""
        self.resumes = Counter(
            "afdserve_request_resumes",
            "Engine requests resumed on a restarted engine after the one they ran on failed",
            registry=self.registry,
        )
        self._recovery = Histogram(
            "afdserve_recovery_seconds",
            "Seconds from an engine failure to serving again on the restarted engine",
            buckets=RECOVERY_BUCKETS,
            registry=self.registry,
        )

    # One method per observation, so that callers never spell a label.
    def prompt_tokens(self, count: int) -> None:
        self._prompt_tokens.labels(self.model()).inc(count)

    def generation_tokens(self, count: int) -> None:
        self._generation_tokens.labels(self.model()).inc(count)

    def first_token(self, seconds: float) -> None:
        self._ttft.labels(self.model()).observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.labels(self.model()).observe(seconds)
        self._tpot.labels(self.model()).observe(seconds)

    def queued(self, seconds: float) -> None:
        self._queue.labels(self.model()).observe(seconds)

    def finished(self, reason: str | None, seconds: float) -> None:
        reason = reason if reason in FINISH_REASONS else "stop"
        self._success.labels(self.model(), reason).inc()
        self._e2e.labels(self.model()).observe(seconds)

    def recovered(self, seconds: float) -> None:
        self._recovery.observe(seconds)

    def request_done(
        self,
        prompt_tokens: int,
        generation_tokens: int,
        max_tokens: int,
        prefill_s: float | None,
        decode_s: float | None,
    ) -> None:
        """One engine sequence finished: its sizes and its prefill and decode phases."""
        model = self.model()
        self._request_prompt.labels(model).observe(prompt_tokens)
        self._request_generation.labels(model).observe(generation_tokens)
        self._max_tokens.labels(model).observe(max_tokens)
        if prefill_s is not None:
            self._prefill.labels(model).observe(prefill_s)
        if decode_s is not None:
            self._decode.labels(model).observe(decode_s)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(reason).inc()

    def connection_shed(self, reason: str) -> None:
        self._shed.labels(reason).inc()

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
