"""Paged KV-cache block accounting: which physical blocks each sequence owns, and with prefix
caching which full blocks hold which prefix. Position p of a sequence lives in block
`block_table[p // block_size]` at offset `p % block_size`.

Prefix caching (vLLM's automatic prefix caching, written from its description): a block whose
positions are all computed is registered under its chained hash (engine/prefix_hash.py). A
block is referenced by every sequence whose table holds it; at zero references it joins the
free queue but keeps its hash, so a later sequence with the same prefix takes it back without a
copy or a recompute. Allocation takes the least recently freed block first, and only then forgets
its hash (eviction). Blocks that hold no hash are freed to the front of the queue, so they are
reused before any cached block is evicted. Only full blocks are shared, and a shared block is
never written again: a sequence writes only the positions it computes, which lie past its cached
prefix.

State slots (model/cache.py's `SequenceSlots`): a sequence takes one with its first blocks and
gives it back with them; there are max_num_seqs of them, and none needs zeroing (a layer starts
from an empty state at position 0).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from afdserve.engine.prefix_hash import ROOT, block_hash
from afdserve.engine.sequence import Sequence


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        blocks_for: Callable[[int, int], int] | None = None,
        num_slots: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"BlockManager.num_blocks={num_blocks}: must be >= 1")
        if block_size < 1:
            raise ValueError(f"BlockManager.block_size={block_size}: must be >= 1")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self.prefix_caching = prefix_caching
        # Blocks a sequence of n tokens needs (the cache layout's `blocks_for`; default: every
        # block holds block_size positions).
        self._blocks_for = blocks_for or (lambda n, size: -(-n // size))
        self._refs = [0] * num_blocks
        # Blocks without a reference, least recently freed first; the values are unused.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_of: dict[int, bytes] = {}
        if num_slots < 0:
            raise ValueError(f"BlockManager.num_slots={num_slots}: must be >= 0")
        self._num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        self._block_of: dict[bytes, int] = {}
        # Prompt tokens looked up and found cached (vLLM's prefix_cache_queries/hits, in tokens).
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.evicted_blocks = 0  # cached blocks reallocated, their prefix forgotten

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can be given: unreferenced ones, cached or not."""
        return len(self._free)

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self._num_blocks

    def refs(self, block: int) -> int:
        return self._refs[block]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` positions holds (the cache layout's rule)."""
        return self._blocks_for(num_tokens, self._block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks so that `seq.block_table` covers positions `[0, num_tokens)`."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens}: must be >= 0")
        total = self.blocks_for(num_tokens)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    # ----- prefix caching -----
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks holding the longest cached prefix of `seq`, in order. Never its last token:
        that one must run through the model to give logits, and it would be written into a
        shared block. None for a request that wants prompt logprobs (vLLM's rule): they come
        from the prefill's own forward, which a cached position skips."""
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hashes = self.hashes(seq, (seq.num_tokens - 1) // self._block_size)
        blocks = []
        for digest in hashes:
            block = self._block_of.get(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def unreferenced(self, blocks: list[int]) -> int:
        """How many of `blocks` lie in the free queue (taking them costs free blocks)."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def take_cached(self, seq: Sequence, blocks: list[int]) -> None:
        """Give a sequence without blocks the cached prefix `blocks` (from `cached_prefix`)."""
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError(f"take_cached: {seq!r} already has blocks or computed tokens")
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += len(blocks) * self._block_size
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1
            seq.block_table.append(block)
        seq.num_registered_blocks = len(blocks)
        seq.num_computed_tokens = len(blocks) * self._block_size

    def hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of `seq`'s first `num_blocks` full blocks, computed once per block:
        a full block's tokens never change (preemption keeps `token_ids`)."""
        have, bs = seq.block_hashes, self._block_size
        for index in range(len(have), num_blocks):
            parent = have[-1] if have else ROOT
            have.append(block_hash(parent, seq.token_ids[index * bs : (index + 1) * bs]))
        return have[:num_blocks]

    def register(self, seq: Sequence) -> None:
        """Register every block of `seq` that its computed positions now fill. A block whose
        hash another block already holds (two sequences computed one prefix at once) stays
        unregistered: it is freed like any uncached block."""
        if not self.prefix_caching:
            return
        full = seq.num_computed_tokens // self._block_size
        if full <= seq.num_registered_blocks:
            return
        hashes = self.hashes(seq, full)
        for index in range(seq.num_registered_blocks, full):
            block, digest = seq.block_table[index], hashes[index]
            if digest not in self._block_of and block not in self._hash_of:
                self._block_of[digest] = block
                self._hash_of[block] = digest
        seq.num_registered_blocks = full

    # ----- allocation -----
    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks so that `seq.block_table` covers `[0, num_tokens)`, and its state slot if it
        has none yet."""
        if self._num_slots and seq.state_slot is None:
            if not self._free_slots:
                raise RuntimeError(
                    f"no free state slot for {seq.request_id!r}: all {self._num_slots} are held "
                    "(the scheduler runs at most that many sequences)"
                )
            seq.state_slot = self._free_slots.pop()
        needed = self.blocks_needed(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(
                f"KV cache out of blocks: {seq.request_id!r} needs {needed} more block(s) for "
                f"{num_tokens} positions, {len(self._free)} of {self._num_blocks} free"
            )
        for _ in range(needed):
            block, _ = self._free.popitem(last=False)
            digest = self._hash_of.pop(block, None)
            if digest is not None:  # evicted: its prefix is no longer cached
                del self._block_of[digest]
                self.evicted_blocks += 1
            self._refs[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        # The table is cleared below, so freeing the same sequence twice returns nothing twice.
        # A block without references is a stale table: fail loudly, never corrupt.
        for block in seq.block_table:
            if self._refs[block] < 1:
                raise RuntimeError(
                    f"block {block} of {seq.request_id!r} is not allocated (stale table)"
                )
        # Last blocks first: a sequence's tail is the part least likely to be shared, so it is
        # evicted before the blocks of its (maybe common) beginning.
        for block in reversed(seq.block_table):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
                if block not in self._hash_of:
                    self._free.move_to_end(block, last=False)
        seq.block_table.clear()
        seq.num_registered_blocks = 0
        if seq.state_slot is not None:
            self._free_slots.append(seq.state_slot)
            seq.state_slot = None
