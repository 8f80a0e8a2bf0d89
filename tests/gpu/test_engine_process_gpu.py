"""`serve`'s default on CUDA: the colocated engine steps in a rank process of its own
(--engine-process auto), and its greedy outputs are the in-process engine's, CUDA graphs on."""

from __future__ import annotations

import pytest

from afdserve import LLM, SamplingParams
from afdserve.frontend.process import ProcessClient
from afdserve.frontend.single_process import SingleProcessClient

pytestmark = pytest.mark.gpu

PROMPTS = [[(11 * i + j) % 250 + 1 for j in range(3 + 5 * i)] for i in range(12)]


def outputs(llm: LLM) -> list[tuple[list[int], str]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text) for o in outs]


def test_served_engine_on_cuda_runs_in_its_own_process_with_the_same_outputs() -> None:
    # float32: the two runs may batch the prompts differently, which bf16 rounding could show.
    common = dict(device="cuda", dtype="float32", max_num_seqs=16)
    with LLM(**common) as offline:
        assert isinstance(offline.engine.core_client, SingleProcessClient)
        want = outputs(offline)
    with LLM(**common, usage_context="server") as served:
        assert isinstance(served.engine.core_client, ProcessClient)
        assert outputs(served) == want
