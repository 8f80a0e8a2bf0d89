"""Speculative decoding across rank processes (gloo): every topology gives colocated's greedy
tokens without speculation, while the attention ranks verify drafts (k + 1 rows a sequence go
to the FFN ranks like any rows) and report their acceptance counters to the frontend."""

from __future__ import annotations

import pytest

from afdserve import LLM

from .conftest import GREEDY, colocated_tokens, mixed_prompts

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    "prompt_lookup_min": 1,
}


def prompts() -> list[list[int]]:
    return [*mixed_prompts(), [1, 2, 3, 4] * 5, [60, 61] * 8]


@pytest.mark.parametrize(
    ("topology", "family", "kwargs"),
    [
        pytest.param("2A1F", "qwen3_moe", {"ubatches": 2}, id="2A1F-ub2"),
        pytest.param("3A2F", "deepseek_v2", {}, id="3A2F", marks=pytest.mark.slow),
        pytest.param(
            "2A2F", "mixtral", {"ffn_expert_parallel": True}, id="2A2F-ep", marks=pytest.mark.slow
        ),
    ],
)
def test_speculative_afd_matches_colocated(afd_models, topology, family, kwargs) -> None:
    model = afd_models[family]
    want = colocated_tokens(model, prompts())
    with LLM(
        str(model),
        topology=topology,
        dtype="float32",
        max_num_batched_tokens=16,
        speculative_config=NGRAM,
        **kwargs,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        stats = llm.engine.stats()
    assert got == want
    ranks = stats.spec_decode
    assert sorted(ranks) == list(range(llm.topology.attention_ranks))
    assert sum(s.num_accepted_tokens for s in ranks.values()) > 0
    assert all(s.num_accepted_tokens <= s.num_draft_tokens for s in ranks.values())


def test_deepseek_v4_speculates_under_afd(tmp_path) -> None:
    """DeepSeek-V4's compressed layers (CSA rate 2, HCA rate 4) under 2A1F: drafts that close
    compressor windows, accepted and rejected, leave colocated's greedy tokens unchanged. Each
    prompt is x, its greedy continuation y, then x again: the lookup drafts y's tokens."""
    from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4

    model = make_tiny_v4(tmp_path / "v4", seed=3)
    base = mixed_prompts()[1:]
    echoes = [x + list(y) + x for x, y in zip(base, colocated_tokens(model, base), strict=True)]
    want = colocated_tokens(model, echoes)
    with LLM(
        str(model),
        topology="2A1F",
        dtype="float32",
        max_num_batched_tokens=16,
        speculative_config=NGRAM,
    ) as llm:
        got = [o.token_ids for o in llm.generate(echoes, GREEDY)]
        ranks = llm.engine.stats().spec_decode
    assert got == want
    accepted = sum(s.num_accepted_tokens for s in ranks.values())
    assert 0 < accepted < sum(s.num_draft_tokens for s in ranks.values())
