"""MTP drafts (speculative decoding's `mtp` method): the checkpoint's next-token-prediction
layer run after each step on the attention rank, over the rows the step kept.

The MTP layer's entry at position p reads the main model's hidden state at p and the token at
p + 1, so it can only be written once that token is known: right after the step's verification.
Each step therefore runs the layer over every row it kept (a prefill chunk's rows, a decode's
verified rows: its accepted drafts and the row before the bonus token), writing the layer's own
KV (a cache group of its own over the same block table) at exactly the positions the main cache
now holds. The hidden states never outlive the step: what a sequence keeps between steps is the
MTP's KV and its next drafts (`Sequence.mtp_drafts`), which `Drafter.propose` hands the
scheduler. A draft is the argmax of the layer's logits at the last kept row; drafts 2..k chain
the layer on its own output at the positions after it, within the blocks the sequence already
holds (a chain that would need a new block stops there: drafts never take blocks). Their KV
rows are written past what the sequence keeps and overwritten by the next step's pass before
any query reads them, as the main cache's rejected drafts are.
"""

from __future__ import annotations

import torch

from afdserve.engine.scheduler import SchedulerOutput
from afdserve.engine.sequence import Sequence
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.model.cache import PagedCache
from afdserve.model.parts import CausalLM, MTPDraft


class MTPProposer:
    """Runs `draft` after each step; its KV mirrors the main cache's blocks one for one."""

    def __init__(
        self, draft: MTPDraft, main: CausalLM, kv_cache: PagedCache, device: torch.device, k: int
    ) -> None:
        self.draft, self.main, self.device, self.k = draft, main, device, k
        self.block_size = kv_cache.block_size
        layout = draft.cache_layout()
        self.cache: PagedCache = layout.allocate(
            kv_cache.num_blocks, kv_cache.block_size, kv_cache.dtype, device
        )
        self.batched = device.type == "cuda" or layout.batched_segments

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput, starts: list[int], hidden: torch.Tensor) -> None:
        """After `Scheduler.update`: `starts`, each scheduled sequence's num_computed_tokens
        before the step; `hidden` [rows, hidden], the step's main hidden rows (as the layer
        loop returns them). Sets each decoding sequence's drafts for the next step."""
        rows: list[int] = []
        spans: list[tuple[Sequence, int, int]] = []  # (seq, first position, rows kept)
        row = 0
        for entry, start in zip(out.scheduled, starts, strict=True):
            seq = entry.seq
            seq.mtp_drafts = None
            kept = seq.num_computed_tokens - start
            if not seq.is_finished and kept > 0:  # a finished sequence's blocks are free
                rows.extend(range(row, row + kept))
                spans.append((seq, start, kept))
            row += entry.num_new_tokens
        if not spans:
            return
        next_ids = [t for seq, at, kept in spans for t in seq.token_ids[at + 1 : at + kept + 1]]
        ids = torch.tensor(next_ids, dtype=torch.int64).to(self.device)
        index = torch.tensor(rows, dtype=torch.int64).to(self.device)
        g = self._layer(self.draft.first_input(hidden[index], ids), ids, spans)
        ends, decoding, at = [], [], 0
        for seq, _, kept in spans:
            at += kept
            if seq.num_uncomputed_tokens == 1:  # it decodes next step: it may take drafts
                ends.append(at - 1)
                decoding.append(seq)
        if decoding:
            self._drafts(decoding, g[torch.tensor(ends, device=self.device)])

    def _drafts(self, seqs: list[Sequence], g: torch.Tensor) -> None:
        """Draft 1 from each sequence's last kept row g [n, hidden]; drafts 2..k chained."""
        drafts = [[t] for t in self.draft.logits(g).argmax(dim=-1).tolist()]
        live = list(range(len(seqs)))  # the sequences g's rows belong to, in order
        for j in range(1, self.k):
            # Draft j + 1 is the layer's prediction at position q + j - 1 (q: the first
            # uncomputed position), whose KV row needs a slot in a block already held.
            keep = [
                n
                for n, i in enumerate(live)
                if seqs[i].num_computed_tokens + j - 1 < len(seqs[i].block_table) * self.block_size
            ]
            if not keep:
                break
            live = [live[n] for n in keep]
            g = g[torch.tensor(keep, device=self.device)]
            ids = torch.tensor([drafts[i][-1] for i in live], dtype=torch.int64).to(self.device)
            spans = [(seqs[i], seqs[i].num_computed_tokens + j - 1, 1) for i in live]
            g = self._layer(self.draft.chain_input(g, ids), ids, spans)
            for i, token in zip(live, self.draft.logits(g).argmax(dim=-1).tolist(), strict=True):
                drafts[i].append(token)
        for seq, tokens in zip(seqs, drafts, strict=True):
            seq.mtp_drafts = (seq.num_computed_tokens, tuple(tokens))

    def _layer(
        self, h: torch.Tensor, ids: torch.Tensor, spans: list[tuple[Sequence, int, int]]
    ) -> torch.Tensor:
        """The MTP decoder layer over rows `h` [rows, hidden]: each span's rows at positions
        [first, first + kept) of its sequence, writing their KV into the MTP cache."""
        positions, slots, segments = [], [], []
        tables = [seq.block_table for seq, _, _ in spans]
        width = max(len(t) for t in tables)
        table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        table_tensor = table_tensor.to(self.device)
        bs = self.block_size
        for index, (seq, first, kept) in enumerate(spans):
            row = len(positions)
            span = range(first, first + kept)
            positions.extend(span)
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in span)
            segments.append(Segment(row, row + kept, table_tensor[index], first + kept))
        host = torch.tensor([positions, slots], dtype=torch.int64)
        position_tensor, slot_tensor = host.to(self.device).unbind(0)
        segments = tuple(segments)
        meta = AttentionMetadata(
            positions=position_tensor,
            slot_mapping=slot_tensor,
            segments=segments,
            batched=batch_segments(segments, self.device) if self.batched else None,
        )
        cos_sin = self.main.cos_sin(position_tensor)
        return self.draft(h, meta, self.cache.layers[0], cos_sin, ids)
