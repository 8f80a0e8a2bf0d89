"""The FP8 KV cache over real rank processes (gloo): 2A1F gives colocated's tokens with the same
cache, token for token, and each attention rank reports its cache's dtype and bytes."""

from __future__ import annotations

import pytest

from afdserve import LLM

from .conftest import GREEDY, colocated_tokens, mixed_prompts


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_2a1f_with_fp8_cache_equals_colocated_with_fp8_cache(afd_models, family):
    model = afd_models[family]
    prompts = mixed_prompts()
    want = colocated_tokens(model, prompts, kv_cache_dtype="fp8", max_num_batched_tokens=16)
    with LLM(
        str(model),
        topology="2A1F",
        dtype="float32",
        kv_cache_dtype="fp8",
        max_num_batched_tokens=16,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        reports = {m.rank: m for m in llm.memory_reports}
    assert got == want
    for rank in (0, 1):
        assert reports[rank].cache_dtype == "float8_e4m3fn"
        assert "float8_e4m3fn" in reports[rank].line() and reports[rank].cache_bytes > 0
    # The FP8 cache changes tokens at all (else this test would not tell the caches apart).
    assert colocated_tokens(model, prompts, max_num_batched_tokens=16) != want
