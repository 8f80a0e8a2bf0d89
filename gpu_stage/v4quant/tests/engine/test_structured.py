"""Structured output through llguidance on the bundled tiny model: whatever the random weights
prefer, the output parses and conforms (the oracle is the schema itself)."""

from __future__ import annotations

import json
import re

import pytest

from afdserve import LLM, SamplingParams, StructuredOutputsParams

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "color", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:
        yield llm


def generate(llm: LLM, structured: StructuredOutputsParams, n: int = 4, **params: object):
    params = {"temperature": 1.0, "seed": 0, "max_tokens": 64, "n": n, **params}
    sampling = SamplingParams(structured_outputs=structured, **params)
    return llm.generate("Answer in JSON:", sampling, use_tqdm=False)[0].outputs


def test_json_schema_is_followed(llm: LLM) -> None:
    for choice in generate(llm, StructuredOutputsParams(json=SCHEMA)):
        value = json.loads(choice.text)
        assert set(value) == {"ok", "color", "count"}
        assert isinstance(value["ok"], bool) and value["color"] in ("red", "green", "blue")
        assert isinstance(value["count"], int) and 0 <= value["count"] <= 99
        assert choice.finish_reason == "stop"  # the grammar ended it with EOS


def test_json_object_regex_and_choice(llm: LLM) -> None:
    objects = generate(llm, StructuredOutputsParams(json_object=True), max_tokens=128)
    finished = [c for c in objects if c.finish_reason == "stop"]  # others may still be growing
    assert finished and all(isinstance(json.loads(c.text), dict) for c in finished)
    for choice in generate(llm, StructuredOutputsParams(regex=r"[a-c]{2}-[0-9]{3}")):
        assert re.fullmatch(r"[a-c]{2}-[0-9]{3}", choice.text), choice.text
    for choice in generate(llm, StructuredOutputsParams(choice=["yes", "no", "mañana"])):
        assert choice.text in ("yes", "no", "mañana")
    greedy = generate(llm, StructuredOutputsParams(choice=["yes", "no"]), n=1, temperature=0.0)
    assert greedy[0].text in ("yes", "no")


def test_bad_grammars_and_combinations_are_refused(llm: LLM) -> None:
    with pytest.raises(ValueError, match="does not compile"):
        generate(llm, StructuredOutputsParams(json={"type": "nonsense"}))
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json=SCHEMA, regex="a")
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs"):
        SamplingParams(structured_outputs=StructuredOutputsParams(regex="a"), ignore_eos=True)


def test_a_grammar_the_rank_cannot_run_refuses_only_that_request(llm: LLM) -> None:
    """A tokenizer directory the rank cannot read fails that request at admission, as a
    RequestError; the engine keeps serving."""
    from afdserve.engine.requests import RequestError

    broken = StructuredOutputsParams(choice=["yes"], tokenizer_dir="/no/such/tokenizer")
    with pytest.raises(RequestError, match="structured_outputs: this rank cannot run"):
        llm.engine.add_request("broken", [1, 2, 3], SamplingParams(structured_outputs=broken))
    assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].finished
