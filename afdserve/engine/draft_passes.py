"""One draft pass of the MTP layer (engine/mtp.py) under its plan: the pass's input rows (the main
model's hidden rows for pass 0, the layer's own previous output for a chained pass) and the token
after each -> h' -> the layer's attention half over its own KV -> its MoE across the boundary ->
g [rows, hidden]. The draft's logits stay outside, as the main step's do.

A pass the plan runs eagerly covers its real rows only. A capture or replay pass (rules 9 and 10
of layout/plan.py) runs over static buffers padded to the plan's rows, as engine/cuda_graphs.py's
decode graphs do: sized to the largest capture size, real rows in front, pad rows with no KV slot
(-1), route id -1 and no segment, so their outputs are zero and dropped. On CUDA it is one graph
per key; elsewhere, or where a capture failed, the same buffers run eagerly, so the CPU tests run
this path too. Whether a pass captures, replays or runs eagerly is read from the plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdserve.engine.cuda_graphs import (
    GraphCaptureError,
    UbatchBuffers,
    capture_graph,
    check_replayable,
)
from afdserve.engine.model_runner import FFNBoundary
from afdserve.kernels.metadata import AttentionMetadata
from afdserve.layout.plan import AttentionRankPlan
from afdserve.model.cache import PagedCache
from afdserve.model.parts import CausalLM, MTPDraft


@dataclass
class PassInputs:
    """A pass's real rows: `rows` [n, hidden] (main hidden rows, or the layer's previous
    output), `ids` [n] the token after each (it travels with the row), `meta` their positions,
    KV slots and segments (`batched` given wherever the pass may run from the buffers)."""

    rows: torch.Tensor
    ids: torch.Tensor
    meta: AttentionMetadata


@dataclass(frozen=True)
class DraftGraphSettings:
    """The buffers' sizes and the decode graphs' launch shape, as the main step's CudaGraphRunner
    has them (a pass's plan says its kind: a mixed graph launches the whole pass); `capture`:
    real CUDA graphs (else capture and replay run the buffers eagerly)."""

    max_rows: int
    max_model_len: int
    decode_query_len: int
    capture: bool


class DraftPasses:
    def __init__(
        self, draft: MTPDraft, main: CausalLM, cache: PagedCache, device: torch.device
    ) -> None:
        self.draft, self.main, self.cache, self.device = draft, main, cache, device
        self.index = draft.config.num_layers - 1  # N, the layer's index on both roles
        self.settings: DraftGraphSettings | None = None
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.eager_keys: set[tuple] = set()  # keys whose capture failed: their buffers run eagerly
        self.pool = None

    def use_graphs(self, settings: DraftGraphSettings | None) -> None:
        """Static buffers for capture and replay passes (None: those run eagerly), and no
        graph yet: graphs captured before hold an earlier boundary."""
        self.settings, self.graphs, self.eager_keys, self.pool = settings, {}, set(), None
        if settings is None:
            return
        if self.cache.has_window_pool or self.cache.num_slots:
            # The buffers carry positions, KV slots and segments only (no window view, no
            # sequence slots). Off CUDA an eager pass pairs with the FFN side's either way.
            if settings.capture:
                raise ValueError(
                    "CUDA graphs of MTP draft passes cover a paged draft cache only; this "
                    "draft's keeps a windowed pool or sequence slots: use graph_mode='none'"
                )
            self.settings = None
            return
        dev, rows = self.device, settings.max_rows
        width = -(-settings.max_model_len // self.cache.block_size)
        # A chained draft's row may lie past max_model_len, in a block the sequence holds.
        self.max_context = width * self.cache.block_size
        self.hidden = torch.zeros(rows, *self.draft.row_shape, dtype=self.draft.dtype)
        self.hidden = self.hidden.to(dev)
        self.next_ids = torch.zeros(rows, dtype=torch.int64, device=dev)  # pad: a valid row
        self.route_ids = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, device=dev)
        self.segments = UbatchBuffers(rows, width, dev)

    def run(
        self, plan: AttentionRankPlan, boundary: FFNBoundary, first: bool, inputs: PassInputs | None
    ) -> torch.Tensor | None:
        """The pass's output g [n, hidden] over its real rows (`inputs`; None: none, yet a pad
        tile still travels where the plan gives one); `first`: pass 0, from the main rows.
        The caller has begun the boundary's step with `plan`."""
        if plan.mode in ("capture", "replay") and self.settings is not None:
            return self._graphed(plan, boundary, first, inputs)
        if inputs is None:
            if plan.mode != "idle" and any(plan.tile_rows):
                # One pad row (zeros, token id -1), as the main step's pad rows travel: no
                # kernel meets an empty batch, and the FFN ranks see a pad row like any other.
                x = torch.zeros(1, self.draft.config.hidden_size, dtype=self.draft.dtype)
                x = x.to(self.device)
                ids = torch.full((1,), -1, dtype=torch.int64, device=self.device)
                routing = self.draft.route_on_attention(self.index, x, ids, boundary.a2e.roundtrip)
                boundary.post(self.index, 0, x, ids, routing).wait()
            return None
        return self._layer(first, inputs.rows, inputs.ids, inputs.ids, inputs.meta, boundary)

    def _layer(
        self,
        first: bool,
        rows: torch.Tensor,
        ids: torch.Tensor,
        route_ids: torch.Tensor,
        meta: AttentionMetadata,
        boundary: FFNBoundary,
    ) -> torch.Tensor:
        """The layer over `rows` [n, hidden]: h' (from main rows where `first`), attention,
        the MoE across `boundary` with `route_ids` (-1 on pad rows), -> g [n, hidden]."""
        draft, positions = self.draft, meta.positions
        h = (draft.first_input if first else draft.chain_input)(rows, ids, positions)
        cos_sin = self.main.cos_sin(positions)
        x, h = draft.attention_half(h, meta, self.cache.layers[0], cos_sin)
        routing = draft.route_on_attention(self.index, x, route_ids, boundary.a2e.roundtrip)
        return draft.add_ffn_output(h, boundary.post(self.index, 0, x, route_ids, routing).wait())

    def _graphed(
        self, plan: AttentionRankPlan, boundary: FFNBoundary, first: bool, inputs: PassInputs | None
    ) -> torch.Tensor | None:
        rows, key, settings = plan.padded_rows, plan.key, self.settings
        if rows > settings.max_rows:
            raise GraphCaptureError(
                f"a draft pass of {rows} rows exceeds the buffers ({settings.max_rows})"
            )
        real = 0 if inputs is None else int(inputs.ids.shape[0])
        if real > rows:
            raise GraphCaptureError(f"a draft pass of {real} rows exceeds its plan's {rows}")
        segments = () if inputs is None else inputs.meta.segments
        if settings.capture and plan.mode == "capture":
            # Warm run and capture over pad rows only, as the main step's: the replay alone
            # runs the pass, once (engine/cuda_graphs.py says why). A capture exchanges twice
            # on every rank (the warm run, then the pass), held key or not.
            self._load(None, plan)
            if key in self.graphs or key in self.eager_keys:
                # Held already (a peer of the group captures a kind this rank has): the warm
                # run alone, over the blank buffers, as the main step's runner does.
                self._warm_again(key, plan, boundary, first)
            elif not self._capture(key, plan, boundary, first):
                self.eager_keys.add(key)
        if not settings.capture or key in self.eager_keys:
            self._load(inputs, plan)
            out = self._layer(first, *self._static(plan, segments), boundary)
            return out[:real] if real else None
        check_replayable(plan.rank, plan.mode, key, self.graphs)
        self._load(inputs, plan)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:real] if real else None

    def _warm_again(self, key, plan: AttentionRankPlan, boundary: FFNBoundary, first: bool) -> None:
        """A capture pass's warm run for a key this rank holds: over the blank buffers."""
        if key in self.graphs:
            self.graphs[key][0].replay()
        else:
            self._layer(first, *self._static(plan, ()), boundary)

    def _capture(self, key, plan: AttentionRankPlan, boundary: FFNBoundary, first: bool) -> bool:
        static = self._static(plan, ())
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm the kernels' autotuning and caches first
            self._layer(first, *static, boundary)
        torch.cuda.current_stream().wait_stream(stream)
        what = f"rank {plan.rank}'s draft pass {key} ({plan.padded_rows} rows)"
        captured = capture_graph(lambda: self._layer(first, *static, boundary), self.pool, what)
        if captured is None:
            return False
        if self.pool is None:
            self.pool = captured[0].pool()
        self.graphs[key] = captured
        return True

    def _query_len(self, plan: AttentionRankPlan) -> int:
        """The query rows a segment may have in the pass's graph: its kind says (rule 5)."""
        rows = plan.padded_rows
        return rows if plan.graph_kind == "mixed" else min(rows, self.settings.decode_query_len)

    def _static(self, plan: AttentionRankPlan, segments: tuple) -> tuple:
        """(rows, ids, route ids, metadata) over the buffers' first `plan.padded_rows`;
        `segments`: the host segments the reference kernels loop over (off CUDA; a graph reads
        the buffers)."""
        rows, query = plan.padded_rows, self._query_len(plan)
        batched = self.segments.batched(rows, query, self.max_context)
        host = () if self.device.type == "cuda" else segments
        layout_batched = self.device.type == "cuda" or self.cache.layout.batched_segments
        meta = AttentionMetadata(
            self.positions[:rows], self.slots[:rows], host, batched if layout_batched else None
        )
        return self.hidden[:rows], self.next_ids[:rows], self.route_ids[:rows], meta

    def _load(self, inputs: PassInputs | None, plan: AttentionRankPlan) -> None:
        """The pass's real rows into the buffers' front, pad rows after them (None: pad only)."""
        rows, query = plan.padded_rows, self._query_len(plan)
        real = 0 if inputs is None else int(inputs.ids.shape[0])
        batched = None if inputs is None else inputs.meta.batched
        if batched is not None and batched.max_query_len > query:
            raise GraphCaptureError(
                f"a draft pass's query of {batched.max_query_len} rows replays a "
                f"{plan.graph_kind} graph launched for {query}"
            )
        if inputs is not None:
            self.hidden[:real].copy_(inputs.rows)
            self.next_ids[:real].copy_(inputs.ids)
            self.route_ids[:real].copy_(inputs.ids)
            self.positions[:real].copy_(inputs.meta.positions)
            self.slots[:real].copy_(inputs.meta.slot_mapping)
        self.hidden[real:rows].zero_()
        self.next_ids[real:rows].zero_()
        self.route_ids[real:rows].fill_(-1)
        self.positions[real:rows].zero_()
        self.slots[real:rows].fill_(-1)
        self.segments.load(batched, rows, real)
