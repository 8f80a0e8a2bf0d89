"""One pool of KV-cache blocks: reference counts, the free queue and, with prefix caching, which
full blocks hold which prefix (engine/block_manager.py holds one pool per kind of block table).

A block is referenced by every sequence whose table holds it; at zero references it joins the
free queue but keeps its hash, so a later sequence with the same prefix takes it back without a
copy or a recompute. Allocation takes the least recently freed block first, and only then forgets
its hash (eviction). Blocks that hold no hash are freed to the front of the queue, so they are
reused before any cached block is evicted.

Nothing here is sized by the pool: blocks never handed out are a counter, not queue entries, and
only referenced blocks have a count. A small model on a large GPU has tens of millions of blocks
(the tiny test models: ~78M on an 80 GB card), and a queue of them all took ~40 s and gigabytes
of host memory to build for every engine.
"""

from __future__ import annotations

from collections import OrderedDict


class RefCounts:
    """The references to each handed-out block of a pool (referenced blocks only)."""

    def __init__(self) -> None:
        self._refs: dict[int, int] = {}

    def refs(self, block: int) -> int:
        return self._refs.get(block, 0)

    def check_held(self, block: int, owner: str) -> None:
        """A block without references in a table is a stale table: fail loudly, never corrupt."""
        if self._refs.get(block, 0) < 1:
            raise RuntimeError(f"block {block} of {owner!r} is not allocated (stale table)")

    def _unref(self, block: int) -> bool:
        """One reference fewer; True where that was the last."""
        refs = self._refs[block] - 1
        if refs:
            self._refs[block] = refs
            return False
        del self._refs[block]
        return True


class BlockPool(RefCounts):
    """Blocks `[reserved, num_blocks)` are handed out; blocks below `reserved` never are (a
    windowed table's null block, which stands for a block freed behind the window)."""

    def __init__(self, num_blocks: int, reserved: int = 0) -> None:
        super().__init__()
        self.num_blocks = num_blocks
        # Blocks `[_fresh, num_blocks)` were never handed out: free, without a hash, taken in order
        # after the freed blocks without a hash and before any cached block is evicted.
        self._fresh = reserved
        # Freed blocks without a reference, least recently freed first (those without a hash at
        # the front); the values are unused.
        self._free: OrderedDict[int, None] = OrderedDict()
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.evicted_blocks = 0  # cached blocks reallocated, their prefix forgotten

    @property
    def num_free(self) -> int:
        """Blocks a sequence can be given: unreferenced ones, cached or not."""
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def cached(self, digest: bytes) -> int | None:
        """The block registered under `digest`, referenced or not."""
        return self._block_of.get(digest)

    def take(self) -> int:
        """A free block with one reference, its cached prefix (if any) evicted."""
        if self._fresh < self.num_blocks and (
            not self._free or next(iter(self._free)) in self._hash_of
        ):
            block = self._fresh
            self._fresh += 1
            self._refs[block] = 1
            return block
        block, _ = self._free.popitem(last=False)
        digest = self._hash_of.pop(block, None)
        if digest is not None:
            del self._block_of[digest]
            self.evicted_blocks += 1
        self._refs[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more reference to a cached block (taking it from the free queue if unreferenced)."""
        refs = self._refs.get(block, 0)
        if refs == 0:
            del self._free[block]
        self._refs[block] = refs + 1

    def release(self, block: int) -> None:
        if self._unref(block):
            self._free[block] = None
            if block not in self._hash_of:
                self._free.move_to_end(block, last=False)

    def register(self, block: int, digest: bytes) -> None:
        """Register `block` under `digest`, unless another block already holds that hash (two
        sequences computed one prefix at once): then it stays unregistered."""
        if digest not in self._block_of and block not in self._hash_of:
            self._block_of[digest] = block
            self._hash_of[block] = digest
