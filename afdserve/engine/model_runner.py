"""Turns a scheduled batch into model inputs and runs the attention side's layer loop.

The FFN half is reached through an `FFNBoundary`: colocated it is a direct call, in AFD a connector
that sends the rows to an FFN rank and brings the output back. The loop is layer-major and
ubatch-minor and waits for ubatch u's FFN output only when its next attention needs it, so with
m > 1 ubatches the attention of ubatch u+1 overlaps the FFN of ubatch u.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from afdserve.engine.scheduler import SchedulerOutput
from afdserve.engine.sequence import Sequence
from afdserve.kernels.a2e import A2EFormat
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.layout.plan import AttentionRankPlan
from afdserve.model.cache import PagedCache
from afdserve.model.layers.moe import Routing
from afdserve.model.parts import CausalLM


class PendingFFN(Protocol):
    def wait(self) -> torch.Tensor: ...


class FFNBoundary(Protocol):
    """Where the attention side hands each layer's rows to the FFN half. `begin_step` gives it
    the rank's plan before the forward: every tile size it uses is read from there. `a2e`: the
    format its rows reach the FFN half in (kernels/a2e.py), which a router on the
    attention side reads them in too."""

    a2e: A2EFormat

    def begin_step(self, plan: AttentionRankPlan, step: int) -> None: ...

    def post(
        self,
        layer: int,
        ubatch: int,
        x: torch.Tensor,
        route_ids: torch.Tensor,
        routing: Routing | None,
    ) -> PendingFFN: ...


@dataclass
class Ready:
    value: torch.Tensor

    def wait(self) -> torch.Tensor:
        return self.value


class LocalFFN:
    """Colocated: the FFN half of the same model, called directly, on the rows as they would
    reach an FFN rank (`a2e`'s round trip), so colocated and AFD give the same tokens."""

    def __init__(self, model: CausalLM, a2e: A2EFormat | None = None) -> None:
        self.model = model
        self.a2e = a2e or A2EFormat("auto", model.dtype)

    def begin_step(self, plan: AttentionRankPlan, step: int) -> None:
        return None

    def post(self, layer, ubatch, x, route_ids, routing) -> PendingFFN:
        x = self.a2e.ffn_rows(x, route_ids)
        return Ready(self.model.ffn_half(layer, x, route_ids, routing))


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [rows] (pad rows: 0, a valid embedding row)
    route_ids: torch.Tensor  # [rows] (pad rows: -1, the id that travels to the FFN)
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [n] row of each sampling sequence's last token (and drafts)
    sample_seqs: list[Sequence]
    real_rows: int
    # Per-ubatch metadata given up front (CUDA graphs read it from static buffers); None: sliced
    # from `meta` per ubatch.
    ubatch_metas: tuple[AttentionMetadata, ...] | None = None
    # Prompt logprobs: the rows whose logits predict a prompt token not yet reported, and per
    # sequence how many of them it owns, in row order.
    prompt_rows: torch.Tensor | None = None  # [m]
    prompt_spans: tuple[tuple[Sequence, int, int], ...] = ()  # (seq, first position, count)

    @property
    def rows(self) -> int:
        return int(self.input_ids.shape[0])


class ModelRunner:
    def __init__(self, model: CausalLM, kv_cache: PagedCache, device: torch.device) -> None:
        self.model, self.kv_cache, self.device = model, kv_cache, device
        self.block_size = kv_cache.block_size
        # Batched segment tensors feed the one-launch kernels (and MLA's latent-space path);
        # the CPU reference loops over segments instead, unless the cache layout says its
        # layers read them on every device.
        batched = kv_cache.layout.batched_segments
        self.batched_metadata = device.type == "cuda" or batched

    def prepare(self, out: SchedulerOutput, padded_rows: int) -> StepInputs:
        ids: list[int] = []
        positions: list[int] = []
        row_seq: list[int] = []  # which scheduled sequence each row belongs to
        spans: list[tuple[int, int, int, int]] = []  # row_start, row_end, seq index, context
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Sequence, int, int]] = []
        tables = [entry.seq.block_table for entry in out.scheduled]
        for index, entry in enumerate(out.scheduled):
            seq, start = entry.seq, entry.seq.num_computed_tokens
            end = start + entry.num_new_tokens
            row = len(ids)
            ids.extend(seq.token_ids[start:end])
            ids.extend(entry.draft_ids)  # past token_ids: the drafts this step verifies
            positions.extend(range(start, end))
            row_seq.extend([index] * (end - start))
            spans.append((row, len(ids), index, end))
            if entry.samples:  # the last token's row, and each draft's
                sample_rows.extend(range(len(ids) - 1 - len(entry.draft_ids), len(ids)))
                sample_seqs.append(seq)
            if seq.params.prompt_logprobs is not None:
                # Position p predicts token p + 1: up to the last prompt token's predecessor.
                first = max(start, seq.prompt_logprobs_done)
                last = min(end, seq.num_prompt_tokens - 1)
                if last > first:
                    prompt_rows.extend(range(row + first - start, row + last - start))
                    prompt_spans.append((seq, first, last - first))
        real = len(ids)
        if padded_rows < real:
            raise ValueError(f"padded_rows={padded_rows} < real rows {real}")
        pad = padded_rows - real
        # One host-to-device copy for every per-row input; pad rows: id 0 to embed, -1 to route.
        host = torch.tensor(
            [ids + [0] * pad, ids + [-1] * pad, positions + [0] * pad, row_seq + [0] * pad],
            dtype=torch.int64,
        )
        dev = self.device
        input_ids, route_ids, position_tensor, seq_of_row = host.to(dev).unbind(0)
        rows = (position_tensor, seq_of_row, real, spans)
        state = [-1 if e.seq.state_slot is None else e.seq.state_slot for e in out.scheduled]
        window = None
        if self.kv_cache.has_window_pool:
            window = self._metadata([e.seq.window_table for e in out.scheduled], *rows, state)
        meta = self._metadata(tables, *rows, state, window)
        return StepInputs(
            input_ids,
            route_ids,
            meta,
            torch.tensor(sample_rows, dtype=torch.int64).to(dev),
            sample_seqs,
            real,
            prompt_rows=torch.tensor(prompt_rows, dtype=torch.int64).to(dev),
            prompt_spans=tuple(prompt_spans),
        )

    def _metadata(
        self,
        tables: list[list[int]],
        positions: torch.Tensor,
        seq_of_row: torch.Tensor,
        real: int,
        spans: list[tuple[int, int, int, int]],
        state: list[int],
        window: AttentionMetadata | None = None,
    ) -> AttentionMetadata:
        """The rows' view through one kind of block table (the main one, or the windowed
        layers'): their KV slots and segments."""
        dev, bs = self.device, self.block_size
        width = max((len(t) for t in tables), default=0)
        table_tensor = torch.tensor(
            [t + [0] * (width - len(t)) for t in tables] or [[0]], dtype=torch.int64
        ).to(dev)
        slots = table_tensor[seq_of_row, positions // bs] * bs + positions % bs
        slots[real:] = -1  # pad rows write no KV
        segments = tuple(
            Segment(r0, r1, table_tensor[index], context, state[index])
            for r0, r1, index, context in spans
        )
        batched = batch_segments(segments, dev) if self.batched_metadata else None
        return AttentionMetadata(positions, slots, segments, batched, window)

    @torch.inference_mode()
    def forward(
        self, inputs: StepInputs, plan: AttentionRankPlan, boundary: FFNBoundary
    ) -> torch.Tensor:
        """Runs every layer over the plan's ubatches; returns the final hidden states
        [rows, hidden], or the family's own residual (model/parts.py, CausalLM)."""
        model = self.model
        bounds = plan.ubatch_bounds
        if plan.padded_rows != inputs.rows or inputs.meta.num_rows != inputs.rows:
            raise ValueError(
                f"the plan's {plan.padded_rows} rows and {inputs.meta.num_rows} metadata rows "
                f"must both equal the step's {inputs.rows} rows"
            )
        h = model.embed(inputs.input_ids)
        cos, sin = model.cos_sin(inputs.meta.positions)
        metas = inputs.ubatch_metas or [inputs.meta.rows(lo, hi) for lo, hi in bounds]
        # Once per ubatch, shared by its layers (inside a graph's capture where there is one).
        metas = [self.kv_cache.layout.with_step_metadata(meta) for meta in metas]
        hs = [h[lo:hi] for lo, hi in bounds]
        ids = [inputs.route_ids[lo:hi] for lo, hi in bounds]
        trig = [(cos[lo:hi], sin[lo:hi]) for lo, hi in bounds]
        pending: list[PendingFFN | None] = [None] * len(bounds)
        # The windowed layers read their own pool through the window tables' view.
        window_metas = [meta.window or meta for meta in metas]
        for layer in range(model.config.num_layers):
            cache = self.kv_cache.layers[layer]
            views = window_metas if layer in self.kv_cache.window_layers else metas
            for u in range(len(bounds)):
                ffn_out = pending[u].wait() if pending[u] is not None else None
                x, hs[u] = model.attention_half(layer, hs[u], ffn_out, views[u], cache, trig[u])
                routing = model.route_on_attention(layer, x, ids[u], boundary.a2e.roundtrip)
                pending[u] = boundary.post(layer, u, x, ids[u], routing)
        for u in range(len(bounds)):
            hs[u] = model.add_ffn_output(hs[u], pending[u].wait())
        return torch.cat(hs) if len(hs) > 1 else hs[0]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor:
        return self.model.logits(hidden[inputs.sample_rows])
