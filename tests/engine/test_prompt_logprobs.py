"""Prompt logprobs (SamplingParams.prompt_logprobs) from the prefill's own forward, against
transformers' logits on the same checkpoint: one entry per prompt token (the first None), the
token's own logprob and rank plus the top k, the same over chunked prefill chunks and after a
preemption; sampled-token logprobs carry their rank too (vLLM's Logprob)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.engine.logprobs import Logprob

PROMPTS = [list(range(40, 75)), [5, 9, 200, 7, 7, 7, 31, 100], [66]]
K = 3


@pytest.fixture(scope="module")
def model_dir(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["qwen3_moe"]


@torch.inference_mode()
def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    logits = hf_model(torch.tensor([prompt])).logits[0].float()  # [len, vocab]
    return torch.log_softmax(logits, dim=-1)


def check_against(hf_model, prompt: list[int], entries: list) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    want = hf_prompt_logprobs(hf_model, prompt)
    for position, entry in enumerate(entries[1:]):
        row, token = want[position], prompt[position + 1]
        assert isinstance(entry[token], Logprob)
        torch.testing.assert_close(entry[token].logprob, float(row[token]), atol=2e-4, rtol=0)
        assert entry[token].rank == int((row >= row[token]).sum())
        top = row.topk(K).indices.tolist()
        listed = [t for t in entry if t != token or entry[t].rank <= K]
        assert sorted(listed) == sorted(top)
        for rank, t in enumerate(top, 1):
            torch.testing.assert_close(entry[t].logprob, float(row[t]), atol=2e-4, rtol=0)
            assert entry[t].rank == rank


@pytest.mark.parametrize("budget", [2048, 8])  # whole prompts, and chunks of 8 tokens
def test_prompt_logprobs_match_transformers(model_dir, hf_models, budget: int) -> None:
    params = SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=K, logprobs=1
    )
    with LLM(str(model_dir), dtype="float32", max_num_batched_tokens=budget) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        check_against(hf_models["qwen3_moe"], prompt, out.prompt_logprobs)
        # The text of each entry's token, and the sampled token's rank, as vLLM gives them.
        entry = out.outputs[0].logprobs[0]
        token = out.token_ids[0]
        assert entry[token].rank == 1 and entry[token].decoded_token == llm.tokenizer.decode(
            [token]
        )


def test_prompt_logprobs_survive_a_preemption(model_dir, hf_models) -> None:
    """A cache too small for both requests: one is preempted and recomputed (seen back in the
    waiting queue with tokens generated), its prompt logprobs are still reported once, and
    equal transformers'."""
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    prompts = [list(range(40, 75)), list(range(100, 135))]
    done, preempted = {}, False
    with LLM(str(model_dir), dtype="float32", kv_cache_blocks=7, block_size=16) as llm:
        for i, prompt in enumerate(prompts):
            llm.engine.add_request(f"r{i}", prompt, params)
        scheduler = llm.engine.core_client.core.scheduler
        while len(done) < len(prompts):
            for out in llm.engine.step():
                if out.finished:
                    done[out.request_id] = out
            preempted |= any(seq.num_output_tokens for seq in scheduler.waiting)
    assert preempted
    for i, prompt in enumerate(prompts):
        entries = done[f"r{i}"].prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        want = hf_prompt_logprobs(hf_models["qwen3_moe"], prompt)
        got = [e[t].logprob for e, t in zip(entries[1:], prompt[1:], strict=True)]
        expected = [float(want[i, t]) for i, t in enumerate(prompt[1:])]
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=0)


def test_logprob_is_a_float_and_pickles() -> None:
    import pickle

    value = Logprob(-1.5, 2, "a")
    assert value == -1.5 and value + 1 == -0.5 and value.logprob == -1.5
    back = pickle.loads(pickle.dumps(value))
    assert (back, back.rank, back.decoded_token) == (-1.5, 2, "a")


def test_prompt_logprobs_with_a_cached_prefix(model_dir, hf_models) -> None:
    """Prefix caching on: a prompt whose blocks are cached by an earlier request still gets
    every prompt position's logprobs (it reads no cached prefix), while a request without
    prompt logprobs still hits the cache."""
    prompt = list(range(40, 90))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", enable_prefix_caching=True) as llm:
        llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)
        (again,) = llm.generate([{"prompt_token_ids": prompt}], plain, use_tqdm=False)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert again.num_cached_tokens > 0 and out.num_cached_tokens == 0
    check_against(hf_models["qwen3_moe"], prompt, out.prompt_logprobs)
