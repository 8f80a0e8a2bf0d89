"""`afdserve bench serve` against a real `afdserve serve` (bundled tiny model, colocated, one
sequence at a time): the counts and token totals it reports are exact, and they agree with the
server's own /metrics. The same server checks that vllm:request_queue_time_seconds holds the
time requests wait in the scheduler's queue."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from afdserve.model.fixtures.bundled import resolve_model
from tests.server.conftest import SERVED_NAME, ServerProcess, free_port, metrics, start_cli_server

PROMPTS, INPUT_LEN, OUTPUT_LEN = 4, 8, 4
MODEL = {"model_name": SERVED_NAME}


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory: pytest.TempPathFactory):
    srv = start_cli_server(
        tmp_path_factory.mktemp("bench-serve"),
        free_port(),
        "--topology",
        "colocated",
        "--max-num-seqs",
        "1",
        "--disable-log-requests",
    )
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def bench(server: ServerProcess, out: Path, *args: str) -> dict:
    command = [
        sys.executable,
        "-m",
        "afdserve.cli",
        "bench",
        "serve",
        "--base-url",
        server.url,
        "--json",
        str(out),
        *args,
    ]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "request rate" in proc.stdout
    return json.loads(out.read_text())


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({**MODEL, **labels}.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_counts_and_tokens_are_exact(one_at_a_time: ServerProcess, tmp_path: Path) -> None:
    before = metrics(one_at_a_time)
    report = bench(
        one_at_a_time,
        tmp_path / "bench.json",
        "--num-prompts",
        str(PROMPTS),
        "--input-len",
        str(INPUT_LEN),
        "--output-len",
        str(OUTPUT_LEN),
        "--request-rate",
        "2,inf",
        "--model-dir",
        str(resolve_model(None)),
    )
    after = metrics(one_at_a_time)
    assert report["config"]["model"] == SERVED_NAME
    assert [r["request_rate"] for r in report["results"]] == [2.0, "inf"]
    for rate in report["results"]:
        assert (rate["completed"], rate["failed"]) == (PROMPTS, 0)
        assert rate["input_tokens"] == PROMPTS * INPUT_LEN
        assert rate["output_tokens"] == PROMPTS * OUTPUT_LEN
        assert rate["output_throughput"] == pytest.approx(
            rate["output_tokens"] / rate["duration_s"]
        )
        for request in rate["requests"]:
            assert request["ok"] and request["error"] == ""
            assert (request["prompt_len"], request["output_tokens"]) == (INPUT_LEN, OUTPUT_LEN)
            assert 0 < request["ttft_s"] <= request["e2e_s"]
            assert len(request["itl_s"]) <= OUTPUT_LEN - 1
        for metric in ("ttft", "tpot", "itl", "e2e"):
            stats = rate["ms"][metric]
            assert 0 < stats["median"] <= stats["p99"], metric
    # The server saw exactly these requests, plus the bench's one test request.
    sent = 2 * PROMPTS + 1
    assert delta(before, after, "vllm:prompt_tokens_total") == sent * INPUT_LEN
    assert delta(before, after, "vllm:generation_tokens_total") == sent * OUTPUT_LEN
    assert delta(before, after, "vllm:request_success_total", finished_reason="length") == sent


def test_queue_time_is_the_wait_for_the_scheduler(
    one_at_a_time: ServerProcess, tmp_path: Path
) -> None:
    """Eight requests at once on a server that runs one at a time: most of their time to first
    token is spent waiting for the ones before them. Queue time ends before the first token,
    so it never exceeds TTFT; the time until the engine accepts a request (what the metric
    held before) is a few milliseconds and would fail the lower bound."""
    before = metrics(one_at_a_time)
    bench(
        one_at_a_time,
        tmp_path / "bench.json",
        "--num-prompts",
        "8",
        "--input-len",
        "8",
        "--output-len",
        "16",
        "--request-rate",
        "inf",
        "--vocab-size",
        "260",
    )
    after = metrics(one_at_a_time)
    assert delta(before, after, "vllm:request_queue_time_seconds_count") == 9
    queued = delta(before, after, "vllm:request_queue_time_seconds_sum")
    first_token = delta(before, after, "vllm:time_to_first_token_seconds_sum")
    assert 0.5 * first_token <= queued <= first_token


def test_shared_prefix_workload_is_generated_as_specified() -> None:
    from collections import Counter

    from afdserve.bench.serve import ServeBench, shared_prefix_prompts

    prompts = shared_prefix_prompts(10, 3, 20, 5, vocab_size=50, seed=4)
    assert len(prompts) == 10 and all(len(p) == 25 for p in prompts)
    uses = Counter(tuple(p[:20]) for p in prompts)
    assert sorted(uses.values()) == [3, 3, 4]  # three distinct prefixes, each in turn
    assert len({tuple(p[20:]) for p in prompts}) == 10  # every suffix its own
    assert all(0 <= t < 50 for p in prompts for t in p)
    assert prompts == shared_prefix_prompts(10, 3, 20, 5, vocab_size=50, seed=4)
    assert prompts != shared_prefix_prompts(10, 3, 20, 5, vocab_size=50, seed=5)
    spec = ServeBench("http://x", 1, 8, 4, (1.0,), num_prefixes=2, prefix_len=16)
    assert spec.prompt_len == 24
    with pytest.raises(ValueError, match="num_prefixes=-1"):
        ServeBench("http://x", 1, 8, 4, (1.0,), num_prefixes=-1)


def test_shared_prefix_bench_reports_cached_tokens(
    one_at_a_time: ServerProcess, tmp_path: Path
) -> None:
    """Two prefixes of one 16-token block over six requests, run one at a time: each prefix is
    computed once, and the four other requests are served its block from the prefix cache."""
    report = bench(
        one_at_a_time,
        tmp_path / "bench.json",
        "--num-prompts",
        "6",
        "--num-prefixes",
        "2",
        "--prefix-len",
        "16",
        "--input-len",
        "8",
        "--output-len",
        "2",
        "--request-rate",
        "inf",
        "--vocab-size",
        "260",
    )
    (rate,) = report["results"]
    assert (rate["completed"], rate["input_tokens"]) == (6, 6 * 24)
    assert rate["cached_tokens"] == 4 * 16
    assert sorted(r["cached_tokens"] for r in rate["requests"]) == [0, 0, 16, 16, 16, 16]


def test_a_model_without_tokenizer_streams_a_chunk_per_token(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """A dummy-weight preset has no tokenizer files: the server warms up on token ids, and every
    generated token reaches the client as its own chunk (with empty text), so that the bench
    measures the time between tokens and not only the time to the whole answer."""
    model_dir = tmp_path_factory.mktemp("ids-only") / "tiny"
    command = [sys.executable, "-m", "afdserve.cli", "make-config", "--preset", "tiny"]
    command.append(str(model_dir))
    made = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    srv = start_cli_server(
        tmp_path,
        free_port(),
        str(model_dir),
        "--load-format",
        "dummy",
        "--topology",
        "colocated",
        "--max-num-seqs",
        "1",
        "--disable-log-requests",
        "--no-use-tqdm-on-load",
    )
    try:
        srv.wait_healthy()
        report = bench(
            srv,
            tmp_path / "bench.json",
            "--num-prompts",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "6",
            "--request-rate",
            "inf",
            "--model-dir",
            str(model_dir),
        )
    finally:
        srv.stop()
    (rate,) = report["results"]
    assert (rate["completed"], rate["failed"]) == (2, 0)
    for request in rate["requests"]:
        assert request["output_tokens"] == 6
        assert len(request["itl_s"]) == 5


def test_the_cli_runs_without_the_bench_extra() -> None:
    """httpx comes with the `bench` extra only: `afdserve serve` (the README's main command
    installs the `server` extra) must parse its arguments without it, and `bench serve` must
    say what to install."""
    code = """
import sys
sys.modules["httpx"] = None  # as if not installed: importing it raises ImportError
from afdserve.cli import build_parser, main
assert build_parser().parse_args(["serve", "--port", "1"]).port == 1
sys.exit(main(["bench", "serve", "--base-url", "http://127.0.0.1:1"]))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pip install 'afdserve[bench]'" in proc.stderr
