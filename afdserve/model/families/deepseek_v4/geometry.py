"""DeepSeek-V4's state geometry: which pages a layer keeps per block of the engine's cache and
which rings per sequence slot, their rows, widths and storage (cache.py allocates and addresses
them; its docstring says how a chunk reads and writes them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from afdserve.kernels import ops
from afdserve.model.config import ModelConfig

# The most rows a step may write past what a sequence keeps and take back (a speculative step's
# drafts): the rings hold them beside every row a rollback can return to (`LayerGeometry.ring`):
# Flash's HCA rings grow from 128 rows to 144, its CSA rings from 4 to 24 (a slot from 6.0 MB to
# 10.4 MB). cache.DRAFT_LIMIT refuses more drafts by name.
MAX_DRAFT_ROWS = 16


def ring_rows(rate: int, csa: bool) -> int:
    """R, the rows of a compressor's slot rings (a position p at row p % R), so that rows at
    their own positions survive a rolled-back step: a chunk resuming at s reads the open rows
    of [s - s % m, s) and CSA the first series of the window before (from s - s % m - m), and
    every row written since, a rejected draft's included, lies before s + MAX_DRAFT_ROWS.
    R = m (CSA 2 m) + MAX_DRAFT_ROWS keeps those positions apart modulo R."""
    return (2 * rate if csa else rate) + MAX_DRAFT_ROWS


@dataclass(frozen=True)
class LayerGeometry:
    """One layer's pages per block: name -> (rows, width, storage), for rate m and B = block_size:
    - `window` [B, head_dim]: the rotated KV of position p sits in block table[p // B] at row
      p % B, through the sequence's window table: its pages are in the engine's window pool,
      which frees the blocks behind the window, so a row per position costs a few blocks per
      sequence (it was a ring of window - 1 rows per block while every block kept it), and no
      write ever lands on another position's row.
    - `entries` [ceil(B / m), head_dim] (compressed layers): entry w (tokens [w m, (w+1) m)) sits
      in the block of position w m, at slot w - ceil(b B / m): block_size / rate entries per
      block, the only part that grows with the context.
    - `prev_kv`, `prev_gate` (CSA only, where B is a multiple of every compress rate, so that
      prefix caching resumes at block boundaries) [m, head_dim]: the first series of the window
      ending at the block's end (its gate with the position bias added, float32 as computed),
      which the next window's entry overlaps: what a chunk resuming there reads; in the window
      pool beside the window's rows where the window is wider than m (`pooled`).
    - `index_*`: the same for a CSA layer's lightning indexer at `index_head_dim` (its keys
      are `index_entries`).
    `open` lists the slot's rings, name -> (R, width, storage), R = `ring`: `open_kv`,
    `open_gate` (and `index_open_*`), the kv / gate projections of the compressor's latest rows
    (what the window still open has not pooled), position p at row p % R of the sequence's
    slot: fixed in size, so kept per sequence rather than per block (HCA's 128 rows would
    outweigh its block's entries); and CSA's `prev_*` rings: the first series of the windows a
    chunk closed inside a block (every window's at other block sizes, `prev_in_slot`), at
    their positions alike. R leaves room for a speculative step's drafts: see `ring`.
    Storage: "kv" pages (window, entries: what queries read) take the cache's dtype; "state"
    rows (the compressor's open rows and first series) the model's; "float32" stays (`stored`
    says how an FP8 cache holds each)."""

    kind: str
    block_size: int
    window: int
    rate: int  # 0: sliding layer, no compressor
    pages: tuple[tuple[str, int, int, str], ...]
    rope: int  # the trailing rotated channels of every key and entry
    open: tuple[tuple[str, int, int, str], ...] = ()
    prev_in_slot: bool = False  # CSA's first series in the slot, not the pages

    @classmethod
    def of(cls, config: ModelConfig, layer: int, block_size: int) -> LayerGeometry:
        v4, dim = config.family_config, config.head_dim
        kind, rate = v4.attention_types[layer], v4.compress_rate(layer)
        pages = [("window", block_size, dim, "kv")]
        open_rows: list[tuple[str, int, int, str]] = []
        rates = (v4.compress_rate(i) for i in range(len(v4.attention_types)))
        prev_in_slot = block_size % math.lcm(*(r for r in rates if r)) != 0
        if rate:
            csa = kind == "compressed_sparse_attention"
            compressors = [("", dim)] + ([("index_", v4.index_head_dim)] if csa else [])
            slots = -(-block_size // rate)
            for prefix, width in compressors:
                pages.append((f"{prefix}entries", slots, width, "kv"))
                projected = 2 * width if csa else width
                ring = ring_rows(rate, csa)
                open_rows.append((f"{prefix}open_kv", ring, projected, "state"))
                open_rows.append((f"{prefix}open_gate", ring, projected, "state"))
                if csa:
                    open_rows.append((f"{prefix}prev_kv", ring, width, "state"))
                    open_rows.append((f"{prefix}prev_gate", ring, width, "float32"))
                    if not prev_in_slot:
                        pages.append((f"{prefix}prev_kv", rate, width, "state"))
                        pages.append((f"{prefix}prev_gate", rate, width, "float32"))
        return cls(
            kind,
            block_size,
            v4.sliding_window,
            rate,
            tuple(pages),
            config.qk_rope_head_dim,
            tuple(open_rows),
            prev_in_slot,
        )

    @property
    def ring(self) -> int:
        """Rows of each slot ring (`ring_rows`; 0: a sliding layer's, which has none)."""
        return ring_rows(self.rate, self.kind == "compressed_sparse_attention") if self.rate else 0

    def pooled(self, name: str) -> bool:
        """Whether page `name` sits in the engine's window pool (cache.V4Window), whose blocks
        behind the window are freed: the window's rows, and CSA's first series of the window
        ending a block (what a chunk resuming there reads, in a block a prefix hit there needs
        cached for the window's rows anyway), where the window reaches back past a compressor
        window (window > m: a chunk reads that series only while it is in its last m
        positions, so never from a freed block)."""
        if name.startswith("window"):
            return True
        return name.endswith(("prev_kv", "prev_gate")) and self.window > self.rate

    @property
    def resumable(self) -> bool:
        """Whether every block boundary is one of the compressor's window boundaries: then the
        state at a block's end lies in that block and the ones before it (a window's entry and
        first series sit in the block it starts in), so a chunk completing the block can leave
        it there and a reused block is never written again."""
        return self.rate == 0 or self.block_size % self.rate == 0

    def pieces(self, start: int, end: int) -> list[tuple[int, int]]:
        """[start, end) cut at the block boundaries inside it, when the boundaries resume."""
        if not self.resumable:
            return [(start, end)]
        cuts = range((start // self.block_size + 1) * self.block_size, end, self.block_size)
        bounds = [start, *cuts, end]
        return list(zip(bounds[:-1], bounds[1:]))

    def stored(
        self, cache_dtype: torch.dtype, slot: bool = False
    ) -> list[tuple[str, int, int, torch.dtype]]:
        """The tensors a cache of `cache_dtype` holds per block (`slot`: per sequence slot):
        (name, rows, width, dtype).
        An FP8 cache splits each "kv" page: its unrotated channels e4m3, the rotated ones
        (`{name}_rope`) bf16, as DeepSeek's FP8 MLA cache keeps its rope part (on tiny V4s,
        mean |d logprob| 0.18 against 0.28 all in e4m3: tools/kv_fp8_quality.py). It keeps
        the compressor's state bf16 (V4's dtype wherever e4m3 runs): the gates are softmax
        logits, which e4m3 would reweight by up to e^(|g| / 16), and the rows are pooled
        before the entry is quantized once. prev_gate stays float32, as computed."""
        fp8 = cache_dtype == ops.FP8_DTYPE
        out = []
        for name, rows, width, storage in self.open if slot else self.pages:
            if storage == "float32":
                out.append((name, rows, width, torch.float32))
            elif not fp8:
                out.append((name, rows, width, cache_dtype))
            elif storage == "state":
                out.append((name, rows, width, torch.bfloat16))
            else:
                out.append((name, rows, width - self.rope, cache_dtype))
                out.append((f"{name}_rope", rows, self.rope, torch.bfloat16))
        return out

    def bytes_per_block(self, dtype: torch.dtype, window: bool | None = None) -> int:
        """Bytes of the pages per block: the window's alone (`window` True), the others
        (False), or all of them (None)."""
        return sum(
            rows * width * d.itemsize
            for name, rows, width, d in self.stored(dtype)
            if window is None or self.pooled(name) == window
        )

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        return sum(rows * width * d.itemsize for _, rows, width, d in self.stored(dtype, True))
