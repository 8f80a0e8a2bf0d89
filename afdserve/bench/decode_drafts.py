"""The MTP draft passes of `bench decode --num-speculative-tokens k` on a model with MTP layers:
after each verification step the MTP layer runs its k passes as the engine's `MTPProposer` does,
each the pass its step's plan gives (layout/plan.py, rules 9 and 10), through the engine's
`DraftPasses`: under graphs they replay their own CUDA graphs, inside the timed step.

Random weights reject every draft, so each sequence keeps its first row: pass 0 covers one row
a sequence at its position p (padded to the plan's bound, the step's rows, as the engine's is)
and the chained pass j one row at p + j, each over the MTP layer's own paged cache, drawn at unit
scale like the main cache so that it reads a full context.
"""

from __future__ import annotations

import torch

from afdserve.engine.draft_passes import DraftGraphSettings, DraftPasses, PassInputs
from afdserve.engine.model_runner import FFNBoundary
from afdserve.kernels.metadata import AttentionMetadata, BatchedSegments, Segment
from afdserve.layout.plan import AttentionRankPlan
from afdserve.model.parts import CausalLM, MTPDraft


class DraftSteps:
    """The draft passes of a `DecodeSteps` batch: `tables` its block tables [batch, width],
    `query_len` its rows a sequence (1 + k), `boundary` where the layer's MoE runs."""

    def __init__(
        self,
        draft: MTPDraft,
        main: CausalLM,
        boundary: FFNBoundary,
        tables: torch.Tensor,
        block_size: int,
        query_len: int,
        dtype: torch.dtype,
        settings: DraftGraphSettings | None,
        generator: torch.Generator,
    ) -> None:
        dev = tables.device
        batch = tables.shape[0]
        cache = draft.cache_layout().allocate(tables.numel(), block_size, dtype, dev)
        for t in cache.tensors():
            if t.dtype.itemsize == 1:  # torch draws no float8: draw float32, cast
                t.copy_(torch.randn(t.shape, generator=generator, device=dev))
            else:
                t.normal_(generator=generator)
        self.passes = DraftPasses(draft, main, cache, dev)
        self.passes.use_graphs(settings)
        self.boundary, self.tables, self.block_size = boundary, tables, block_size
        self.batched = dev.type == "cuda" or cache.layout.batched_segments
        self.first_rows = torch.arange(batch, device=dev) * query_len  # each sequence's kept row
        self.query_start = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        passes = range(query_len - 1)
        self.positions = [torch.zeros(batch, dtype=torch.int64, device=dev) for _ in passes]
        self.slots = [torch.zeros(batch, dtype=torch.int64, device=dev) for _ in passes]
        self.context_lens = [torch.zeros(batch, dtype=torch.int32, device=dev) for _ in passes]
        self.metas: list[AttentionMetadata] = []
        self.last: torch.Tensor | None = None  # the latest step's drafts [batch, k]

    def advance(self, position: int) -> None:
        """Each pass's rows at position + j of every sequence (device-side writes, and host
        segments for the reference kernels), before the timed step."""
        bs, batch = self.block_size, self.tables.shape[0]
        rows = torch.arange(batch, device=self.tables.device)
        self.metas = []
        for j, (positions, slots, lens) in enumerate(
            zip(self.positions, self.slots, self.context_lens, strict=True)
        ):
            p = position + j
            positions.fill_(p)
            slots.copy_(self.tables[rows, p // bs].long() * bs + p % bs)
            lens.fill_(p + 1)
            segments = ()  # the reference kernels' host segments; CUDA reads the batched ones
            if self.tables.device.type != "cuda":
                segments = tuple(Segment(i, i + 1, self.tables[i], p + 1) for i in range(batch))
            batched = BatchedSegments(self.query_start, lens, self.tables, 1, p + 1)
            meta = AttentionMetadata(positions, slots, segments, batched if self.batched else None)
            self.metas.append(meta)

    def run(
        self, plan: AttentionRankPlan, hidden: torch.Tensor, next_ids: torch.Tensor, step: int
    ) -> torch.Tensor:
        """The step's draft passes after its main layers (`hidden` [rows, hidden], `next_ids`
        [rows] its greedy tokens): each sequence's drafts [batch, k]."""
        rows, ids, drafts = hidden[self.first_rows], next_ids[self.first_rows], []
        for j, (draft_plan, meta) in enumerate(zip(plan.drafts, self.metas, strict=True)):
            self.boundary.begin_step(draft_plan, step)
            g = self.passes.run(draft_plan, self.boundary, j == 0, PassInputs(rows, ids, meta))
            rows, ids = g, self.passes.draft.logits(g).argmax(dim=-1)
            drafts.append(ids)
        self.last = torch.stack(drafts, dim=1)
        return self.last
