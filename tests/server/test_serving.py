"""What a vLLM user relies on, against a real colocated server process (bundled tiny model) with
an API key: no request takes the engine down (hypothesis over the request schema), every sampling
field is honoured or refused by name, and the operational surface (auth, /tokenize, /detokenize,
/version, model cards, logs). The oracle for generated text is the offline API, whose sampler is
tested against transformers' logits processors in tests/engine/test_sampler.py.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from afdserve import LLM, SamplingParams
from afdserve.engine.structured import StructuredOutputsParams
from afdserve.frontend.outputs import cumulative_logprob
from afdserve.server.options import ServeOptions

from .conftest import SERVED_NAME, ServerProcess, free_port, start_server

API_KEY = "sk-afdserve-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
HELLO = "Hello, world"
VOCAB = 260  # the bundled byte-level tokenizer


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(
        tmp_path_factory.mktemp("serving"),
        free_port(),
        topology="colocated",
        api_key=API_KEY,
        stats_interval_s=0.5,
        log_requests=True,  # off by default, as vLLM
    )
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(served: ServerProcess):
    with httpx.Client(base_url=served.url, headers=AUTH, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def client(served: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def oracle():
    with LLM() as llm:
        yield llm


def offline(oracle: LLM, prompt: str, **params: object):
    return oracle.generate([prompt], SamplingParams(**params), use_tqdm=False)[0]


# ----- isolation: hypothesis over the request schema -----

odd = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([1e-45, 5e-324, 2**63, 2**64, -(2**63) - 1, 1e308, -0.0]),
    st.text(max_size=12),
    st.lists(st.integers(-3, 300), max_size=4),
    st.dictionaries(st.text(max_size=4), st.integers(-200, 200), max_size=3),
)
token_ids = st.lists(st.integers(0, VOCAB - 1), max_size=6)
# Values a client may well send: most bodies are served, so that generation itself is fuzzed.
plausible = {
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([1e-45, 1e-6, 1e-5])),
    "top_p": st.floats(0.01, 1),
    "top_k": st.one_of(st.just(-1), st.integers(1, 300)),
    "min_p": st.floats(0, 1),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "n": st.integers(1, 3),
    "max_tokens": st.integers(1, 8),
    "min_tokens": st.integers(0, 3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 3),
    "logit_bias": st.dictionaries(st.integers(0, VOCAB - 1).map(str), st.floats(-100, 100)),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3))),
    "stop_token_ids": st.one_of(token_ids, st.just(list(range(VOCAB)))),
    "ignore_eos": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "return_token_ids": st.booleans(),
    "echo": st.booleans(),
    "truncate_prompt_tokens": st.integers(-2, 12),
    "stream": st.booleans(),
    "model": st.just(SERVED_NAME),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "json_schema", "json_schema": {"schema": {"enum": ["a", "b"]}}},
        ]
    ),
    "structured_outputs": st.sampled_from(
        [{"regex": "[ab]{1,3}"}, {"choice": ["x", "yz"]}, {"json_object": True}, {"grammar": "("}]
    ),
    "guided_choice": st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=3),
}
fields = sorted(
    {
        *plausible,
        "best_of",
        "stream_options",
        "logprobs",
        "tools",
        "response_format",
        "unknown_x",
        "guided_regex",
        "guided_json",
        "tool_choice",
        "parallel_tool_calls",
    }
)


def with_odd_field(base: dict) -> st.SearchStrategy[dict]:
    """`base` as it is, or with one field set to an odd value."""
    return st.one_of(
        st.just(base),
        st.tuples(st.sampled_from(fields), odd).map(lambda kv: {**base, kv[0]: kv[1]}),
    )


prompts = st.one_of(
    st.text(max_size=40),
    token_ids,
    st.lists(st.text(max_size=10), min_size=1, max_size=3),
    st.lists(token_ids.filter(bool), min_size=1, max_size=3),
    st.lists(st.integers(-2, VOCAB + 2), max_size=6),
    odd,
)
turn = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=30)}
)
odd_turn = st.fixed_dictionaries(
    {"role": st.one_of(st.sampled_from(["user", "tool", ""]), odd)},
    optional={"content": st.one_of(st.text(max_size=30), odd)},
)
messages = st.one_of(
    st.lists(turn, min_size=1, max_size=3),
    st.lists(st.one_of(turn, odd_turn), max_size=3),
)
completion_bodies = st.fixed_dictionaries({"prompt": prompts}, optional=plausible).flatmap(
    with_odd_field
)
chat_bodies = st.fixed_dictionaries(
    {"messages": messages}, optional={**plausible, "logprobs": st.booleans()}
).flatmap(with_odd_field)
fuzz = settings(
    max_examples=60,
    deadline=None,
    derandomize=True,  # the same bodies every run: a failure is reproducible
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps writes NaN and Infinity (not JSON, but clients send them); httpx would refuse.
    headers = {"content-type": "application/json"}
    return http.post(path, content=json.dumps(body), headers=headers)


def check_answer(r: httpx.Response) -> None:
    """2xx, or a 4xx with an OpenAI-style error body; never a 5xx."""
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        error = r.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert error["type"] in ("invalid_request_error", "not_found_error"), error
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in r.text.splitlines() if line]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            assert "error" not in json.loads(event), event
    else:
        assert r.json()["choices"]


@fuzz
@example({"prompt": "hi", "temperature": 1e-45, "max_tokens": 2})  # issue 12: took it down
@example({"prompt": "hi", "seed": 2**64, "max_tokens": 2})
@example({"prompt": "hi", "seed": 2**63 - 1, "n": 2, "max_tokens": 2})
@example({"prompt": "hi", "top_k": 2**70, "max_tokens": 2})
@example({"prompt": "hi", "stop_token_ids": list(range(VOCAB)), "min_tokens": 3})
@example({"prompt": "hi", "logit_bias": {str(VOCAB): 5}})
@given(body=completion_bodies)
def test_fuzz_completions_never_take_the_server_down(http: httpx.Client, body: dict) -> None:
    check_answer(post(http, "/v1/completions", body))


@fuzz
@given(body=chat_bodies)
def test_fuzz_chat_never_takes_the_server_down(http: httpx.Client, body: dict) -> None:
    check_answer(post(http, "/v1/chat/completions", body))


def test_still_serving_after_the_fuzz(http: httpx.Client, oracle: LLM) -> None:
    assert http.get("/health").status_code == 200
    body = {"prompt": HELLO, "temperature": 0, "max_tokens": 8}
    want = offline(oracle, HELLO, temperature=0.0, max_tokens=8)
    assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == want.text


# ----- no field silently ignored -----

FEATURES = [
    {"presence_penalty": 2.0},
    {"frequency_penalty": 1.5},
    {"repetition_penalty": 1.8},
    {"min_p": 0.5, "temperature": 1.0, "seed": 3},
    {"top_k": 3, "temperature": 1.5, "seed": 4},
    {"logit_bias": "against the greedy tokens"},
]


@pytest.mark.parametrize("fields", FEATURES, ids=lambda f: next(iter(f)))
def test_sampling_fields_are_honoured(http: httpx.Client, oracle: LLM, fields: dict) -> None:
    """Over HTTP equals the offline engine with the same SamplingParams, and differs from the
    request without the field: the field reached the sampler."""
    base = {"temperature": 0.0, "max_tokens": 16, "ignore_eos": True}
    prompt = "aaaa abab aaaa"
    plain = offline(oracle, prompt, **base)
    params = {**base, **fields}
    if "logit_bias" in fields:  # push down what greedy picks without it, lift one other token
        params["logit_bias"] = {t: -100.0 for t in plain.token_ids[:3]} | {65: 3.0}
        fields = {"logit_bias": {str(t): v for t, v in params["logit_bias"].items()}}
    body = {"prompt": prompt, **base, **fields}
    got = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert got == offline(oracle, prompt, **params).text
    assert got != plain.text


def test_logit_bias_min_tokens_and_stop_token_ids(http: httpx.Client, oracle: LLM) -> None:
    forced = {"prompt": HELLO, "temperature": 0.0, "max_tokens": 5, "logit_bias": {"65": 100}}
    assert http.post("/v1/completions", json=forced).json()["choices"][0]["text"] == "AAAAA"

    first = offline(oracle, HELLO, temperature=0.0, max_tokens=1).token_ids[0]
    body = {"prompt": HELLO, "temperature": 0.0, "max_tokens": 6, "stop_token_ids": [first]}
    answer = http.post("/v1/completions", json=body).json()
    assert answer["usage"]["completion_tokens"] == 1
    assert answer["choices"][0]["finish_reason"] == "stop"
    answer = http.post("/v1/completions", json={**body, "min_tokens": 3}).json()
    assert answer["usage"]["completion_tokens"] >= 3


def test_best_of_returns_the_most_likely_candidates(http: httpx.Client, oracle: LLM) -> None:
    body = {"prompt": HELLO, "temperature": 1.0, "max_tokens": 6, "seed": 11, "ignore_eos": True}
    answer = http.post("/v1/completions", json={**body, "n": 2, "best_of": 4}).json()
    params = {k: v for k, v in body.items() if k != "prompt"}
    candidates = [
        offline(oracle, HELLO, **{**params, "seed": 11 + i}, logprobs=0) for i in range(4)
    ]
    ranked = sorted(candidates, key=lambda c: -cumulative_logprob(c.outputs[0]))
    assert [c["text"] for c in answer["choices"]] == [c.text for c in ranked[:2]]
    assert answer["usage"]["completion_tokens"] == 4 * 6  # every candidate was generated
    assert answer["choices"][0]["logprobs"] is None  # ranked with logprobs, not asked for them


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "response_format"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"max_tokens": 600}, "max_tokens"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"seed": 2**64}, "seed"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(
    http: httpx.Client, body: dict, param: str
) -> None:
    r = http.post("/v1/completions", json={"prompt": HELLO, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}},
        "required": ["ok", "color"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model=SERVED_NAME,
        messages=[{"role": "user", "content": "JSON please"}],
        n=3,
        seed=1,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    )
    for choice in answer.choices:
        value = json.loads(choice.message.content)
        assert isinstance(value["ok"], bool) and value["color"] in ("red", "green")
        assert set(value) == {"ok", "color"} and choice.finish_reason == "stop"


def test_detokenization_fields(http: httpx.Client, oracle: LLM) -> None:
    """vLLM's include_stop_str_in_output and skip_special_tokens reach the detokenizer: the
    text is the offline API's with the same fields, streamed or not."""
    greedy = {"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
    full = offline(oracle, HELLO, **greedy).text
    stop = next(
        full[i : i + 2]
        for i in range(1, len(full) - 1)
        if full[i : i + 2].isascii() and full[i : i + 2].isprintable()
    )
    eos = oracle.tokenizer.eos_token_id
    cases = [
        {"stop": [stop], "include_stop_str_in_output": True},
        {"stop": [stop], "include_stop_str_in_output": False},
        {"logit_bias": {eos: 100.0}, "skip_special_tokens": False},
        {"logit_bias": {eos: 100.0}, "skip_special_tokens": True},
    ]
    for fields in cases:
        expected = offline(oracle, HELLO, **greedy, **fields).text
        body = {
            "prompt": HELLO,
            **greedy,
            **fields,
            "logit_bias": {str(k): v for k, v in fields.get("logit_bias", {}).items()},
        }
        answer = http.post("/v1/completions", json=body).json()
        assert answer["choices"][0]["text"] == expected, fields
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == expected
    assert offline(oracle, HELLO, **greedy, **cases[0]).text.endswith(stop)
    assert "<|eos|>" in offline(oracle, HELLO, **greedy, **cases[2]).text


@pytest.mark.parametrize(
    ("field", "value", "constraint"),
    [
        ("structured_outputs", {"regex": "[ab]{2,4}!"}, {"regex": "[ab]{2,4}!"}),
        ("guided_regex", "[ab]{2,4}!", {"regex": "[ab]{2,4}!"}),
        ("structured_outputs", {"choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
        ("guided_choice", ["yes", "no"], {"choice": ["yes", "no"]}),
        ("guided_json", {"enum": ["red", "green"]}, {"json": {"enum": ["red", "green"]}}),
        ("structured_outputs", {"grammar": 'start: "a" "b"+'}, {"grammar": 'start: "a" "b"+'}),
    ],
)
def test_vllm_structured_output_fields(
    http: httpx.Client, oracle: LLM, field: str, value: object, constraint: dict
) -> None:
    """vLLM's structured_outputs and its older guided_* fields constrain the answer exactly as
    the offline StructuredOutputsParams does (greedy: the same text)."""
    body = {"prompt": HELLO, "temperature": 0.0, "max_tokens": 12, field: value}
    answer = http.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    params = StructuredOutputsParams(**constraint, tokenizer_dir=oracle.engine_config.model)
    expected = offline(oracle, HELLO, temperature=0.0, max_tokens=12, structured_outputs=params)
    (choice,) = answer.json()["choices"]
    assert choice["text"] == expected.text
    if "regex" in constraint:
        assert re.fullmatch(constraint["regex"], choice["text"])
    elif "choice" in constraint:
        assert choice["text"] in constraint["choice"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"structured_outputs": {"regex": "a", "frobnicate": 1}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs"),
        ({"guided_regex": "("}, "guided_regex"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
        ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"guided_regex": "a+", "ignore_eos": True}, "guided_regex"),
    ],
)
def test_bad_structured_output_fields_are_a_400_naming_the_field(
    http: httpx.Client, body: dict, param: str
) -> None:
    r = http.post("/v1/completions", json={"prompt": HELLO, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_unknown_fields_are_logged_by_name(http: httpx.Client, served: ServerProcess) -> None:
    body = {"prompt": HELLO, "max_tokens": 2, "frobnicate_level": 3, "user": "u1"}
    assert http.post("/v1/completions", json=body).status_code == 200
    wait_for_log(served, "frobnicate_level")
    assert "user" not in line_with(served, "frobnicate_level")  # known, cannot change the text


# ----- operational surface -----


def wait_for_log(served: ServerProcess, text: str, deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while text not in served.log():
        assert time.monotonic() < deadline, f"{text!r} not in the log:\n{served.log()}"
        time.sleep(0.1)


def line_with(served: ServerProcess, text: str) -> str:
    return next(line for line in served.log().splitlines() if text in line)


def test_api_key(served: ServerProcess, client: openai.OpenAI) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{served.url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(f"{served.url}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{served.url}/health").status_code == 200
    assert httpx.get(f"{served.url}/metrics").status_code == 200
    assert [m.id for m in client.models.list().data] == [SERVED_NAME]
    bad = openai.OpenAI(base_url=f"{served.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=SERVED_NAME, prompt="hi", max_tokens=1)


def test_tokenize_detokenize_version_and_model_card(http: httpx.Client, oracle: LLM) -> None:
    text = "héllo ✓"
    tokens = http.post("/tokenize", json={"prompt": text}).json()
    assert tokens["tokens"] == oracle.encode_prompt(text) and tokens["count"] == len(text.encode())
    assert tokens["max_model_len"] == oracle.engine.max_model_len
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == text
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = oracle.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat["tokens"] == oracle.encode_prompt(text)
    assert http.post("/detokenize", json={"tokens": [VOCAB]}).json()["error"]["param"] == "tokens"
    import afdserve

    assert http.get("/version").json() == {"version": afdserve.__version__}
    card = http.get(f"/v1/models/{SERVED_NAME}").json()
    assert card["id"] == SERVED_NAME and card["max_model_len"] == oracle.engine.max_model_len
    assert http.get("/v1/models/other").status_code == 404


def test_startup_summary_request_log_and_stats_line(
    http: httpx.Client, served: ServerProcess
) -> None:
    summary = line_with(served, "max concurrency")
    for part in (
        "afdserve 0.1.0",
        SERVED_NAME,
        "topology colocated",
        "dtype",
        "max_model_len 512",
        "KV cache",
        "tokens",
        "prefix caching on",
    ):
        assert part in summary, summary
    body = {"prompt": HELLO, "max_tokens": 64, "ignore_eos": True, "temperature": 0}
    answer = http.post("/v1/completions", json=body).json()
    request_id = answer["id"].removeprefix("cmpl-")
    wait_for_log(served, f"request {request_id} finished: 64 tokens")
    assert "completion, 1 prompt(s) of 12 tokens" in line_with(served, f"request {request_id}:")
    wait_for_log(served, "generation")
    stats = line_with(served, "tokens/s")
    assert "running" in stats and "waiting" in stats and "KV cache" in stats
    assert "prefix cache hit rate" in stats


def test_request_log_can_be_switched_off(oracle: LLM, caplog: pytest.LogCaptureFixture) -> None:
    from fastapi.testclient import TestClient

    from afdserve.server.serve import build_app

    caplog.set_level(logging.INFO, logger="afdserve.server")
    for enabled in (True, False):
        caplog.clear()
        options = ServeOptions(served_model_name=SERVED_NAME, log_requests=enabled)
        with TestClient(build_app(oracle, options)) as local:
            local.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        logged = [r for r in caplog.records if r.getMessage().startswith("request ")]
        assert bool(logged) == enabled


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["/no/such/model"], "model='/no/such/model': no such directory"),
        (["--topology", "2A3F"], "topology"),
        (["--max-num-seqs", "0"], "EngineConfig.max_num_seqs=0"),
        (["--topology", "2A1F", "--connector", "inprocess"], "AFDConfig.connector='inprocess'"),
        (["--control-plane", "nccl"], "AFDConfig.control_plane='nccl' is not allowed"),
        (["--generation-config", "/no/dir"], "generation_config='/no/dir'"),
        (["--chat-template", "missing.jinja"], "chat_template='missing.jinja'"),
    ],
)
def test_config_errors_are_one_line_before_anything_starts(args: list[str], message: str) -> None:
    port = str(free_port())
    proc = subprocess.run(
        [sys.executable, "-m", "afdserve.cli", "serve", *args, "--port", port],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and lines[0].startswith("afdserve: error:")
    assert "Traceback" not in proc.stderr and "listening" not in proc.stderr


def test_several_served_model_names(oracle: LLM) -> None:
    """vLLM's --served-model-name a b: a card for each, a request may name either, responses
    carry the first."""
    from fastapi.testclient import TestClient

    from afdserve.server.serve import build_app

    options = ServeOptions(served_model_name=("first", "second"))
    with TestClient(build_app(oracle, options)) as local:
        cards = local.get("/v1/models").json()["data"]
        assert [c["id"] for c in cards] == ["first", "second"]
        assert local.get("/v1/models/second").json()["id"] == "second"
        done = local.post(
            "/v1/completions", json={"model": "second", "prompt": "hi", "max_tokens": 2}
        )
        assert done.status_code == 200 and done.json()["model"] == "first"
        assert (
            local.post("/v1/completions", json={"model": "third", "prompt": "hi"}).status_code
            == 404
        )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--device", "cuda"], "device='cuda': this torch"),
        (["-tp", "2"], "AFDConfig.tensor_parallel_size=2 is not supported"),
        (["-dp", "2", "--topology", "1A1F"], "AFDConfig.data_parallel_size=2 is not allowed"),
        (["--graph-mode", "full", "--enforce-eager"], "GraphConfig.enforce_eager=True"),
    ],
)
def test_vllm_flag_errors_are_one_line_and_bind_no_port(args: list[str], message: str) -> None:
    """The port is held open by the test while the server starts: a server that tried to bind it
    would report the port in use instead, so the configuration error came first."""
    import torch

    if args[:2] == ["--device", "cuda"] and torch.cuda.is_available():
        pytest.skip("this machine has a GPU: --device cuda is valid here")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = str(held.getsockname()[1])
        proc = subprocess.run(
            [sys.executable, "-m", "afdserve.cli", "serve", *args, "--port", port],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("afdserve: error:"), proc.stderr
    assert message in lines[0] and "already in use" not in lines[0]


def test_engine_flags_reach_the_llm() -> None:
    from afdserve.cli import build_parser, llm_kwargs

    args = build_parser().parse_args(
        [
            "serve",
            "--topology",
            "1A1F",
            "--connector",
            "p2p",
            "--no-use-tqdm-on-load",
            "--control-plane",
            "shm",
        ]
    )
    kwargs = llm_kwargs(args)
    assert (kwargs["connector"], kwargs["use_tqdm_on_load"]) == ("p2p", False)
    assert kwargs["control_plane"] == "shm"
    assert llm_kwargs(build_parser().parse_args(["serve"]))["use_tqdm_on_load"] is True


def test_chat_template_replaces_the_tokenizers(oracle: LLM, tmp_path) -> None:
    from fastapi.testclient import TestClient

    from afdserve.cli import read_chat_template
    from afdserve.server.serve import build_app

    template = "{% for m in messages %}<{{ m.role }}:{{ m.content }}>{% endfor %}"
    path = tmp_path / "template.jinja"
    path.write_text(template)
    assert read_chat_template(str(path)) == read_chat_template(template) == template
    with pytest.raises(ValueError, match="chat_template='nofile.jinja': no such file"):
        read_chat_template("nofile.jinja")
    messages = [{"role": "user", "content": "hi"}]
    options = ServeOptions(served_model_name=SERVED_NAME, chat_template=template)
    with TestClient(build_app(oracle, options)) as local:
        tokens = local.post("/tokenize", json={"messages": messages}).json()["tokens"]
        assert tokens == oracle.encode_prompt("<user:hi>")
        body = {"messages": messages, "temperature": 0, "max_tokens": 4}
        answer = local.post("/v1/chat/completions", json=body).json()
    assert answer["usage"]["prompt_tokens"] == len("<user:hi>")
    want = offline(oracle, "<user:hi>", temperature=0.0, max_tokens=4)
    assert answer["choices"][0]["message"]["content"] == want.text


def test_generation_config_sets_the_defaults(oracle: LLM, tmp_path) -> None:
    from fastapi.testclient import TestClient

    from afdserve.server.serve import build_app

    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.0, "max_new_tokens": 3, "do_sample": False})
    )
    greedy = {
        n: offline(oracle, HELLO, temperature=0.0, max_tokens=n, ignore_eos=True).text
        for n in (3, 5)
    }
    body = {"prompt": HELLO, "ignore_eos": True}
    for source, tokens in ((str(tmp_path), 3), ("vllm", 16), ("auto", 16)):
        options = ServeOptions(served_model_name=SERVED_NAME, generation_config=source)
        with TestClient(build_app(oracle, options)) as local:
            answer = local.post("/v1/completions", json=body).json()
            assert answer["usage"]["completion_tokens"] == tokens, source
            if source == str(tmp_path):  # temperature 0 by default: greedy
                assert answer["choices"][0]["text"] == greedy[3]
                explicit = local.post("/v1/completions", json={**body, "max_tokens": 5}).json()
                assert explicit["choices"][0]["text"] == greedy[5]


# ----- tool calls: tool_choice "required" or a named function -----

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def streamed_calls(client: openai.OpenAI, **request: object) -> tuple[dict, str | None]:
    """Tool-call deltas put together as OpenAI's SDK users do: index -> name, arguments."""
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=SERVED_NAME, stream=True, **request):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    return calls, finish


def test_named_tool_choice_writes_the_functions_arguments(
    client: openai.OpenAI, oracle: LLM
) -> None:
    """The arguments are what the offline API writes under the function's parameter schema."""
    request = {
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0.0,
        "max_tokens": 40,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    answer = client.chat.completions.create(model=SERVED_NAME, **request)
    (choice,) = answer.choices
    params = StructuredOutputsParams(json=WEATHER, tokenizer_dir=oracle.engine_config.model)
    expected = oracle.chat(
        ASK,
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=params),
        use_tqdm=False,
    )[0]
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", expected.text)
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    assert choice.finish_reason == "stop" and choice.message.content is None
    calls, finish = streamed_calls(client, **request)
    assert calls == {0: {"name": "get_weather", "arguments": expected.text}} and finish == "stop"


def test_required_tool_choice_calls_one_of_the_tools(client: openai.OpenAI) -> None:
    request = {
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0.0,
        "max_tokens": 60,
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    (choice,) = client.chat.completions.create(model=SERVED_NAME, **request).choices
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert arguments["city"] in ("Paris", "Oslo")
    else:
        assert call.function.name == "get_time" and arguments["zone"] in ("UTC", "CET")
    assert choice.finish_reason == "tool_calls"
    calls, finish = streamed_calls(client, **request)
    assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}
    assert finish == "tool_calls"


def test_a_conversation_with_tool_turns_is_served(http: httpx.Client) -> None:
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    body = {"messages": messages, "tools": TOOLS, "tool_choice": "none", "max_tokens": 3}
    answer = http.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": TOOLS}, "tool_choice"),  # "auto" by default: needs a parser
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "none"}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_tool_requests_we_cannot_honour_are_a_400(
    http: httpx.Client, body: dict, param: str
) -> None:
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def auto_tools(tmp_path_factory: pytest.TempPathFactory):
    srv = start_server(
        tmp_path_factory.mktemp("auto-tools"),
        free_port(),
        topology="colocated",
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
    )
    try:
        srv.wait_healthy()
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60)
    finally:
        srv.stop()


def test_auto_tool_choice_reads_hermes_calls(auto_tools: openai.OpenAI) -> None:
    """A regex makes the tiny model write a preamble and one hermes call; the parser turns it
    into content and tool_calls, the same whole and streamed."""
    block = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    request = {
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0.0,
        "max_tokens": 120,
        "extra_body": {"structured_outputs": {"regex": re.escape("Checking." + block)}},
    }
    (choice,) = auto_tools.chat.completions.create(model=SERVED_NAME, **request).choices
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo"},
    )
    assert choice.message.content == "Checking." and choice.finish_reason == "tool_calls"
    calls, finish = streamed_calls(auto_tools, **request)
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}
    assert finish == "tool_calls"
    content = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in auto_tools.chat.completions.create(model=SERVED_NAME, stream=True, **request)
        if chunk.choices
    )
    assert content == "Checking."


def test_auto_tool_choice_without_a_call_is_a_plain_answer(
    auto_tools: openai.OpenAI, oracle: LLM
) -> None:
    request = {"messages": ASK, "tools": TOOLS, "temperature": 0.0, "max_tokens": 8}
    (choice,) = auto_tools.chat.completions.create(model=SERVED_NAME, **request).choices
    expected = oracle.chat(ASK, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert choice.message.content == expected[0].text and not choice.message.tool_calls


def sse_objects(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_return_token_ids(http: httpx.Client, oracle: LLM) -> None:
    """vLLM's return_token_ids: the prompt's ids and each choice's ids, which are the offline
    API's; streamed, the token ids add up and the prompt's come once."""
    greedy = {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True, "return_token_ids": True}
    prompts = [[72, 105, 33], [10, 20, 30, 40]]
    body = {"prompt": prompts, **greedy}
    answer = http.post("/v1/completions", json=body).json()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for choice, prompt in zip(answer["choices"], prompts, strict=True):
        expected = oracle.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        assert choice["prompt_token_ids"] == prompt
        assert choice["token_ids"] == expected.token_ids
    chunks = sse_objects(http, "/v1/completions", body)
    for index, prompt in enumerate(prompts):
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        mine = [c for c in choices if c["index"] == index]
        assert [c["prompt_token_ids"] for c in mine if "prompt_token_ids" in c] == [prompt]
        streamed = [t for c in mine for t in c["token_ids"]]
        assert streamed == answer["choices"][index]["token_ids"]

    chat = {"messages": ASK, **greedy}
    answer = http.post("/v1/chat/completions", json=chat).json()
    expected = oracle.chat(ASK, params, use_tqdm=False)[0]
    assert answer["prompt_token_ids"] == expected.prompt_token_ids
    assert answer["choices"][0]["token_ids"] == expected.token_ids
    chunks = sse_objects(http, "/v1/chat/completions", chat)
    assert [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c] == [
        expected.prompt_token_ids
    ]
    streamed = [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids", [])]
    assert streamed == expected.token_ids


def test_truncate_prompt_tokens(http: httpx.Client, oracle: LLM) -> None:
    """vLLM's truncate_prompt_tokens keeps the prompt's last tokens: the answer is the offline
    API's on that tail."""
    prompt = list(range(40, 60))
    greedy = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True, "return_token_ids": True}
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    answer = http.post(
        "/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": 5, **greedy}
    ).json()
    expected = oracle.generate([{"prompt_token_ids": prompt[-5:]}], params, use_tqdm=False)[0]
    (choice,) = answer["choices"]
    assert choice["prompt_token_ids"] == prompt[-5:] and answer["usage"]["prompt_tokens"] == 5
    assert choice["token_ids"] == expected.token_ids
    whole = http.post(
        "/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": -1, **greedy}
    ).json()
    assert whole["choices"][0]["prompt_token_ids"] == prompt
    chat = http.post(
        "/v1/chat/completions", json={"messages": ASK, "truncate_prompt_tokens": 3, **greedy}
    ).json()
    full = oracle.chat(ASK, params, use_tqdm=False)[0].prompt_token_ids
    assert chat["prompt_token_ids"] == full[-3:]
    for bad in (0, -2, 10**6):
        r = http.post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_continuous_usage_stats(http: httpx.Client) -> None:
    body = {
        "prompt": HELLO,
        "max_tokens": 6,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = sse_objects(http, "/v1/completions", body)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 6 and len(counts) == 6
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {len(HELLO)}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 6


def test_echo_puts_the_prompt_before_the_answer(http: httpx.Client, oracle: LLM) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True}
    expected = offline(oracle, HELLO, **greedy).text
    answer = http.post("/v1/completions", json={"prompt": HELLO, "echo": True, **greedy}).json()
    assert answer["choices"][0]["text"] == HELLO + expected
    prompts = [[72, 105], [79, 107, 33]]  # "Hi", "Ok!"
    body = {"prompt": prompts, "echo": True, "n": 2, **greedy}
    answer = http.post("/v1/completions", json=body).json()
    assert [
        c["text"][: len(p)]
        for c, p in zip(answer["choices"], ["Hi", "Hi", "Ok!", "Ok!"], strict=True)
    ] == ["Hi", "Hi", "Ok!", "Ok!"]
    texts = {i: "" for i in range(4)}
    for chunk in sse_objects(http, "/v1/completions", body):
        for c in chunk["choices"]:
            texts[c["index"]] += c["text"]
    assert [texts[i] for i in range(4)] == [c["text"] for c in answer["choices"]]
