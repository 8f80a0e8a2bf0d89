"""Turns a scheduled batch into model inputs and runs the attention side's layer loop.

The FFN half is reached through an `FFNBoundary`: colocated it is a direct call, in AFD a connector
that sends the rows to an FFN rank and brings the output back. The loop is layer-major and
ubatch-minor and waits for ubatch u's FFN output only when its next attention needs it, so with
m > 1 ubatches the attention of ubatch u+1 overlaps the FFN of ubatch u.
"""

from __future__ import annotations

import array
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from afdserve.engine.scheduler import SchedulerOutput
from afdserve.engine.sequence import Sequence
from afdserve.kernels.a2e import A2EFormat
from afdserve.kernels.metadata import AttentionMetadata, BatchedSegments, Segment, keeps_state
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
        spans: list[tuple[int, int, int, int]] = []  # row_start, row_end, seq index, context
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_rows: list[int] = []
        prompt_spans: list[tuple[Sequence, int, int]] = []
        for index, entry in enumerate(out.scheduled):
            seq, start = entry.seq, entry.seq.num_computed_tokens
            end = start + entry.num_new_tokens
            row = len(ids)
            ids.extend(seq.token_ids[start:end])
            ids.extend(entry.draft_ids)  # past token_ids: the drafts this step verifies
            positions.extend(range(start, end))
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
        # Every integer the step's tensors hold goes to the device in one copy per dtype
        # (`HostStage`): a copy per tensor costs the host a synchronizing round trip each, and
        # the host's time before a step's launch is time the GPU stands idle.
        stage = HostStage()
        input_ids = stage.int64(ids + [0] * pad)  # pad rows: id 0 to embed, -1 to route
        route_ids = stage.int64(ids + [-1] * pad)
        position_tensor = stage.int64(positions + [0] * pad)
        sample_tensor = stage.int64(sample_rows)
        prompt_tensor = stage.int64(prompt_rows)
        state = [-1 if e.seq.state_slot is None else e.seq.state_slot for e in out.scheduled]

        def view(tables: list[list[int]]) -> _MetadataStage:
            return _MetadataStage(
                stage, tables, spans, pad, self.block_size, state, self.batched_metadata
            )

        main = view([e.seq.block_table for e in out.scheduled])
        window = None  # the windowed layers' own pool, through their own tables
        if self.kv_cache.has_window_pool:
            window = view([e.seq.window_table for e in out.scheduled])
        stage.upload(self.device)
        positions_dev = position_tensor.get()
        window_meta = window.build(positions_dev) if window is not None else None
        return StepInputs(
            input_ids.get(),
            route_ids.get(),
            main.build(positions_dev, window_meta),
            sample_tensor.get(),
            sample_seqs,
            real,
            prompt_rows=prompt_tensor.get(),
            prompt_spans=tuple(prompt_spans),
        )

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


class Staged:
    """One array of a `HostStage`: its device tensor once the stage is uploaded."""

    def __init__(self, stage: HostStage, dtype: torch.dtype, start: int, shape: tuple[int, ...]):
        self.stage, self.dtype, self.start, self.shape = stage, dtype, start, shape

    def get(self) -> torch.Tensor:
        flat = self.stage.uploaded[self.dtype]
        return flat[self.start : self.start + math.prod(self.shape)].view(self.shape)


# array.array's typecode of each staged dtype (the sizes checked: 'i' is 4 bytes on every
# platform CPython supports, 'q' 8).
_TYPECODES = {torch.int64: "q", torch.int32: "i"}
assert all(array.array(c).itemsize == d.itemsize for d, c in _TYPECODES.items())


class HostStage:
    """Integer arrays gathered on the host and copied to the device together: one pinned
    buffer and one asynchronous copy per dtype (int64, int32). The pinned buffers come from
    torch's caching host allocator, which keeps a buffer until the copy that read it is done."""

    def __init__(self) -> None:
        # Only the dtypes some array was staged in travel (no int32 copy where no kernel
        # reads the batched segments).
        self.values: dict[torch.dtype, list[int]] = {}
        self.uploaded: dict[torch.dtype, torch.Tensor] = {}

    def _add(self, dtype: torch.dtype, values: list[int], shape: tuple[int, ...]) -> Staged:
        flat = self.values.setdefault(dtype, [])
        # Each array starts 16 bytes in, as an allocation would: kernels specialized on their
        # pointers' alignment see one alignment whatever the step's sizes.
        flat.extend([0] * (-len(flat) % (16 // dtype.itemsize)))
        staged = Staged(self, dtype, len(flat), shape)
        flat.extend(values)
        return staged

    def int64(self, values: list[int]) -> Staged:
        return self._add(torch.int64, values, (len(values),))

    def int32(self, values: list[int]) -> Staged:
        return self._add(torch.int32, values, (len(values),))

    def rows(self, dtype: torch.dtype, rows: list[list[int]], width: int) -> Staged:
        """`rows`, each exactly `width` long, as one [len(rows), width] tensor."""
        return self._add(dtype, [v for row in rows for v in row], (len(rows), width))

    def upload(self, device: torch.device) -> None:
        pin = device.type == "cuda"
        for dtype, values in self.values.items():
            # Through an array.array: it packs a list of ints several times faster than
            # torch.tensor(list), host time before the step's first launch (docs/benchmarks.md).
            packed = array.array(_TYPECODES[dtype], values)
            host = torch.frombuffer(packed, dtype=dtype) if values else torch.empty(0, dtype=dtype)
            if pin:
                host = host.pin_memory()
            self.uploaded[dtype] = host.to(device, non_blocking=pin)


class _MetadataStage:
    """The rows' view through one kind of block table (the main one, or the windowed
    layers'), staged: their KV slots, block tables and segments' tensors."""

    def __init__(
        self,
        stage: HostStage,
        tables: list[list[int]],
        spans: list[tuple[int, int, int, int]],
        pad: int,
        block_size: int,
        state: list[int],
        batched: bool,
    ) -> None:
        width = max((len(t) for t in tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in tables]
        slots: list[int] = []
        for r0, r1, index, context in spans:  # one run per block the span's positions touch
            table, position = tables[index], context - (r1 - r0)
            while position < context:
                block, offset = divmod(position, block_size)
                run = min(context - position, block_size - offset)
                base = table[block] * block_size + offset
                slots.extend(range(base, base + run))
                position += run
        self.slots = stage.int64(slots + [-1] * pad)  # pad rows write no KV
        self.spans, self.state = spans, state
        self.tables = stage.rows(torch.int64, padded or [[0]], width if padded else 1)
        self.batched = None
        if batched:
            starts = [r0 for r0, _, _, _ in spans] + [spans[-1][1] if spans else 0]
            self.batched = (
                stage.int32(starts),
                stage.int32([context for _, _, _, context in spans]),
                stage.rows(torch.int32, padded, width) if padded else None,
                stage.int32(state) if keeps_state(state) else None,
                max((r1 - r0 for r0, r1, _, _ in spans), default=0),
                max((context for _, _, _, context in spans), default=0),
            )

    def build(
        self, positions: torch.Tensor, window: AttentionMetadata | None = None
    ) -> AttentionMetadata:
        table = self.tables.get()
        segments = tuple(
            Segment(r0, r1, table[index], context, self.state[index])
            for r0, r1, index, context in self.spans
        )
        batched = None
        if self.batched is not None:
            starts, contexts, tables, slots, max_query, max_context = self.batched
            batched = BatchedSegments(
                query_start=starts.get(),
                context_lens=contexts.get(),
                block_tables=(
                    tables.get()
                    if tables is not None
                    else torch.zeros(0, 1, dtype=torch.int32, device=positions.device)
                ),
                max_query_len=max_query,
                max_context_len=max_context,
                state_slots=slots.get() if slots is not None else None,
            )
        return AttentionMetadata(positions, self.slots.get(), segments, batched, window)
