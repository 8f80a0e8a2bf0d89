"""CUDA graphs for the attention side: colocated, in-process 1A1F, and attention ranks of
multi-process AFD.

One graph per attention key from the StepPlan covers the whole forward: embedding, every layer's
attention half and the FFN boundary (the FFN half of in-process AFD, or the sends and receives of
an attention rank, whose FFN rank replays its own graph of the same step).
Logits and sampling stay outside. Static buffers are sized to the largest capture size; a replay
copies the step's inputs into them, each ubatch's segments into that ubatch's own buffers (and,
where the cache has a windowed pool, the windowed layers' slots and tables into theirs). Pad rows
write no KV (slot -1), carry token id -1, and belong to no attention segment, so their outputs are
zero and dropped.

Whether a step captures, replays or runs eagerly is read from the plan, never decided here, and
so is the kind of graph (`AttentionRankPlan.graph_kind`): a decode graph launches its attention for
at most `decode_query_len` query rows a segment (the decode kernels), a mixed one for queries as
long as the step (the varlen path), so `full` holds both kinds of each size.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import torch

from afdserve.engine.graph_tally import CaptureTally
from afdserve.engine.model_runner import FFNBoundary, ModelRunner, StepInputs
from afdserve.kernels.metadata import AttentionMetadata, BatchedSegments
from afdserve.layout.plan import AttentionRankPlan
from afdserve.model.config import ModelConfig
from afdserve.model.families import cache_layout

log = logging.getLogger(__name__)


class GraphCaptureError(RuntimeError):
    pass


class GraphKeyError(GraphCaptureError):
    """The plan said replay, but this rank holds no graph for the key: a pairing bug upstream.
    Raised by the graph runners of both roles."""


def check_replayable(rank: int, mode: str, key, graphs: dict) -> None:
    if mode == "replay" and key not in graphs:
        raise GraphKeyError(f"rank {rank}: the plan replays {key}, which it never captured")


def capture_graph(
    run: Callable[[], Any], pool, what: str
) -> tuple[torch.cuda.CUDAGraph, Any] | None:
    """Captures `run` (already warmed up) into a graph: (graph, what it returned), or None where
    two captures failed, the reason logged, so that the caller runs the key eagerly: a server's
    warm-up must not die of a capture. CUDA reports a failure inside a capture only as "failed
    due to a previous error during capture"; the causes that come and go between runs are a
    Python finalizer freeing memory mid-capture and the allocator returning cached blocks
    (a device sync) under memory pressure, so the garbage collector is run first and held off
    while capturing, and a failed capture is retried once after a sync."""
    reasons = []
    for _ in range(2):
        gc.collect()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        gc.disable()
        try:
            # thread_local: a process group's watchdog thread polls events during the capture.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = run()
            return graph, out
        except RuntimeError as e:
            free, total = (n / 2**30 for n in torch.cuda.mem_get_info())
            reasons.append(f"{e} (device memory free: {free:.1f} of {total:.1f} GiB)")
        finally:
            gc.enable()
    log.warning(
        "capturing the CUDA graph of %s failed twice, so that key runs eagerly: %s",
        what,
        " / then: ".join(reasons),
    )
    return None


def check_capturable(config: ModelConfig, device: str, graph_mode: str) -> None:
    """Refuses, by name, a graph mode the model's cache layout cannot be captured in on CUDA.
    On CPU every graph mode runs eagerly anyway, so it is allowed there."""
    why = cache_layout(config).graph_refusal(graph_mode)
    if why is not None and device.startswith("cuda"):
        raise ValueError(
            f"GraphConfig.graph_mode={graph_mode!r} is not supported for family "
            f"{config.family!r} on CUDA yet: {why}"
        )


def auto_graph_mode(config: ModelConfig, mode: str, max_model_len: int) -> tuple[str, str | None]:
    """What graph_mode "auto" (already resolved to `mode` for the device) becomes for this model
    at this max_model_len, and why, where its layout keeps it eager."""
    why = cache_layout(config).eager_by_default(max_model_len)
    if why is None or mode == "none":
        return mode, None
    return "none", why


def graphs_supported(runner: ModelRunner) -> str | None:
    """None when CUDA graphs can be used, else the reason they cannot."""
    if runner.device.type != "cuda":
        return "CUDA graphs need device='cuda'"
    return None


class UbatchBuffers:
    """Static segment tensors of one ubatch: the graph's kernels read them by address, a replay
    refills them. Segments past the step's real ones are empty (no rows, no context)."""

    def __init__(self, max_rows: int, width: int, device: torch.device) -> None:
        self.query_start = torch.zeros(max_rows + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(max_rows, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_rows, width, dtype=torch.int32, device=device)
        # Pad segments hold state slot -1: no sequence's state.
        self.state_slots = torch.full((max_rows,), -1, dtype=torch.int32, device=device)

    def batched(self, rows: int, max_query_len: int, max_context_len: int) -> BatchedSegments:
        return BatchedSegments(
            query_start=self.query_start[: rows + 1],
            context_lens=self.context_lens[:rows],
            block_tables=self.block_tables[:rows],
            max_query_len=max_query_len,
            max_context_len=max_context_len,
            state_slots=self.state_slots[:rows],
        )

    def load(self, batched: BatchedSegments | None, rows: int, real: int) -> None:
        segments = int(batched.context_lens.shape[0]) if batched is not None else 0
        if segments > rows:
            raise GraphCaptureError(f"{segments} segments do not fit a graph of {rows} rows")
        if batched is not None and segments:
            self.query_start[: segments + 1].copy_(batched.query_start)
            self.context_lens[:segments].copy_(batched.context_lens)
            width = batched.block_tables.shape[1]
            self.block_tables[:segments, :width].copy_(batched.block_tables)
            if batched.state_slots is not None:
                self.state_slots[:segments].copy_(batched.state_slots)
        else:
            self.query_start[0] = 0
        if segments < rows:  # segments past the real ones: no rows, no context
            self.query_start[segments + 1 : rows + 1] = real
            self.context_lens[segments:rows] = 0
            self.state_slots[segments:rows] = -1


class CudaGraphRunner:
    def __init__(
        self,
        runner: ModelRunner,
        max_rows: int,
        max_model_len: int,
        ubatches: int = 1,
        decode_query_len: int = 1,
    ) -> None:
        """`decode_query_len`: the most rows a request has in a decode step (1 + the drafts of
        speculative decoding), which the decode graphs' attention is launched for."""
        self.runner = runner
        self.decode_query_len = decode_query_len
        dev = runner.device
        self.max_rows, self.max_model_len = max_rows, max_model_len
        width = -(-max_model_len // runner.block_size)
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.route_ids = torch.full((max_rows,), -1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_rows,), -1, dtype=torch.int64, device=dev)
        self.ubatches = [UbatchBuffers(max_rows, width, dev) for _ in range(ubatches)]
        # The windowed layers' view (their own pool's slots and tables), where the cache has one.
        self.window_slots: torch.Tensor | None = None
        self.window_ubatches: list[UbatchBuffers] = []
        if runner.kv_cache.has_window_pool:
            self.window_slots = torch.full_like(self.slots, -1)
            self.window_ubatches = [UbatchBuffers(max_rows, width, dev) for _ in range(ubatches)]
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.eager_keys: set[tuple] = set()  # keys whose capture failed: they run eagerly
        self.pool = None
        self.tally = CaptureTally()

    def _query_len(self, plan: AttentionRankPlan, rows: int) -> int:
        """The query length a graph of the plan's kind launches its attention for: a mixed
        graph's queries may be the whole ubatch (prefill chunks), a decode graph's 1 + k."""
        return rows if plan.graph_kind == "mixed" else min(rows, self.decode_query_len)

    def _static_inputs(self, plan: AttentionRankPlan) -> StepInputs:
        rows = plan.padded_rows
        metas = []
        for u, (buffers, (lo, hi)) in enumerate(
            zip(self.ubatches, plan.ubatch_bounds, strict=True)
        ):
            n = hi - lo
            query = self._query_len(plan, n)
            window = None
            if self.window_slots is not None:
                batched = self.window_ubatches[u].batched(n, query, self.max_model_len)
                slots = self.window_slots[lo:hi]
                window = AttentionMetadata(self.positions[lo:hi], slots, (), batched)
            batched = buffers.batched(n, query, self.max_model_len)
            slots = self.slots[lo:hi]
            metas.append(AttentionMetadata(self.positions[lo:hi], slots, (), batched, window))
        # The whole batch's view (positions feed the rotary tables of every ubatch).
        one = len(metas) == 1
        whole = AttentionMetadata(
            self.positions[:rows],
            self.slots[:rows],
            (),
            metas[0].batched if one else None,
            metas[0].window if one else None,
        )
        return StepInputs(
            self.input_ids[:rows],
            self.route_ids[:rows],
            whole,
            torch.zeros(0, dtype=torch.int64),
            [],
            0,
            tuple(metas),
        )

    def _load(self, inputs: StepInputs, plan: AttentionRankPlan) -> None:
        """Copy one step's inputs into the static buffers, each ubatch's segments into its own."""
        rows = plan.padded_rows
        batched = inputs.meta.batched
        if batched is not None and batched.max_query_len > self._query_len(plan, rows):
            raise GraphCaptureError(
                f"a query of {batched.max_query_len} rows replays the {plan.graph_kind} graph "
                f"{plan.key}, launched for {self._query_len(plan, rows)}"
            )
        self.input_ids[:rows].copy_(inputs.input_ids)
        self.route_ids[:rows].copy_(inputs.route_ids)
        self.positions[:rows].copy_(inputs.meta.positions)
        self.slots[:rows].copy_(inputs.meta.slot_mapping)
        # one ubatch: rows(0, rows) is the step's own metadata, no new segment tensors
        per_ubatch = zip(self.ubatches, plan.ubatch_bounds, plan.ubatch_real_rows, strict=True)
        for u, (buffers, (lo, hi), real) in enumerate(per_ubatch):
            meta = inputs.meta.rows(lo, hi)
            buffers.load(meta.batched, hi - lo, real)
            if self.window_slots is not None:
                self.window_ubatches[u].load(meta.window.batched, hi - lo, real)
        if self.window_slots is not None:
            self.window_slots[:rows].copy_(inputs.meta.window.slot_mapping)

    def _load_blank(self, plan: AttentionRankPlan) -> None:
        """Pad rows only: token 0, route id -1, position 0, no KV slot, no segment."""
        rows = plan.padded_rows
        self.input_ids[:rows].zero_()
        self.route_ids[:rows].fill_(-1)
        self.positions[:rows].zero_()
        self.slots[:rows].fill_(-1)
        for buffers, (lo, hi) in zip(self.ubatches, plan.ubatch_bounds, strict=True):
            buffers.load(None, hi - lo, 0)
        if self.window_slots is not None:
            self.window_slots[:rows].fill_(-1)
            for buffers, (lo, hi) in zip(self.window_ubatches, plan.ubatch_bounds, strict=True):
                buffers.load(None, hi - lo, 0)

    def forward(
        self, inputs: StepInputs, plan: AttentionRankPlan, boundary: FFNBoundary
    ) -> torch.Tensor:
        if plan.mode not in ("capture", "replay"):
            return self.runner.forward(inputs, plan, boundary)
        rows = plan.padded_rows
        if rows > self.max_rows:
            raise GraphCaptureError(f"a graph of {rows} rows exceeds the buffers ({self.max_rows})")
        if len(plan.ubatch_rows) != len(self.ubatches):
            raise GraphCaptureError(
                f"the plan has {len(plan.ubatch_rows)} ubatches, the graph buffers "
                f"{len(self.ubatches)}"
            )
        key = plan.key
        if plan.mode == "capture":
            # A capture executes the forward twice (its warm run, then the replay), so it runs
            # over blank buffers (pad rows only, as the warm-up steps) and the replay alone runs
            # the step: a step need not be idempotent (a sliding window's ring and a compressor's
            # prev rows overwrite rows the same step reads). The graph reads the buffers by
            # address, never their contents on the host, so what it holds is the same.
            self._load_blank(plan)
            if key in self.graphs or key in self.eager_keys:
                # Held already (another member of the group captures a kind it lacked): the
                # warm run alone, so that peers see a capture's sends and receives.
                self._warm_again(key, plan, boundary)
            elif not self._capture(key, plan, boundary):
                # The warm run has run over blank buffers: the step itself runs now, eagerly
                # (a peer rank sees the same sends and receives as from a replay).
                self.eager_keys.add(key)
        if key in self.eager_keys:
            return self.runner.forward(inputs, plan, boundary)
        check_replayable(plan.rank, plan.mode, key, self.graphs)
        self._load(inputs, plan)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _warm_again(self, key, plan: AttentionRankPlan, boundary: FFNBoundary) -> None:
        """A capture step's warm run for a key this rank holds: over the blank buffers."""
        if key in self.graphs:
            self.graphs[key][0].replay()
        else:
            self.runner.forward(self._static_inputs(plan), plan, boundary)

    def _capture(self, key, plan: AttentionRankPlan, boundary: FFNBoundary) -> bool:
        with self.tally.capturing(plan.graph_kind or "decode"):
            return self._warm_and_capture(key, plan, boundary)

    def _warm_and_capture(self, key, plan: AttentionRankPlan, boundary: FFNBoundary) -> bool:
        static = self._static_inputs(plan)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm the kernels' autotuning and caches first
            self.runner.forward(static, plan, boundary)
        torch.cuda.current_stream().wait_stream(stream)
        what = f"rank {plan.rank}'s {key} ({plan.padded_rows} rows)"
        step = lambda: self.runner.forward(static, plan, boundary)  # noqa: E731
        captured = capture_graph(step, self.pool, what)
        if captured is None:
            return False
        if self.pool is None:
            self.pool = captured[0].pool()
        self.graphs[key] = captured
        return True


class PlannedForward:
    """The attention side's forward under its rank's plan: the boundary learns the plan first,
    then the step runs eagerly or as the CUDA graph the plan names (`graphs` is None without CUDA
    graphs; a capture or replay step then runs eagerly with the same padded layout)."""

    def __init__(
        self, runner: ModelRunner, boundary: FFNBoundary, graphs: CudaGraphRunner | None = None
    ) -> None:
        self.runner, self.boundary, self.graphs = runner, boundary, graphs

    def __call__(self, inputs: StepInputs, plan: AttentionRankPlan, step: int) -> torch.Tensor:
        self.boundary.begin_step(plan, step)
        if self.graphs is not None:
            return self.graphs.forward(inputs, plan, self.boundary)
        return self.runner.forward(inputs, plan, self.boundary)
