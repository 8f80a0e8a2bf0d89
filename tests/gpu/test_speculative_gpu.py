"""Speculative decoding (n-gram) on one GPU under CUDA graphs, colocated and in-process 1A1F:
the eager engine's greedy tokens without speculation (bf16: up to reported near-ties). Decode
steps with drafts (up to k + 1 rows a sequence) replay under full_decode_only, whose graphs'
attention is launched for queries of k + 1 rows; full also replays those beside a prefill."""

from __future__ import annotations

import pytest

from afdserve import LLM, SamplingParams

from .test_graphs import _check, bf16_model  # noqa: F401 - the fixture

pytestmark = pytest.mark.gpu

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def _prompts() -> list[list[int]]:
    return [[(5 * i + j % (2 + i % 3)) % 250 for j in range(12 + i)] for i in range(6)]


@pytest.mark.parametrize("topology", ["colocated", "1A1F"])
@pytest.mark.parametrize("graph_mode", ["full_decode_only", "full"])
def test_speculative_graphs_equal_eager(bf16_model, topology, graph_mode):  # noqa: F811
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    common = dict(
        device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=256, kv_cache_blocks=256
    )
    prompts = _prompts()
    with LLM(str(bf16_model), **common) as eager:
        want = [o.token_ids for o in eager.generate(prompts, params)]
        with LLM(
            str(bf16_model),
            topology=topology,
            connector="inprocess" if topology == "1A1F" else "auto",
            graph_mode=graph_mode,
            cuda_graph_sizes=[1, 2, 4, 8, 16, 32],
            speculative_config=NGRAM,
            log_step_plan=True,
            **common,
        ) as spec:
            got = [o.token_ids for o in spec.generate(prompts, params)]
            stats = spec.engine.stats().spec_decode[0]
            modes = {r["mode"] for r in spec.step_log()}
        gaps = _check(eager, prompts, got, want)
    assert stats.num_accepted_tokens > 0
    assert "replay" in modes
    print(f"{topology} {graph_mode}: {len(gaps)} near-tie divergences, {stats}")
