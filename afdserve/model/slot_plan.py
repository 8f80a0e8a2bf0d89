"""State slots in the pages of the paged groups (model/cache.py's `CacheLayout.slot_plan`): how a
slot's parts pack into the paged tensors' spans, and the views that address them.

Every paged tensor of every layer (`[blocks, ...]`, contiguous, `row_bytes` per block) is a
*row*. Slot s of S holds blocks `[N - (S - s) pages, N - (S - s - 1) pages)` of every row, and
each part of each slot layer (a delta-rule state, a convolution window) sits whole in one row at
a byte offset of that span, so a part is one strided view `[S + 1, *shape]` whose slot stride is
the span, not its size. The scratch slot S holds `pages` blocks past the N the tables address.
vLLM v1's hybrid allocator draws a sequence's recurrent state from its one pool the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Every part starts on a multiple of it (any dtype's size, and what vectorized loads want).
SLOT_ALIGN = 64

Part = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype) of one part of one slot


@dataclass(frozen=True)
class SlotPlan:
    pages: int  # blocks a slot spans in every row
    row_bytes: int
    places: tuple[tuple[int, int], ...]  # (row, byte offset) of each part, in the parts' order


def part_bytes(part: Part) -> int:
    shape, dtype = part
    return -(-torch.Size(shape).numel() * dtype.itemsize // SLOT_ALIGN) * SLOT_ALIGN


def pack(rows: int, row_bytes: int, parts: list[Part]) -> SlotPlan | None:
    """The fewest blocks a slot can span so that `parts` fit `rows` rows of `row_bytes` a block,
    first-fit, largest first (None: nothing to place, or rows that cannot hold an aligned
    part)."""
    if not parts or rows < 1 or row_bytes % SLOT_ALIGN:
        return None
    sizes = [part_bytes(p) for p in parts]
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])
    pages = max(-(-sum(sizes) // (rows * row_bytes)), -(-max(sizes) // row_bytes))
    while True:  # ends: a span of sum(sizes) bytes holds every part in row 0
        fill = [0] * rows
        places: list[tuple[int, int]] = [(0, 0)] * len(sizes)
        for i in order:
            room = pages * row_bytes - sizes[i]
            r = next((r for r, f in enumerate(fill) if f <= room), None)
            if r is None:
                break
            places[i] = (r, fill[r])
            fill[r] += sizes[i]
        else:
            return SlotPlan(pages, row_bytes, tuple(places))
        pages += 1


def views(
    plan: SlotPlan, rows: list[torch.Tensor], parts: list[Part], num_blocks: int, num_slots: int
) -> list[torch.Tensor]:
    """Each part as a `[num_slots + 1, *shape]` view into its row (`rows`: the paged tensors,
    each `[num_blocks + plan.pages, ...]`): slot s at block `num_blocks - (num_slots - s) *
    pages`, the scratch (slot num_slots) at num_blocks."""
    first = (num_blocks - num_slots * plan.pages) * plan.row_bytes
    out = []
    for (shape, dtype), (row, offset) in zip(parts, plan.places, strict=True):
        flat = rows[row].view(-1).view(torch.uint8).view(dtype)
        inner = torch.empty(shape, device="meta").stride()
        size = dtype.itemsize
        out.append(
            flat.as_strided(
                (num_slots + 1, *shape),
                (plan.pages * plan.row_bytes // size, *inner),
                (first + offset) // size,
            )
        )
    return out
