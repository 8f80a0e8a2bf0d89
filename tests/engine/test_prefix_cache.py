"""Prefix caching in the block manager and the scheduler: reference counts, LRU eviction, the hash
chain, and that no block is handed out while a sequence still holds it (checked after every
operation of random workloads against a model of who holds what)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afdserve.engine.block_manager import BlockManager
from afdserve.engine.prefix_hash import block_hash, prefix_hashes
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.scheduler import Scheduler, SchedulerConfig
from afdserve.engine.sequence import Sequence

BS = 4


def seq(name: str, tokens: list[int], max_tokens: int = 4) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(name, tokens, params, eos_token_id=None)


def compute(bm: BlockManager, s: Sequence, cached: list[int] | None = None) -> None:
    """Admit `s` from its cached prefix and compute its whole prompt, as the scheduler does."""
    bm.take_cached(s, bm.cached_prefix(s) if cached is None else cached)
    bm.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    bm.register(s)


def test_hash_chain_depends_on_every_earlier_token() -> None:
    a = prefix_hashes(list(range(12)), BS)
    b = prefix_hashes([99] + list(range(1, 12)), BS)
    assert len(a) == 3 and len(set(a)) == 3
    # Blocks 1 and 2 hold the same tokens in both, but their prefixes differ.
    assert all(x != y for x, y in zip(a, b))
    assert a[1] == block_hash(a[0], [4, 5, 6, 7])
    assert a[1] != block_hash(b"", [4, 5, 6, 7])
    assert block_hash(b"", [1, 2], extra=b"x") != block_hash(b"", [1, 2])
    assert prefix_hashes(list(range(11)), BS) == a[:2]  # only full blocks


def test_shared_prefix_is_referenced_not_copied() -> None:
    bm = BlockManager(16, BS, prefix_caching=True)
    first = seq("a", list(range(10)))
    compute(bm, first)  # blocks 0-1 full and registered, block 2 partial
    second = seq("b", list(range(8)) + [50, 51, 52])
    hits = bm.cached_prefix(second)
    assert hits == first.block_table[:2]
    compute(bm, second, hits)
    assert second.block_table[:2] == first.block_table[:2]
    assert [bm.refs(b) for b in first.block_table] == [2, 2, 1]
    assert bm.hit_tokens == 8 and bm.queried_tokens == 10 + 11
    shared = list(second.block_table[:2])
    bm.free(first)
    assert [bm.refs(b) for b in second.block_table] == [1, 1, 1]
    bm.free(second)
    assert bm.num_free_blocks == 16 and bm.usage == 0.0
    # Freed, still cached: a third sequence takes the same blocks back.
    assert bm.cached_prefix(seq("c", list(range(9)))) == shared


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(16, BS, prefix_caching=True)
    compute(bm, seq("a", list(range(8))))
    # Exactly two full blocks cached, but an 8-token prompt must still compute its last token.
    assert len(bm.cached_prefix(seq("b", list(range(8))))) == 1
    assert len(bm.cached_prefix(seq("c", list(range(9))))) == 2


def test_eviction_takes_the_least_recently_freed_cached_block() -> None:
    bm = BlockManager(4, BS, prefix_caching=True)
    old, new = seq("old", [1] * 4 + [7]), seq("new", [2] * 4 + [7])
    compute(bm, old)
    compute(bm, new)
    bm.free(old)
    bm.free(new)
    assert bm.num_cached_blocks == 2
    # Two blocks without a hash are reused first; the third allocation evicts old's block.
    taker = seq("t", [3] * 9)
    bm.allocate(taker, 8)
    assert bm.num_cached_blocks == 2
    bm.allocate(taker, 12)
    assert bm.num_cached_blocks == 1
    assert bm.cached_prefix(seq("x", [1] * 4 + [7])) == []
    assert len(bm.cached_prefix(seq("y", [2] * 4 + [7]))) == 1


def test_a_hit_on_a_free_block_takes_it_out_of_the_free_queue() -> None:
    bm = BlockManager(3, BS, prefix_caching=True)
    a = seq("a", list(range(5)))
    compute(bm, a)
    bm.free(a)
    b = seq("b", list(range(4)) + [9])
    hits = bm.cached_prefix(b)
    assert bm.unreferenced(hits) == 1
    compute(bm, b, hits)
    assert bm.num_free_blocks == 1 and bm.refs(hits[0]) == 1
    other = seq("o", [5] * 5)
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.allocate(other, 5)  # two needed, one free: the held cached block is not evictable


def test_disabled_caches_nothing() -> None:
    bm = BlockManager(8, BS)
    a = seq("a", list(range(9)))
    compute(bm, a)
    assert bm.num_cached_blocks == 0 and bm.cached_prefix(seq("b", list(range(9)))) == []


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.integers(4, 24))
def test_no_block_is_handed_out_while_referenced(seed: int, num_blocks: int) -> None:
    """Random schedules over few prefixes and a tiny cache (eviction and preemption happen):
    after every step, each block's count equals the tables holding it, a free block is held by
    none, and a cached block holds exactly the tokens its hash chain names."""
    rng = random.Random(seed)
    bm = BlockManager(num_blocks, BS, prefix_caching=True)
    config = SchedulerConfig(
        max_num_seqs=6, max_num_batched_tokens=rng.choice([3, 8, 16]), max_model_len=4 * num_blocks
    )
    scheduler = Scheduler(config, bm)
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 10))] for _ in range(3)]
    content: dict[int, tuple[int, ...]] = {}  # block -> the positions' tokens written in it
    names = iter(range(10**6))
    for _ in range(60):
        if rng.random() < 0.4 and scheduler.num_waiting < 4:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(1, 5))]
            budget = rng.randint(1, 6)
            if -(-(len(prompt) + budget) // BS) <= num_blocks:
                scheduler.add(seq(f"r{next(names)}", prompt, budget))
        out = scheduler.schedule()
        for entry in out.scheduled:  # the step writes KV of exactly these positions
            s, start = entry.seq, entry.seq.num_computed_tokens
            for p in range(start, start + entry.num_new_tokens):
                block = s.block_table[p // BS]
                assert bm.refs(block) == 1 or p // BS >= s.num_registered_blocks, "shared write"
                have = list(content.get(block, ()))[: p % BS]
                content[block] = (*have, s.token_ids[p])
        scheduler.update(out, [rng.randrange(50) if e.samples else None for e in out.scheduled])
        holders: dict[int, int] = {}
        for s in scheduler.running:
            for block in s.block_table:
                holders[block] = holders.get(block, 0) + 1
            for index, block in enumerate(s.block_table[: s.num_computed_tokens // BS]):
                assert content[block] == tuple(s.token_ids[index * BS : (index + 1) * BS])
        for block in range(num_blocks):
            assert bm.refs(block) == holders.get(block, 0)
        assert bm.num_free_blocks == num_blocks - len(holders)
        for s in scheduler.waiting:
            assert s.block_table == [] and s.num_computed_tokens == 0
    assert bm.hit_tokens <= bm.queried_tokens


def test_random_schedules_do_hit_the_cache() -> None:
    """The property test above is only worth something if its workloads share prefixes: one
    fixed seed of the same kind of workload, where hits must happen."""
    bm = BlockManager(8, BS, prefix_caching=True)
    scheduler = Scheduler(SchedulerConfig(4, 8, 32), bm)
    for i in range(6):
        scheduler.add(seq(f"r{i}", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10 + i], 2))
    while scheduler.has_unfinished:
        out = scheduler.schedule()
        scheduler.update(out, [0 if e.samples else None for e in out.scheduled])
    assert bm.hit_tokens >= 5 * 8
