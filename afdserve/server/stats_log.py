"""The stats line the server logs while it has work (vLLM's periodic line)."""

from __future__ import annotations

import logging
import threading
import time

from afdserve.server.options import STATS_INTERVAL_S
from afdserve.server.state import ServerState

log = logging.getLogger("afdserve.server")


class StatsLogger:
    """A line every `interval_s` while the server has work: running, waiting, KV use, token
    rates. Reads the metrics registry, so it shows exactly what /metrics shows."""

    def __init__(self, state: ServerState, interval_s: float = STATS_INTERVAL_S) -> None:
        self.state, self.interval_s = state, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="afdserve-stats", daemon=True)
        self._last = (time.monotonic(), 0.0, 0.0)
        self._last_spec = (0, 0, 0)  # EngineStats.spec_totals at the last line

    def start(self) -> StatsLogger:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def line(self) -> str | None:
        """The stats line, or None when nothing ran since the last one and nothing runs now."""
        stats = self.state.engine.stats() if self.state.engine else None
        registry = self.state.metrics.registry
        labels = {"model_name": self.state.model_name}
        prompt = registry.get_sample_value("vllm:prompt_tokens_total", labels) or 0.0
        generated = registry.get_sample_value("vllm:generation_tokens_total", labels) or 0.0
        now = time.monotonic()
        then, prompt_before, generated_before = self._last
        self._last = (now, prompt, generated)
        busy = stats is not None and (stats.running or stats.waiting)
        if not busy and prompt == prompt_before and generated == generated_before:
            return None
        elapsed = max(now - then, 1e-9)
        running, waiting, kv = (
            (stats.running, stats.waiting, stats.kv_cache_usage) if stats else (0, 0, 0.0)
        )
        rate = stats.prefix_cache_hit_rate if stats else None
        cached = "" if rate is None else f", prefix cache hit rate {rate:.1%}"
        return (
            f"running {running}, waiting {waiting}, KV cache {kv:.1%}{cached}, "
            f"prompt {(prompt - prompt_before) / elapsed:.1f} tokens/s, "
            f"generation {(generated - generated_before) / elapsed:.1f} tokens/s"
            f"{self._acceptance(stats)}"
        )

    def _acceptance(self, stats) -> str:
        """Since the last line (vLLM's SpecDecoding line): the share of draft tokens accepted,
        and the tokens a verification gives a sequence (its accepted drafts and one more)."""
        if stats is None or not stats.spec_decode:
            return ""
        totals = stats.spec_totals
        accepted, drafted, drafts = (now - then for now, then in zip(totals, self._last_spec))
        self._last_spec = totals
        if not drafted:
            return ", draft acceptance rate n/a"
        return (
            f", draft acceptance rate {accepted / drafted:.1%}, mean acceptance length "
            f"{1 + accepted / drafts:.2f}"
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            line = self.line()
            if line is not None:
                log.info(line)
