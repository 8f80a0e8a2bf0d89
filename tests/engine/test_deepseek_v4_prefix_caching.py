"""Prefix caching for DeepSeek-V4 (model/families/deepseek_v4/cache.py's boundary writes): with
caching on, requests that share a prefix with earlier ones resume from its full blocks and give the
tokens of the engine without caching, for shared prefixes ending mid-window and mid-compressor
window, a window shorter and longer than a block, chunked prefill, the per-sequence path, hits
taken when preempted sequences come back, and a bf16 model over the FP8 cache; block sizes that
end inside a compressor window are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.config import EngineConfig
from afdserve.engine.factory import prefix_caching_for
from afdserve.model.families import cache_layout, load_model_config
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from tests.engine.test_llm import run

CSA, HCA, SLIDING = (
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "sliding_attention",
)
# name -> (make_tiny_v4 overrides, block_size). "w4": window 4 (3 ring rows per block, fewer than
# its 4 positions), CSA rate 2, HCA rate 4. "w10": a window of 10 read back over three blocks of
# 4, rates 4 and 8 over blocks of 8; "w3": window 3 and CSA rate 3 over blocks of 6.
SHAPES = {
    "w4-r2r4-b4": ({}, 4),
    "w10-r4r8-b8": (
        dict(
            sliding_window=10,
            index_topk=3,
            compress_rates={CSA: 4, HCA: 8},
            layer_types=[HCA, CSA, SLIDING, CSA],
        ),
        8,
    ),
    # A window no wider than CSA's: its first series stay in the main pages, not the window pool
    # (`LayerGeometry.pooled`), whose blocks a chunk may need after the pool freed them.
    "w3-r3r6-b6": (
        dict(sliding_window=3, index_topk=3, compress_rates={CSA: 3, HCA: 6}),
        6,
    ),
}
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# Shared prefixes of 13, 19 and 22 tokens: each ends inside a window and inside an open CSA and
# HCA window, so the cache hands back their full blocks only and the rest recomputes.
PREFIX_LENS = (13, 19, 22)


def workload(seed: int = 0) -> list[list[int]]:
    """Per prefix a first prompt, then two more sharing it with their own tails."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in PREFIX_LENS:
        prefix = torch.randint(0, 256, (n,), generator=gen).tolist()
        out += [prefix + torch.randint(0, 256, (k,), generator=gen).tolist() for k in (3, 1, 6)]
    return out


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(request, tmp_path_factory) -> tuple[Path, int]:
    overrides, block_size = SHAPES[request.param]
    return make_tiny_v4(tmp_path_factory.mktemp("v4p") / request.param, seed=6, **overrides), (
        block_size
    )


@pytest.fixture(scope="module")
def uncached(shape) -> list[list[int]]:
    """The oracle: each prompt alone, caching off."""
    path, block_size = shape
    with LLM(str(path), dtype="float32", block_size=block_size, enable_prefix_caching=False) as llm:
        return [o.token_ids for o in llm.generate(workload(), GREEDY, use_tqdm=False)]


def one_by_one(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Prompts one generate call each, so every later prompt meets the earlier ones' blocks."""
    outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("budget", [None, 5], ids=["one-shot", "chunks-of-5"])
def test_caching_gives_the_uncached_tokens(shape, uncached, budget) -> None:
    path, block_size = shape
    with LLM(
        str(path),
        dtype="float32",
        block_size=block_size,
        enable_prefix_caching=True,
        max_num_batched_tokens=budget,
    ) as llm:
        got, cached = one_by_one(llm, workload())
    assert got == uncached
    # Each later prompt of a prefix resumes from the prefix's full blocks.
    full = [n // block_size * block_size for n in PREFIX_LENS]
    assert cached == [0 if i % 3 == 0 else full[i // 3] for i in range(len(cached))]


def test_the_per_sequence_path_writes_a_cache_the_batched_path_resumes(shape, uncached) -> None:
    """Steps without device segments (the per-sequence oracle, model.py's _per_sequence) leave
    every block's end state too: requests alternate between the two paths and share blocks."""
    path, block_size = shape
    with LLM(str(path), dtype="float32", block_size=block_size, enable_prefix_caching=True) as llm:
        runner = llm.engine.core_client.core.runner
        got = []
        for i, prompt in enumerate(workload()):
            runner.batched_metadata = i % 2 == 1
            got.append(llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)
    assert got == uncached


def test_hits_behind_preemption_keep_the_tokens(shape, uncached) -> None:
    """A cache too small for the workload at once: sequences are preempted, prefixes evicted and
    hit again as preempted sequences recompute, beside chunked prefills."""
    path, block_size = shape
    prompts = workload()
    blocks = -(-(max(map(len, prompts)) + GREEDY.max_tokens) // block_size) + 2
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=block_size,
        enable_prefix_caching=True,
        kv_cache_blocks=blocks,
        max_num_batched_tokens=7,
    )
    outs, preempted = run(llm, prompts, GREEDY, late={i: 2 * i for i in range(len(prompts))})
    core = llm.engine.core_client.core
    assert preempted > 0 and sum(llm.engine.stats().prefix_cache_hits.values()) > 0
    assert [o.token_ids for o in outs] == uncached
    assert core.block_manager.num_free_blocks == blocks


def test_block_sizes_inside_a_compressor_window_are_refused(tmp_path) -> None:
    path = make_tiny_v4(tmp_path / "v4")  # CSA rate 2, HCA rate 4
    layout = cache_layout(load_model_config(path))
    assert [layout.prefix_reuse_refusal(b) for b in (4, 8, 16)] == [None] * 3
    why = layout.prefix_reuse_refusal(6)
    assert why == (
        "block_size=6 is not a multiple of every compress rate (CSA 2, HCA 4), so a block "
        "would end inside a compressor window, whose open rows live in the sequence's state "
        "slot, not in the block; use a block_size that is a multiple of 4"
    )
    with pytest.raises(ValueError, match=r"enable_prefix_caching=True .* block_size=6 is not"):
        LLM(str(path), block_size=6, enable_prefix_caching=True)
    config = load_model_config(path)
    assert prefix_caching_for(EngineConfig(model=str(path), block_size=6), config) is False
    assert prefix_caching_for(EngineConfig(model=str(path), block_size=8), config) is True


def test_fp8_cache_with_caching_gives_its_uncached_tokens(tmp_path) -> None:
    """A bf16 model over the FP8 cache: a chunk's own keys and entries take the pages' round trip
    and the compressor state's bf16 pages hold its values exactly, so resuming from cached blocks
    reads the keys the uncached run read."""
    path = make_tiny_v4(tmp_path / "v4", seed=6, dtype="bfloat16")
    runs = {}
    for enable in (False, True):
        with LLM(
            str(path),
            dtype="bfloat16",
            block_size=4,
            kv_cache_dtype="fp8",
            enable_prefix_caching=enable,
            max_num_batched_tokens=5,
        ) as llm:
            runs[enable] = one_by_one(llm, workload())
    assert runs[True][0] == runs[False][0]
    assert sum(runs[True][1]) > 0 and sum(runs[False][1]) == 0
