"""State slots (model/cache.py's SequenceSlots): the block manager gives a running sequence one
slot with its first blocks and takes it back with them; the scheduler's preemption and retirement
return it; a cache with slots of their own counts them in its bytes, and the memory budget of a
layout whose slots live in the pages takes them out of the blocks; the step metadata carries
each segment's slot through a ubatch split."""

from __future__ import annotations

import random

import pytest
import torch

from afdserve.config import EngineConfig
from afdserve.engine.block_manager import BlockManager
from afdserve.engine.factory import CPU_CACHE_BUDGET, kv_blocks_for
from afdserve.engine.kv_cache import make_kv_cache, slots_for
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.scheduler import Scheduler, SchedulerConfig
from afdserve.engine.sequence import Sequence
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.model.families import cache_layout
from afdserve.model.presets import preset_config


def make_seq(name: str, tokens: int = 3) -> Sequence:
    return Sequence(name, list(range(1, tokens + 1)), SamplingParams(), eos_token_id=None)


def test_a_sequence_holds_one_slot_from_its_first_blocks_until_it_frees_them() -> None:
    bm = BlockManager(num_blocks=16, block_size=4, num_slots=3)
    a, b = make_seq("a"), make_seq("b")
    assert a.state_slot is None
    bm.allocate(a, 3)
    slot = a.state_slot
    bm.allocate(a, 9)  # more blocks, the same slot
    assert a.state_slot == slot and bm.num_free_slots == 2
    bm.allocate(b, 1)
    assert b.state_slot not in (None, slot)
    bm.free(a)
    assert a.state_slot is None and bm.num_free_slots == 2
    bm.free(a)  # twice: nothing returned twice
    assert bm.num_free_slots == 2


def test_slots_stay_distinct_under_random_churn_and_all_come_back() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4, num_slots=5)
    seqs = [make_seq(f"r{i}") for i in range(5)]
    for _ in range(300):
        seq = rng.choice(seqs)
        if rng.random() < 0.3:
            bm.free(seq)
        elif bm.can_allocate(bm.blocks_needed(seq, len(seq.block_table) * 4 + 2)):
            bm.allocate(seq, len(seq.block_table) * 4 + 2)
        held = [s.state_slot for s in seqs if s.state_slot is not None]
        assert len(held) == len(set(held)) == 5 - bm.num_free_slots
        assert all(0 <= s < 5 for s in held)
        assert all((s.state_slot is None) == (not s.block_table) for s in seqs)
    for seq in seqs:
        bm.free(seq)
    assert bm.num_free_slots == 5


def test_no_slots_without_slotted_specs_and_a_clear_error_when_exhausted() -> None:
    plain = BlockManager(num_blocks=8, block_size=4)
    seq = make_seq("a")
    plain.allocate(seq, 3)
    assert seq.state_slot is None
    full = BlockManager(num_blocks=8, block_size=4, num_slots=1)
    full.allocate(make_seq("x"), 1)
    with pytest.raises(RuntimeError, match="no free state slot"):
        full.allocate(make_seq("y"), 1)


def test_preemption_and_retirement_return_the_slots() -> None:
    """Room for two sequences' blocks, slots for three: the scheduler preempts by recompute
    and every slot comes back once all finish."""
    bm = BlockManager(num_blocks=6, block_size=2, num_slots=3)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_model_len=16), bm)
    seqs = [make_seq(f"s{i}", 3) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    preempted = 0
    for _ in range(200):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        preempted += len(out.preempted)
        assert all(s.state_slot is None for s in out.preempted)
        held = [e.seq.state_slot for e in out.scheduled]
        assert None not in held and len(set(held)) == len(held)
        sched.update(out, [7 if e.samples else None for e in out.scheduled])
        for seq in list(sched.running):
            if seq.num_output_tokens >= 5:
                sched.finish(seq, "stop")
    assert preempted > 0 and not sched.has_unfinished
    assert bm.num_free_slots == 3 and bm.num_free_blocks == 6


def test_cache_bytes_count_own_slots_and_the_budget_shares_the_pages() -> None:
    config = preset_config("qwen3-next-80b-a3b:8")  # 6 linear layers, 2 full
    layout = cache_layout(config)
    dtype = torch.bfloat16
    per_slot = layout.bytes_per_slot(dtype)
    # Delta state [32 heads, 128, 128] float32 and conv window [8192, 3] bf16, per linear layer.
    assert per_slot == 6 * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2)
    assert layout.bytes_per_block(16, dtype) == 2 * 2 * 16 * 2 * 256 * 2  # 2 layers of K and V
    assert slots_for(config, 7, dtype) == 7
    cache = make_kv_cache(config, 3, 16, dtype, "meta", num_slots=7)
    assert cache.num_slots == 7
    assert cache.bytes == 3 * layout.bytes_per_block(16, dtype) + 7 * per_slot
    held = sum(t.numel() * t.element_size() for t in cache.tensors())
    assert held == cache.bytes
    # The engine keeps them in the pages: the budget reserves no slot bytes up front, only the
    # scratch slot's pages past the blocks; each held slot takes `pages` blocks.
    pages = layout.slot_pages(16, dtype)
    per_block = layout.bytes_per_block(16, dtype)
    assert per_slot <= pages * per_block
    engine = EngineConfig(model="unused", max_num_seqs=32, block_size=16)
    blocks = kv_blocks_for(engine, config, dtype, 4096, torch.device("cpu"))
    assert blocks == min(32 * (256 + pages), CPU_CACHE_BUDGET // per_block - pages)
    shared = make_kv_cache(config, blocks, 16, dtype, "meta", num_slots=7, shared_slots=True)
    assert shared.slot_pages == pages and shared.bytes == (blocks + pages) * per_block


def test_segments_carry_their_slot_through_a_ubatch_split() -> None:
    table = torch.zeros(4, dtype=torch.int64)
    segments = (Segment(0, 5, table, 5, state_slot=2), Segment(5, 6, table, 9, state_slot=0))
    meta = AttentionMetadata(
        torch.arange(6), torch.arange(6), segments, batch_segments(segments, torch.device("cpu"))
    )
    assert meta.batched.state_slots.tolist() == [2, 0]
    first, second = meta.rows(0, 3), meta.rows(3, 6)
    assert [(s.row_start, s.row_end, s.context_len, s.state_slot) for s in first.segments] == [
        (0, 3, 3, 2)
    ]
    assert [(s.row_start, s.context_len, s.state_slot) for s in second.segments] == [
        (0, 5, 2),
        (2, 9, 0),
    ]
    assert second.batched.state_slots.tolist() == [2, 0]
