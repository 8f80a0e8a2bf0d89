"""The lightning indexer of DeepSeek Sparse Attention: which earlier tokens each query attends to.

Per query row and cached position t <= the row's position:
  score[t] = sum_h w[h] * relu(q[h] . k[t] * index_head_dim^-0.5),  w = weights_proj(x) * H^-0.5
with q from the query's low-rank latent (`wq_b`), k = LayerNorm(wk(x)) cached per position, and the
first qk_rope_head_dim dims of both rotated (halves for DeepSeek-V3.2, interleaved pairs for
GLM-5). Scores are float32, as transformers computes them. The `index_topk` best positions are kept,
ties broken towards the earlier position by a stable sort, so every chunking and batch shape
selects alike (torch.topk's choice among ties depends on the shape). transformers skips
DeepSeek's Hadamard rotation (orthogonal: dot products unchanged) and FP8 scoring, and so do we.

A selection is `[rows, index_topk]` cache slots (block * B + offset), -1 where a row has fewer
earlier tokens than index_topk (and for pad rows): GLM-5's shared layers reuse it as it is, since
every layer of a sequence shares its block table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.config import ModelConfig
from afdserve.model.families.deepseek_v4.rows import StepRows

# Scores held at once, [rows, heads, context] float32 (256 MiB): rows are scored in chunks of
# this many elements, so a long context costs more launches rather than memory.
SCORE_ELEMENTS = 1 << 26


class HeadWeights(nn.Module):
    """weights_proj: hidden -> one weight per indexer head, in float32 (transformers keeps it
    float32; published checkpoints store it unquantized, so it is no nn.Linear for FP8 to take)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(heads, hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dsa = config.family_config
        self.heads, self.dim, self.topk = dsa.index_n_heads, dsa.index_head_dim, dsa.index_topk
        self.rope, self.interleave = config.qk_rope_head_dim, dsa.indexer_interleave
        self.wq_b = nn.Linear(config.q_lora_rank, self.heads * self.dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.dim, bias=False)
        self.k_norm = nn.LayerNorm(self.dim, eps=1e-6)
        self.weights_proj = HeadWeights(config.hidden_size, self.heads)
        self.scale = self.dim**-0.5

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [rows, heads, dim]: its first `rope` dims rotated, the rest as they are."""
        rot, rest = x.split([self.rope, self.dim - self.rope], dim=-1)
        return torch.cat((ops.rotate(rot.contiguous(), cos, sin, self.interleave), rest), dim=-1)

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [rows, hidden] -> the rows' keys [rows, 1, dim], as cached."""
        return self._rotate(self.k_norm(self.wk(x))[:, None, :], cos, sin)

    def queries(
        self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q [rows, heads, dim] in the model's dtype, w [rows, heads] float32). Scores are
        float32 dots of q's values (the Triton path multiplies them exactly in their dtype)."""
        q = self.wq_b(q_latent).view(-1, self.heads, self.dim)
        weights = self.weights_proj(x) * self.heads**-0.5
        return self._rotate(q, cos, sin), weights

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q [rows, H, D], w [rows, H], keys [rows or 1, T, D] -> [rows, T] float32."""
        q = q.float()
        logits = torch.einsum("rhd,rtd->rht", q, keys.float().expand(q.shape[0], -1, -1))
        return torch.einsum("rh,rht->rt", w, F.relu(logits * self.scale))

    def top(self, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """scores [rows, T], visible [rows, T] -> the kept positions [rows, topk], -1 past the
        visible ones."""
        scores = scores.masked_fill(~visible, float("-inf"))
        if scores.shape[1] < self.topk:
            scores = F.pad(scores, (0, self.topk - scores.shape[1]), value=float("-inf"))
        order = torch.sort(scores, dim=-1, descending=True, stable=True)
        kept = order.indices[:, : self.topk]
        return kept.masked_fill(order.values[:, : self.topk] == float("-inf"), -1)


def take(pages: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pages[index], an FP8 cache's gathered as bytes (float8 indexing kernels are not on every
    device and torch release; the bytes are the same values)."""
    if pages.dtype != torch.float8_e4m3fn:
        return pages[index]
    return pages.view(torch.uint8)[index].view(pages.dtype)


def _chunks(rows: int, heads: int, context: int) -> range:
    """The first row of each chunk of rows whose scores fit SCORE_ELEMENTS."""
    return range(0, rows, max(1, SCORE_ELEMENTS // (heads * max(context, 1))))


def _slots(positions: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    """positions [rows, K] (-1: none), tables [rows, W] -> cache slots [rows, K] (-1: none)."""
    block = tables.gather(1, (positions.clamp(min=0) // block_size).clamp(max=tables.shape[1] - 1))
    return torch.where(positions >= 0, block * block_size + positions % block_size, -1)


def select_fast(
    indexer: Indexer,
    q: torch.Tensor,
    w: torch.Tensor,
    keys_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor | None:
    """Every row at once from the device segments in the Triton kernels (`ops.dsa_select`: no
    host sync, graph capturable, prefill rows alike; kept slots in position order, the set the
    stable sort keeps), or None where they do not run (CPU: the references below; the CPU
    metadata carries device segments only where a test asks for them)."""
    if meta.batched is None:
        return None
    rows = StepRows.find(meta)
    # The keys are written at scale 1.0 (an FP8 cache's per-tensor scale, as the latent's).
    return ops.dsa_select(
        q, w, keys_cache, (rows.tables, rows.positions, rows.real), indexer.topk, indexer.scale
    )


def select_per_segment(
    indexer: Indexer,
    q: torch.Tensor,
    w: torch.Tensor,
    keys_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The reference: each segment scores its rows against its own cached keys, gathered once,
    in row chunks (`_chunks`). q [rows, H, D], w [rows, H] -> slots [rows, topk] (pad rows
    -1)."""
    block_size = keys_cache.shape[1]
    slots = torch.full((q.shape[0], indexer.topk), -1, dtype=torch.long, device=q.device)
    for seg in meta.segments:
        blocks = seg.block_table[: -(-seg.context_len // block_size)].long()
        keys = take(keys_cache, blocks).flatten(0, 2)[: seg.context_len]  # [context, D]
        keys = ops.dequantize_kv(keys, 1.0, torch.float32)
        table = seg.block_table.long()[None, :]
        context = torch.arange(seg.context_len, device=q.device)
        step = _chunks(seg.num_rows, indexer.heads, seg.context_len).step
        for lo in range(seg.row_start, seg.row_end, step):
            hi = min(lo + step, seg.row_end)
            visible = context[None, :] <= meta.positions[lo:hi, None]
            kept = indexer.top(indexer.scores(q[lo:hi], w[lo:hi], keys[None]), visible)
            slots[lo:hi] = _slots(kept, table.expand(hi - lo, -1), block_size)
    return slots


def select_batched(
    indexer: Indexer,
    q: torch.Tensor,
    w: torch.Tensor,
    keys_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """Every row from the device segments (no host sync, CUDA-graph capturable): each row
    gathers its own sequence's keys over the block-table width W, [rows, W B, D], in row chunks
    of fixed size (`_chunks`); pad rows see nothing. -> slots [rows, topk]."""
    rows = StepRows.find(meta)
    block_size = keys_cache.shape[1]
    context = torch.arange(rows.tables.shape[1] * block_size, device=q.device)
    visible = (context[None, :] <= rows.positions[:, None]) & rows.real[:, None]
    kept = []
    chunks = _chunks(q.shape[0], indexer.heads, context.shape[0])
    for lo in chunks:
        hi = min(lo + chunks.step, q.shape[0])
        keys = take(keys_cache, rows.tables[lo:hi]).flatten(1, 3)  # [rows, W B, D]
        keys = ops.dequantize_kv(keys, 1.0, torch.float32)
        kept.append(indexer.top(indexer.scores(q[lo:hi], w[lo:hi], keys), visible[lo:hi]))
    if not kept:  # a ubatch of no rows
        return torch.full((0, indexer.topk), -1, dtype=torch.long, device=q.device)
    return _slots(torch.cat(kept), rows.tables, block_size)
