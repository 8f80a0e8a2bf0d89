"""Prompt logprobs on CUDA, with CUDA graphs (prefill steps captured too), colocated and
in-process 1A1F, chunked prefill: equal to the CPU engine's on the same float32 checkpoint
(itself held to transformers' logits in tests/engine/test_prompt_logprobs.py), and
1A1F equal to colocated."""

from __future__ import annotations

import pytest

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.tiny import make_tiny_model

pytestmark = pytest.mark.gpu

PROMPTS = [[(7 * i + 3) % 250 for i in range(70)], [5, 6, 7], [42] * 9, [9]]
PARAMS = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("plp") / "m", "qwen3_moe", hash_layers=1, seed=5, dtype="float32"
    )


def logprobs(model, **kwargs) -> list[list[dict[int, float]]]:
    with LLM(str(model), dtype="float32", max_num_batched_tokens=32, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.prompt_logprobs[1:] for o in outs]


@pytest.mark.parametrize("topology", ["colocated", "1A1F"])
@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_prompt_logprobs_on_cuda_equal_the_cpu_engine(model, topology, graph_mode) -> None:
    cpu = logprobs(model)
    gpu = logprobs(model, device="cuda", topology=topology, graph_mode=graph_mode)
    for got_prompt, want_prompt in zip(gpu, cpu, strict=True):
        assert len(got_prompt) == len(want_prompt)
        for got, want in zip(got_prompt, want_prompt, strict=True):
            token = next(iter(want))  # the prompt's own token comes first
            assert token in got and abs(got[token] - want[token]) < 2e-3
