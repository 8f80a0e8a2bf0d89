"""The colocated engine through the offline API: scheduling never changes greedy tokens (token
budget, preemption, late arrivals), stopping rules, seeded sampling, and requests the engine refuses
while it keeps serving the others."""

from __future__ import annotations

import os
import time

import pytest

from afdserve import LLM, SamplingParams
from afdserve.engine.requests import RequestError
from afdserve.frontend.outputs import SequenceOutput
from afdserve.model.fixtures.byte_tokenizer import EOS_TOKEN, VOCAB_SIZE

NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
PROMPTS: list[str | list[int]] = [
    "Hello, world",
    [3],
    list(range(100, 137)),
    "The quick brown fox jumps over the lazy dog.",
    [250, 251, 252, 253],
    "héllo wörld ✓",
    list(range(0, 256, 9)),
    "ab",
]


def token_ids(prompt: str | list[int]) -> list[int]:
    # The byte tokenizer: token b is byte b.
    return list(prompt.encode()) if isinstance(prompt, str) else prompt


def run(llm: LLM, prompts: list, params: SamplingParams, late: dict[int, int] | None = None):
    """Drives `llm.engine` step by step. `late[i] = s` adds prompt i only after step s. Returns
    the finished outputs in prompt order and how many sequences were preempted on the way (a
    sequence that ran and is found back in the waiting queue)."""
    late = late or {}
    engine, scheduler = llm.engine, llm.engine.core_client.core.scheduler
    done: dict[str, SequenceOutput] = {}
    streamed: dict[str, tuple[list[int], str]] = {}
    seen_running: set[str] = set()
    preempted: set[str] = set()
    step = 0
    while len(done) < len(prompts):
        for i, prompt in enumerate(prompts):
            if late.get(i, 0) == step:
                engine.add_request(f"req-{i}", token_ids(prompt), params)
        for out in engine.step():
            assert out.request_id not in done
            tokens, text = streamed.get(out.request_id, ([], ""))
            streamed[out.request_id] = (tokens + out.new_token_ids, text + out.new_text)
            if out.finished:
                done[out.request_id] = out
        seen_running |= {seq.request_id for seq in scheduler.running}
        preempted |= {seq.request_id for seq in scheduler.waiting} & seen_running
        step += 1
        assert step < 10_000
    assert not engine.has_unfinished
    # The streamed pieces add up to the final output.
    for request_id, out in done.items():
        assert streamed[request_id] == (out.token_ids, out.text)
    return [done[f"req-{i}"] for i in range(len(prompts))], len(preempted)


@pytest.fixture(scope="module", params=["deepseek_v2", "qwen3_moe-hash"])
def model_dir(request: pytest.FixtureRequest, tiny_models: dict, hash_models: dict) -> str:
    """An MLA family, and a GQA family with a hash-routed layer (token ids travel to the FFN)."""
    family, _, variant = request.param.partition("-")
    return str((hash_models if variant else tiny_models)[family])


@pytest.fixture(scope="module")
def llm(model_dir: str) -> LLM:
    return LLM(model_dir, dtype="float32", max_model_len=128)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    """Greedy tokens of every prompt, all batched in one generate call with a roomy engine."""
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(out.token_ids) == NEW_TOKENS for out in outs)
    return [out.token_ids for out in outs]


@pytest.mark.parametrize("budget", [4, 16, 4096])
def test_greedy_tokens_do_not_depend_on_the_token_budget(
    budget: int, model_dir: str, reference: list
) -> None:
    llm = LLM(model_dir, dtype="float32", max_num_batched_tokens=budget, max_num_seqs=5)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [out.token_ids for out in outs] == reference
    assert all(out.finish_reason == "length" for out in outs)


def test_preemption_by_recompute_keeps_greedy_tokens(model_dir: str, reference: list) -> None:
    block_size, blocks = 4, 24
    llm = LLM(model_dir, dtype="float32", kv_cache_blocks=blocks, block_size=block_size)
    needed = sum(-(-(len(token_ids(p)) + NEW_TOKENS) // block_size) for p in PROMPTS)
    assert needed > 2 * blocks  # far from fitting all at once
    outs, preempted = run(llm, PROMPTS, GREEDY)
    assert preempted > 0
    assert [out.token_ids for out in outs] == reference
    assert llm.engine.core_client.core.block_manager.num_free_blocks == blocks


def test_requests_added_while_others_run(llm: LLM, reference: list) -> None:
    late = {0: 0, 1: 0, 2: 3, 3: 3, 4: 7, 5: 20, 6: 21, 7: 40}
    outs, _ = run(llm, PROMPTS, GREEDY, late=late)
    assert [out.token_ids for out in outs] == reference


def test_string_and_token_id_prompts_agree(llm: LLM, reference: list) -> None:
    text, ids = "The quick brown fox", list(b"The quick brown fox")
    by_text, by_ids = llm.generate([text, ids], GREEDY)
    assert by_text.prompt_token_ids == ids and by_ids.prompt_token_ids == ids
    assert by_text.token_ids == by_ids.token_ids and by_text.text == by_ids.text
    (single,) = llm.generate(PROMPTS[3], GREEDY)  # one prompt, not in a list
    assert single.token_ids == reference[3]


def test_text_is_the_decoded_tokens(llm: LLM, reference: list) -> None:
    outs = llm.generate(PROMPTS, GREEDY)
    for out, want in zip(outs, reference, strict=True):
        assert out.token_ids == want
        assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_max_tokens_finishes_with_length(llm: LLM, reference: list) -> None:
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    for out, want in zip(outs, reference, strict=True):
        assert out.token_ids == want[:5] and out.finish_reason == "length"


def test_max_model_len_finishes_with_length(model_dir: str, reference: list) -> None:
    llm = LLM(model_dir, dtype="float32", max_model_len=40)
    (out,) = llm.generate([PROMPTS[2]], GREEDY)  # 37 prompt tokens
    assert out.token_ids == reference[2][:3] and out.finish_reason == "length"


def test_stop_token_ids(llm: LLM, reference: list) -> None:
    for index, want in enumerate(reference):
        stop = want[6]
        cut = want.index(stop) + 1
        params = SamplingParams(
            max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, stop_token_ids=[stop]
        )
        (out,) = llm.generate([PROMPTS[index]], params)
        assert out.token_ids == want[:cut] and out.finish_reason == "stop"


def ascii_stop(text: str) -> str | None:
    """A two-character printable ASCII piece of `text` that starts after its first character."""
    for start in range(1, len(text) - 1):
        piece = text[start : start + 2]
        if piece.isascii() and piece.isprintable():
            return piece
    return None


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_truncate_text(llm: LLM, reference: list, include: bool) -> None:
    """The text ends before the stop string, or with it (vLLM's include_stop_str_in_output)."""
    checked = 0
    for prompt, want in zip(PROMPTS, reference, strict=True):
        full = llm.tokenizer.decode(want, skip_special_tokens=True)
        stop = ascii_stop(full)
        if stop is None:
            continue
        params = SamplingParams(
            max_tokens=NEW_TOKENS,
            temperature=0.0,
            stop=["\x00\x01", stop],
            include_stop_str_in_output=include,
        )
        (out,) = llm.generate([prompt], params)
        assert out.finish_reason == "stop"
        assert out.text == full[: full.index(stop) + (len(stop) if include else 0)]
        # Generation stops at the token that completes the stop string.
        assert want[: len(out.token_ids)] == out.token_ids
        assert stop in llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert stop not in llm.tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
        checked += 1
    assert checked >= 4


def test_stop_string_completed_by_the_last_allowed_token(llm: LLM, reference: list) -> None:
    checked = 0
    for prompt, want in zip(PROMPTS, reference, strict=True):
        stop = ascii_stop(llm.tokenizer.decode(want, skip_special_tokens=True))
        if stop is None:
            continue
        last = next(
            n
            for n in range(1, NEW_TOKENS + 1)
            if stop in llm.tokenizer.decode(want[:n], skip_special_tokens=True)
        )
        params = SamplingParams(max_tokens=last, temperature=0.0, ignore_eos=True, stop=stop)
        (out,) = llm.generate([prompt], params)
        assert out.token_ids == want[:last]
        assert out.finish_reason == "stop" and stop not in out.text
        checked += 1
    assert checked >= 4


def test_stop_strings_stream_through_the_engine(llm: LLM, reference: list) -> None:
    stops = [ascii_stop(llm.tokenizer.decode(want, skip_special_tokens=True)) for want in reference]
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, stop=[s for s in stops if s]
    )
    outs, _ = run(llm, PROMPTS, params, late={5: 2, 6: 4})
    for out, want in zip(outs, reference, strict=True):
        full = llm.tokenizer.decode(want, skip_special_tokens=True)
        assert want[: len(out.token_ids)] == out.token_ids
        if out.finish_reason == "stop":
            assert full.startswith(out.text) and any(
                full[len(out.text) :].startswith(s) for s in params.stop
            )
        else:
            assert out.text == full and not any(s in full for s in params.stop)


def test_seeded_sampling_ignores_scheduling(llm: LLM, model_dir: str) -> None:
    # Each token is sampled once, from its own request's generator: chunking, preemption and
    # arrival order change nothing.
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, seed=5)
    want = [out.token_ids for out in llm.generate(PROMPTS, params)]
    small = LLM(
        model_dir, dtype="float32", kv_cache_blocks=20, block_size=4, max_num_batched_tokens=7
    )
    outs, preempted = run(small, PROMPTS, params, late={3: 5, 6: 9})
    assert preempted > 0
    assert [out.token_ids for out in outs] == want


def test_seeded_sampling_is_reproducible(model_dir: str) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, seed=1234)
    first = LLM(model_dir, dtype="float32").generate(PROMPTS, params)
    second = LLM(model_dir, dtype="float32").generate(PROMPTS[::-1], params)[::-1]
    assert [o.token_ids for o in first] == [o.token_ids for o in second]
    other = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.9, top_p=0.95, seed=4321)
    third = LLM(model_dir, dtype="float32").generate(PROMPTS, other)
    assert [o.token_ids for o in first] != [o.token_ids for o in third]


def test_engine_seed_makes_unseeded_sampling_reproducible(model_dir: str) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0)
    first = LLM(model_dir, dtype="float32", seed=7).generate(PROMPTS, params)
    second = LLM(model_dir, dtype="float32", seed=7).generate(PROMPTS, params)
    assert [o.token_ids for o in first] == [o.token_ids for o in second]


def test_abort_leaves_the_others_untouched(llm: LLM, reference: list) -> None:
    engine = llm.engine
    for i in (2, 3):
        engine.add_request(f"abort-{i}", token_ids(PROMPTS[i]), GREEDY)
    for _ in range(3):
        engine.step()
    engine.abort("abort-2")
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == {"abort-3"} and done["abort-3"].token_ids == reference[3]
    assert llm.engine.core_client.core.block_manager.usage == 0.0


BAD_REQUESTS = [
    ([], GREEDY, "prompt"),
    (list(range(128)), GREEDY, "max_model_len"),
    (list(range(200)), GREEDY, "max_model_len"),
    ([1, 2, VOCAB_SIZE], GREEDY, rf"token id {VOCAB_SIZE} at position 2"),
    ([1, -1, 2], GREEDY, "token id -1 at position 1"),
    ([1, 2.5], GREEDY, "position 1"),
]


@pytest.mark.parametrize("prompt, params, message", BAD_REQUESTS)
def test_bad_request_is_refused_and_the_engine_keeps_serving(
    prompt: list, params: SamplingParams, message: str, llm: LLM, reference: list
) -> None:
    engine = llm.engine
    engine.add_request("good", token_ids(PROMPTS[0]), GREEDY)
    engine.step()
    with pytest.raises(RequestError, match=message):
        engine.add_request("bad", prompt, params)
    with pytest.raises(RequestError, match=message):
        llm.generate([PROMPTS[4], prompt], params)
    done = {}
    while engine.has_unfinished:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    # The refused batch's good prompt was withdrawn with it; the running request is unaffected.
    assert list(done) == ["good"] and done["good"].token_ids == reference[0]
    (after,) = llm.generate([PROMPTS[4]], GREEDY)
    assert after.token_ids == reference[4]


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_non_positive_max_tokens_names_the_field(max_tokens: int) -> None:
    with pytest.raises(ValueError, match=rf"max_tokens={max_tokens}"):
        SamplingParams(max_tokens=max_tokens)


def test_request_larger_than_the_cache_is_refused(model_dir: str, reference: list) -> None:
    llm = LLM(model_dir, dtype="float32", kv_cache_blocks=4, block_size=4)
    with pytest.raises(RequestError, match="prompt \\+ max_tokens"):
        llm.generate([list(range(20))], GREEDY)
    short = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[1]], short)
    assert out.token_ids == reference[1][:5]


def test_duplicate_request_id_is_refused(llm: LLM, reference: list) -> None:
    llm.engine.add_request("twice", token_ids(PROMPTS[1]), GREEDY)
    with pytest.raises(RequestError, match="request_id"):
        llm.engine.add_request("twice", token_ids(PROMPTS[2]), GREEDY)
    done = {}
    while llm.engine.has_unfinished:
        done.update({o.request_id: o for o in llm.engine.step() if o.finished})
    assert done["twice"].token_ids == reference[1]


def test_temporary_step_log_outlives_shutdown_but_not_its_file(model_dir: str) -> None:
    """log_step_plan=True logs to a temporary file: read back after shutdown, then removed."""
    with LLM(model_dir, dtype="float32", max_model_len=64, log_step_plan=True) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0))
        path = llm._log_path
        during = llm.step_log()
    assert during and all(r["role"] == "attention" for r in during)
    assert llm.step_log() == during
    assert path is not None and not os.path.exists(path)


def test_step_log_lines_carry_each_steps_wall_clocks(model_dir: str) -> None:
    """Each line says when its step was planned and run: the generate call's steps lie inside it,
    in order, each run after it was planned, none planned before the one before it ended."""
    with LLM(model_dir, dtype="float32", max_model_len=64, log_step_plan=True) as llm:
        before = time.time() - 1e-6  # the lines' clocks are rounded to microseconds
        llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, temperature=0.0))
        after = time.time() + 1e-6
        lines = sorted(llm.step_log(), key=lambda r: r["step"])
    ours = [r for r in lines if r["start"] >= before]
    assert len(ours) >= 4  # a prefill step, then a decode step per further token
    for line in ours:
        assert before <= line["start"] <= line["end"] <= after
    for prev, line in zip(ours, ours[1:]):
        assert line["start"] >= prev["end"]


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(llm: LLM, skip: bool) -> None:
    """Greedy on a logit bias that forces the EOS token (ignore_eos keeps going): the text is the
    tokenizer's own decode of the tokens, with or without the special ones."""
    eos = llm.tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    params = SamplingParams(
        max_tokens=4,
        temperature=0.0,
        ignore_eos=True,
        logit_bias={eos: 100.0},
        skip_special_tokens=skip,
    )
    (out,) = llm.generate(["ab"], params)
    assert out.token_ids == [eos] * 4
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=skip)
    assert (EOS_TOKEN in out.text) is (not skip)
