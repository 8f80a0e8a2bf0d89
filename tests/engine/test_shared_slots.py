"""State slots in the pages of the one pool (model/cache.py's `SlotPlan`, engine/shared_pages.py):
a page is a block or part of a slot, never both; memory flows from many short sequences' slots to
a long sequence's blocks and back; each slot's state lands in its own pages of the paged layers'
tensors and nowhere else; a lone sequence whose slot sits in the pages its blocks need is
preempted into the topmost slot instead of being refused."""

from __future__ import annotations

import random

import pytest
import torch

from afdserve import LLM
from afdserve.engine.block_manager import BlockManager
from afdserve.engine.kv_cache import make_kv_cache
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.scheduler import Scheduler, SchedulerConfig
from afdserve.engine.sequence import Sequence
from afdserve.engine.shared_pages import SharedPages
from afdserve.model.families import cache_layout, load_model_config
from afdserve.model.fixtures.tiny import make_tiny_model


def make_seq(name: str, tokens: int = 3) -> Sequence:
    return Sequence(name, list(range(1, tokens + 1)), SamplingParams(), eos_token_id=None)


def slot_range(pool: SharedPages, slot: int) -> range:
    first = pool.num_blocks - (pool.num_slots - slot) * pool.slot_pages
    return range(first, first + pool.slot_pages)


@pytest.mark.parametrize("pages,slot_pages,slots,steps", [(40, 3, 9, 3000), (400, 5, 60, 6000)])
def test_pages_are_blocks_or_slots_never_both_under_churn(pages, slot_pages, slots, steps) -> None:
    rng = random.Random(0)
    pool = SharedPages(num_pages=pages, slot_pages=slot_pages, num_slots=slots)
    blocks: list[int] = []
    held_slots: list[int] = []
    for _ in range(steps):
        action = rng.random()
        if action < 0.3 and blocks:
            pool.release(blocks.pop(rng.randrange(len(blocks))))
        elif action < 0.45 and held_slots:
            pool.release_slot(held_slots.pop(rng.randrange(len(held_slots))))
        elif action < 0.8:
            can = pool.can_take(1, 0)
            assert can == (pool.num_free >= 1)
            if can:
                blocks.append(pool.take())
            else:
                with pytest.raises(RuntimeError):
                    pool.take()
        else:
            can = pool.can_take(0, 1)
            assert can == (pool.num_free_slots >= 1)
            if can:
                held_slots.append(pool.take_slot())
            else:
                with pytest.raises(RuntimeError):
                    pool.take_slot()
        held = [p for s in held_slots for p in slot_range(pool, s)] + blocks
        assert len(held) == len(set(held)) and all(0 <= p < pages for p in held)
        assert pool.num_free + len(blocks) + slot_pages * len(held_slots) <= pages
        assert len(pool._free) <= 2 * len(pool._free_set) + 65  # the lazy heap stays bounded
    for block in blocks:
        pool.release(block)
    for slot in held_slots:
        pool.release_slot(slot)
    assert pool.num_free == pages and pool.num_free_slots == slots


def test_memory_flows_between_slots_and_blocks() -> None:
    pool = SharedPages(num_pages=20, slot_pages=4, num_slots=5)
    slots = [pool.take_slot() for _ in range(5)]  # many short sequences: every page a slot
    assert pool.num_free == 0 and not pool.can_take(1, 0)
    for slot in slots:
        pool.release_slot(slot)
    blocks = [pool.take() for _ in range(20)]  # then one long sequence: every page a block
    assert sorted(blocks) == list(range(20)) and pool.num_free_slots == 0
    assert not pool.can_take(0, 1)
    for block in blocks[10:]:  # its upper half back: room for two slots, not three
        pool.release(block)
    assert pool.num_free_slots == 2 and pool.can_take(2, 1) and not pool.can_take(7, 1)
    assert pool.take_slot() == 4 and pool.take_slot() == 3
    assert pool.num_free == 2  # pages 10 and 11, below slot 3's


def test_the_block_manager_admits_a_slot_with_its_blocks() -> None:
    bm = BlockManager(num_blocks=12, block_size=4, num_slots=3, slot_pages=3)
    a, b = make_seq("a"), make_seq("b")
    assert bm.can_admit(a, [], 24)  # 6 blocks and a slot's 3 of 12
    bm.allocate(a, 24)
    assert a.state_slot == 2 and bm.num_free_blocks == 3
    assert not bm.can_admit(b, [], 4)  # a block, but no slot's pages beside it
    assert bm.fits_alone(36) and not bm.fits_alone(40)
    bm.free(a)
    assert bm.num_free_blocks == 12 and bm.num_free_slots == 3
    with pytest.raises(ValueError, match="prefix caching"):
        BlockManager(num_blocks=12, block_size=4, prefix_caching=True, num_slots=3, slot_pages=3)


def test_a_lone_sequence_in_a_low_slot_is_preempted_into_the_top_one() -> None:
    """Three short sequences take the three slots; the last admitted holds the lowest, and once
    the other two finish it grows into its own slot's pages: it is preempted by recompute,
    comes back in the topmost slot and finishes; everything is free at the end."""
    bm = BlockManager(num_blocks=12, block_size=4, num_slots=3, slot_pages=3)
    sched = Scheduler(SchedulerConfig(max_num_seqs=3, max_model_len=40), bm)
    seqs = [make_seq(f"s{i}", 3) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert [e.seq.state_slot for e in out.scheduled] == [2, 1, 0]
    sched.update(out, [7] * 3)
    sched.finish(seqs[0], "stop")
    sched.finish(seqs[1], "stop")
    preempted, slots = 0, set()
    for _ in range(100):
        if not sched.has_unfinished:
            break
        out = sched.schedule()
        preempted += len(out.preempted)
        slots |= {e.seq.state_slot for e in out.scheduled}
        sched.update(out, [7 if e.samples else None for e in out.scheduled])
        if seqs[2].num_tokens >= 30:
            sched.finish(seqs[2], "stop")
    assert preempted == 1 and slots == {0, 2}
    assert not sched.has_unfinished
    assert bm.num_free_blocks == 12 and bm.num_free_slots == 3


def test_each_slot_writes_its_own_pages_and_blocks_stay_apart(tmp_path) -> None:
    """A tiny Qwen3-Next layout, slots in the pages: fill every block below the slots and every
    part of every slot (scratch included) with its own value; each reads back its value, and no
    page past the slots' region's end is written."""
    config = load_model_config(make_tiny_model(tmp_path / "m", "qwen3_next", seed=0))
    layout = cache_layout(config)
    pages = layout.slot_pages(4, torch.float32)
    assert pages > 0
    blocks, slots = 5 + 3 * pages, 3
    cache = make_kv_cache(config, blocks, 4, torch.float32, "cpu", slots, shared_slots=True)
    assert cache.slot_pages == pages
    slot_layers = [i for i, c in enumerate(cache.layers) if hasattr(c, "delta_all")]
    kv = [t for i, c in enumerate(cache.layers) if i not in slot_layers for t in c if t is not None]
    assert kv and all(t.shape[0] == blocks + pages for t in kv)
    for t in kv:
        t[:5] = -1.0  # the blocks below the slots' region
    for i in slot_layers:
        state = cache.layers[i]
        for slot in range(slots + 1):
            state.delta_all[slot] = 100 * i + slot
            if slot < slots:
                state.conv[slot] = 100 * i + slot + 0.5
    for i in slot_layers:
        state = cache.layers[i]
        for slot in range(slots + 1):
            assert (state.delta_all[slot] == 100 * i + slot).all()
            if slot < slots:
                assert (state.conv[slot] == 100 * i + slot + 0.5).all()
    for t in kv:
        assert (t[:5] == -1.0).all()
    # Every slot's bytes lie within its own pages of some row.
    row_bytes = kv[0][0].numel() * kv[0].element_size()
    for i in slot_layers:
        state = cache.layers[i]
        for part in (state.conv, state.delta_all):
            for slot in range(part.shape[0]):
                start = part[slot].data_ptr()
                row = next(t for t in kv if t.data_ptr() <= start < t.data_ptr() + t.nbytes)
                first = (start - row.data_ptr()) // row_bytes
                last = (start + part[slot].nbytes - 1 - row.data_ptr()) // row_bytes
                base = blocks - (slots - slot) * pages
                assert base <= first <= last < base + pages


def test_the_start_up_line_counts_a_slot_s_pages_in_the_concurrency(tmp_path, caplog) -> None:
    """vLLM's 'maximum concurrency' line: sequences of max_model_len the pool holds at once,
    each with its slot's pages."""
    model = make_tiny_model(tmp_path / "m", "qwen3_next", seed=0)
    pages = cache_layout(load_model_config(model)).slot_pages(4, torch.float32)
    blocks = 3 * (16 + pages)  # three sequences of 64 tokens with their slots
    args = dict(dtype="float32", block_size=4, kv_cache_blocks=blocks, max_model_len=64)
    with caplog.at_level("INFO", logger="afdserve.engine.factory"), LLM(str(model), **args):
        pass
    assert "maximum concurrency for 64 tokens per request: 3.00x" in caplog.text
