"""The decode benches' attention side: a fixed decode batch (`DecodeSteps`) that an attention
driver steps as its work source, and the model halves it runs, built from a preset or a model dir.

The rank around the batch is assembled by afdserve/afd/ranks/build.py, as the engine's ranks
are: the boundary (`attention_boundary`), the graph runner and the driver (`attention_driver`).
`afdserve bench decode` runs it colocated or in process (bench/decode.py), and its 1A1F run puts
the same batch on one GPU and the FFN half on another (bench/decode_p2p.py).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from afdserve.afd.ranks.build import StepGraphs, attention_boundary, attention_driver
from afdserve.bench.bytes import step_weight_bytes, timed_kv_bytes, touched_experts
from afdserve.bench.decode_drafts import DraftSteps
from afdserve.bench.report import WARMUP_STEPS, Timer
from afdserve.engine.control_round import LocalControl
from afdserve.engine.cuda_graphs import PlannedForward, check_capturable
from afdserve.engine.factory import auto_block_size
from afdserve.engine.kv_cache import (
    bytes_per_block,
    cache_dtype,
    check_fp8_kv,
    make_kv_cache,
    slots_for,
)
from afdserve.engine.model_runner import FFNBoundary, LocalFFN, ModelRunner, StepInputs
from afdserve.kernels.metadata import AttentionMetadata, BatchedSegments, Segment
from afdserve.layout.plan import RankStep
from afdserve.layout.topology import Topology
from afdserve.model.checkpoint.draft import config_refusal, load_draft, random_draft
from afdserve.model.checkpoint.loader import (
    TORCH_DTYPES,
    all_tensor_names,
    build_model,
    init_random_weights,
    load_weights,
)
from afdserve.model.config import ModelConfig
from afdserve.model.families import cache_layout, parse_model_config
from afdserve.model.parts import CausalLM, ModelParts, MTPDraft
from afdserve.model.quantization import resolve_quantization


class DecodeSpec(Protocol):
    """What the decode benches read of their spec: bench/decode.py's DecodeBench, which runs
    them and so is not imported here."""

    @property
    def model_dir(self) -> str | None: ...
    @property
    def preset(self) -> str | None: ...
    @property
    def random_weights(self) -> bool: ...
    @property
    def batch_sizes(self) -> tuple[int, ...]: ...
    @property
    def context_len(self) -> int: ...
    @property
    def topology(self) -> str: ...
    @property
    def connector(self) -> str: ...
    @property
    def graph_mode(self) -> str: ...
    @property
    def ubatches(self) -> int: ...
    @property
    def steps(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def block_size(self) -> int | None: ...  # None: the engine's auto
    @property
    def seed(self) -> int: ...
    @property
    def quantization(self) -> str | None: ...
    @property
    def kv_cache_dtype(self) -> str: ...
    @property
    def a2e_dtype(self) -> str: ...


@dataclass(frozen=True)
class DecodeResult:
    batch: int
    step_ms: float
    weight_bytes: int
    kv_bytes: int
    copy_gbps: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.batch / (self.step_ms / 1e3)

    @property
    def achieved_gbps(self) -> float:
        return (self.weight_bytes + self.kv_bytes) / (self.step_ms / 1e3) / 1e9


def build_half(spec: DecodeSpec, raw: dict, parts: ModelParts, device: torch.device) -> CausalLM:
    """One half (or the whole model) of the config `raw`: random weights hold what a colocated
    model of the spec's seed holds, so every half equals its part of the colocated model."""
    config = parse_model_config(raw)
    # Refused before any weight is drawn: DeepSeek-V4's attention is not capturable on CUDA.
    check_capturable(config, spec.device, spec.graph_mode)
    quantization = resolve_quantization(config.quantization, spec.quantization)
    config = dataclasses.replace(config, quantization=quantization)
    model = build_model(config, parts, TORCH_DTYPES[spec.dtype], device)
    if spec.random_weights:
        init_random_weights(model, spec.seed)
    else:
        load_weights(model, spec.model_dir, all_tensor_names(config))
    return model


def build_drafts(
    spec: DecodeSpec, raw: dict, attn: CausalLM, ffn: CausalLM
) -> tuple[MTPDraft, MTPDraft] | None:
    """The MTP layer beside each half (the same one colocated), with weights drawn from the
    spec's seed or read from its checkpoint; None where the model has none afdserve builds."""
    if config_refusal(raw, attn.config.family) is not None:
        return None
    device = next(attn.parameters()).device

    def one(main: CausalLM) -> MTPDraft:
        if spec.random_weights:
            return random_draft(main, raw, spec.seed, device)
        return load_draft(spec.model_dir, main, "auto", spec.seed, device)

    draft = one(attn)
    return draft, draft if ffn is attn else one(ffn)


def build_halves(spec: DecodeSpec, raw: dict) -> tuple[CausalLM, CausalLM]:
    """(attention half, FFN half) on the spec's device; colocated, both are the one model."""
    device = torch.device(spec.device)
    if spec.topology == "colocated":
        model = build_half(spec, raw, ModelParts.colocated(), device)
        return model, model
    return (
        build_half(spec, raw, ModelParts(True, False), device),
        build_half(spec, raw, ModelParts(False, True), device),
    )


class DecodeSteps:
    """A batch of `batch` sequences with `context_len` random cached tokens, decoded in lockstep.
    The cache is the engine's (`make_kv_cache`), every tensor of it drawn at unit scale in its
    own dtype: GQA/MLA K/V, or every page of a DeepSeek-V4 layer (its window rows and entries are
    RMS-normed, the open windows' projections and gates of unit order too), so a step at
    `context_len` reads a full context's worth of state.

    Steps run the engine's own path, assembled by ranks/build.py: a one-rank StepPlan decides
    capture / replay / eager, and graph steps go through the engine's `CudaGraphRunner` (its input
    copies included in the timing); in-process 1A1F hands tiles to the FFN half through the
    `InProcessConnector`, and `boundary` puts another in their place (1A1F across GPUs).

    `query_len` above 1 makes each step a speculative verification step: every sequence
    computes that many rows (its last token and query_len - 1 drafts) and every row's logits are
    taken, as the engine's verification does; the sequences then advance by one position (all
    drafts rejected, as random weights make them), so the context grows as in plain decode.
    `drafts`: the MTP layer's (attention half, FFN half), whose k = query_len - 1 draft passes
    then follow each step inside its timed span (bench/decode_drafts.py)."""

    def __init__(
        self,
        model: CausalLM,
        ffn: CausalLM | None,
        spec: DecodeSpec,
        batch: int,
        boundary: FFNBoundary | None = None,
        query_len: int = 1,
        drafts: tuple[MTPDraft, MTPDraft] | None = None,
    ) -> None:
        config, dev = model.config, next(model.parameters()).device
        self.model, self.spec, self.batch, self.device = model, spec, batch, dev
        self.query_len, self.rows = query_len, batch * query_len
        self.stamps = None  # kernels/triton_stamp.Stamps at the start and end of each step
        self.block_size = bs = spec.block_size or auto_block_size(config)
        last = spec.context_len + WARMUP_STEPS + spec.steps + query_len - 1
        self.width = math.ceil(last / bs)
        kv_dtype = cache_dtype(spec.kv_cache_dtype, TORCH_DTYPES[spec.dtype])
        if kv_dtype != TORCH_DTYPES[spec.dtype]:
            check_fp8_kv(config, dev)
        # One state slot per sequence where the layout keeps one (linear attention), in the
        # pages past the tables' blocks where the engine keeps them there (the same strides).
        slots = slots_for(config, batch, kv_dtype)
        pages = cache_layout(config).slot_pages(bs, kv_dtype)
        blocks = batch * (self.width + pages)
        check_cache_fits(config, batch, spec.context_len, blocks, bs, kv_dtype, dev)
        self.kv = make_kv_cache(config, blocks, bs, kv_dtype, dev, slots, shared_slots=pages > 0)
        gen = torch.Generator(device=dev).manual_seed(spec.seed + 1)
        for t in self.kv.tensors():
            if t.dtype.itemsize == 1:  # torch draws no float8: draw float32, cast
                t.copy_(torch.randn(t.shape, generator=gen, device=dev))
            else:
                t.normal_(generator=gen)
        self.tables = torch.arange(batch * self.width, device=dev, dtype=torch.int32).view(
            batch, self.width
        )
        rows = self.rows
        self.input_ids = torch.randint(0, config.vocab_size, (rows,), device=dev, generator=gen)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(batch + 1, dtype=torch.int32, device=dev) * query_len
        # Each row's sequence and its offset from the sequence's first row of the step.
        self.row_seq = torch.arange(batch, device=dev).repeat_interleave(query_len)
        self.row_offset = torch.arange(query_len, device=dev).repeat(batch)
        self.sample_rows = torch.arange(rows, device=dev)  # every row's logits: its own token
        self.state_slots = torch.arange(batch, dtype=torch.int32, device=dev)
        self.runner = ModelRunner(model, self.kv, dev)
        topology = Topology(1, 0 if spec.topology == "colocated" else 1)
        if boundary is None:
            boundary = attention_boundary(
                model,
                topology,
                0,
                False,
                ffn_model=ffn,
                a2e_dtype=spec.a2e_dtype,
                config=drafts[0].config if drafts else None,
                ffn_draft=drafts[1] if drafts and not topology.colocated else None,
            )
        # The step's rows are a graph size; verification steps launch their attention for
        # query_len rows a sequence, as the engine's decode graphs with drafts do. Draft passes
        # pad to the step's rows (pass 0) and to the batch (chained passes).
        sizes = tuple(sorted({batch, rows})) if drafts else (rows,)
        passes = query_len - 1 if drafts else 0
        graphs = StepGraphs(spec.graph_mode, sizes, spec.ubatches, query_len, passes)
        self.drafts = None
        if drafts:
            local = LocalFFN(drafts[0], boundary.a2e) if topology.colocated else boundary
            settings = graphs.draft_settings(dev, last)
            self.drafts = DraftSteps(
                drafts[0], model, local, self.tables, bs, query_len, kv_dtype, settings, gen
            )
        self.eager = PlannedForward(self.runner, boundary)
        self.driver = attention_driver(
            self,
            self.runner,
            boundary,
            graphs,
            graphs.recorder(0, keep_records=True),
            LocalControl(),
            topology=topology,
            rank=0,
            max_model_len=last,
            log_ranks=tuple(range(topology.world_size)),
        )
        self.step_index = 0

    def _inputs(self) -> StepInputs:
        q = self.query_len
        context = self.spec.context_len + self.step_index + q
        segments = tuple(
            Segment(i * q, (i + 1) * q, self.tables[i], context, i if self.kv.num_slots else -1)
            for i in range(self.batch)
        )
        batched = None
        if self.runner.batched_metadata:  # as ModelRunner.prepare gives it (DeepSeek-V4: always)
            slots = self.state_slots if self.kv.num_slots else -torch.ones_like(self.state_slots)
            batched = BatchedSegments(
                self.query_start, self.context_lens, self.tables, q, context, slots
            )
        meta = AttentionMetadata(self.positions, self.slots, segments, batched)
        return StepInputs(self.input_ids, self.input_ids, meta, self.sample_rows, [], self.rows)

    def _advance(self) -> None:
        """Point the step's tensors at the next position (device-side writes only)."""
        position = self.spec.context_len + self.step_index
        bs = self.block_size
        torch.add(self.row_offset, position, out=self.positions)
        blocks = self.tables[self.row_seq, self.positions // bs].long()
        self.slots.copy_(blocks * bs + self.positions % bs)
        self.context_lens.fill_(position + self.query_len)
        if self.drafts is not None:
            self.drafts.advance(position)

    # ----- the attention driver's work source: one fixed decode batch -----
    def schedule(self) -> tuple[None, RankStep]:
        return None, RankStep(self.rows, self.batch, True)

    def idle_work(self) -> None:
        return None

    @torch.inference_mode()
    def execute(
        self, work: None, plan, forward: PlannedForward, step: int
    ) -> tuple[torch.Tensor, float]:
        """One decode step: (next token ids, seconds of device time). The timed span is the
        engine's step on the device: the graph runner's copies into its buffers and the replay
        (or the eager forward), logits and the greedy pick. The plan and this bench's stand-in
        for the scheduler's input preparation (`_advance`) come before it."""
        inputs = self._inputs()
        self._advance()
        timer = Timer(self.device)
        if self.stamps is not None:
            self.stamps.mark()
        hidden = forward(inputs, plan, step)
        next_ids = self.runner.logits(hidden, inputs).argmax(dim=-1)
        self.input_ids.copy_(next_ids)
        if self.drafts is not None and plan.drafts:
            self.drafts.run(plan, hidden, next_ids, step)
        if self.stamps is not None:
            self.stamps.mark()
        seconds = timer.stop()
        self.step_index += 1
        return next_ids, seconds

    def step(self, eager: bool = False) -> tuple[torch.Tensor, float]:
        """One step through the attention driver; `eager` runs one outside it, without graphs
        and unrecorded (so it marks no graph as captured)."""
        if not eager:
            outputs = self.driver.step().outputs
            graphs = self.driver.forward.graphs
            failed = set(graphs.eager_keys) if graphs is not None else set()
            failed |= self.drafts.passes.eager_keys if self.drafts is not None else set()
            if failed:  # a figure of graphs, or none at all
                raise RuntimeError(
                    f"bench: capturing the graph of {sorted(failed)} failed (the warning "
                    "above says why), so the step would be timed eagerly"
                )
            return outputs
        recorder = self.driver.recorder
        plan = recorder.plan([self.schedule()[1]], self.driver.topology).attention[0]
        # Without its draft passes, whose plan may name graphs this step must not capture.
        plan = dataclasses.replace(plan, drafts=())
        return self.execute(None, plan, self.eager, recorder.step)


def check_cache_fits(
    config: ModelConfig,
    batch: int,
    context_len: int,
    blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """A ValueError naming the batch, the context and the bytes where the bench's paged cache
    (every sequence at `context_len` plus the timed steps) is more than the GPU has free, in
    place of an out-of-memory traceback halfway through the batch sizes."""
    if device.type != "cuda":
        return
    layout = cache_layout(config)
    need = bytes_per_block(config, block_size, dtype) * blocks
    if not layout.slot_pages(block_size, dtype):  # else the slots are in the blocks
        need += layout.bytes_per_slot(dtype) * slots_for(config, batch, dtype)
    free = torch.cuda.mem_get_info(device)[0]
    if need > free:
        raise ValueError(
            f"bench: a batch of {batch} at context {context_len} needs a KV cache of "
            f"{need / 2**30:.1f} GiB ({blocks} blocks of {block_size} tokens, {dtype}), more than "
            f"the {free / 2**30:.1f} GiB free on {device}; lower --batch-sizes or "
            "--context-len, or use --kv-cache-dtype fp8"
        )


def bench_batch(
    attn: CausalLM,
    ffn: CausalLM,
    spec: DecodeSpec,
    batch: int,
    copy_gbps: float | None,
    ready: Callable[[], None] | None = None,
    query_len: int = 1,
    drafts: tuple[MTPDraft, MTPDraft] | None = None,
) -> DecodeResult:
    """Warm up, then time `spec.steps` decode steps of a batch of `batch` (their median).
    `ready` runs between the two: -dp's replicas wait there for each other, so that their timed
    steps run at the same time (bench/decode_dp.py). `query_len` > 1: verification steps of
    that many rows a sequence, followed by `drafts`' passes where given (DecodeSteps)."""
    steps = DecodeSteps(attn, ffn, spec, batch, query_len=query_len, drafts=drafts)
    hit = touched_experts(steps, ffn)
    for _ in range(WARMUP_STEPS - 1):  # the first of these captures the graph, if any
        steps.step()
    if ready is not None:
        ready()
    times = [steps.step()[1] for _ in range(spec.steps)]
    # The timed steps' positions: touched_experts' step and the warm-up steps came first.
    timed = range(spec.context_len + WARMUP_STEPS, spec.context_len + WARMUP_STEPS + spec.steps)
    result = DecodeResult(
        batch=batch,
        step_ms=statistics.median(times) * 1e3,
        weight_bytes=step_weight_bytes(attn, ffn, batch, hit),
        kv_bytes=timed_kv_bytes(attn, batch, timed, steps.kv.dtype.itemsize),
        copy_gbps=copy_gbps,
    )
    del steps
    if spec.device == "cuda":
        torch.cuda.empty_cache()
    return result
