"""The per-step engine metrics and the per-role AFD metrics of a live 2A1F server, against what
was sent and against the ranks' own logs of what they did: the step-plan log (each step's rows)
and the data-plane log (each tensor that crossed the wire, its shape and dtype)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from afdserve.server.metrics import ITERATION_BUCKETS

from .conftest import MARKER, SERVED_NAME, ServerProcess, free_port, metrics

# The engine's keywords as JSON, so that the ranks log their steps and their wire.
SERVER_CODE = """
import json, sys
from afdserve.llm import LLM
from afdserve.server.serve import ServeOptions, run_server

options = ServeOptions(host="127.0.0.1", port=int(sys.argv[1]), **json.loads(sys.argv[3]))
sys.exit(run_server(lambda: LLM(**json.loads(sys.argv[2])), options))
"""
BLOCK_SIZE, KV_BLOCKS = 16, 8  # 128 tokens per attention rank: two long requests preempt
DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana" / "afdserve-afd.json"
MODEL = {"model_name": SERVED_NAME}


def start(tmp_path: Path) -> tuple[ServerProcess, Path, Path]:
    steps, wire = tmp_path / "steps.jsonl", tmp_path / "wire"
    wire.mkdir()
    engine = {
        "topology": "2A1F",
        "kv_cache_blocks": KV_BLOCKS,
        "block_size": BLOCK_SIZE,
        "log_step_plan": str(steps),
        "log_data_plane": str(wire),
    }
    options = {"served_model_name": SERVED_NAME, "uvicorn_log_level": "warning"}
    port, marker = free_port(), uuid.uuid4().hex
    log_path = tmp_path / "server.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", **{MARKER: marker})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-c", SERVER_CODE, str(port), json.dumps(engine), json.dumps(options)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    return ServerProcess(proc, port, marker, log_path), steps, wire


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    server, steps, wire = start(tmp_path_factory.mktemp("afd-metrics"))
    try:
        server.wait_healthy()
        yield server, steps, wire
    finally:
        server.stop()


def complete(server: ServerProcess, prompt: list[int], max_tokens: int) -> dict:
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wire_lines(wire: Path) -> dict[int, list[dict]]:
    return {int(re.findall(r"\d+", p.name)[0]): lines(p) for p in sorted(wire.glob("rank*.jsonl"))}


def per_rank(sample: dict, name: str) -> dict[int, float]:
    """The attention ranks' samples of `name`, by rank."""
    return {
        int(dict(labels)["rank"]): v
        for (n, labels), v in sample.items()
        if n == name and dict(labels).get("role") == "attention"
    }


def hidden_bytes(batches: list[dict], kind: str, hidden: int) -> int:
    """Bytes of the [rows, hidden] tensors of `kind` (send/recv) in a rank's data-plane log."""
    total = 0
    for batch in batches:
        for op_kind, _peer, shape, dtype in batch["ops"]:
            if op_kind == kind and len(shape) == 2 and shape[1] == hidden:
                total += shape[0] * shape[1] * getattr(torch, dtype.removeprefix("torch.")).itemsize
    return total


def settle() -> None:
    """A rank's stats ride with its outputs and its heartbeat (0.5 s): wait for both."""
    time.sleep(1.5)


def test_step_metrics_and_afd_metrics(served) -> None:
    server, steps_log, wire = served
    settle()  # the start-up's warm-up request reported by every rank
    before, steps_before = metrics(server), len(lines(steps_log))
    wire_before = {rank: len(batches) for rank, batches in wire_lines(wire).items()}

    # One request alone: one attention rank computes every token, the other none.
    start_s = time.monotonic()
    complete(server, list(range(5, 21)), 4)
    settle()
    alone = metrics(server)
    assert alone[("afdserve:attention_imbalance", (("role", "attention"),))] == 2.0
    # Two of the same size at once: the router gives each rank one.
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda p: complete(server, p, 4), [list(range(30, 46)), list(range(50, 66))]))
    settle()
    pair = metrics(server)
    assert pair[("afdserve:attention_imbalance", (("role", "attention"),))] == 1.0
    elapsed = time.monotonic() - start_s

    # Three requests of 16 prompt tokens and 4 generated: 16 + 3 tokens computed each (the last
    # token is sampled, never fed back), none from the prefix cache.
    computed = 3 * (16 + 3)
    check_tokens(before, pair, lines(steps_log)[steps_before:], computed)
    check_boundary_bytes(server, before, pair, wire, wire_before)
    check_busy_and_wait(before, pair, elapsed)
    check_ffn_rank(before, pair, computed, elapsed)
    check_cache_config(pair)


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def check_tokens(before: dict, pair: dict, steps: list[dict], computed: int) -> None:
    """Tokens computed, per rank and in the iteration histogram, against the step-plan log."""
    assert (
        sum(
            delta(before, pair, "vllm:prefix_cache_hits_total", **MODEL, engine=str(r))
            for r in (0, 1)
        )
        == 0
    )
    scheduled = per_rank(pair, "afdserve:scheduled_tokens_total")
    scheduled_before = per_rank(before, "afdserve:scheduled_tokens_total")
    assert sum(scheduled.values()) - sum(scheduled_before.values()) == computed
    assert delta(before, pair, "vllm:iteration_tokens_total_sum", **MODEL) == computed

    # The histogram's buckets are the steps the ranks logged, by their real rows.
    logged = [r for r in steps if r["role"] == "attention" and r["real_rows"] > 0]
    assert sum(r["real_rows"] for r in logged) == computed
    for bound in ITERATION_BUCKETS:
        expected = sum(1 for r in logged if r["real_rows"] <= bound)
        bucket = delta(
            before, pair, "vllm:iteration_tokens_total_bucket", **MODEL, le=str(float(bound))
        )
        assert bucket == expected, bound
    assert delta(before, pair, "vllm:iteration_tokens_total_count", **MODEL) == len(logged)


def check_boundary_bytes(
    server: ServerProcess, before: dict, pair: dict, wire: Path, wire_before: dict[int, int]
) -> None:
    """A2E / E2A bytes: what the data-plane log says crossed the wire, tensor by tensor."""
    hidden = json.loads(model_config(server)).get("hidden_size")
    batches = wire_lines(wire)
    a2e, e2a = (
        per_rank(pair, "afdserve:a2e_bytes_total"),
        per_rank(pair, "afdserve:e2a_bytes_total"),
    )
    a2e_before, e2a_before = (
        per_rank(before, "afdserve:a2e_bytes_total"),
        per_rank(before, "afdserve:e2a_bytes_total"),
    )
    for rank in (0, 1):
        new = batches[rank][wire_before[rank] :]
        assert a2e[rank] - a2e_before.get(rank, 0) == hidden_bytes(new, "send", hidden) > 0
        assert e2a[rank] - e2a_before.get(rank, 0) == hidden_bytes(new, "recv", hidden) > 0


def check_busy_and_wait(before: dict, pair: dict, elapsed: float) -> None:
    """Busy and waiting seconds: both ran on each rank (gloo waits block), within the wall time."""
    busy, wait = (
        per_rank(pair, "afdserve:rank_busy_seconds_total"),
        per_rank(pair, "afdserve:rank_wait_seconds_total"),
    )
    busy_before, wait_before = (
        per_rank(before, "afdserve:rank_busy_seconds_total"),
        per_rank(before, "afdserve:rank_wait_seconds_total"),
    )
    for rank in (0, 1):
        spent = (busy[rank] - busy_before.get(rank, 0), wait[rank] - wait_before.get(rank, 0))
        assert spent[0] > 0 and spent[1] > 0 and sum(spent) < elapsed, (rank, spent)


def check_ffn_rank(before: dict, pair: dict, computed: int, elapsed: float) -> None:
    """The FFN rank (2) reports over its own channel: every real row both ranks sent it."""

    def ffn(sample: dict, name: str) -> float:
        return sample.get((name, (("rank", "2"), ("role", "ffn"))), 0.0)

    assert (
        ffn(pair, "afdserve:scheduled_tokens_total")
        - ffn(before, "afdserve:scheduled_tokens_total")
        == computed
    )
    for name in ("afdserve:rank_busy_seconds_total", "afdserve:rank_wait_seconds_total"):
        assert 0 < ffn(pair, name) - ffn(before, name) < elapsed, name


def check_cache_config(pair: dict) -> None:
    """The KV cache's configuration as the ranks hold it."""
    info = [
        labels
        for (name, labels), v in pair.items()
        if name == "vllm:cache_config_info" and v == 1.0
    ]
    assert len(info) == 1 and dict(info[0]) == {
        "block_size": str(BLOCK_SIZE),
        "num_gpu_blocks": str(KV_BLOCKS),
        "cache_dtype": "auto",
        "enable_prefix_caching": dict(info[0])["enable_prefix_caching"],
    }
    assert dict(info[0])["enable_prefix_caching"] in ("True", "False")


def model_config(server: ServerProcess) -> str:
    from afdserve.model.fixtures.bundled import bundled_model_dir

    return (bundled_model_dir() / "config.json").read_text()


def test_preemptions_counted_per_rank(served) -> None:
    """Two requests of 116 tokens each on a rank of 128 KV tokens: one must be preempted."""
    server = served[0]
    before = metrics(server)
    with ThreadPoolExecutor(4) as pool:
        outs = list(
            pool.map(
                lambda i: complete(server, list(range(100 + 20 * i, 116 + 20 * i)), 100), range(4)
            )
        )
    assert all(len(o["choices"][0]["text"]) > 0 for o in outs)
    settle()
    after = metrics(server)
    name = "vllm:num_preemptions_total"
    moved = {
        r: after.get((name, (("engine", str(r)), ("model_name", SERVED_NAME))), 0)
        - before.get((name, (("engine", str(r)), ("model_name", SERVED_NAME))), 0)
        for r in (0, 1)
    }
    # The router spreads four equal requests two and two: each rank ran out of blocks.
    assert moved[0] >= 1 and moved[1] >= 1, moved


def test_dashboard_names_only_served_metrics(served) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert exprs
    names = {n for e in exprs for n in re.findall(r"\b((?:afdserve[:_]|vllm:)[a-z0-9_:]+)", e)}
    served_names = {name for name, _labels in metrics(served[0])}
    assert names and names <= served_names, names - served_names


def test_one_process_engine_reports_the_same_metrics() -> None:
    """Colocated, one process: the same names from SingleProcessClient's stats; nothing crosses
    a wire, so no bytes and no waits, and the tokens are those of the prompts sent."""
    from prometheus_client.parser import text_string_to_metric_families

    from afdserve import LLM, SamplingParams
    from afdserve.server.metrics import ServerMetrics

    llm = LLM(topology="colocated", enable_prefix_caching=False, kv_cache_blocks=64)
    try:
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(5, 15))}] * 2, params)
        stats = llm.engine.stats()
        text = ServerMetrics(lambda: stats, lambda: "m").render().decode()
    finally:
        llm.shutdown()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    attention = (("rank", "0"), ("role", "attention"))
    assert samples[("afdserve:scheduled_tokens_total", attention)] == 2 * (10 + 2)
    assert samples[("vllm:iteration_tokens_total_sum", (("model_name", "m"),))] == 2 * (10 + 2)
    assert samples[("afdserve:a2e_bytes_total", attention)] == 0
    assert samples[("afdserve:rank_wait_seconds_total", attention)] == 0
    assert samples[("afdserve:rank_busy_seconds_total", attention)] > 0
    assert samples[("vllm:num_preemptions_total", (("engine", "0"), ("model_name", "m")))] == 0
    assert (
        samples[
            (
                "vllm:cache_config_info",
                (
                    ("block_size", "16"),
                    ("cache_dtype", "auto"),
                    ("enable_prefix_caching", "False"),
                    ("num_gpu_blocks", "64"),
                ),
            )
        ]
        == 1.0
    )
