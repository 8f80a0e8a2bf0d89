"""The speculative-decoding counters on /metrics under vLLM's names, equal to the engine's own,
and the acceptance rate in the periodic stats line."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from afdserve import LLM
from afdserve.server.options import ServeOptions
from afdserve.server.serve import build_app
from afdserve.server.stats_log import StatsLogger

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 2,
    "prompt_lookup_max": 2,
    "prompt_lookup_min": 1,
}


def test_spec_decode_metrics_and_stats_line() -> None:
    options = ServeOptions(served_model_name="m")
    with LLM(speculative_config=NGRAM) as llm, TestClient(build_app(llm, options)) as http:
        body = {"model": "m", "prompt": "abababababab", "max_tokens": 12, "temperature": 0.0}
        assert http.post("/v1/completions", json=body).status_code == 200
        logger = StatsLogger(http.app.state.server)
        line = logger.line()
        spec = llm.engine.stats().spec_decode[0]
        text = http.get("/metrics").text
    samples = {
        (s.name, s.labels.get("position")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("vllm:spec_decode") and s.labels.get("engine") == "0"
    }
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == spec.num_drafts > 0
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == spec.num_draft_tokens
    accepted = samples[("vllm:spec_decode_num_accepted_tokens_total", None)]
    assert accepted == spec.num_accepted_tokens
    per_pos = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", p)] for p in "01"]
    assert per_pos == spec.accepted_per_pos and sum(per_pos) == accepted
    rate = spec.num_accepted_tokens / spec.num_draft_tokens
    length = 1 + spec.num_accepted_tokens / spec.num_drafts
    assert line is not None
    assert line.endswith(f"draft acceptance rate {rate:.1%}, mean acceptance length {length:.2f}")
