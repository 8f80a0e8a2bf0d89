"""BlockPool hands out never-used blocks from a counter and counts only referenced blocks; its
order is the one a queue of every block gives (the oracle below: freed blocks without a hash
first, most recent first, then never-used blocks in order, then cached blocks least recently
freed first), and it builds without touching every block."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from afdserve.engine.block_pool import BlockPool


class QueueOfEveryBlock:
    """The pool as one queue holding every free block from the start."""

    def __init__(self, num_blocks: int, reserved: int) -> None:
        self.refs = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(reserved, num_blocks))
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}

    def take(self) -> int:
        block, _ = self.free.popitem(last=False)
        digest = self.hash_of.pop(block, None)
        if digest is not None:
            del self.block_of[digest]
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            del self.free[block]
        self.refs[block] += 1

    def release(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None
            if block not in self.hash_of:
                self.free.move_to_end(block, last=False)

    def register(self, block: int, digest: bytes) -> None:
        if digest not in self.block_of and block not in self.hash_of:
            self.block_of[digest] = block
            self.hash_of[block] = digest


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("reserved", [0, 1])
def test_pool_takes_blocks_in_the_order_of_a_queue_of_every_block(seed: int, reserved: int):
    rng = random.Random(seed)
    num_blocks = 40
    pool, oracle = BlockPool(num_blocks, reserved), QueueOfEveryBlock(num_blocks, reserved)
    held: list[int] = []
    for _ in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free:
            block = pool.take()
            assert block == oracle.take()
            held.append(block)
        elif op < 0.7 and held:
            block = held.pop(rng.randrange(len(held)))
            pool.release(block)
            oracle.release(block)
        elif op < 0.85 and held:
            block, digest = rng.choice(held), bytes([rng.randrange(30)])
            pool.register(block, digest)
            oracle.register(block, digest)
        else:  # a prefix hit: share a cached block, referenced or not
            digest = bytes([rng.randrange(30)])
            block = pool.cached(digest)
            assert block == oracle.block_of.get(digest)
            if block is not None:
                pool.share(block)
                oracle.share(block)
                held.append(block)
        assert pool.num_free == len(oracle.free)
        assert pool.num_cached == len(oracle.block_of)
        assert all(pool.refs(b) == oracle.refs[b] for b in range(num_blocks))
    assert pool.evicted_blocks >= 1  # the run evicted cached blocks, not only fresh ones


def test_a_pool_of_2_to_the_40_blocks_is_built_without_touching_them():
    pool = BlockPool(2**40, reserved=1)
    assert pool.num_free == 2**40 - 1
    blocks = [pool.take() for _ in range(3)]
    assert blocks == [1, 2, 3]
    pool.release(blocks[1])
    assert pool.take() == 2  # a freed block without a hash before the never-used ones
    assert pool.num_free == 2**40 - 4 and pool.refs(2**40 - 1) == 0
    with pytest.raises(RuntimeError, match="not allocated"):
        pool.check_held(2**40 - 1, "seq 0")
