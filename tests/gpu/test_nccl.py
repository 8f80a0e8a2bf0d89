"""The NCCL data plane across GPUs: 1A1F with one rank per GPU gives the colocated tokens."""

from __future__ import annotations

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.model.tiny import make_tiny_model

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one rank per GPU)")
@pytest.mark.parametrize(
    ("family", "ubatches", "gate"),
    [
        ("qwen3_moe", 1, False),
        ("deepseek_v3", 2, True),
    ],
)
def test_nccl_1a1f_matches_colocated(tmp_path, family, ubatches, gate):
    model = make_tiny_model(tmp_path / family, family, hash_layers=1, seed=4)
    prompts = [[(11 * i + j) % 250 for j in range(2 + 3 * i)] for i in range(8)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(model), device="cuda", dtype="float32") as ref:
        want = [o.token_ids for o in ref.generate(prompts, params)]
    with LLM(
        str(model),
        device="cuda",
        dtype="float32",
        topology="1A1F",
        connector="p2p",
        ubatches=ubatches,
        gate_on_attention=gate,
        max_num_batched_tokens=16,
        log_step_plan=True,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        records = llm.step_log()
    assert got == want
    assert {r["role"] for r in records} == {"attention", "ffn"}
