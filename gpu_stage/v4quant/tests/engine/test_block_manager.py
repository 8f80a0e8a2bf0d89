from __future__ import annotations

import math
import random

import pytest

from afdserve.engine.block_manager import BlockManager
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.sequence import Sequence


def make_seq(name: str = "r") -> Sequence:
    return Sequence(name, [1, 2, 3], SamplingParams(), eos_token_id=None)


@pytest.mark.parametrize("block_size", [1, 2, 3, 7, 16, 256])
@pytest.mark.parametrize("num_tokens", [0, 1, 2, 3, 15, 16, 17, 100, 255, 256, 257, 1000])
def test_allocation_count_is_ceil_division(block_size: int, num_tokens: int) -> None:
    bm = BlockManager(num_blocks=1000, block_size=block_size)
    seq = make_seq()
    expected = math.ceil(num_tokens / block_size)
    assert bm.blocks_needed(seq, num_tokens) == expected
    bm.allocate(seq, num_tokens)
    assert len(seq.block_table) == expected
    assert bm.num_free_blocks == 1000 - expected
    assert bm.blocks_needed(seq, num_tokens) == 0


@pytest.mark.parametrize("block_size", [1, 4, 5, 16])
def test_incremental_growth_matches_one_shot(block_size: int) -> None:
    rng = random.Random(block_size)
    bm = BlockManager(num_blocks=500, block_size=block_size)
    seq = make_seq()
    covered = 0
    for _ in range(60):
        covered += rng.randint(0, 9)
        needed = bm.blocks_needed(seq, covered)
        before = len(seq.block_table)
        bm.allocate(seq, covered)
        assert len(seq.block_table) == before + needed == math.ceil(covered / block_size)
    # Asking for fewer positions than already covered never shrinks nor grows the table.
    assert bm.blocks_needed(seq, 0) == 0
    bm.allocate(seq, 1)
    assert len(seq.block_table) == math.ceil(covered / block_size)


def test_free_returns_every_block_and_tables_are_disjoint() -> None:
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4)
    seqs = [make_seq(f"r{i}") for i in range(8)]
    for _ in range(200):
        seq = rng.choice(seqs)
        if rng.random() < 0.3:
            bm.free(seq)
            assert seq.block_table == []
            continue
        target = len(seq.block_table) * 4 + rng.randint(1, 12)
        if bm.can_allocate(bm.blocks_needed(seq, target)):
            bm.allocate(seq, target)
        owned = [block for s in seqs for block in s.block_table]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert all(0 <= block < 64 for block in owned)
        assert bm.num_free_blocks == 64 - len(owned)
        assert bm.usage == pytest.approx(len(owned) / 64)
    for seq in seqs:
        bm.free(seq)
    assert bm.num_free_blocks == 64
    assert bm.usage == 0.0
    # Everything can be handed out again, every block exactly once.
    whole = make_seq("whole")
    bm.allocate(whole, 64 * 4)
    assert sorted(whole.block_table) == list(range(64))
    assert bm.usage == 1.0


def test_exhaustion_raises_and_leaves_state_unchanged() -> None:
    bm = BlockManager(num_blocks=4, block_size=8)
    a, b = make_seq("a"), make_seq("b")
    bm.allocate(a, 24)
    assert not bm.can_allocate(2)
    assert bm.can_allocate(1)
    with pytest.raises(RuntimeError, match="out of blocks"):
        bm.allocate(b, 9)
    assert b.block_table == []
    assert bm.num_free_blocks == 1
    bm.allocate(b, 8)
    assert bm.num_free_blocks == 0


def test_double_free_is_harmless() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    seq = make_seq()
    bm.allocate(seq, 5)
    bm.free(seq)
    bm.free(seq)
    assert bm.num_free_blocks == 8


def test_stale_block_table_is_rejected() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a, b = make_seq("a"), make_seq("b")
    bm.allocate(a, 4)
    b.block_table = list(a.block_table)  # two owners of the same blocks: a bug elsewhere
    bm.free(a)
    with pytest.raises(RuntimeError, match="not allocated"):
        bm.free(b)
    assert bm.num_free_blocks == 8


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 16), (4, 0), (-1, 1)])
def test_invalid_sizes(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError, match="BlockManager"):
        BlockManager(num_blocks, block_size)
