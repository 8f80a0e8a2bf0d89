"""Token -> expert assignment for the grouped expert kernels, with no sort and no host sync.

The routed (token, k) pairs of a step, p = row * top_k + j, are grouped by expert, each group
padded to a whole number of row tiles, so that one program owns one tile of one expert and reads
its weight tile once for all the tile's rows. A counting sort in two launches:
1. count: a program per chunk of pairs counts each expert's pairs in its chunk and gives each
   pair its rank among the chunk's pairs of the same expert.
2. place: every program reads the chunk x expert count grid (sized to be small), derives the
   padded group starts by prefix sums over experts and chunks, and writes each of its pairs into
   slot start[expert] + (pairs of that expert in earlier chunks) + rank.
The slots keep pair order within a group (stable), so results do not depend on launch timing.
Slots past a group's count are never written (the kernels mask them by the count); pairs with
an id outside [0, experts) get no slot. Sizes are static per pair count (a CUDA graph replays
them): the slot buffer holds the worst case, every group one partial tile past its pairs.
Every size that follows the pair count (the pairs, the chunk length, the chunks) is a runtime
argument, unspecialized, and the count grid's pad is fixed by the expert count: one compile per
expert count and tile height serves every step, so a server's warm-up compiles what its traffic
runs (a pair count a power of two apart used to compile both kernels again, under traffic).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The count grid every `place` program loads is chunks x experts: capped at this many cells, so
# a program holds it in registers (64 chunks at 128 experts, 16 at 512).
GRID_CELLS = 8192
SUB = 32  # pairs a program compares against every expert at once (an experts x SUB block)


@dataclass(frozen=True)
class Assignment:
    """Pairs grouped by expert. `slots[expert_start[e] + i]` is the i-th pair routed to expert e
    for i < expert_count[e]; each group spans a whole number of `rows`-row tiles, starting at
    `expert_end[e - 1]` (0 for e = 0). `tiles`: the static number of tiles a kernel grid covers
    (tiles past the last group's end belong to no expert)."""

    slots: torch.Tensor  # int32 [tiles * rows]
    expert_end: torch.Tensor  # int32 [experts]: end slot of each padded group
    expert_count: torch.Tensor  # int32 [experts]
    rows: int
    tiles: int


def max_tiles(pairs: int, experts: int, rows: int) -> int:
    """Tiles of the worst case: all pairs' whole tiles plus one partial tile per touched expert."""
    return triton.cdiv(pairs, rows) + min(experts, pairs)


def _most_chunks(experts_pad: int) -> int:
    """The count grid's rows: as many chunks as GRID_CELLS allows (a power of two, >= 2)."""
    return max(2, GRID_CELLS // experts_pad)


def _chunking(pairs: int, experts_pad: int) -> tuple[int, int]:
    """(pairs per chunk, chunks): as many chunks as the count grid allows."""
    chunk = max(SUB, triton.next_power_of_2(triton.cdiv(pairs, _most_chunks(experts_pad))))
    return chunk, triton.cdiv(pairs, chunk)


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "chunk_len"])
def _count_kernel(
    ids_ptr,
    counts_ptr,
    rank_ptr,
    num_pairs,
    num_experts,
    chunk_len,
    E_PAD: tl.constexpr,
    SUB: tl.constexpr,
    GDC: tl.constexpr = 0,
):
    if GDC:  # launched early (programmatic dependent launch): wait for the kernels before
        tl.extra.cuda.gdc_wait()
    chunk = tl.program_id(0)
    expert = tl.arange(0, E_PAD)
    seen = tl.zeros((E_PAD,), dtype=tl.int32)
    for s in range(0, chunk_len, SUB):
        pair = chunk * chunk_len + s + tl.arange(0, SUB)
        ids = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=-1).to(tl.int32)
        hit = (ids[None, :] == expert[:, None]) & (expert[:, None] < num_experts)  # [E_PAD, SUB]
        before = tl.cumsum(hit.to(tl.int32), axis=1) - 1 + seen[:, None]
        rank = tl.sum(tl.where(hit, before, 0), axis=0)
        tl.store(rank_ptr + pair, rank, mask=pair < num_pairs)
        seen += tl.sum(hit.to(tl.int32), axis=1)
    tl.store(counts_ptr + chunk * E_PAD + expert, seen)


@triton.jit(do_not_specialize=["num_pairs", "num_experts", "num_chunks", "chunk_len"])
def _place_kernel(
    ids_ptr,
    counts_ptr,
    rank_ptr,
    slots_ptr,
    end_ptr,
    count_ptr,
    num_pairs,
    num_experts,
    num_chunks,
    chunk_len,
    ROWS: tl.constexpr,
    E_PAD: tl.constexpr,
    CHUNKS_PAD: tl.constexpr,
    SUB: tl.constexpr,
    GDC: tl.constexpr = 0,
):
    if GDC:
        tl.extra.cuda.gdc_wait()
    chunk = tl.program_id(0)
    expert = tl.arange(0, E_PAD)
    row = tl.arange(0, CHUNKS_PAD)
    grid = tl.load(
        counts_ptr + row[:, None] * E_PAD + expert[None, :], mask=row[:, None] < num_chunks, other=0
    )  # [CHUNKS_PAD, E_PAD]
    count = tl.sum(grid, axis=0)
    padded = (count + ROWS - 1) // ROWS * ROWS
    end = tl.cumsum(padded, axis=0)
    earlier = tl.cumsum(grid, axis=0) - grid  # pairs of each expert in the chunks before
    base = end - padded + tl.sum(tl.where(row[:, None] == chunk, earlier, 0), axis=0)
    if chunk == 0:
        keep = expert < num_experts
        tl.store(end_ptr + expert, end, mask=keep)
        tl.store(count_ptr + expert, count, mask=keep)
    for s in range(0, chunk_len, SUB):
        pair = chunk * chunk_len + s + tl.arange(0, SUB)
        ok = pair < num_pairs
        ids = tl.load(ids_ptr + pair, mask=ok, other=-1).to(tl.int32)
        rank = tl.load(rank_ptr + pair, mask=ok, other=0)
        hit = (ids[None, :] == expert[:, None]) & (expert[:, None] < num_experts)
        slot = tl.sum(tl.where(hit, base[:, None], 0), axis=0) + rank
        routed = tl.sum(hit.to(tl.int32), axis=0) > 0
        tl.store(slots_ptr + slot, pair, mask=ok & routed)


def assign(ids: torch.Tensor, experts: int, rows: int, gdc: int = 0) -> Assignment:
    """ids [pairs] (any integer dtype; ids outside [0, experts) are dropped) -> the grouping."""
    pairs = ids.numel()
    ids = ids.reshape(-1).contiguous()
    experts_pad = max(16, triton.next_power_of_2(experts))
    chunk, chunks = _chunking(pairs, experts_pad)
    tiles = max_tiles(pairs, experts, rows)
    dev = ids.device
    counts = torch.empty(chunks, experts_pad, dtype=torch.int32, device=dev)
    rank = torch.empty(pairs, dtype=torch.int32, device=dev)
    slots = torch.empty(tiles * rows, dtype=torch.int32, device=dev)
    end = torch.empty(experts, dtype=torch.int32, device=dev)
    count = torch.empty(experts, dtype=torch.int32, device=dev)
    warps = 4 if experts_pad <= 128 else 8
    _count_kernel[(chunks,)](
        ids,
        counts,
        rank,
        pairs,
        experts,
        chunk,
        E_PAD=experts_pad,
        SUB=SUB,
        GDC=gdc,
        num_warps=warps,
        launch_pdl=gdc > 0,
    )
    _place_kernel[(chunks,)](
        ids,
        counts,
        rank,
        slots,
        end,
        count,
        pairs,
        experts,
        chunks,
        chunk,
        ROWS=rows,
        E_PAD=experts_pad,
        CHUNKS_PAD=_most_chunks(experts_pad),
        SUB=SUB,
        GDC=gdc,
        num_warps=warps,
        launch_pdl=gdc > 0,
    )
    return Assignment(slots, end, count, rows, tiles)
