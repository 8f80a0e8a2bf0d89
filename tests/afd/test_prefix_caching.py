"""Prefix caching under AFD: rank worlds with caching give the tokens of colocated without it,
over random shared-prefix workloads on a tiny cache (eviction and preemption happen); the FFN
ranks receive only the rows the attention ranks compute; the router sends a repeated prefix to
the rank that cached it."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afdserve import LLM, SamplingParams

from .conftest import GREEDY
from .wire_logs import assert_data_plane_matches_plan, received

BS = 4
# 10 blocks of 4 tokens: two or three prompts of up to 24 tokens fill it, so the scheduler
# preempts and the block manager evicts cached prefixes (the colocated cell checks both happen).
TINY_CACHE = dict(dtype="float32", block_size=BS, kv_cache_blocks=10, max_num_batched_tokens=16)


@st.composite
def shared_prefix_workloads(draw) -> tuple[list[list[int]], SamplingParams]:
    rng = random.Random(draw(st.integers(0, 2**31)))
    prefixes = [
        [rng.randrange(250) for _ in range(rng.randint(1, 18))]
        for _ in range(draw(st.integers(1, 3)))
    ]
    prompts = [
        rng.choice(prefixes) + [rng.randrange(250) for _ in range(rng.randint(1, 6))]
        for _ in range(draw(st.integers(2, 7)))
    ]
    params = SamplingParams(max_tokens=draw(st.integers(1, 8)), temperature=0.0, ignore_eos=True)
    return prompts, params


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(afd_models):
    """Colocated without prefix caching: the oracle."""
    with LLM(str(afd_models["qwen3_moe"]), enable_prefix_caching=False, **TINY_CACHE) as llm:
        yield llm


def check_world(reference: LLM, llm: LLM, data) -> None:
    for _ in range(data.draw(st.integers(1, 3))):  # later rounds meet what earlier ones cached
        prompts, params = data.draw(shared_prefix_workloads())
        assert tokens(llm, prompts, params) == tokens(reference, prompts, params)


WORLDS = [
    pytest.param("colocated", {}, id="colocated"),
    # The graph layout (eager on CPU): cached prefills beside decodes keep the graph keys paired.
    pytest.param(
        "2A1F",
        {"graph_mode": "full_decode_only", "cuda_graph_sizes": [1, 2, 4, 8]},
        id="2A1F-graphs",
    ),
    pytest.param("3A2F", {"ubatches": 2}, id="3A2F", marks=pytest.mark.slow),
    pytest.param("2A2F", {"ffn_expert_parallel": True}, id="2A2F-ep", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("topology", "extra"), WORLDS)
def test_caching_gives_the_uncached_tokens(afd_models, reference, topology, extra) -> None:
    model = str(afd_models["qwen3_moe"])
    with LLM(model, topology=topology, **TINY_CACHE, **extra) as llm:
        assert llm.prefix_caching

        @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.data())
        def run(data) -> None:
            check_world(reference, llm, data)

        run()
        core = getattr(llm.engine.core_client, "core", None)
        if core is not None:  # one process: the tiny cache did preempt and evict
            assert core.scheduler.num_preemptions > 0 and core.block_manager.evicted_blocks > 0
        # Whether the random workloads met a cached block is up to their draws; a prompt sent
        # twice meets its own three blocks (the router sends it back to the rank that cached
        # them), and the ranks' stats report that hit.
        hits = sum(llm.engine.stats().prefix_cache_hits.values())
        again = [[(7 * i) % 250 for i in range(1, 15)]]
        want = tokens(reference, again, GREEDY)
        for _ in range(2):
            assert tokens(llm, again, GREEDY) == want
        assert sum(llm.engine.stats().prefix_cache_hits.values()) > hits


def ffn_rows(log_dir, layer: int = 0) -> int:
    return sum(t["real_rows"] for t in received(log_dir) if t["layer"] == layer)


def test_ffn_ranks_compute_only_uncached_rows(afd_models, tmp_path) -> None:
    """A prompt whose first 12 tokens (three blocks) another prompt computed before: its FFN rank
    receives 3 prompt rows and the decode rows, never the cached 12 (per layer, every tile's
    real rows are the plan's, checked by assert_data_plane_matches_plan)."""
    model = str(afd_models["qwen3_moe"])
    rng = random.Random(5)
    prefix = [rng.randrange(250) for _ in range(12)]
    first, second = prefix + [1, 2, 3], prefix + [7, 8, 9]
    with LLM(
        model,
        topology="2A1F",
        dtype="float32",
        block_size=BS,
        log_step_plan=True,
        log_data_plane=str(tmp_path),
    ) as llm:
        a = llm.generate([first], GREEDY, use_tqdm=False)[0]
        b = llm.generate([second], GREEDY, use_tqdm=False)[0]
    records = llm.step_log()
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 12)
    decode_rows = GREEDY.max_tokens - 1  # the last sampled token is never run
    assert ffn_rows(tmp_path) == (15 + decode_rows) + (3 + decode_rows)
    assert assert_data_plane_matches_plan(tmp_path, records, warmup_steps=0) > 0
    attention = [r for r in records if r["role"] == "attention"]
    assert sum(r["real_rows"] for r in attention) == ffn_rows(tmp_path)
    with LLM(model, dtype="float32", enable_prefix_caching=False) as ref:
        assert [a.token_ids, b.token_ids] == tokens(ref, [first, second], GREEDY)


@pytest.mark.parametrize("policy", ["prefix", "least-tokens"])
def test_a_repeated_prefix_goes_to_the_rank_that_cached_it(afd_models, policy) -> None:
    """Two prefixes land on ranks 0 and 1 (least work); then the second prefix again, with both
    ranks idle: `prefix` sends it to rank 1, which serves 16 tokens from its cache, while
    `least-tokens` breaks the tie towards rank 0, which holds nothing of it."""
    rng = random.Random(11)
    one, two = ([rng.randrange(250) for _ in range(16)] for _ in range(2))
    with LLM(
        str(afd_models["qwen3_moe"]),
        topology="2A1F",
        dtype="float32",
        block_size=BS,
        routing_policy=policy,
    ) as llm:
        llm.generate([one + [1], two + [2]], GREEDY, use_tqdm=False)
        again = llm.generate([two + [3, 4]], GREEDY, use_tqdm=False)[0]
        stats = llm.engine.stats()
    if policy == "prefix":
        assert again.num_cached_tokens == 16
        assert stats.prefix_cache_hits == {0: 0, 1: 16}
    else:
        assert again.num_cached_tokens == 0
        assert stats.prefix_cache_hits == {0: 0, 1: 0}
