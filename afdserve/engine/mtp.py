"""MTP drafts (speculative decoding's `mtp` method): the checkpoint's next-token-prediction
layer, run on the attention rank after each step's verification over the rows the step kept.

Its entry at position p reads the main hidden state at p and the token at p + 1, so it is
written once that token is known: after sampling and before `Scheduler.update` (a sequence the
step finishes still holds its blocks then, whose MTP rows a prefix-cache hit may reuse). The
rows are a prefill chunk's, or a decode's verified ones (its accepted drafts and the row before
the bonus token); their KV, a cache group of its own over the same block table, then holds the
positions the main cache holds. Hidden states never outlive the step: a sequence keeps the MTP's
KV and its next drafts (`Sequence.mtp_drafts`), which `Drafter.propose` hands the scheduler.
A draft is the argmax at the last kept row; drafts 2..k chain the layer on its own output at the
next positions, within blocks the sequence holds (drafts never take blocks). Those KV rows lie
past what the sequence keeps and are rewritten by the next step's pass before any query reads
them, as the main cache's rejected drafts are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdserve.engine.draft_passes import DraftPasses, PassInputs
from afdserve.engine.model_runner import FFNBoundary, LocalFFN
from afdserve.engine.scheduler import SchedulerOutput
from afdserve.engine.sequence import Sequence
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.layout.plan import AttentionRankPlan
from afdserve.model.cache import PagedCache
from afdserve.model.parts import CausalLM, MTPDraft

Spans = list[tuple[Sequence, int, int]]  # (sequence, first position, rows)


@dataclass
class Written:
    """One step's MTP rows: each sequence's span of them and the layer's output g [rows,
    hidden] (None without rows); the step's draft passes and the boundary they cross."""

    spans: Spans
    g: torch.Tensor | None
    passes: tuple[AttentionRankPlan, ...]
    boundary: FFNBoundary
    step: int


class MTPProposer:
    """Runs `draft` after each step; its KV mirrors the main cache's blocks one for one. Each
    pass of the layer is a planned step of one ubatch (`AttentionRankPlan.drafts`, rules 9 and
    10 of layout/plan.py), run by `passes` (engine/draft_passes.py: eagerly, or from static
    buffers as a CUDA graph of the plan's key): under AFD its MoE rows cross the rank's boundary
    to the FFN ranks as layer N's, padded to the plan's tile, and a pass without real rows still
    sends its pad tile."""

    def __init__(
        self, draft: MTPDraft, main: CausalLM, kv_cache: PagedCache, device: torch.device, k: int
    ) -> None:
        self.draft, self.main, self.device, self.k = draft, main, device, k
        self.index = draft.config.num_layers - 1  # N, the layer's index on both roles
        self.block_size = kv_cache.block_size
        layout = draft.cache_layout()
        self.cache: PagedCache = layout.allocate(
            kv_cache.num_blocks, kv_cache.block_size, kv_cache.dtype, device
        )
        self.batched = device.type == "cuda" or layout.batched_segments
        self.local: LocalFFN | None = None
        self.passes = DraftPasses(draft, main, self.cache, device)

    def boundary(self, main: FFNBoundary) -> FFNBoundary:
        """Where the layer's MoE runs: the draft's own FFN half where the rank holds one
        (colocated, in the main boundary's format), else the main layers' boundary."""
        if not self.draft.parts.ffn:
            return main
        if self.local is None:
            self.local = LocalFFN(self.draft, main.a2e)
        return self.local

    @torch.inference_mode()
    def write(
        self,
        out: SchedulerOutput,
        sampled: list[int | list[int] | None],
        hidden: torch.Tensor,
        plan: AttentionRankPlan,
        boundary: FFNBoundary,
        step: int,
    ) -> Written:
        """Before `Scheduler.update`: the layer over every row the step keeps, given each
        sequence's sampled tokens (`sampled`, as `update` takes them) and `hidden` [rows,
        hidden], the step's main hidden rows (as the layer loop returns them); `plan`: the
        step's rank plan, whose `drafts` size the passes."""
        if len(plan.drafts) != self.k:
            raise ValueError(
                f"attention rank {plan.rank}: the plan carries {len(plan.drafts)} draft passes, "
                f"MTP with num_speculative_tokens={self.k} runs {self.k}"
            )
        written = Written([], None, plan.drafts, self.boundary(boundary), step)
        rows: list[int] = []
        next_ids: list[int] = []
        row = 0
        for entry, tokens in zip(out.scheduled, sampled, strict=True):
            seq, start = entry.seq, entry.seq.num_computed_tokens
            seq.mtp_drafts = None
            new = [tokens] if isinstance(tokens, int) else tokens or []
            # Rejected drafts' rows are not kept: the accepted ones and the bonus token's are.
            kept = entry.num_new_tokens - len(entry.draft_ids) + max(len(new) - 1, 0)
            if not seq.is_finished:  # an aborted sequence's blocks are already free
                known = seq.token_ids[start + 1 : start + kept + 1]
                next_ids += known + new[: kept - len(known)]
                rows.extend(range(row, row + kept))
                written.spans.append((seq, start, kept))
            row += entry.num_new_tokens
        ids = torch.tensor(next_ids, dtype=torch.int64).to(self.device)
        index = torch.tensor(rows, dtype=torch.int64).to(self.device)
        written.g = self._pass(written, 0, hidden[index], ids, written.spans)
        return written

    @torch.inference_mode()
    def propose(self, written: Written) -> None:
        """After `Scheduler.update`: each sequence that decodes next step (one token behind)
        gets its drafts, from the last row `write` kept for it; every planned pass runs."""
        ends, decoding, at = [], [], 0
        for seq, _, kept in written.spans:
            at += kept
            if not seq.is_finished and seq.num_uncomputed_tokens == 1:
                ends.append(at - 1)
                decoding.append(seq)
        g = written.g[torch.tensor(ends, device=self.device)] if decoding else None
        self._drafts(decoding, g, written)

    def _drafts(self, seqs: list[Sequence], g: torch.Tensor | None, written: Written) -> None:
        """Draft 1 from each sequence's last kept row g [n, hidden]; drafts 2..k chained."""
        drafts = [[t] for t in self.draft.logits(g).argmax(dim=-1).tolist()] if seqs else []
        live = list(range(len(seqs)))  # the sequences g's rows belong to, in order
        for j in range(1, self.k):
            # Draft j + 1 is the layer's prediction at position q + j - 1 (q: the first
            # uncomputed position), whose KV row needs a slot in a block already held.
            keep = [
                n
                for n, i in enumerate(live)
                if seqs[i].num_computed_tokens + j - 1 < len(seqs[i].block_table) * self.block_size
            ]
            live = [live[n] for n in keep]
            if live:
                g = g[torch.tensor(keep, device=self.device)]
            ids = torch.tensor([drafts[i][-1] for i in live], dtype=torch.int64).to(self.device)
            spans = [(seqs[i], seqs[i].num_computed_tokens + j - 1, 1) for i in live]
            g = self._pass(written, j, g, ids, spans)
            if g is not None:
                tokens = self.draft.logits(g).argmax(dim=-1).tolist()
                for i, token in zip(live, tokens, strict=True):
                    drafts[i].append(token)
        for seq, tokens in zip(seqs, drafts, strict=True):
            seq.mtp_drafts = (seq.num_computed_tokens, tuple(tokens))

    def _pass(
        self, written: Written, j: int, rows: torch.Tensor | None, ids: torch.Tensor, spans: Spans
    ) -> torch.Tensor | None:
        """Draft pass j under its plan over `spans`' rows: `rows` [n, hidden] the main hidden
        rows (j = 0) or the previous pass's output, `ids` [n] the tokens that travel with them;
        its output g, or None without rows (a pad tile still travels where the plan gives one)."""
        plan = written.passes[j]
        written.boundary.begin_step(plan, written.step)
        graphed = plan.mode in ("capture", "replay") and self.passes.settings is not None
        inputs = PassInputs(rows, ids, self._metadata(spans, graphed)) if spans else None
        return self.passes.run(plan, written.boundary, j == 0, inputs)

    def _metadata(self, spans: Spans, batched: bool = False) -> AttentionMetadata:
        """Each span's rows at positions [first, first + rows) of its sequence, writing their
        KV into the MTP cache; `batched`: the device segments too (a graphed pass loads them)."""
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
        return AttentionMetadata(
            positions=position_tensor,
            slot_mapping=slot_tensor,
            segments=segments,
            batched=batch_segments(segments, self.device) if self.batched or batched else None,
        )
