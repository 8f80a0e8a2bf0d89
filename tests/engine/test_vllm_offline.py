"""What a script ported from vLLM's offline API reads: stop_reason, Logprob objects, metrics,
get_tokenizer(), SamplingParams' detokenize / output_kind / truncate_prompt_tokens, and a clear
error at LLM.encode (vLLM's pooling call); on the bundled tiny model, colocated. The oracle for
each run is the same engine's plain greedy answer."""

from __future__ import annotations

import pytest

from afdserve import LLM, SamplingParams
from afdserve.engine.logprobs import Logprob
from afdserve.engine.sampling_params import RequestOutputKind

PROMPT = "Hello, world"
GREEDY = {"temperature": 0.0, "max_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:
        yield llm


def one(llm: LLM, **params):
    return llm.generate(PROMPT, SamplingParams(**params), use_tqdm=False)[0]


def test_stop_reason_names_what_ended_the_choice(llm: LLM) -> None:
    plain = one(llm, **GREEDY).outputs[0]
    assert plain.finish_reason == "length" and plain.stop_reason is None
    token = plain.token_ids[3]
    by_token = one(llm, **GREEDY, stop_token_ids=[token]).outputs[0]
    first = plain.token_ids.index(token)
    assert by_token.token_ids == plain.token_ids[: first + 1]
    assert (by_token.finish_reason, by_token.stop_reason) == ("stop", token)
    text = plain.text[4:6]
    by_string = one(llm, **GREEDY, stop=["\x00never", text]).outputs[0]
    assert (by_string.finish_reason, by_string.stop_reason) == ("stop", text)
    assert by_string.text == plain.text[: plain.text.index(text)]


def test_logprobs_are_vllms_logprob_objects(llm: LLM) -> None:
    choice = one(llm, **GREEDY, logprobs=2).outputs[0]
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.tokenizer
    for token, entry in zip(choice.token_ids, choice.logprobs, strict=True):
        assert all(isinstance(v, Logprob) for v in entry.values())
        best = sorted(entry.items(), key=lambda kv: -kv[1].logprob)
        assert entry[token].rank == 1  # greedy: the sampled token is the most likely
        assert [v.rank for _, v in best[:2]] == [1, 2]
        assert all(v.decoded_token == tokenizer.decode([t]) for t, v in entry.items())


def test_metrics(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(**GREEDY, n=2, seed=1), use_tqdm=False)[0]
    metrics = out.metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time <= metrics.first_token_time
    assert metrics.time_in_queue == metrics.first_scheduled_time - metrics.arrival_time
    assert metrics.num_generation_tokens == sum(len(c.token_ids) for c in out.outputs) == 24


def test_detokenize_output_kind_and_truncation(llm: LLM) -> None:
    plain = one(llm, **GREEDY)
    silent = one(llm, **GREEDY, detokenize=False)
    assert silent.token_ids == plain.token_ids and silent.outputs[0].text == ""
    with pytest.raises(ValueError, match="SamplingParams.detokenize=False: must be True when"):
        SamplingParams(detokenize=False, stop=["x"])
    # The offline API returns each request once, finished, whatever the kind (vLLM's rule).
    for kind in RequestOutputKind:
        assert one(llm, **GREEDY, output_kind=kind).token_ids == plain.token_ids
    tail = one(llm, **GREEDY, truncate_prompt_tokens=5)
    assert tail.prompt_token_ids == llm.encode_prompt(PROMPT)[-5:]
    assert (
        tail.token_ids
        == llm.generate(
            {"prompt_token_ids": tail.prompt_token_ids}, SamplingParams(**GREEDY), use_tqdm=False
        )[0].token_ids
    )
    with pytest.raises(ValueError, match="truncate_prompt_tokens=100000: must be -1 or at most"):
        one(llm, **GREEDY, truncate_prompt_tokens=100000)


def test_encode_points_to_encode_prompt(llm: LLM) -> None:
    with pytest.raises(NotImplementedError, match=r"LLM.encode_prompt\(prompt\)"):
        llm.encode(PROMPT)
    assert llm.encode_prompt(PROMPT) == llm.tokenizer.encode(PROMPT, add_special_tokens=False)
