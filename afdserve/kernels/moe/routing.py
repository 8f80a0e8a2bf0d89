"""How an expert program finds its expert and its (token, expert) pairs, shared by the MoE kernels.

The decode kernels' gate/up and down kernels open with a program per (column tile, expert slot).
With fewer pairs than experts, slot `s` takes the expert of pair `s` and runs only if `s` is that
expert's first pair; with more, slot `s` is expert `s`. Pairs with id -1 (a pad row, or an expert
another rank holds) belong to no program. Two forms of the same ranking:
- held (decode.py, fp8_decode.py): `program_pairs` ranks the whole pair list once and holds it in
  registers across the weight loop, `tile_pairs` picks a tile's pairs from it;
- by chunk (fp4_decode.py): `program_pairs_by_chunk` and `tile_pairs_by_chunk` re-read the list
  64 pairs at a time, so no [ROWS, PAIRS_PAD] pick (64 registers a thread at 512 pairs) sets the
  kernel's register count. The FP4 kernels need that to hold three programs an SM under their
  register cap (4-5% faster at 8 and 64 rows on an H100); the bf16 kernels measured no faster
  read by chunk (docs/benchmarks.md, 2026-12-06, eighteenth session), so they keep the held form.
The grouped kernels (grouped.py) read align.py's assignment instead: `tile_rows`.
The host side (`DecodeLaunch`, `in_row_chunks`) is what every decode path sets up alike.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl


@triton.jit
def expert_pairs(ids_ptr, num_pairs, slot, PAIRS_PAD: tl.constexpr, BY_EXPERT: tl.constexpr):
    """The expert program `slot` owns and its pairs (none if it owns no expert: pairs of id -1
    are no program's, so their count is 0 and no weight is read for them).
    Returns (expert, pair indices, which pairs are this expert's, their rank, their count)."""
    pair = tl.arange(0, PAIRS_PAD)
    ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)
    if BY_EXPERT:
        expert = slot.to(tl.int64)
        mine = ids == expert
    else:
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        same = (ids == expert) & (ids >= 0)
        owned_earlier = tl.sum((same & (pair < slot)).to(tl.int32), axis=0)
        mine = same & (owned_earlier == 0)
    rank = tl.cumsum(mine.to(tl.int32), axis=0) - 1
    count = tl.sum(mine.to(tl.int32), axis=0)
    return expert, pair, mine, rank, count


@triton.jit
def program_pairs(
    ids_ptr,
    num_pairs,
    width,
    PAIRS_PAD: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """A decode expert kernel's prologue, for the program at (column tile, expert slot) of the
    grid: `expert_pairs`' five values, then the tile's output columns and which are < `width`."""
    slot = tl.program_id(1)
    expert, pair, mine, rank, count = expert_pairs(ids_ptr, num_pairs, slot, PAIRS_PAD, BY_EXPERT)
    col, col_ok = _columns(width, COLUMNS)
    return expert, pair, mine, rank, count, col, col_ok


@triton.jit
def _columns(width, COLUMNS: tl.constexpr):
    """The program's tile of output columns (grid axis 0) and which are < `width`."""
    col = tl.program_id(0) * COLUMNS + tl.arange(0, COLUMNS)
    return col, col < width


@triton.jit
def tile_pairs(pair, mine, rank, first, count, ROWS: tl.constexpr):
    """Pairs of ranks [first, first + ROWS) of one expert, and which of those rows exist."""
    row = first + tl.arange(0, ROWS)
    pick = mine[None, :] & (rank[None, :] == row[:, None])  # [ROWS, PAIRS_PAD]
    return tl.sum(tl.where(pick, pair[None, :], 0), axis=1), row < count


# Pairs the by-chunk form reads at a time.
CHUNK = tl.constexpr(64)


@triton.jit
def _chunk(ids_ptr, num_pairs, first):
    """Pairs [first, first + CHUNK) and their expert ids (-1 past the list)."""
    pair = first + tl.arange(0, CHUNK)
    return pair, tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1)


@triton.jit
def _expert_of(ids_ptr, num_pairs, slot, PAIRS_PAD: tl.constexpr, BY_EXPERT: tl.constexpr):
    """The expert program `slot` owns, and whether it owns one (`expert_pairs`' rule), the pair
    list read a chunk at a time."""
    if BY_EXPERT:
        expert = slot.to(tl.int64)
        owns = slot >= 0
    else:
        expert = tl.load(ids_ptr + slot).to(tl.int64)
        earlier = 0
        for c in range(0, PAIRS_PAD, CHUNK):
            pair, ids = _chunk(ids_ptr, num_pairs, c)
            earlier += tl.sum(((ids == expert) & (pair < slot)).to(tl.int32), axis=0)
        owns = (earlier == 0) & (expert >= 0)
    return expert, owns


@triton.jit
def program_pairs_by_chunk(
    ids_ptr,
    num_pairs,
    width,
    PAIRS_PAD: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    COLUMNS: tl.constexpr,
):
    """`program_pairs` by chunk: (expert, whether the program owns it, its pair count, the tile's
    output columns, which are < `width`)."""
    expert, owns = _expert_of(ids_ptr, num_pairs, tl.program_id(1), PAIRS_PAD, BY_EXPERT)
    count = 0
    for c in range(0, PAIRS_PAD, CHUNK):
        _, ids = _chunk(ids_ptr, num_pairs, c)
        count += tl.sum(((ids == expert) & owns).to(tl.int32), axis=0)
    col, col_ok = _columns(width, COLUMNS)
    return expert, owns, count, col, col_ok


@triton.jit
def tile_pairs_by_chunk(
    ids_ptr,
    num_pairs,
    expert,
    owns,
    first,
    count,
    PAIRS_PAD: tl.constexpr,
    ROWS: tl.constexpr,
):
    """`tile_pairs` by chunk: the program's pairs of ranks [first, first + ROWS) among its
    expert's, in pair order, and which of those rows exist."""
    row = first + tl.arange(0, ROWS)
    found = tl.zeros((ROWS,), dtype=tl.int32)
    seen = 0
    for c in range(0, PAIRS_PAD, CHUNK):
        pair, ids = _chunk(ids_ptr, num_pairs, c)
        mine = ((ids == expert) & owns).to(tl.int32)
        rank = seen + tl.cumsum(mine, axis=0) - 1
        pick = (mine[None, :] != 0) & (rank[None, :] == row[:, None])  # [ROWS, CHUNK]
        found += tl.sum(tl.where(pick, pair[None, :], 0), axis=1)
        seen += tl.sum(mine, axis=0)
    return found, row < count


@triton.jit
def tile_rows(slots_ptr, end_ptr, count_ptr, num_experts, ROWS: tl.constexpr, E_PAD: tl.constexpr):
    """The grouped kernels' prologue: the expert of this program's tile of align.py's slots
    (num_experts past the last group), the tile's pair indices and which of its rows hold one."""
    first = tl.program_id(0) * ROWS
    e = tl.arange(0, E_PAD)
    ends = tl.load(end_ptr + e, mask=e < num_experts, other=2147483647)
    done = ends <= first
    expert = tl.sum(done.to(tl.int32), axis=0)  # groups ending at or before this tile
    start = tl.max(tl.where(done, ends, 0), axis=0)
    count = tl.load(count_ptr + tl.minimum(expert, num_experts - 1))
    slot = first + tl.arange(0, ROWS)
    # (A tile past the last group has expert == num_experts; the comparison is broadcast over
    # the rows, which Triton's interpreter needs for a mask.)
    row_ok = (slot - start < count) & (slot * 0 + expert < num_experts)
    pairs = tl.load(slots_ptr + slot, mask=row_ok, other=0)
    return expert, pairs, row_ok


class DecodeLaunch(NamedTuple):
    """What a decode path's three launches share: the flat pair list (pair p = row * top_k + j),
    the h and y buffers, the output, the expert slots of the grid and the routing constexprs."""

    ids: torch.Tensor  # [pairs]
    weights: torch.Tensor  # [pairs]
    h: torch.Tensor  # [pairs, inter] in x's dtype
    y: torch.Tensor  # [pairs, hidden] float32
    out: torch.Tensor  # like x
    slots: int
    routing: dict


def decode_launch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    experts: int,
    inter: int,
    rows: int | None = None,
) -> DecodeLaunch:
    """The buffers and routing of one launch over x [rows, hidden]. The pair list is padded to a
    power of two from 64 (one compile serves every count up to a decode batch of 8 at top-8);
    `rows`: pairs of one expert per tile (None: `rows_per_tile`'s choice by load)."""
    ids = topk_ids.reshape(-1).contiguous()
    pairs, hidden = ids.numel(), x.shape[1]
    routing = dict(
        PAIRS_PAD=max(64, triton.next_power_of_2(pairs)),
        BY_EXPERT=pairs > experts,
        ROWS=rows or rows_per_tile(pairs, experts),
    )
    return DecodeLaunch(
        ids,
        topk_weights.reshape(-1).contiguous(),
        torch.empty(pairs, inter, dtype=x.dtype, device=x.device),
        torch.empty(pairs, hidden, dtype=torch.float32, device=x.device),
        torch.empty_like(x),
        min(pairs, experts),
        routing,
    )


def rows_per_tile(pairs: int, experts: int) -> int:
    """Pairs of one expert per tile: twice the mean load, at least tl.dot's smallest height (16).
    An expert with more pairs loops over tiles and re-reads its weights for each."""
    mean = -(-pairs // min(pairs, experts))
    return min(64, max(16, triton.next_power_of_2(2 * mean)))


def in_row_chunks(
    topk_ids: torch.Tensor,
    max_pairs: int,
    run: Callable[[slice], torch.Tensor],
) -> torch.Tensor:
    """`run(rows)` over slices of rows holding at most `max_pairs` pairs (at least one row
    each), concatenated; one slice's output as it is."""
    rows, top_k = topk_ids.shape
    step = max(1, max_pairs // top_k)
    outs = [run(slice(r, r + step)) for r in range(0, rows, step)]
    return outs[0] if len(outs) == 1 else torch.cat(outs)
