"""A stop string completed before `min_tokens` does not end the request; after, it does."""

from __future__ import annotations

from afdserve import LLM, SamplingParams


def test_stop_string_waits_for_min_tokens(tiny_models):
    with LLM(str(tiny_models["qwen3_moe"]), dtype="float32") as llm:
        free = llm.generate(
            [[5, 6, 7]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        )[0]
        text = free.outputs[0].text
        stop = text[2:4]  # completes within the first few tokens
        early = llm.generate(
            [[5, 6, 7]],
            SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]),
        )[0]
        held = llm.generate(
            [[5, 6, 7]],
            SamplingParams(
                max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=24
            ),
        )[0]
    assert stop and early.outputs[0].finish_reason == "stop"
    assert len(early.outputs[0].token_ids) < 24
    assert held.outputs[0].token_ids == free.outputs[0].token_ids
    assert held.outputs[0].finish_reason == "length"
