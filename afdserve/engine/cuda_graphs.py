"""CUDA graphs for the attention side of a one-process engine (colocated or in-process 1A1F).

One graph per attention key from the StepPlan covers the whole forward: embedding, every layer's
attention half and the FFN boundary (so the FFN half of in-process AFD is inside the same graph).
Logits and sampling stay outside. Static buffers are sized to the largest capture size; a replay
copies the step's inputs into them. Pad rows write no KV (slot -1), carry token id -1, and belong to
no attention segment, so their outputs are zero and dropped.

Whether a step captures, replays or runs eagerly is read from the plan, never decided here.
"""

from __future__ import annotations

import torch

from afdserve.afd.plan import AttentionRankPlan
from afdserve.engine.model_runner import FFNBoundary, ModelRunner, StepInputs
from afdserve.kernels.reference import AttentionMetadata, BatchedSegments


class GraphCaptureError(RuntimeError):
    pass


def graphs_supported(runner: ModelRunner, ubatches: int) -> str | None:
    """None when CUDA graphs can be used, else the reason they cannot."""
    if runner.device.type != "cuda":
        return "CUDA graphs need device='cuda'"
    if ubatches != 1:
        return "CUDA graphs are captured for ubatches=1 only"
    return None


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_rows: int, max_model_len: int,
                 allow_prefill: bool) -> None:
        self.runner = runner
        dev = runner.device
        self.max_rows, self.max_model_len = max_rows, max_model_len
        # full mode replays steps with prefill chunks too, so its graphs budget for long queries.
        self.allow_prefill = allow_prefill
        width = -(-max_model_len // runner.block_size)
        self.input_ids = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.route_ids = torch.full((max_rows,), -1, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_rows, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_rows,), -1, dtype=torch.int64, device=dev)
        self.query_start = torch.zeros(max_rows + 1, dtype=torch.int32, device=dev)
        self.context_lens = torch.zeros(max_rows, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_rows, width, dtype=torch.int32, device=dev)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _static_inputs(self, rows: int) -> StepInputs:
        batched = BatchedSegments(
            query_start=self.query_start[: rows + 1],
            context_lens=self.context_lens[:rows],
            block_tables=self.block_tables[:rows],
            max_query_len=rows if self.allow_prefill else 1,
            max_context_len=self.max_model_len,
        )
        meta = AttentionMetadata(self.positions[:rows], self.slots[:rows], (), batched)
        return StepInputs(self.input_ids[:rows], self.route_ids[:rows], meta,
                          torch.zeros(0, dtype=torch.int64), [], 0)

    def _load(self, inputs: StepInputs, rows: int) -> None:
        """Copy one step's inputs into the static buffers; segments past the real ones are empty."""
        real = inputs.real_rows
        self.input_ids[:rows].copy_(inputs.input_ids)
        self.route_ids[:rows].copy_(inputs.route_ids)
        self.positions[:rows].copy_(inputs.meta.positions)
        self.slots[:rows].copy_(inputs.meta.slot_mapping)
        batched = inputs.meta.batched
        segments = int(batched.context_lens.shape[0]) if batched is not None else 0
        if segments > rows:
            raise GraphCaptureError(f"{segments} segments do not fit a graph of {rows} rows")
        if batched is not None and segments:
            self.query_start[: segments + 1].copy_(batched.query_start)
            self.context_lens[:segments].copy_(batched.context_lens)
            width = batched.block_tables.shape[1]
            self.block_tables[:segments, :width].copy_(batched.block_tables)
        else:
            self.query_start[0] = 0
        self.query_start[segments + 1 : rows + 1] = real
        self.context_lens[segments:rows] = 0

    def forward(self, inputs: StepInputs, plan: AttentionRankPlan,
                boundary: FFNBoundary) -> torch.Tensor:
        if plan.mode not in ("capture", "replay"):
            return self.runner.forward(inputs, plan.ubatch_rows, boundary)
        rows = plan.padded_rows
        if rows > self.max_rows:
            raise GraphCaptureError(f"a graph of {rows} rows exceeds the buffers ({self.max_rows})")
        self._load(inputs, rows)
        key = plan.key
        if plan.mode == "capture" or key not in self.graphs:
            self._capture(key, rows, plan, boundary)
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def _capture(self, key, rows: int, plan: AttentionRankPlan, boundary: FFNBoundary) -> None:
        static = self._static_inputs(rows)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm the kernels' autotuning and caches first
            self.runner.forward(static, plan.ubatch_rows, boundary)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                out = self.runner.forward(static, plan.ubatch_rows, boundary)
        except RuntimeError as e:
            raise GraphCaptureError(
                f"capturing the graph for {rows} rows failed ({e}); the forward must not sync "
                "with the host (bfloat16 weights use the grouped-GEMM MoE path)"
            ) from e
        if self.pool is None:
            self.pool = graph.pool()
        self.graphs[key] = (graph, out)
