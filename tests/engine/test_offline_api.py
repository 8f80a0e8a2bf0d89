"""The offline API in vLLM's shape: RequestOutput.outputs[i] (CompletionOutput), n and best_of,
dict prompts, LLM.chat, the progress bar; on the bundled tiny model, colocated."""

from __future__ import annotations

import pytest

from afdserve import LLM, CompletionOutput, RequestOutput, SamplingParams
from afdserve.frontend.outputs import cumulative_logprob

HELLO = "Hello, world"
SAMPLED = {"temperature": 1.0, "max_tokens": 6, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm():
    with LLM() as llm:
        yield llm


def one(llm: LLM, prompt, **params) -> RequestOutput:
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def test_outputs_have_vllms_shape(llm: LLM) -> None:
    out = one(llm, HELLO, temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
    assert isinstance(out, RequestOutput) and out.finished and out.prompt == HELLO
    assert out.prompt_token_ids == list(HELLO.encode())
    (choice,) = out.outputs
    assert isinstance(choice, CompletionOutput) and choice.index == 0
    assert len(choice.token_ids) == 4 and choice.finish_reason in ("stop", "length")
    assert choice.text == llm.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert len(choice.logprobs) == 4
    assert choice.cumulative_logprob == pytest.approx(
        sum(entry[t] for t, entry in zip(choice.token_ids, choice.logprobs))
    )
    # The flat fields of afdserve 0.1 read the first choice.
    assert (out.text, out.token_ids, out.finish_reason) == (
        choice.text,
        choice.token_ids,
        choice.finish_reason,
    )
    assert one(llm, HELLO, temperature=0.0, max_tokens=1).outputs[0].logprobs is None


def test_n_choices_are_the_seeded_samples(llm: LLM) -> None:
    out = one(llm, HELLO, n=3, seed=5, **SAMPLED)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    alone = [one(llm, HELLO, seed=5 + i, **SAMPLED).text for i in range(3)]
    assert [c.text for c in out.outputs] == alone
    assert len(set(alone)) == 3
    wrapped = one(llm, HELLO, n=2, seed=2**63 - 1, **SAMPLED)  # seed + 1 wraps to -2**63
    assert wrapped.outputs[1].text == one(llm, HELLO, seed=-(2**63), **SAMPLED).text


def test_best_of_keeps_the_most_likely_candidates(llm: LLM) -> None:
    out = one(llm, HELLO, n=2, best_of=5, seed=9, **SAMPLED)
    assert len(out.candidates) == 5 and len(out.outputs) == 2
    alone = [one(llm, HELLO, seed=9 + i, logprobs=0, **SAMPLED) for i in range(5)]
    scores = sorted((-cumulative_logprob(a.candidates[0]), a.text) for a in alone)
    assert [c.text for c in out.outputs] == [text for _, text in scores[:2]]
    assert out.outputs[0].cumulative_logprob >= out.outputs[1].cumulative_logprob
    assert out.outputs[0].logprobs is None  # ranked with logprobs, not asked for them


def test_dict_prompts(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=5)
    ids = [72, 105, 33]
    outs = llm.generate(
        [{"prompt_token_ids": ids}, {"prompt": HELLO}, ids, HELLO], params, use_tqdm=False
    )
    assert outs[0].token_ids == outs[2].token_ids and outs[0].prompt is None
    assert outs[1].token_ids == outs[3].token_ids and outs[1].prompt == HELLO
    with pytest.raises(ValueError, match="prompt: a dict prompt"):
        llm.generate({"prompt_token_ids": ids, "multi_modal_data": {}}, params)


def test_chat_renders_the_template(llm: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    (got,) = llm.chat(messages, params, use_tqdm=False)
    assert got.prompt == text
    assert got.token_ids == one(llm, text, temperature=0.0, max_tokens=6).token_ids
    two = llm.chat([messages, messages[1:]], params, use_tqdm=False)
    assert two[0].token_ids == got.token_ids and len(two) == 2


def test_progress_bar(llm: LLM, capsys: pytest.CaptureFixture) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=2)
    llm.generate(["a", "b", "c"], params, use_tqdm=True)
    assert "Processed prompts" in capsys.readouterr().err
    llm.generate(["a", "b", "c"], params, use_tqdm=False)
    assert "Processed prompts" not in capsys.readouterr().err


def test_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    vocab = llm.engine.vocab_size
    for field, value in (("logit_bias", {vocab: 1.0}), ("stop_token_ids", [vocab + 7])):
        with pytest.raises(ValueError, match=f"{field}: token id"):
            llm.generate("hi", SamplingParams(**{field: value}), use_tqdm=False)
    assert one(llm, "hi", temperature=0.0, max_tokens=2).finished  # the engine is untouched


def test_min_tokens_holds_back_stop_tokens(llm: LLM) -> None:
    first = one(llm, HELLO, temperature=0.0, max_tokens=1).token_ids[0]
    stopped = one(llm, HELLO, temperature=0.0, max_tokens=8, stop_token_ids=[first])
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop"
    held = one(llm, HELLO, temperature=0.0, max_tokens=8, stop_token_ids=[first], min_tokens=4)
    assert len(held.token_ids) >= 4 and first not in held.token_ids[:4]
