"""No error a client sees names a server path or an internal repr: every 400 of the output
constraints (response_format, tool_choice, structured_outputs, guided_*) combined with what they
cannot be, and bad constraints themselves, against the in-process app with the bundled model.
The oracle for "leaks nothing" is the server's own paths (its model and tokenizer directory)
and the shape of a dataclass repr."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from afdserve import LLM
from afdserve.server.options import ServeOptions
from afdserve.server.serve import build_app

from .conftest import SERVED_NAME

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": SCHEMA}}]
CHAT = [{"role": "user", "content": "hi"}]
# A repr of a dataclass or an object: Name(field=...) or <... object at 0x...>.
REPR = re.compile(r"\b[A-Z]\w*\(\w+=|object at 0x|tokenizer_dir")


@pytest.fixture(scope="module")
def http() -> Iterator[tuple[TestClient, str]]:
    with LLM() as llm:
        app = build_app(llm, ServeOptions(served_model_name=SERVED_NAME))
        with TestClient(app) as client:
            yield client, llm.engine_config.model


CASES = {
    "response_format + ignore_eos": (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "ignore_eos": True,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA},
            },
        },
        "response_format",
    ),
    "response_format + min_tokens": (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "min_tokens": 2,
            "response_format": {"type": "json_object"},
        },
        "response_format",
    ),
    "tool_choice + ignore_eos": (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "tools": TOOLS,
            "ignore_eos": True,
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
        "tool_choice",
    ),
    "tool_choice + min_tokens": (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "tools": TOOLS,
            "min_tokens": 1,
            "tool_choice": "required",
        },
        "tool_choice",
    ),
    "structured_outputs + ignore_eos": (
        "/v1/completions",
        {
            "prompt": "hi",
            "ignore_eos": True,
            "structured_outputs": {"regex": "a+"},
        },
        "structured_outputs",
    ),
    "guided_json + min_tokens": (
        "/v1/completions",
        {
            "prompt": "hi",
            "min_tokens": 1,
            "guided_json": SCHEMA,
        },
        "guided_json",
    ),
    "a regex that does not compile": (
        "/v1/completions",
        {
            "prompt": "hi",
            "structured_outputs": {"regex": "(("},
        },
        "structured_outputs",
    ),
    "a schema that is not a schema": (
        "/v1/completions",
        {
            "prompt": "hi",
            "guided_json": {"type": 17},
        },
        "guided_json",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_constraint_errors_name_the_field_and_no_server_detail(http, case):
    client, model_dir = http
    path, body, param = CASES[case]
    r = client.post(path, json={"model": SERVED_NAME, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(param + ":"), error
    assert model_dir not in r.text and "/root" not in r.text and "/tmp" not in r.text, r.text
    assert not REPR.search(error["message"]), error["message"]
    if "+" in case:
        assert error["message"] == f"{param}: cannot be combined with ignore_eos or min_tokens"
