"""Paged KV-cache block accounting (no prefix caching): which physical blocks each sequence
owns. Position p of a sequence lives in block `block_table[p // block_size]` at offset
`p % block_size`."""

from __future__ import annotations

from collections import deque

from afdserve.engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockManager.num_blocks={num_blocks}: must be >= 1")
        if block_size < 1:
            raise ValueError(f"BlockManager.block_size={block_size}: must be >= 1")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self._num_blocks

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks so that `seq.block_table` covers positions `[0, num_tokens)`."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens}: must be >= 0")
        total = -(-num_tokens // self._block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(
                f"KV cache out of blocks: {seq.request_id!r} needs {needed} more block(s) for "
                f"{num_tokens} positions, {len(self._free)} of {self._num_blocks} free"
            )
        for _ in range(needed):
            block = self._free.popleft()
            self._used.add(block)
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        # The table is cleared below, so freeing the same sequence twice returns nothing twice.
        # A block that is not in use means two sequences shared it: fail loudly, never corrupt.
        for block in seq.block_table:
            if block not in self._used:
                raise RuntimeError(
                    f"block {block} of {seq.request_id!r} is not allocated (shared or stale table)"
                )
        for block in reversed(seq.block_table):
            self._used.remove(block)
            self._free.append(block)
        seq.block_table.clear()
