"""What the delta-rule layers read of a ubatch: its segments as span tables on the device, built
once per ubatch (the cache spec's `step_metadata`) and shared by every linear layer.

Built by device ops from the ubatch's segment tensors (`AttentionMetadata.batched`), so a step
costs no host-to-device copy beyond those, and the tables have one row per segment of their
capacity: a CUDA graph's buffers hold as many segments as rows, the ones past the step's real
segments with no rows and slot -1. Every table marks the entries a kernel skips with slot -1
(the pad marker): pad segments everywhere, and in each delta-rule table the segments the other
one runs. A one-row segment steps the recurrence (`ops.delta_rule_step`); a longer one runs the
chunked form (`ops.delta_rule_spans`); the short convolution runs every segment. Which is which
is read on the device, so one graph of a mixed step replays any mix of its size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdserve.kernels.metadata import AttentionMetadata, batch_segments


@dataclass(frozen=True)
class DeltaSpans:
    """Spans [n, 4] int32 are (row_start, row_end, state_slot, fresh: the segment starts at
    position 0, so from an empty window and state); n the segments' capacity."""

    conv: torch.Tensor  # [n, 4] every segment with rows
    chunked: torch.Tensor  # [n, 4] the segments of more than one row
    step_src: torch.Tensor  # [n] int64: a one-row segment's row (others: a valid row to read)
    # [n] int64: where its output goes (others: the ubatch's row count, the layer's sink row)
    step_dst: torch.Tensor
    step_slots: torch.Tensor  # [n] int64: a one-row segment's slot, -1 for the others
    step_fresh: torch.Tensor  # [n] bool
    # Every segment has at most one row (known on the host: a decode step, or a decode graph),
    # so the chunked launch is left out.
    decode: bool

    @classmethod
    def of(cls, meta: AttentionMetadata) -> DeltaSpans:
        """The spans of `meta`'s segments: from its device segments where it has them (as
        every engine step does: the cache spec asks for them), else built from the host's."""
        batched = meta.batched
        if batched is None:
            batched = batch_segments(meta.segments, meta.positions.device)
        start = batched.query_start.long()
        r0, r1 = start[:-1], start[1:]
        count = r1 - r0
        slots = batched.state_slots
        slots = torch.full_like(r0, -1) if slots is None else slots.long()
        live = (count > 0) & (slots >= 0)
        fresh = batched.context_lens.long() == count
        one = live & (count == 1)
        rows = meta.num_rows
        pad = torch.full_like(slots, -1)

        def table(keep: torch.Tensor) -> torch.Tensor:
            spans = (r0, r1, torch.where(keep, slots, pad), fresh.long())
            return torch.stack(spans, dim=1).to(torch.int32)

        return cls(
            conv=table(live),
            chunked=table(live & (count > 1)),
            step_src=torch.where(one, r0, 0).clamp(max=max(rows - 1, 0)),
            step_dst=torch.where(one, r0, rows),
            step_slots=torch.where(one, slots, pad),
            step_fresh=fresh,
            decode=batched.max_query_len <= 1,
        )

    @classmethod
    def find(cls, meta: AttentionMetadata) -> DeltaSpans:
        """The ubatch's spans as the engine built them (`CacheLayout.with_step_metadata`), or
        built here where the caller gave bare metadata (a test, a bench)."""
        return next((s for s in meta.step if isinstance(s, cls)), None) or cls.of(meta)
