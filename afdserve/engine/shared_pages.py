"""One pool of pages that holds both blocks and sequence slots, for layouts whose per-sequence
state lives in the paged groups' pages (model/cache.py's `SlotPlan`): memory flows between the
KV of long sequences and the state of many short ones instead of being split up front (vLLM
v1's hybrid allocator draws a sequence's recurrent state from its one pool the same way).

Slot s of S covers the `pages` consecutive pages `[N - (S - s) pages, N - (S - s - 1) pages)`,
so slots grow down from the top of the pool while blocks grow up from its bottom: a block is
the lowest free page below the slots' region, a slot the topmost free slot, or a new one just
below the region where its pages are free of blocks. When the region's lowest slot or the
blocks' highest page is given back, the region shrinks back, so a page serves as a block
after it served a slot and the other way round. A freed slot inside the region, or a block
held high up, keeps its pages to its own kind until that happens (fragmentation, not loss:
once the sequences holding them finish, every page is free).

No prefix caching here: the layouts that keep state in slots refuse it (a cached block holds
no state to resume from), and the block manager refuses the two together.
"""

from __future__ import annotations

import heapq

from afdserve.engine.block_pool import RefCounts


class SharedPages(RefCounts):
    """The block-pool interface of engine/block_pool.py (no prefix hashes) plus slots."""

    def __init__(self, num_pages: int, slot_pages: int, num_slots: int) -> None:
        if slot_pages < 1 or num_slots < 1 or num_slots * slot_pages > num_pages:
            raise ValueError(
                f"SharedPages: {num_slots} slots of {slot_pages} pages do not fit "
                f"{num_pages} pages (each must be >= 1)"
            )
        super().__init__()
        self.num_blocks = num_pages
        self.slot_pages = slot_pages
        self.num_slots = num_slots
        self._top = 0  # blocks live in [0, _top); pages past it hold no block
        self._free: list[int] = []  # freed blocks below _top (a heap; lazily deleted)
        self._free_set: set[int] = set()
        self._low = num_slots  # slots live in [_low, num_slots)
        self._free_slots: list[int] = []  # freed slots above _low, as -slot (a max-heap)
        self._free_slot_set: set[int] = set()
        self.evicted_blocks = 0
        self.num_cached = 0

    def _floor(self, low: int) -> int:
        """The first page of the slots' region when it starts at slot `low`."""
        return self.num_blocks - (self.num_slots - low) * self.slot_pages

    @property
    def num_free(self) -> int:
        """Blocks that can be taken now, without taking a new slot."""
        return len(self._free_set) + self._floor(self._low) - self._top

    @property
    def num_free_slots(self) -> int:
        """Slots that can be taken now, without taking a block."""
        fresh = min(self._low, (self._floor(self._low) - self._top) // self.slot_pages)
        return len(self._free_slot_set) + fresh

    def cached(self, digest: bytes) -> int | None:
        return None

    def can_take(self, blocks: int, slots: int) -> bool:
        """Whether `blocks` blocks and `slots` (0 or 1) slot can be taken together now."""
        if slots and not self._free_slot_set:
            floor = self._floor(self._low - 1)
            return (
                self._low > 0
                and floor >= self._top
                and blocks <= len(self._free_set) + (floor - self._top)
            )
        return blocks <= self.num_free

    def take(self) -> int:
        while self._free:
            block = heapq.heappop(self._free)
            if block in self._free_set:
                self._free_set.discard(block)
                self._refs[block] = 1
                return block
        if self._top >= self._floor(self._low):
            raise RuntimeError("SharedPages.take: no free page below the slots")
        block = self._top
        self._top += 1
        self._refs[block] = 1
        return block

    def share(self, block: int) -> None:
        raise RuntimeError("SharedPages.share: prefix caching is not supported with shared slots")

    def register(self, block: int, digest: bytes) -> None:
        raise RuntimeError(
            "SharedPages.register: prefix caching is not supported with shared slots"
        )

    def release(self, block: int) -> None:
        if not self._unref(block):
            return
        self._free_set.add(block)
        heapq.heappush(self._free, block)
        while self._top and self._top - 1 in self._free_set:  # shrink the blocks' part
            self._top -= 1
            self._free_set.discard(self._top)
        if len(self._free) > 2 * len(self._free_set) + 64:  # drop the entries shrinking left
            self._free = sorted(self._free_set)

    def take_slot(self) -> int:
        while self._free_slots:
            slot = -heapq.heappop(self._free_slots)
            if slot in self._free_slot_set:
                self._free_slot_set.discard(slot)
                return slot
        if self._low == 0 or self._floor(self._low - 1) < self._top:
            raise RuntimeError("SharedPages.take_slot: no slot's pages are free of blocks")
        self._low -= 1
        return self._low

    def release_slot(self, slot: int) -> None:
        if not self._low <= slot < self.num_slots or slot in self._free_slot_set:
            raise RuntimeError(f"SharedPages.release_slot: slot {slot} is not held")
        self._free_slot_set.add(slot)
        heapq.heappush(self._free_slots, -slot)
        while self._low < self.num_slots and self._low in self._free_slot_set:  # shrink
            self._free_slot_set.discard(self._low)
            self._low += 1
        if len(self._free_slots) > 2 * len(self._free_slot_set) + 64:
            self._free_slots = sorted(-s for s in self._free_slot_set)
