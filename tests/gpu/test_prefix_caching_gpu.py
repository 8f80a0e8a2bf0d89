"""Prefix caching on the GPU: with CUDA graphs (prefill steps captured too), colocated and
in-process 1A1F, a shared-prefix workload gives the tokens of the same engine without caching
(bf16: up to reported near-ties), and its second round is served from the cache."""

from __future__ import annotations

import random

import pytest

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.tiny import make_tiny_model

from .test_graphs import _check

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    # A hash layer too: its token ids must follow the scheduled (uncached) tokens to the FFN.
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu") / "m", "qwen3_moe", hash_layers=1, seed=5, dtype="bfloat16"
    )


def _workload() -> list[list[int]]:
    rng = random.Random(0)
    prefixes = [[rng.randrange(250) for _ in range(n)] for n in (40, 70, 17)]
    return [
        rng.choice(prefixes) + [rng.randrange(250) for _ in range(rng.randint(1, 9))]
        for _ in range(24)
    ]


@pytest.mark.parametrize("topology", ["colocated", "1A1F"])
@pytest.mark.parametrize("graph_mode", ["full_decode_only", "full"])
def test_caching_keeps_the_tokens_on_cuda(bf16_model, topology, graph_mode) -> None:
    prompts = _workload()
    common = dict(
        device="cuda",
        topology=topology,
        graph_mode=graph_mode,
        block_size=16,
        kv_cache_blocks=48,
        max_num_batched_tokens=64,
    )
    with LLM(str(bf16_model), enable_prefix_caching=False, **common) as plain:
        want = [o.token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
        with LLM(str(bf16_model), **common) as cached:
            assert cached.prefix_caching
            first = cached.generate(prompts, GREEDY, use_tqdm=False)
            again = cached.generate(prompts, GREEDY, use_tqdm=False)
            stats = cached.engine.stats()
        gaps = _check(plain, prompts, [o.token_ids for o in first], want)
        gaps += _check(plain, prompts, [o.token_ids for o in again], want)
    print(
        f"{topology} {graph_mode}: {len(gaps)} near-tie divergences, hit rate "
        f"{stats.prefix_cache_hit_rate:.1%}"
    )
    assert sum(o.num_cached_tokens > 0 for o in again) >= len(prompts) // 2
    assert stats.prefix_cache_hit_rate > 0.2
