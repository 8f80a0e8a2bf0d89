"""Prompt logprobs under AFD: computed on the attention ranks from the prefill's own forward,
so 2A1F (rank processes, chunked prefill under a small token budget) reports what colocated
reports: the same tokens, entries and ranks, and the same logprobs to float32 rounding (the
ranks batch other rows beside each prompt than colocated does, and CPU matmuls round by batch:
colocated itself differs in the last bits between a prompt run alone and in a batch)."""

from __future__ import annotations

from afdserve import LLM, SamplingParams

from .conftest import mixed_prompts


def test_2a1f_prompt_logprobs_equal_colocated(afd_models) -> None:
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts()]
    params = SamplingParams(
        max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2, logprobs=2
    )
    model = str(afd_models["qwen3_moe"])
    results = {}
    for topology in ("colocated", "2A1F"):
        with LLM(model, topology=topology, dtype="float32", max_num_batched_tokens=16) as llm:
            results[topology] = llm.generate(prompts, params, use_tqdm=False)
    for ours, theirs in zip(results["2A1F"], results["colocated"], strict=True):
        assert ours.token_ids == theirs.token_ids
        assert len(ours.prompt_logprobs) == len(ours.prompt_token_ids)
        for got, want in zip(
            [*ours.prompt_logprobs[1:], *ours.outputs[0].logprobs],
            [*theirs.prompt_logprobs[1:], *theirs.outputs[0].logprobs],
        ):
            assert {t: v.rank for t, v in got.items()} == {t: v.rank for t, v in want.items()}
            assert max(abs(got[t] - want[t]) for t in got) < 1e-5
