"""Many streams at once, served with the engine core in the server's process and in a process of
its own (--engine-process): each stream's chunks, in the order they came, add up to the offline
engine's output for its prompt, and end with the finish reason, then the usage, then [DONE]."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from afdserve import LLM, SamplingParams
from afdserve.frontend.process import ProcessClient
from afdserve.frontend.single_process import SingleProcessClient
from afdserve.server.serve import build_app

MAX_TOKENS = 6
# Prompts of different lengths, so that prefill chunks and decodes share steps.
PROMPTS = [[(7 * i + j) % 250 + 1 for j in range(2 + i % 9)] for i in range(24)]


@pytest.fixture(scope="module")
def offline() -> list[tuple[str, list[int], str]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM() as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.outputs[0].text, list(o.outputs[0].token_ids), o.finish_reason) for o in outs]


def stream(http: TestClient, prompt: list[int]) -> list[dict]:
    body = {
        "model": "afdserve-tiny",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    events = []
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append({"done": True} if data == "[DONE]" else json.loads(data))
    return events


@pytest.mark.parametrize(
    ("engine_process", "client_type"), [("off", SingleProcessClient), ("on", ProcessClient)]
)
def test_concurrent_streams_equal_the_offline_engine(
    offline: list, engine_process: str, client_type: type
) -> None:
    with LLM(engine_process=engine_process) as llm, TestClient(build_app(llm)) as http:
        assert isinstance(llm.engine.core_client, client_type)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            streams = list(pool.map(lambda p: stream(http, p), PROMPTS))
    for events, (text, token_ids, reason) in zip(streams, offline, strict=True):
        assert events[-1] == {"done": True}
        usage, chunks = events[-2], events[:-2]
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == MAX_TOKENS
        choices = [c["choices"][0] for c in chunks]
        assert "".join(c["text"] for c in choices) == text
        assert [t for c in choices for t in c.get("token_ids") or ()] == token_ids
        assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + [reason]
