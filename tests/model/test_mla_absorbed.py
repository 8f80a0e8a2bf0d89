"""MLA in the latent space (kv_b_proj folded into the query and the output: the batched path the
GPU uses and CUDA graphs capture) equals MLA with keys and values expanded per sequence."""

from __future__ import annotations

import pytest
import torch

from afdserve.afd.ranks.messages import WorkerSpec
from afdserve.config import AFDConfig, EngineConfig, GraphConfig
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.tokenizer import load_tokenizer
from afdserve.frontend.client import EngineClient
from afdserve.frontend.single_process import SingleProcessClient

PROMPTS = [[5, 6, 7, 8, 9, 10], [100, 3, 4], [42] * 11, list(range(1, 30)), [7]]


def _run(model_dir, batched: bool, budget: int):
    engine = EngineConfig(model=str(model_dir), dtype="float32", max_num_batched_tokens=budget)
    core_client = SingleProcessClient(WorkerSpec(engine, AFDConfig(), GraphConfig()))
    client = EngineClient(core_client, load_tokenizer(str(model_dir)))
    core_client.core.runner.batched_metadata = batched
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=5)
    for i, p in enumerate(PROMPTS):
        client.add_request(str(i), p, params)
    done = {}
    while client.has_unfinished:
        for out in client.step():
            if out.finished:
                done[out.request_id] = out
    return [done[str(i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_latent_space_mla_equals_expanded(tiny_models, family):
    expanded = _run(tiny_models[family], batched=False, budget=7)
    latent = _run(tiny_models[family], batched=True, budget=7)
    for a, b in zip(expanded, latent, strict=True):
        assert a.token_ids == b.token_ids
        for la, lb in zip(a.logprobs, b.logprobs, strict=True):
            assert la.keys() == lb.keys()
            torch.testing.assert_close(
                torch.tensor(list(la.values())),
                torch.tensor(list(lb.values())),
                rtol=0,
                atol=1e-4,
            )
