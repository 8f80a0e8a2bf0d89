"""The windowed layers' own pool (model/cache.py's `CacheSpec.window`, engine/block_manager.py):
blocks behind the window return to the pool as a sequence advances, a prefix hit needs the
window's blocks before it, and gpt-oss's tiny checkpoint (window 8) gives transformers' greedy
tokens with chunked prefill, preemption, prefix caching and 2A1F on a window pool smaller than
one sequence, so that only freeing lets it run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.engine.block_manager import NULL_BLOCK, BlockManager
from afdserve.engine.kv_cache import window_pool_bound
from afdserve.engine.sequence import Sequence
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.engine.test_llm import run
from tests.model.test_parity import hf_logits

BLOCK, WINDOW = 4, 8  # the tiny checkpoint's window
NEW_TOKENS = 14
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
# Two sequences, 6 tokens a step: a window pool of 11 blocks (10 usable), where the longest
# sequence (45 + 14 tokens) spans 15 blocks.
LIMITS = dict(block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=6)


def live(seq: Sequence) -> list[int]:
    """Indices of the window table's blocks still held."""
    return [i for i, block in enumerate(seq.window_table) if block != NULL_BLOCK]


def advance(bm: BlockManager, seq: Sequence, chunk: int) -> None:
    """One step of `chunk` positions, as the scheduler and `update` drive it."""
    end = min(seq.num_tokens, seq.num_computed_tokens + chunk)
    bm.allocate(seq, end)
    seq.num_computed_tokens = end
    bm.register(seq)


def test_blocks_behind_the_window_return_to_the_pool() -> None:
    bm = BlockManager(32, BLOCK, window=WINDOW, num_window_blocks=9)
    seq = Sequence("a", list(range(40)), SamplingParams(max_tokens=1), None)
    while seq.num_computed_tokens < 40:
        start = seq.num_computed_tokens
        end = min(40, start + 5)
        bm.allocate(seq, end)
        # A step from `start` reads positions from start - (WINDOW - 1): exactly their blocks.
        first = max(0, start - WINDOW + 1) // BLOCK
        assert live(seq) == list(range(first, -(-end // BLOCK)))
        assert bm.num_free_window_blocks == 8 - len(live(seq))
        seq.num_computed_tokens = end
        bm.register(seq)
    assert len(seq.block_table) == 10 > 8  # more blocks than the window pool holds
    bm.free(seq)
    assert (bm.num_free_blocks, bm.num_free_window_blocks) == (32, 8)


def test_a_prefix_hit_needs_the_windows_blocks_cached() -> None:
    bm = BlockManager(64, BLOCK, prefix_caching=True, window=WINDOW, num_window_blocks=12)
    tokens = [(7 * i) % 256 for i in range(40)]
    first = Sequence("a", tokens, SamplingParams(max_tokens=1), None)
    while first.num_computed_tokens < 40:
        advance(bm, first, 6)
    bm.free(first)
    again = Sequence("b", tokens + [1], SamplingParams(max_tokens=1), None)
    hit = bm.cached_prefix(again)
    assert len(hit) == 10
    bm.take_cached(again, hit)
    # A query at 40 reads from 33: blocks 8 and 9, the rest of the window table is null.
    assert live(again) == [8, 9] and again.num_computed_tokens == 40
    bm.free(again)
    # A branch after 32 tokens: its hit ends at block 8, whose window reads blocks 6 and 7.
    branch = Sequence("e", tokens[:32] + [1] * 9, SamplingParams(max_tokens=1), None)
    hit = bm.cached_prefix(branch)
    bm.take_cached(branch, hit)
    assert len(hit) == 8 and live(branch) == [6, 7]
    bm.free(branch)
    # Another sequence takes every window block, evicting them: no prefix is a hit any more,
    # though every main block is still cached.
    other = Sequence("c", [3] * 44, SamplingParams(max_tokens=1), None)
    bm.allocate(other, 44)
    bm.free(other)
    assert bm.num_cached_blocks >= 10
    assert bm.cached_prefix(Sequence("d", tokens + [1], SamplingParams(max_tokens=1), None)) == []


def test_window_pool_bound_holds_a_full_step() -> None:
    """The bound's arithmetic, against the worst case counted block by block: every sequence's
    step written from every start offset within a block."""
    for window, block, seqs, budget in [(8, 4, 2, 6), (128, 16, 3, 100), (5, 16, 4, 64)]:
        worst = 0
        for start in range(block):
            per_seq = budget // seqs
            lo = max(0, start + 64 * block - window + 1) // block
            hi = -(-(start + 64 * block + per_seq) // block)
            worst = max(worst, seqs * (hi - lo))
        assert worst + 1 <= window_pool_bound(window, block, seqs, budget)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt-oss-window") / "m", "gpt_oss", seed=0)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 29, 45, 11)]


def teacher_forced(model_dir: Path, outputs: list[list[int]]) -> list[list[int]]:
    """transformers' greedy choice at every generated position, fed our tokens before it."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    want = []
    for prompt, tokens in zip(prompts(), outputs, strict=True):
        logits = hf_logits(hf, prompt + tokens[:-1])
        want.append(logits[len(prompt) - 1 :].argmax(-1).tolist())
    return want


def test_tokens_match_transformers_with_preemption_and_prefix_hits(model_dir) -> None:
    llm = LLM(
        str(model_dir), dtype="float32", kv_cache_blocks=20, enable_prefix_caching=True, **LIMITS
    )
    manager = llm.engine.core_client.core.block_manager
    assert manager.num_free_window_blocks == window_pool_bound(WINDOW, BLOCK, 2, 6) - 1 == 10
    outs, preempted = run(llm, prompts(), GREEDY, late={3: 9})
    got = [o.token_ids for o in outs]
    assert preempted > 0 and len({tuple(t) for t in got}) == len(got)
    # The longest prompt alone, three times: the 20 main blocks hold its prefix again from the
    # third on (the mixed run's blocks evicted), its hit past the window taking the main
    # blocks and the window's last two.
    longest = prompts()[2]
    again = [llm.generate([longest], GREEDY)[0] for _ in range(3)]
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in again] == [got[2]] * 3
    assert again[2].num_cached_tokens == 44
    assert got == teacher_forced(model_dir, got)
    assert (manager.num_free_blocks, manager.num_free_window_blocks) == (20, 10)


# tests/afd/test_gpt_oss_afd.py's 2A1F cell (a 70-token prompt, blocks of 16) frees window
# blocks on every CI run; this cell's window pool is smaller than one sequence.
@pytest.mark.slow
def test_2a1f_matches_transformers(model_dir) -> None:
    with LLM(str(model_dir), topology="2A1F", dtype="float32", kv_cache_blocks=20, **LIMITS) as llm:
        got = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    assert got == teacher_forced(model_dir, got)


def test_rejected_drafts_keep_the_tokens(model_dir) -> None:
    """n-gram speculation beside chunked prefill and prefix caching: rejected drafts' rows sit
    in window blocks a later step overwrites, as in the main pool."""
    from tests.engine.test_speculative import NGRAM, _run

    common = dict(kv_cache_blocks=28, enable_prefix_caching=True, **LIMITS)
    want, _, _, _ = _run(str(model_dir), None, GREEDY, **common)
    got, stats, _, _ = _run(str(model_dir), NGRAM, GREEDY, **common)
    assert got == want
    spec = stats.spec_decode[0]
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens


def test_gpt_oss_capacity_at_long_context_nearly_doubles() -> None:
    """gpt-oss-120b on an H200's memory: the sliding half of the layers no longer holds every
    position, so the main pool (engine sizing, `split_budget` at `bench capacity`'s limits)
    and the planner's batch (`max_batch`) hold about twice the sequences counted with every
    layer's pages per position (the sizing before the window pool)."""
    from afdserve.engine.factory import split_budget
    from afdserve.model.families import cache_layout
    from afdserve.model.presets import preset_config
    from afdserve.planner.memory import max_batch, model_bytes

    config, h200 = preset_config("gpt-oss-120b"), 150109880320
    layout, sizes, dtype = cache_layout(config), model_bytes(config), torch.bfloat16
    every_layer = layout.bytes_per_block(16, dtype)
    windowed = layout.bytes_per_window_block(16, dtype)
    assert 2 * windowed == every_layer and sizes.kv_per_token == windowed // 16
    bound = window_pool_bound(layout.window, 16, 1024, 16384)
    for context in (32768, 131072):
        per_sequence = context // 16
        for weights in (sizes.colocated, sizes.attention):
            budget = int(h200 * 0.9 - weights)
            before = budget // every_layer // per_sequence
            pools = split_budget(budget, every_layer - windowed, windowed, bound)
            assert pools.window_blocks == bound
            assert 1.7 * before <= pools.blocks // per_sequence <= 2 * before + 1
            was = max_batch(h200, 0.9, weights, every_layer // 16, context)
            now = max_batch(
                h200, 0.9, weights, sizes.kv_per_token, context, sizes.state_per_sequence
            )
            assert 1.9 * was <= now <= 2 * was + 1


def test_a_layer_sits_in_at_most_one_spec_of_each_kind() -> None:
    """A layer may keep part of its state in the window pool and part in the main pages (one
    windowed and one unwindowed spec, joined by the unwindowed one), never in two of a kind;
    a spec that cannot join says so by name."""
    from afdserve.model.cache import CacheLayout, PagedKV
    from afdserve.model.families.gpt_oss.cache import SlidingKV

    with pytest.raises(ValueError, match=r"unwindowed cache specs cover layers \[0, 0, 1\]"):
        CacheLayout((PagedKV((0, 1), 1, 4), PagedKV((0,), 1, 4)), 2)
    with pytest.raises(ValueError, match=r"windowed cache specs cover layers \[0, 0, 1\]"):
        CacheLayout((SlidingKV((0,), 1, 4, window=2), SlidingKV((0, 1), 1, 4, window=2)), 2)
    with pytest.raises(ValueError, match="cover layers"):
        CacheLayout((PagedKV((0,), 1, 4), SlidingKV((0,), 1, 4, window=2)), 2)
    both = CacheLayout((PagedKV((0, 1), 1, 4), SlidingKV((1,), 1, 4, window=2)), 2)
    with pytest.raises(TypeError, match="PagedKV keeps no part of a layer in a windowed pool"):
        both.allocate(2, 4, torch.float32, "cpu", num_window_blocks=3)
