"""Paged KV-cache block accounting: which physical blocks each sequence owns, and with prefix
caching which full blocks hold which prefix. Position p of a sequence lives in block
`block_table[p // block_size]` at offset `p % block_size`.

Prefix caching (vLLM's automatic prefix caching, written from its description): a block whose
positions are all computed is registered under its chained hash (engine/prefix_hash.py) in its
pool (engine/block_pool.py: reference counts, the free queue, eviction). Only full blocks are
shared, and a shared block is never written again: a sequence writes only the positions it
computes, which lie past its cached prefix.

Windowed layers (model/cache.py's `CacheSpec.window`, after vLLM's sliding-window manager): their
pages sit in a pool of their own, addressed by a second table, `seq.window_table`, with the same
indices. A query at p reads positions p - window < j <= p, so once a step starts at c every
block wholly before c - window + 1 is released and its entry becomes the null block 0, which
nothing writes or reads. A prefix hit then needs the window's blocks before it still cached too.

State slots (model/cache.py's `SequenceSlots`): a sequence takes one with its first blocks and
gives it back with them, and none needs zeroing (a layer starts from an empty state at position
0). Either there are max_num_seqs of them in memory of their own, or (`slot_pages`) they live in
the pages of the one pool (engine/shared_pages.py), each taking `slot_pages` blocks' worth while
it is held, so admission asks for a slot and blocks together.
"""

from __future__ import annotations

from collections.abc import Callable

from afdserve.engine.block_pool import BlockPool
from afdserve.engine.prefix_hash import ROOT, block_hash
from afdserve.engine.sequence import Sequence
from afdserve.engine.shared_pages import SharedPages

NULL_BLOCK = 0  # a windowed table's entry for a block released behind the window


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_caching: bool = False,
        blocks_for: Callable[[int, int], int] | None = None,
        num_slots: int = 0,
        window: int | None = None,
        num_window_blocks: int = 0,
        slot_pages: int = 0,
    ) -> None:
        """`window`, `num_window_blocks`: the windowed layers' window and their own pool (its
        block 0 is the null block); None: the layout has no windowed layers. `slot_pages`: the
        blocks a state slot takes where the slots live in the pool's pages (0: in memory of
        their own)."""
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
        if slot_pages and (prefix_caching or window is not None or num_slots < 1):
            raise ValueError(
                "BlockManager.slot_pages: slots in the pool's pages need num_slots >= 1 and "
                "neither prefix caching nor a window pool"
            )
        self._shared: SharedPages | None = None
        self._pool: BlockPool | SharedPages = BlockPool(num_blocks)
        if slot_pages:
            self._shared = self._pool = SharedPages(num_blocks, slot_pages, num_slots)
        self.window = window
        self._window_pool: BlockPool | None = None
        if window is not None:
            if window < 1 or num_window_blocks < 2:
                raise ValueError(
                    f"BlockManager.window={window}, num_window_blocks={num_window_blocks}: "
                    "must be >= 1 and >= 2 (the null block and at least one)"
                )
            self._window_pool = BlockPool(num_window_blocks, reserved=NULL_BLOCK + 1)
        if num_slots < 0:
            raise ValueError(f"BlockManager.num_slots={num_slots}: must be >= 0")
        self._num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: 0 first
        # Prompt tokens looked up and found cached (vLLM's prefix_cache_queries/hits, in tokens).
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can be given: unreferenced ones, cached or not."""
        return self._pool.num_free

    @property
    def num_free_window_blocks(self) -> int:
        return 0 if self._window_pool is None else self._window_pool.num_free

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free_slots(self) -> int:
        if self._shared is not None:
            return self._shared.num_free_slots
        return len(self._free_slots)

    @property
    def slot_pages(self) -> int:
        """Blocks a held slot takes of the pool (0: slots have memory of their own)."""
        return 0 if self._shared is None else self._shared.slot_pages

    @property
    def num_cached_blocks(self) -> int:
        return self._pool.num_cached

    @property
    def evicted_blocks(self) -> int:
        return self._pool.evicted_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self._pool.num_free / self._num_blocks

    def refs(self, block: int) -> int:
        return self._pool.refs(block)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` positions holds (the cache layout's rule)."""
        return self._blocks_for(num_tokens, self._block_size)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks so that `seq.block_table` covers positions `[0, num_tokens)`."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens}: must be >= 0")
        total = self.blocks_for(num_tokens)
        return max(0, total - len(seq.block_table))

    def fits_alone(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` positions fits the cache with nothing else held
        (its slot's pages too, where slots live in the pool)."""
        return self.blocks_for(num_tokens) + self.slot_pages <= self._num_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self._pool.num_free

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether both tables of `seq` can cover `[0, num_tokens)` now (the window's blocks
        behind the sequence's next query counted as given back)."""
        if not self.can_allocate(self.blocks_needed(seq, num_tokens)):
            return False
        pool = self._window_pool
        if pool is None:
            return True
        behind = self._behind(seq.num_computed_tokens)
        freed = seq.window_table[seq.window_first : behind]
        returned = sum(1 for block in freed if block != NULL_BLOCK and pool.refs(block) == 1)
        new = max(0, self.blocks_for(num_tokens) - len(seq.window_table))
        return new <= pool.num_free + returned

    def can_admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Whether a sequence without blocks, given its cached prefix `cached` (from
        `cached_prefix`), can cover `[0, num_tokens)` now. Cached blocks nobody references
        sit in the free queue: taking them costs free blocks too."""
        total = self.blocks_for(num_tokens)
        if self._shared is not None:
            return self._shared.can_take(total, 1 if seq.state_slot is None else 0)
        if not self.can_allocate(total - len(cached) + self._unreferenced(self._pool, cached)):
            return False
        pool = self._window_pool
        if pool is None:
            return True
        held = self._window_hit(seq, len(cached))
        return total - len(cached) + self._unreferenced(pool, held) <= pool.num_free

    @staticmethod
    def _unreferenced(pool: BlockPool, blocks: list[int]) -> int:
        return sum(1 for block in blocks if pool.refs(block) == 0)

    def _behind(self, position: int) -> int:
        """Leading blocks wholly before the window of a query at `position` (0 without one)."""
        if self.window is None:
            return 0
        return max(0, (position - self.window + 1) // self._block_size)

    # ----- prefix caching -----
    def cached_prefix(self, seq: Sequence) -> list[int]:
        """The blocks holding the longest cached prefix of `seq`, in order. Never its last token:
        that one must run through the model to give logits, and it would be written into a
        shared block. None for a request that wants prompt logprobs (vLLM's rule): they come
        from the prefill's own forward, which a cached position skips. With windowed layers the
        prefix ends where the window's blocks before its end are cached too."""
        if not self.prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        hashes = self.hashes(seq, (seq.num_tokens - 1) // self._block_size)
        blocks = []
        for digest in hashes:
            block = self._pool.cached(digest)
            if block is None:
                break
            blocks.append(block)
        return blocks[: self._window_cached(hashes[: len(blocks)])]

    def _window_cached(self, hashes: list[bytes]) -> int:
        """The longest prefix of these full blocks (cached in the main pool) whose window
        blocks a query at its end reads are cached too (without a window pool: all of them)."""
        if self._window_pool is None:
            return len(hashes)
        # runs[h]: how many window blocks are cached in a row up to block h - 1.
        run, runs = 0, [0]
        for digest in hashes:
            run = run + 1 if self._window_pool.cached(digest) is not None else 0
            runs.append(run)
        hit = len(hashes)
        while hit and runs[hit] < hit - self._behind(hit * self._block_size):
            hit -= 1
        return hit

    def _window_hit(self, seq: Sequence, hit: int) -> list[int | None]:
        """The window pool's cached blocks (None: not cached) a prefix of `hit` full blocks
        needs: those a query at its end still reads."""
        if self._window_pool is None:
            return []
        hashes = self.hashes(seq, hit)
        lo = self._behind(hit * self._block_size)
        return [self._window_pool.cached(digest) for digest in hashes[lo:]]

    def unreferenced(self, blocks: list[int]) -> int:
        """How many of `blocks` lie in the free queue (taking them costs free blocks)."""
        return self._unreferenced(self._pool, blocks)

    def take_cached(self, seq: Sequence, blocks: list[int]) -> None:
        """Give a sequence without blocks the cached prefix `blocks` (from `cached_prefix`)."""
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError(f"take_cached: {seq!r} already has blocks or computed tokens")
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += len(blocks) * self._block_size
        for block in blocks:
            self._pool.share(block)
            seq.block_table.append(block)
        if self._window_pool is not None:
            held = self._window_hit(seq, len(blocks))
            seq.window_first = len(blocks) - len(held)
            seq.window_table = [NULL_BLOCK] * seq.window_first
            for block in held:
                self._window_pool.share(block)
                seq.window_table.append(block)
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
        """After a step: register every block of `seq` that its computed positions now fill (a
        block whose hash another block already holds stays unregistered, freed like any
        uncached block), then release the window's blocks its next query no longer reads."""
        full = seq.num_computed_tokens // self._block_size
        if self.prefix_caching and full > seq.num_registered_blocks:
            hashes = self.hashes(seq, full)
            for index in range(seq.num_registered_blocks, full):
                self._pool.register(seq.block_table[index], hashes[index])
                if self._window_pool is not None and index < len(seq.window_table):
                    block = seq.window_table[index]
                    if block != NULL_BLOCK:
                        self._window_pool.register(block, hashes[index])
            seq.num_registered_blocks = full
        self._slide(seq)

    def _slide(self, seq: Sequence) -> None:
        """Release the window blocks wholly behind the window of the query at
        `seq.num_computed_tokens` (the next position a step computes)."""
        if self._window_pool is None:
            return
        behind = min(self._behind(seq.num_computed_tokens), len(seq.window_table))
        for index in range(seq.window_first, behind):
            block = seq.window_table[index]
            if block != NULL_BLOCK:
                self._window_pool.release(block)
                seq.window_table[index] = NULL_BLOCK
        seq.window_first = max(seq.window_first, behind)

    # ----- allocation -----
    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Blocks so that both tables of `seq` cover `[0, num_tokens)`, and its state slot if
        it has none yet."""
        if self._shared is not None and seq.state_slot is None:
            if not self._shared.can_take(self.blocks_needed(seq, num_tokens), 1):
                raise RuntimeError(
                    f"no free state slot for {seq.request_id!r} beside its blocks: "
                    f"{self._shared.num_free_slots} slot(s) and {self._shared.num_free} "
                    "block(s) free (the scheduler admits by can_admit)"
                )
            seq.state_slot = self._shared.take_slot()
        elif self._num_slots and seq.state_slot is None:
            if not self._free_slots:
                raise RuntimeError(
                    f"no free state slot for {seq.request_id!r}: all {self._num_slots} are held "
                    "(the scheduler runs at most that many sequences)"
                )
            seq.state_slot = self._free_slots.pop()
        needed = self.blocks_needed(seq, num_tokens)
        self._extend(self._pool, seq.block_table, needed, seq, num_tokens)
        if self._window_pool is not None:
            self._slide(seq)
            needed = max(0, self.blocks_for(num_tokens) - len(seq.window_table))
            self._extend(self._window_pool, seq.window_table, needed, seq, num_tokens)

    def _extend(
        self,
        pool: BlockPool | SharedPages,
        table: list[int],
        needed: int,
        seq: Sequence,
        num_tokens: int,
    ) -> None:
        if needed > pool.num_free:
            kind = "window " if pool is self._window_pool else ""
            raise RuntimeError(
                f"KV cache out of {kind}blocks: {seq.request_id!r} needs {needed} more block(s) "
                f"for {num_tokens} positions, {pool.num_free} of {pool.num_blocks} free"
            )
        table.extend(pool.take() for _ in range(needed))

    def free(self, seq: Sequence) -> None:
        # The tables are cleared below, so freeing the same sequence twice returns nothing twice.
        window = [b for b in seq.window_table if b != NULL_BLOCK]
        for block in seq.block_table:
            self._pool.check_held(block, seq.request_id)
        for block in window:
            self._window_pool.check_held(block, seq.request_id)
        # Last blocks first: a sequence's tail is the part least likely to be shared, so it is
        # evicted before the blocks of its (maybe common) beginning.
        for block in reversed(seq.block_table):
            self._pool.release(block)
        for block in reversed(window):
            self._window_pool.release(block)
        seq.block_table.clear()
        seq.window_table.clear()
        seq.window_first = 0
        seq.num_registered_blocks = 0
        if seq.state_slot is not None:
            if self._shared is not None:
                self._shared.release_slot(seq.state_slot)
            else:
                self._free_slots.append(seq.state_slot)
            seq.state_slot = None
