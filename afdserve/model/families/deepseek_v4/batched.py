"""DeepSeek-V4 attention for a decode ubatch, every sequence at once: what a CUDA graph captures.

A decode ubatch gives each sequence exactly one row (its new token at position t). This path runs
all of them in tensor ops over the paged layout of cache.py, with no loop over sequences and no
host sync: every shape follows the ubatch's row count and the block table's width W (the graph
buffers' maxima), never a sequence's length. Rows read before they write, and a sequence writes
only its own blocks' rows (V4 shares no block between sequences: prefix caching is off), so the
order of rows does not matter. Pad rows (a graph's padding, context 0) read whatever their table
points at, send every write to the pages' scratch row (`LayerPages.flat`) and give a zero output,
as rows of no segment do on the per-sequence path; the sink keeps their softmax finite.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.families.deepseek_v4.attention import Compressor, RopeTable, V4Attention
from afdserve.model.families.deepseek_v4.cache import LayerPages


@dataclass(frozen=True)
class DecodeRows:
    """One decode ubatch on the device: row i is segment i's one token (rows past the segments,
    and segments of context 0, are pad rows)."""

    positions: torch.Tensor  # [rows] int64
    tables: torch.Tensor  # [rows, W] int64, W = the block table width (max blocks per sequence)
    real: torch.Tensor  # [rows] bool

    @classmethod
    def of(cls, meta: AttentionMetadata) -> DecodeRows | None:
        """The decode rows of `meta`, or None when it is no decode ubatch (a segment of more than
        one row) or carries no device segments (`batched`)."""
        batched = meta.batched
        if batched is None or batched.max_query_len > 1:
            return None
        pad = meta.num_rows - batched.context_lens.shape[0]  # host-side sizes only
        context = F.pad(batched.context_lens.long(), (0, pad))
        tables = F.pad(batched.block_tables.long(), (0, 0, 0, pad))
        return cls(meta.positions.long(), tables, context > 0)


def decode_attention(
    attn: V4Attention,
    pages: LayerPages,
    x: torch.Tensor,
    rows: DecodeRows,
    rope: RopeTable,
    compress_rope: RopeTable,
) -> torch.Tensor:
    """One layer's attention of a decode ubatch: x [rows, hidden] -> [rows, hidden], as
    `V4Attention.forward` gives each row over `pages.read`'s state, with what `pages.write`
    would store written to the pages. The window: the rows of positions t - 1 .. t - (window - 1),
    masked where negative, beside t's own; t's row is written to the ring."""
    if x.shape[0] == 0:
        return torch.zeros_like(x)
    t, real = rows.positions, rows.real
    cos_sin = rope.at(t)
    q_residual, q, kv = attn.project(x, cos_sin)
    back = t[:, None] - torch.arange(1, attn.window, device=t.device)  # [rows, window - 1]
    cached = pages.take("window", pages.batch_rows("window", rows.tables, back))
    keys = torch.cat((cached, kv[:, None].to(cached.dtype)), dim=1)
    allowed = torch.cat((back >= 0, real[:, None]), dim=1)
    pages.store(
        "window", pages.batch_rows("window", rows.tables, t[:, None]), kv[:, None], real[:, None]
    )
    if attn.compressor is not None:
        entries, seen = _compressed(attn, pages, x, q_residual, rows, compress_rope)
        keys = torch.cat((keys, entries.to(keys.dtype)), dim=1)
        allowed = torch.cat((allowed, seen), dim=1)
    y = attn.finish(attn.attend_batched(q, keys, allowed), cos_sin)
    return torch.where(real[:, None], y, torch.zeros_like(y))


def _compressed(
    attn: V4Attention,
    pages: LayerPages,
    x: torch.Tensor,
    q_residual: torch.Tensor,
    rows: DecodeRows,
    rope: RopeTable,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed keys [rows, n, head_dim] each row attends to and their mask [rows, n]: HCA
    every entry the table can address (n = ceil(W B / m)), CSA the indexer's top-k of them.
    Entries at or past the (t + 1) // m closed ones are masked. CSA: the indexer scores every
    padded entry, invisible ones -inf, and `Indexer.ranked` (the per-sequence path's stable sort)
    keeps the first index_topk: visible entries come first, so a top-k beyond the visible count
    keeps all of them and masks the rest, as the per-sequence path."""
    comp = attn.compressor
    count = -(-rows.tables.shape[1] * pages.geometry.block_size // comp.rate)
    every = torch.arange(count, device=x.device).expand(x.shape[0], count)
    closed = ((rows.positions + 1) // comp.rate)[:, None]
    if comp.indexer is None:
        return _compress(comp, pages, "", x, rows, rope, every), every < closed
    indexer = comp.indexer
    index_keys = _compress(indexer, pages, "index_", x, rows, rope, every)
    scores = indexer.score_keys(x, q_residual, rows.positions, rope, index_keys)
    top = indexer.ranked(scores.masked_fill(every >= closed, float("-inf")))
    return _compress(comp, pages, "", x, rows, rope, top), top < closed


def _compress(
    comp: Compressor,
    pages: LayerPages,
    prefix: str,
    x: torch.Tensor,
    rows: DecodeRows,
    rope: RopeTable,
    read: torch.Tensor,
) -> torch.Tensor:
    """Feed each row's token to one compressor (pages `prefix`*: HCA's, CSA's or its indexer's):
    pool its window, write what the per-sequence path writes, and return the entries at `read`
    [rows, n] (the one this step closes in its place) -> [rows, n, dim]. t's window (positions
    [w m, (w + 1) m), w = t // m) is read from the open rows, t's own projections in its slot, the
    previous window's first series (CSA) from prev_*; it is pooled for every row, and written,
    with prev_*, only by rows whose token closes the window ((t + 1) % m == 0); the others write
    t's open row instead."""
    m, t, tables = comp.rate, rows.positions, rows.tables
    kv, gate = comp.kv_proj(x), comp.gate_proj(x)
    w = t // m
    closes = rows.real & ((t + 1) % m == 0)
    slots = w[:, None] * m + torch.arange(m, device=x.device)  # [rows, m]: t's window
    here = (slots == t[:, None])[..., None]
    window = pages.batch_rows(f"{prefix}open_kv", tables, slots)  # open_* and prev_*: alike
    win_kv = torch.where(here, kv[:, None], pages.take(f"{prefix}open_kv", window).to(kv.dtype))
    win_gate = torch.where(
        here, gate[:, None], pages.take(f"{prefix}open_gate", window).to(gate.dtype)
    )
    own = pages.batch_rows(f"{prefix}open_kv", tables, t[:, None])
    still_open = (rows.real & ~closes)[:, None]
    pages.store(f"{prefix}open_kv", own, kv[:, None], still_open)
    pages.store(f"{prefix}open_gate", own, gate[:, None], still_open)
    win_gate = win_gate + comp.position_bias
    if comp.overlap:
        d = comp.dim
        previous = pages.batch_rows(f"{prefix}prev_kv", tables, slots - m)
        first = (w > 0)[:, None, None]  # before window 0: no first series (weight 0)
        first_kv = torch.where(first, pages.take(f"{prefix}prev_kv", previous).to(kv.dtype), 0.0)
        first_gate = torch.where(
            first, pages.take(f"{prefix}prev_gate", previous).float(), float("-inf")
        ).to(win_gate.dtype)
        keep = closes[:, None].expand(-1, m)
        pages.store(f"{prefix}prev_kv", window, win_kv[..., :d], keep)
        pages.store(f"{prefix}prev_gate", window, win_gate[..., :d], keep)
        win_kv, win_gate = comp.overlap_slots(first_kv, first_gate, win_kv, win_gate)
    new = comp.pool(win_kv, win_gate, w * m, rope)  # [rows, dim], kept where t closes
    entry = ((t + 1) // m - 1).clamp(min=0)[:, None]
    stored = pages.take(
        f"{prefix}entries", pages.batch_entry_rows(f"{prefix}entries", tables, read)
    )
    pages.store(
        f"{prefix}entries",
        pages.batch_entry_rows(f"{prefix}entries", tables, entry),
        new[:, None],
        closes[:, None],
    )
    is_new = ((read == entry) & closes[:, None])[..., None]
    return torch.where(is_new, new[:, None].to(stored.dtype), stored)
