"""vLLM's request fields that change the answer, over HTTP, each against its oracle:
chat_template_kwargs / add_generation_prompt / continue_final_message against transformers'
apply_chat_template on the same tokenizer and template; bad_words / allowed_token_ids against
transformers' greedy generation with its own logits processors on the same checkpoint;
return_tokens_as_token_ids against the choice's token ids; vLLM fields this server does not
implement are a 400 naming them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoTokenizer
from transformers.generation.logits_process import (
    LogitsProcessor,
    LogitsProcessorList,
    NoBadWordsLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
)

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.byte_tokenizer import PAD_TOKEN
from afdserve.server.options import ServeOptions
from afdserve.server.serve import build_app

PROMPT = [72, 101, 108, 108, 111, 44, 32]  # "Hello, "
NEW = 8
# A Qwen3-like template: enable_thinking=false writes an empty think block after the opening.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["qwen3_moe"]


@pytest.fixture(scope="module")
def llm(model_dir: Path):
    """The offline API's engine; the server gets its own (one thread drives an engine)."""
    with LLM(str(model_dir), dtype="float32") as engine:
        yield engine


@pytest.fixture(scope="module")
def http(model_dir: Path):
    options = ServeOptions(served_model_name="tiny", chat_template=TEMPLATE)
    with LLM(str(model_dir), dtype="float32") as served:
        with TestClient(build_app(served, options)) as client:
            yield client


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):
    return AutoTokenizer.from_pretrained(model_dir)


class OnOutput(LogitsProcessor):
    """A transformers processor over the generated tokens only (vLLM's bad_words look at the
    output, not the prompt)."""

    def __init__(self, inner: LogitsProcessor, prompt_len: int) -> None:
        self.inner, self.prompt_len = inner, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids[:, self.prompt_len :], scores)


@torch.inference_mode()
def hf_greedy(hf_model, hf_tokenizer, processors: list[LogitsProcessor]) -> list[int]:
    ids = torch.tensor([PROMPT])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=hf_tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        logits_processor=LogitsProcessorList(processors),
    )
    return out[0, len(PROMPT) :].tolist()


def complete(http: TestClient, **fields: object) -> dict:
    body = {
        "prompt": PROMPT,
        "max_tokens": NEW,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **fields,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_allowed_token_ids_match_transformers(http, hf_models, hf_tokenizer) -> None:
    allowed = [97, 98, 99, 100, 101, 32]  # "abcde "
    got = complete(http, allowed_token_ids=allowed)["token_ids"]
    prefix = PrefixConstrainedLogitsProcessor(lambda _batch, _ids: allowed, 1)
    assert got == hf_greedy(hf_models["qwen3_moe"], hf_tokenizer, [prefix])
    assert set(got) <= set(allowed)
    assert (
        http.post("/v1/completions", json={"prompt": PROMPT, "allowed_token_ids": [10**6]}).json()[
            "error"
        ]["param"]
        == "allowed_token_ids"
    )


def test_bad_words_match_transformers(http, hf_models, hf_tokenizer) -> None:
    plain = complete(http)["token_ids"]
    # A two-token word the greedy answer writes (text that tokenizes back to the same ids).
    word = next(
        text
        for i in range(1, len(plain) - 1)
        if (text := hf_tokenizer.decode(plain[i : i + 2])).strip() == text
        and hf_tokenizer.encode(text, add_special_tokens=False) == plain[i : i + 2]
    )
    single = hf_tokenizer.decode(plain[:1])
    got = complete(http, bad_words=[word, single])
    ids = [hf_tokenizer.encode(w, add_special_tokens=False) for w in (word, single)]
    ban = OnOutput(NoBadWordsLogitsProcessor(ids, eos_token_id=None), len(PROMPT))
    want = hf_greedy(hf_models["qwen3_moe"], hf_tokenizer, [ban])
    assert got["token_ids"] == want and word not in got["text"] and single not in got["text"]
    assert want != plain  # the ban changed the answer


def test_return_tokens_as_token_ids(http: TestClient) -> None:
    choice = complete(http, logprobs=2, return_tokens_as_token_ids=True)
    lp = choice["logprobs"]
    assert lp["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(
        len(top) == 2 and all(k.startswith("token_id:") for k in top) for top in lp["top_logprobs"]
    )
    body = {
        "messages": ASK,
        "max_tokens": 4,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 1,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
    }
    chat = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)


def chat_prompt_ids(http: TestClient, messages: list[dict], **fields: object) -> dict:
    body = {
        "messages": messages,
        "max_tokens": 3,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        **fields,
    }
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize(
    "switches",
    [
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"chat_template_kwargs": {"enable_thinking": True}},
        {"add_generation_prompt": False},
    ],
)
def test_chat_template_switches_match_transformers(
    http: TestClient, llm: LLM, hf_tokenizer, switches: dict
) -> None:
    answer = chat_prompt_ids(http, ASK, **switches)
    kwargs = {
        **switches.get("chat_template_kwargs", {}),
        "add_generation_prompt": switches.get("add_generation_prompt", True),
    }
    text = hf_tokenizer.apply_chat_template(ASK, chat_template=TEMPLATE, tokenize=False, **kwargs)
    assert answer["prompt_token_ids"] == hf_tokenizer.encode(text, add_special_tokens=False)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    offline = llm.chat(ASK, params, use_tqdm=False, chat_template=TEMPLATE, **switches)[0]
    assert offline.prompt_token_ids == answer["prompt_token_ids"]
    assert answer["choices"][0]["token_ids"] == offline.token_ids


def test_continue_final_message_matches_transformers(http: TestClient, hf_tokenizer) -> None:
    turns = [*ASK, {"role": "assistant", "content": "Sure, the"}]
    answer = chat_prompt_ids(http, turns, add_generation_prompt=False, continue_final_message=True)
    text = hf_tokenizer.apply_chat_template(
        turns, chat_template=TEMPLATE, tokenize=False, continue_final_message=True
    )
    assert text.endswith("Sure, the")
    assert answer["prompt_token_ids"] == hf_tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"continue_final_message": True}, "continue_final_message"),  # with the generation prompt
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
        ),  # the last message is the user's
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs"),
        ({"chat_template_kwargs": 3}, "chat_template_kwargs"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"bad_words": "ab"}, "bad_words"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(
    http: TestClient, fields: dict, param: str
) -> None:
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_offline_api_honours_the_fields(llm: LLM, hf_models, hf_tokenizer) -> None:
    """The same fields through SamplingParams: token ids only without text when detokenize is
    off, the prompt's tail with truncate_prompt_tokens, allowed ids as over HTTP."""
    allowed = [97, 98, 99]
    params = SamplingParams(
        max_tokens=NEW,
        temperature=0.0,
        ignore_eos=True,
        allowed_token_ids=allowed,
        detokenize=False,
    )
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    prefix = PrefixConstrainedLogitsProcessor(lambda _batch, _ids: allowed, 1)
    assert out.token_ids == hf_greedy(hf_models["qwen3_moe"], hf_tokenizer, [prefix])
    assert out.outputs[0].text == ""
    params = SamplingParams(max_tokens=2, temperature=0.0, truncate_prompt_tokens=3)
    (out,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert out.prompt_token_ids == PROMPT[-3:]


def test_echo_with_logprobs_gives_the_prompts_logprobs(http, hf_models, hf_tokenizer) -> None:
    """What lm-eval's loglikelihood reads: with echo and logprobs, the prompt's tokens and
    their logprobs (the first null) before the answer's, streamed the same."""
    body = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0.0, "echo": True, "logprobs": 1}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(PROMPT) + 1
    assert lp["tokens"][: len(PROMPT)] == [hf_tokenizer.decode([t]) for t in PROMPT]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    with torch.inference_mode():
        logits = hf_models["qwen3_moe"](torch.tensor([PROMPT])).logits[0]
    want = torch.log_softmax(logits.float(), dim=-1)
    expected = [float(want[i, t]) for i, t in enumerate(PROMPT[1:])]
    torch.testing.assert_close(lp["token_logprobs"][1 : len(PROMPT)], expected, atol=2e-4, rtol=0)
    for i, top in enumerate(lp["top_logprobs"][1 : len(PROMPT)]):
        assert list(top) == [hf_tokenizer.decode([int(want[i].argmax())])]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [t for c in chunks for t in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp["token_logprobs"]


def test_prompt_logprobs_field(http, llm: LLM) -> None:
    """vLLM's prompt_logprobs: per completions choice, once per chat response, as the offline
    API reports them."""
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0, "prompt_logprobs": 2}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    (offline,) = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    assert choice["prompt_logprobs"][0] is None
    for got, want in zip(choice["prompt_logprobs"][1:], offline.prompt_logprobs[1:], strict=True):
        assert {int(t): (v["rank"], v["decoded_token"]) for t, v in got.items()} == {
            t: (v.rank, v.decoded_token) for t, v in want.items()
        }
        assert max(abs(got[str(t)]["logprob"] - v) for t, v in want.items()) < 1e-5
    chat = http.post(
        "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, "prompt_logprobs": 0}
    ).json()
    assert chat["prompt_logprobs"][0] is None and "prompt_logprobs" not in chat["choices"][0]
    assert all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    r = http.post("/v1/completions", json={**body, "prompt_logprobs": 21})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_stop_reason(http: TestClient, llm: LLM) -> None:
    """vLLM's stop_reason in each choice: the stop token id or string that ended it."""
    plain = complete(http)
    token = plain["token_ids"][2]
    choice = complete(http, stop_token_ids=[token])
    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", token)
    assert plain["stop_reason"] is None
    body = {"messages": ASK, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    answer = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    text = answer["message"]["content"][1:3]
    stopped = http.post("/v1/chat/completions", json={**body, "stop": [text]}).json()
    assert stopped["choices"][0]["stop_reason"] == text


def test_reasoning_parser_over_http(model_dir: Path) -> None:
    """--reasoning-parser deepseek_r1 on the tiny model: whatever it writes, the message's
    reasoning_content and content are the parser's split of the plain answer, and the streamed
    deltas add up to them."""
    from afdserve.server.reasoning import split_reasoning

    body = {"messages": ASK, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
    with LLM(str(model_dir), dtype="float32") as served:
        plain_app = build_app(served, ServeOptions(served_model_name="tiny"))
        with TestClient(plain_app) as plain:
            text = plain.post("/v1/chat/completions", json=body).json()["choices"][0]
        options = ServeOptions(served_model_name="tiny", reasoning_parser="deepseek_r1")
        with TestClient(build_app(served, options)) as http:
            message = http.post("/v1/chat/completions", json=body).json()["choices"][0]
            with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
                deltas = [
                    json.loads(line[6:])["choices"][0]["delta"]
                    for line in r.iter_lines()
                    if line.startswith("data: {")
                ]
    thinking, content = split_reasoning(text["message"]["content"], "deepseek_r1")
    assert thinking  # no </think> from a random model: all of it is reasoning (R1's rule)
    assert message["message"]["reasoning_content"] == thinking
    assert message["message"]["content"] == content
    assert "".join(d.get("reasoning_content", "") for d in deltas) == thinking
    assert "".join(d.get("content", "") for d in deltas) == content


def test_responses_api_with_the_openai_client(model_dir: Path, llm: LLM) -> None:
    """/v1/responses through the official client (a real uvicorn server, in a thread): the
    output text is the chat answer to the same conversation, whole and streamed."""
    import threading

    import openai
    import uvicorn

    from .conftest import free_port

    port = free_port()
    with LLM(str(model_dir), dtype="float32") as served:
        app = build_app(served, ServeOptions(served_model_name="tiny"))
        server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            while not server.started:
                thread.join(0.05)
            client = openai.OpenAI(
                base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0
            )
            kwargs = {
                "model": "tiny",
                "instructions": "Be brief.",
                "input": "hi",
                "max_output_tokens": 6,
                "temperature": 0.0,
            }
            whole = client.responses.create(**kwargs)
            events = list(client.responses.create(**kwargs, stream=True))
            with pytest.raises(openai.BadRequestError, match="previous_response_id"):
                client.responses.create(**kwargs, previous_response_id="resp_1")
        finally:
            server.should_exit = True
            thread.join(30)
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    want = llm.chat(turns, params, use_tqdm=False)[0]
    assert whole.output_text == want.outputs[0].text
    assert whole.status == ("incomplete" if want.finish_reason == "length" else "completed")
    assert whole.usage.output_tokens == len(want.token_ids)
    assert whole.usage.input_tokens == len(want.prompt_token_ids)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert events[0].type == "response.created" and events[-1].response.output_text == deltas


def scrape(http: TestClient) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(http.get("/metrics").text)
    return {s.name: s.value for f in families for s in f.samples if "le" not in s.labels}


def test_vllm_dashboard_metrics(http: TestClient) -> None:
    """The per-request histograms vLLM's Grafana dashboard reads, against the requests sent:
    two choices of 5 tokens (max_tokens 5) on a prompt of len(PROMPT) tokens."""
    before = scrape(http)
    body = {"prompt": PROMPT, "max_tokens": 5, "n": 2, "temperature": 1.0, "ignore_eos": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    after = scrape(http)

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vllm:request_prompt_tokens_count") == 2
    assert grew("vllm:request_prompt_tokens_sum") == 2 * len(PROMPT)
    assert grew("vllm:request_generation_tokens_sum") == 10
    assert grew("vllm:request_max_num_generation_tokens_sum") == 10
    assert grew("vllm:request_prefill_time_seconds_count") == 2
    assert grew("vllm:request_decode_time_seconds_count") == 2
    assert after["vllm:gpu_cache_usage_perc"] == after["vllm:kv_cache_usage_perc"]
    assert after["process_cpu_seconds_total"] > 0
