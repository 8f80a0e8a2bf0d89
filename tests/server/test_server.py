"""The OpenAI-compatible server, driven by the official `openai` client against a real server
process (bundled tiny model, 2A1F: three rank processes). The oracle for generated text is the
offline API on a colocated engine (AFD is token-identical to colocated on CPU float32); token
counts come from the tokenizer. A few fast checks run in-process on a colocated engine.

The tests share one server and run in file order; the last one stops it with SIGTERM.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

from afdserve import LLM, SamplingParams
from afdserve.server.app import create_app
from afdserve.server.options import ServeOptions
from afdserve.server.serve import build_app, engine_view

from .conftest import (
    SERVED_NAME,
    ServerProcess,
    alive,
    child_pids,
    free_port,
    marked_pids,
    metrics,
    start_server,
    wait_until_in_engine,
)

GREEDY = {"temperature": 0.0, "max_tokens": 8}
RUNNING = ("vllm:num_requests_running", (("model_name", SERVED_NAME),))
KV_USAGE = ("vllm:kv_cache_usage_perc", (("model_name", SERVED_NAME),))
HELLO = "Hello, world"


@pytest.fixture(scope="module")
def oracle():
    with LLM() as llm:
        yield llm


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def local():
    """build_app on a colocated engine, in-process: fast checks of the HTTP layer."""
    options = ServeOptions(served_model_name=SERVED_NAME)
    with LLM() as llm, TestClient(build_app(llm, options)) as http:
        yield http


def expected(oracle: LLM, prompt: str | list[int], **params):
    return oracle.generate([prompt], SamplingParams(**params))[0]


def chat_ids(oracle: LLM, messages: list[dict]) -> list[int]:
    text = oracle.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return oracle.encode_prompt(text)


def requests_counted(server: ServerProcess, endpoint: str, status: int) -> float:
    key = ("afdserve_requests_total", (("endpoint", endpoint), ("status", str(status))))
    return metrics(server).get(key, 0.0)


# ----- the real server -----


def test_health_and_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert server.health_seen == {503, 200}  # answered 503 while the ranks were starting
    assert "warming up" in server.log() and "ready" in server.log()
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]


def test_completion_matches_offline_greedy(client: openai.OpenAI, oracle: LLM) -> None:
    want = expected(oracle, HELLO, **GREEDY)
    got = client.completions.create(model=SERVED_NAME, prompt=HELLO, logprobs=2, **GREEDY)
    choice = got.choices[0]
    assert choice.text == want.text
    assert choice.finish_reason == ("length" if len(want.token_ids) == 8 else "stop")
    assert got.usage.prompt_tokens == len(oracle.tokenizer.encode(HELLO, add_special_tokens=False))
    assert got.usage.completion_tokens == len(want.token_ids) == len(choice.logprobs.tokens)
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    for top, logprob in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) >= logprob  # greedy picks the top token

    # Token ids and a list of prompts, answered in prompt order.
    ids = [72, 105, 33]
    batch = client.completions.create(model=SERVED_NAME, prompt=[HELLO, "abc"], **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == want.text
    assert batch.choices[1].text == expected(oracle, "abc", **GREEDY).text
    by_ids = client.completions.create(model=SERVED_NAME, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == expected(oracle, ids, **GREEDY).text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_chat_matches_offline_greedy(client: openai.OpenAI, oracle: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    prompt = chat_ids(oracle, messages)
    want = expected(oracle, prompt, **GREEDY)
    got = client.chat.completions.create(model=SERVED_NAME, messages=messages, **GREEDY)
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == len(prompt)
    assert got.usage.completion_tokens == len(want.token_ids)


def test_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    params = dict(model=SERVED_NAME, temperature=0.0, max_tokens=12)
    whole = client.completions.create(prompt=HELLO, **params)
    chunks = list(client.completions.create(prompt=HELLO, stream=True, **params))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason

    messages = [{"role": "user", "content": "Tell me a story"}]
    whole = client.chat.completions.create(messages=messages, **params)
    stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **params
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == []
    got, want = chunks[-1].usage, whole.usage
    assert got.prompt_tokens == want.prompt_tokens
    assert got.completion_tokens == want.completion_tokens
    # The stream ran the same prompt again: its attention rank (prefix routing) had every full
    # 16-token block of it cached, all but the block holding the last prompt token.
    assert got.prompt_tokens_details.cached_tokens == (got.prompt_tokens - 1) // 16 * 16


def test_concurrent_requests(client: openai.OpenAI, oracle: LLM) -> None:
    prompts = [f"Request number {i}: " + "x" * i for i in range(16)]
    wants = oracle.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))

    def ask(prompt: str):
        return client.completions.create(
            model=SERVED_NAME, prompt=prompt, temperature=0.0, max_tokens=6
        )

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, prompts))
    for prompt, want, got in zip(prompts, wants, answers):
        assert got.choices[0].text == want.text
        assert got.usage.prompt_tokens == len(want.prompt_token_ids) == len(prompt.encode())
        assert got.usage.completion_tokens == len(want.token_ids)


def test_n_choices_are_seeded_samples(client: openai.OpenAI, oracle: LLM) -> None:
    params = {"temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
    got = client.completions.create(
        model=SERVED_NAME,
        prompt=HELLO,
        n=2,
        seed=7,
        temperature=1.0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in got.choices] == [0, 1]
    wants = [expected(oracle, HELLO, seed=7 + i, **params).text for i in range(2)]
    assert [c.text for c in got.choices] == wants
    assert wants[0] != wants[1]
    assert got.usage.prompt_tokens == len(HELLO) and got.usage.completion_tokens == 16


def test_bad_requests_name_the_field_and_others_keep_working(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    url = f"{server.url}/v1/completions"
    cases = [
        ({"model": SERVED_NAME, "max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "max_tokens": "x"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "a" * 600, "max_tokens": 4}, "prompt"),
        ({"prompt": "hi", "temperature": -1}, "temperature"),
        ({"prompt": [1, 2, 10**6]}, "prompt"),
    ]
    before = requests_counted(server, "/v1/completions", 400)
    with ThreadPoolExecutor(4) as pool:  # a good request runs while the bad ones arrive
        good = pool.submit(client.completions.create, model=SERVED_NAME, prompt=HELLO, **GREEDY)
        for body, field in cases:
            r = httpx.post(url, json=body, timeout=30)
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == field and field in error["message"], (body, error)
            assert error["type"] == "invalid_request_error"
        assert good.result().usage.completion_tokens >= 1
    assert requests_counted(server, "/v1/completions", 400) == before + len(cases)

    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=SERVED_NAME, messages=[])
    assert client.completions.create(model=SERVED_NAME, prompt="hi", **GREEDY).choices[0].text


def test_requests_that_stopped_the_service_are_served_or_refused(
    server: ServerProcess, client: openai.OpenAI, oracle: LLM
) -> None:
    """Issue 12, on 2A1F: a tiny temperature is greedy, seeds are bounded at validation, and the
    service keeps answering after each."""
    got = client.completions.create(
        model=SERVED_NAME, prompt=HELLO, temperature=1e-45, max_tokens=8
    )
    assert got.choices[0].text == expected(oracle, HELLO, **GREEDY).text
    url = f"{server.url}/v1/completions"
    r = httpx.post(url, json={"prompt": HELLO, "seed": 2**64, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "seed"
    body = {"prompt": HELLO, "seed": 2**63 - 1, "n": 2, "max_tokens": 2}
    assert len(httpx.post(url, json=body, timeout=60).json()["choices"]) == 2
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_structured_output_on_the_ranks(client: openai.OpenAI) -> None:
    """The grammar runs beside the sampler on each attention rank of 2A1F."""
    answer = client.completions.create(
        model=SERVED_NAME,
        prompt=["a", "b"],
        max_tokens=32,
        seed=3,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"schema": {"enum": ["alpha", "beta", "gamma"]}},
            }
        },
    )
    assert [json.loads(c.text) in ("alpha", "beta", "gamma") for c in answer.choices] == [1, 1]


def test_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    before = metrics(server)
    for _ in range(3):
        client.completions.create(model=SERVED_NAME, prompt=HELLO, temperature=0.0, max_tokens=4)
    client.chat.completions.create(
        model=SERVED_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    after = metrics(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    requests = "afdserve_requests_total"
    model = {"model_name": SERVED_NAME}
    assert delta(requests, endpoint="/v1/completions", status="200") == 3
    assert delta(requests, endpoint="/v1/chat/completions", status="200") == 1
    assert delta("vllm:prompt_tokens_total", **model) >= 3 * len(HELLO)
    assert 4 <= delta("vllm:generation_tokens_total", **model) <= 16
    assert delta("vllm:time_to_first_token_seconds_count", **model) == 4
    assert delta("vllm:e2e_request_latency_seconds_count", **model) == 4
    assert delta("vllm:request_queue_time_seconds_count", **model) == 4
    finished = sum(
        delta("vllm:request_success_total", finished_reason=reason, **model)
        for reason in ("stop", "length")
    )
    assert finished == 4
    tokens_after_first = delta("vllm:generation_tokens_total", **model) - 4
    assert delta("vllm:inter_token_latency_seconds_count", **model) == tokens_after_first
    assert after[("vllm:num_requests_running", (("model_name", SERVED_NAME),))] == 0
    assert 0.0 <= after[("vllm:kv_cache_usage_perc", (("model_name", SERVED_NAME),))] <= 1.0
    steps = {labels: v for (name, labels), v in after.items() if name.startswith("afdserve_engine")}
    assert steps[(("mode", "eager"), ("role", "attention"))] > 0


def test_cached_tokens_and_prefix_cache_metrics(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    """A shared 40-token prefix: the first request computes it, the next ones (completion,
    streamed completion, over either rank) report its two full 16-token blocks as cached, and
    the per-rank counters of /metrics move by exactly the tokens looked up and found."""
    before = metrics(server)
    prefix = [(13 * i + 5) % 200 + 3 for i in range(40)]
    params = dict(model=SERVED_NAME, temperature=0.0, max_tokens=2)
    first = client.completions.create(prompt=prefix + [1], **params)
    again = client.completions.create(prompt=prefix + [2, 3], **params)
    chunks = list(
        client.completions.create(
            prompt=prefix + [4], stream=True, stream_options={"include_usage": True}, **params
        )
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 32
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 32

    def total(name: str, snapshot: dict) -> float:
        return sum(
            v
            for (n, labels), v in snapshot.items()
            if n == name and dict(labels).get("model_name") == SERVED_NAME
        )

    def moved(snapshot: dict) -> tuple[float, float]:
        return tuple(
            total(name, snapshot) - total(name, before)  # type: ignore[return-value]
            for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
        )

    # The engine thread's stats snapshot follows the ranks' last step report.
    wait_for(lambda: moved(metrics(server)) == (41 + 42 + 41, 64))
    engines = {
        dict(labels)["engine"]
        for (n, labels) in metrics(server)
        if n == "vllm:prefix_cache_queries_total"
    }
    assert engines == {"0", "1"}  # one series per attention rank


def wait_for(condition, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.1)


def test_client_disconnect_aborts(server: ServerProcess, client: openai.OpenAI) -> None:
    aborted = ("afdserve_requests_aborted_total", ())
    before = metrics(server).get(aborted, 0.0)
    # Long enough that it cannot finish by itself while the test watches.
    body = {"prompt": HELLO, "max_tokens": 480, "ignore_eos": True, "temperature": 0.0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: {"))
    wait_for(lambda: metrics(server).get(aborted, 0.0) == before + 1)
    wait_for(lambda: metrics(server)[RUNNING] == 0)

    with pytest.raises(httpx.ReadTimeout):  # not streamed: the client gives up waiting
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    wait_for(lambda: metrics(server).get(aborted, 0.0) == before + 2)
    wait_for(lambda: metrics(server)[RUNNING] == 0)
    wait_for(lambda: metrics(server)[KV_USAGE] == 0)
    assert client.completions.create(model=SERVED_NAME, prompt="hi", **GREEDY).choices


def test_port_in_use_fails_fast(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        srv = start_server(tmp_path, port)
        try:
            code = srv.proc.wait(60)
        finally:
            srv.stop()
    assert code != 0
    assert f"port {port} on 127.0.0.1 is already in use" in srv.log()
    assert "loading" not in srv.log()
    assert marked_pids(srv.marker) == []


def test_second_sigterm_stops_every_process_at_once(server: ServerProcess) -> None:
    """The last test of the shared server: it stops it while a request is in flight. The first
    SIGTERM starts the drain (test_reliability.py); the second one cuts it short."""
    ranks = child_pids(server.proc.pid)
    assert len(ranks) >= 3, ranks  # three ranks (and whatever else the frontend started)
    body = {"prompt": HELLO, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(line for line in lines if line.startswith("data: {"))
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]  # the stream ends with an error: no hang
    assert rest[-1] == "data: [DONE]"
    assert any('"error"' in line for line in rest)
    assert server.proc.wait(60) == 0
    assert time.monotonic() - start < 30
    assert [pid for pid in ranks if alive(pid)] == []
    assert marked_pids(server.marker) == []


def _not_serving(request) -> bool:
    try:
        return request().status_code == 503
    except httpx.ConnectError:
        return True


def test_rank_death_fails_requests_and_health(tmp_path: Path) -> None:
    """A rank killed mid-request: in-flight requests get a 500 error (streamed or not), /health
    turns 503, new requests are refused, and the server exits 1 (on_engine_failure="exit",
    whether or not a SIGTERM comes first) leaving nothing behind."""
    srv = start_server(tmp_path, free_port(), topology="1A1F")  # 2 ranks: the cheapest AFD
    try:
        srv.wait_healthy()
        url = f"{srv.url}/v1/completions"
        body = {"prompt": HELLO, "max_tokens": 480, "ignore_eos": True, "temperature": 0.0}
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, url, json=body, timeout=120)
            with httpx.stream("POST", url, json={**body, "stream": True}, timeout=120) as r:
                lines = (line for line in r.iter_lines() if line)
                assert next(lines).startswith("data: {")
                wait_until_in_engine(srv, 2)
                ranks = child_pids(srv.proc.pid, recursive=False)
                os.kill(max(ranks), signal.SIGKILL)  # the FFN rank, started last
                rest = list(lines)
            answer = waiting.result()
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2].removeprefix("data: "))["error"]["message"]
        assert answer.status_code == 500 and "rank" in answer.json()["error"]["message"]
        # The server may already be on its way out (it exits on engine failure): a refused
        # connection is as much "not serving" as a 503.
        assert _not_serving(lambda: httpx.get(f"{srv.url}/health"))
        assert _not_serving(lambda: httpx.post(url, json=body, timeout=10))
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.exit_code(60) == 1
        assert marked_pids(srv.marker) == []
    finally:
        srv.stop()


# ----- in-process, colocated -----


def test_engine_view_of_an_llm(oracle: LLM) -> None:
    """serve.py reads the LLM in one place: what the server needs of it, in one EngineView."""
    view = engine_view(oracle, ServeOptions(served_model_name="served", generation_config="vllm"))
    assert view.client is oracle.engine and view.tokenizer is oracle.tokenizer
    assert (view.served_name, view.root) == ("served", oracle.model_name)
    assert view.model_dir == oracle.engine_config.model
    assert view.max_model_len == oracle.engine.max_model_len
    assert view.vocab_size == oracle.engine.vocab_size
    assert view.defaults == {} and view.encode(HELLO) == oracle.encode_prompt(HELLO)
    assert engine_view(oracle, ServeOptions()).served_name == oracle.model_name


def test_health_is_503_until_the_model_is_attached() -> None:
    options = ServeOptions(served_model_name="tiny")
    with TestClient(create_app(options)) as http:
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and "loading" in r.json()["error"]["message"]


def test_local_validation_and_stop(local: TestClient, oracle: LLM) -> None:
    bad = [
        ("/v1/completions", {"prompt": "hi", "n": 0}, "n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "echo": True},
            "echo",
        ),
        ("/v1/completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
        ("/v1/completions", {"prompt": {"a": 1}}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
    ]
    for path, body, param in bad:
        r = local.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = local.post(
        "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    r = local.get("/v2/nothing")
    assert r.status_code == 404 and "error" in r.json()

    text = expected(oracle, HELLO, temperature=0.0, max_tokens=16, ignore_eos=True).text
    stop = text[4:6]
    want = expected(oracle, HELLO, temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop)
    body = {"prompt": HELLO, "temperature": 0, "max_tokens": 16, "ignore_eos": True, "stop": [stop]}
    got = local.post("/v1/completions", json=body).json()["choices"][0]
    assert got["text"] == want.text and got["finish_reason"] == want.finish_reason == "stop"


def test_local_chat_logprobs_stream(local: TestClient) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0,
        "max_tokens": 5,
        "logprobs": True,
        "top_logprobs": 3,
    }
    answer = local.post("/v1/chat/completions", json=body).json()
    whole = answer["choices"][0]
    content = whole["logprobs"]["content"]
    assert len(content) == answer["usage"]["completion_tokens"]
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry["top_logprobs"]) == 3
        assert entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"])
    with local.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [t["token"] for t in streamed] == [t["token"] for t in content]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["message"]["content"]
