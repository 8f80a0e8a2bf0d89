"""Builds one rank (attention, FFN, or a whole one-process engine) from a WorkerSpec: loads its
half, picks its boundary, sets up CUDA graphs, and wraps it all in its role's step driver. The
offline API and the rank workers both build ranks here, so both get the same parts.

The parts are built by the builders below (`attention_boundary`, `graph_runner`,
`attention_driver`, `open_inboxes`, `ffn_driver`), which take what they assemble rather than a
WorkerSpec: the decode benches (afdserve/bench/) build their halves from presets and drive a fixed
decode batch as the work source, and assemble their ranks through these same functions.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from afdserve.afd.dataplane.connector import AttentionConnector, InProcessConnector
from afdserve.afd.dataplane.expert_group import ExpertGroup
from afdserve.afd.dataplane.ffn import FFNExchange, FFNStepRunner
from afdserve.afd.dataplane.wire import Wire
from afdserve.afd.ranks.messages import RankReady, WorkerSpec
from afdserve.afd.step.ffn_driver import FFNDriver
from afdserve.config import MTP_IPC_REFUSAL
from afdserve.engine.control_round import Control
from afdserve.engine.cuda_graphs import CudaGraphRunner, PlannedForward, check_capturable
from afdserve.engine.device import resolve_device
from afdserve.engine.draft_passes import DraftGraphSettings
from afdserve.engine.engine_core import EngineCore
from afdserve.engine.factory import (
    MemoryReport,
    create_engine_core,
    half_parts,
    load_ffn_draft,
    load_half,
    parameter_bytes,
)
from afdserve.engine.model_runner import FFNBoundary, LocalFFN, ModelRunner
from afdserve.engine.step_loop import AttentionDriver, WorkSource
from afdserve.engine.step_recorder import StepRecorder
from afdserve.kernels.a2e import A2EFormat
from afdserve.layout.experts import resolve_placement
from afdserve.layout.topology import Topology
from afdserve.model.config import ModelConfig
from afdserve.model.families import load_model_config
from afdserve.model.parts import CausalLM

if TYPE_CHECKING:
    from afdserve.afd.dataplane.ipc import Inboxes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepGraphs:
    """A rank's CUDA-graph settings, the same on every rank of a world: the graph mode, the
    capture sizes (the graph table's; a bench's fixed batch is its one size) and the ubatches.
    The recorder and the graph runners are built from one value, so they cannot disagree."""

    mode: str = "none"
    sizes: tuple[int, ...] = ()
    ubatches: int = 1
    decode_query_len: int = 1  # rows a request in a decode step: 1 + its drafts at most
    draft_passes: int = 0  # MTP: the draft layer's passes after each step (layout/plan.py)

    @classmethod
    def of(cls, spec: WorkerSpec) -> StepGraphs:
        # Ranks started elsewhere get "auto" as given: each resolves it on its own host.
        graphs = spec.graphs.resolved(resolve_device(spec.engine.device))
        sizes = graphs.capture_sizes(spec.engine.max_num_seqs)
        speculative = spec.engine.speculative_config
        drafts = speculative.num_speculative_tokens if speculative is not None else 0
        passes = drafts if speculative is not None and speculative.is_mtp else 0
        return cls(graphs.mode, sizes, spec.afd.ubatches, 1 + drafts, passes)

    def recorder(
        self, rank: int, log_path: str | None = None, keep_records: bool = False
    ) -> StepRecorder:
        return StepRecorder(
            rank, self.mode, self.sizes, log_path, keep_records, self.ubatches, self.draft_passes
        )

    def draft_settings(self, device: torch.device, max_model_len: int) -> DraftGraphSettings | None:
        """The MTP draft passes' graph buffers, where capture and replay passes may come (on
        every device: off CUDA their buffers run eagerly), or None."""
        if self.mode == "none" or not self.sizes or not self.draft_passes:
            return None
        return DraftGraphSettings(
            max(self.sizes),
            max_model_len,
            self.decode_query_len,
            device.type == "cuda",
        )

    def captured_on(self, device: torch.device) -> bool:
        """Whether capture and replay steps really run CUDA graphs on `device`: elsewhere they
        run eagerly with the graph layout, so the plan's policy is the same everywhere."""
        wanted = self.mode != "none" and bool(self.sizes)
        if wanted and device.type != "cuda":
            log.info(
                "graph_mode=%s on %s: capture and replay steps run eagerly with the graph "
                "layout (CUDA graphs need device='cuda')",
                self.mode,
                device,
            )
        return wanted and device.type == "cuda"


def attention_boundary(
    model: CausalLM,
    topology: Topology,
    rank: int,
    gate_on_attention: bool,
    wire: Wire | None = None,
    ffn_model: CausalLM | None = None,
    inboxes: Inboxes | None = None,
    a2e_dtype: str = "auto",
    config: ModelConfig | None = None,
    ffn_draft: CausalLM | None = None,
) -> FFNBoundary:
    """Where an attention rank's layers hand their rows to the FFN half: the FFN half of a
    colocated model (`ffn_model`, or `model` itself when it holds both halves), the FFN half in
    this process (`ffn_model`, 1A1F on one device; `wire` only logs), the FFN rank's symmetric
    inbox (`inboxes`, connector "ipc"), or point-to-point batches over `wire`; every one hands
    the rows over in `a2e_dtype`'s format (kernels/a2e.py). `config`: the layers that cross
    it when more than the model's (an MTP draft's config: the main layers, then layer N);
    `ffn_draft`: the MTP layer's FFN half beside `ffn_model` in this process."""
    a2e = A2EFormat(a2e_dtype, model.dtype)
    config = config or model.config
    if topology.colocated:
        return LocalFFN(ffn_model if ffn_model is not None else model, a2e)
    if ffn_model is not None:
        return InProcessConnector(ffn_model, gate_on_attention, wire, a2e, ffn_draft)
    if inboxes is not None:
        _check_ipc_format(a2e)
        from afdserve.afd.dataplane.ipc import IPCAttentionConnector

        return IPCAttentionConnector(config, inboxes, rank, gate_on_attention)
    param = next(model.parameters())
    # A wire without a log path sends plainly; the workers pass one that logs when asked.
    return AttentionConnector(
        config,
        model.dtype,
        param.device,
        gate_on_attention,
        wire if wire is not None else Wire(rank),
        a2e,
    )


def _check_ipc_format(a2e: A2EFormat) -> None:
    if not a2e.plain:  # the push kernel writes rows in the inbox's (the model's) dtype
        raise ValueError(
            f"a2e_dtype={a2e.name!r} over a {a2e.model_dtype} model is not carried "
            f"by connector='ipc' yet: use connector='p2p'"
        )


def graph_runner(
    runner: ModelRunner, graphs: StepGraphs, max_model_len: int
) -> CudaGraphRunner | None:
    """The attention side's CUDA graphs (buffers for the largest capture size), or None where
    capture and replay steps run eagerly."""
    if not graphs.captured_on(runner.device):
        return None
    # The frontend refuses this first; a bench assembling its ranks here meets the same line.
    check_capturable(runner.model.config, str(runner.device), graphs.mode)
    return CudaGraphRunner(
        runner,
        max(graphs.sizes),
        max_model_len,
        ubatches=graphs.ubatches,
        decode_query_len=graphs.decode_query_len,
    )


def attention_driver(
    source: WorkSource,
    runner: ModelRunner,
    boundary: FFNBoundary,
    graphs: StepGraphs,
    recorder: StepRecorder,
    control: Control,
    *,
    topology: Topology,
    rank: int,
    max_model_len: int,
    log_ranks: tuple[int, ...] | None = None,
) -> AttentionDriver:
    """An attention rank's step loop: `source` (the engine, or a bench's fixed decode batch)
    schedules and executes through `runner` and `boundary` under the plan, with CUDA graphs when
    `graphs` captures on the runner's device. `log_ranks`: the ranks whose step lines this rank
    logs (a one-process engine logs its FFN half's line too)."""
    forward = PlannedForward(runner, boundary, graph_runner(runner, graphs, max_model_len))
    return AttentionDriver(source, forward, recorder, control, topology, rank, log_ranks)


def open_inboxes(
    topology: Topology,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    ubatches: int,
    tile_cap: int,
) -> Inboxes:
    """The symmetric inboxes of connector "ipc", sized for the busiest FFN rank's peers and
    tiles of up to `tile_cap` rows. A collective over the whole world: every rank opens them
    once, with these same sizes."""
    from afdserve.afd.dataplane.ipc import Inboxes

    peers_cap = max(len(topology.peers(f)) for f in range(topology.ffn_ranks))
    return Inboxes(
        dist.group.WORLD,
        device,
        dtype,
        config.hidden_size,
        config.top_k,
        ubatches,
        peers_cap,
        tile_cap,
    )


def ffn_driver(
    model: CausalLM,
    rank: int,
    device: torch.device,
    wire: Wire,
    graphs: StepGraphs,
    recorder: StepRecorder,
    control: Control,
    *,
    topology: Topology,
    gate_on_attention: bool = False,
    expert: ExpertGroup | None = None,
    inboxes: Inboxes | None = None,
    a2e_dtype: str = "auto",
    draft: CausalLM | None = None,
) -> FFNDriver:
    """An FFN rank's step loop: its half receives every peer's tile (over `wire`, or from its
    symmetric inbox with `inboxes`) in `a2e_dtype`'s format, runs, and replies, as one CUDA
    graph per plan key when `graphs` captures on `device`; `expert`: its expert-parallel group,
    if any; `draft`: the MTP layer's FFN half, which the plan's draft passes run."""
    transport = None
    a2e = A2EFormat(a2e_dtype, model.dtype)
    if inboxes is not None:
        _check_ipc_format(a2e)
        from afdserve.afd.dataplane.ipc import IPCTransport

        transport = IPCTransport(inboxes, rank)
    exchange = FFNExchange(
        model, rank, gate_on_attention, device, wire, expert, transport, a2e, draft
    )
    runner = FFNStepRunner(exchange, graphs.captured_on(device))
    return FFNDriver(runner, recorder, control, topology, rank)


@dataclass
class BuiltRank:
    driver: AttentionDriver | FFNDriver
    core: EngineCore | None  # attention ranks
    wire: Wire | None
    ready: tuple[RankReady, ...]  # one per rank this process holds (two for in-process 1A1F)
    boundary: FFNBoundary | None = None  # attention ranks: where rows cross to the FFN half
    half: CausalLM | None = None  # the weights this rank holds (an FFN rank's model)
    draft: CausalLM | None = None  # an FFN rank's MTP layer (its FFN half), with MTP drafts

    def drop_requests(self) -> int:
        """Forget every request (its KV blocks go back to the free list; blocks a prefix cache
        registered stay cached, their contents were complete): after a failure the frontend
        resumes them by recompute. Returns how many there were."""
        if self.core is None:
            return 0
        ids = list(self.core.requests)
        for request_id in ids:
            self.core.abort(request_id)
        return len(ids)


def _wire(spec: WorkerSpec, rank: int) -> Wire:
    directory = spec.afd.log_data_plane
    return Wire(rank, os.path.join(directory, f"rank{rank}.jsonl") if directory else None)


def _inboxes(
    spec: WorkerSpec, device: torch.device, dtype: torch.dtype, config: ModelConfig
) -> Inboxes | None:
    """The inboxes of connector="ipc" (every rank of the world opens them, with these same
    sizes), or None for the other connectors."""
    if spec.afd.connector != "ipc":
        return None
    # A tile is at most one attention rank's padded rows of a ubatch: its tokens, or a graph size.
    sizes = StepGraphs.of(spec).sizes  # "auto" resolved as the graph runners resolve it
    tile_cap = max((spec.engine.max_num_batched_tokens, *sizes))
    return open_inboxes(spec.topology, config, dtype, device, spec.afd.ubatches, tile_cap)


def _ready(
    rank: int, role: str, memory: MemoryReport, model, limits, prefix_caching: bool = False
) -> RankReady:
    return RankReady(
        rank, role, memory, tuple(sorted(model.expected_tensors())), limits, prefix_caching
    )


def build_attention_rank(
    spec: WorkerSpec,
    rank: int,
    device: torch.device,
    control: Control,
    in_process: bool = False,
    kept: BuiltRank | None = None,
) -> BuiltRank:
    """An attention rank. Colocated topologies hold the FFN half too; `in_process` (1A1F on one
    device) holds the FFN rank's half behind an InProcessConnector and logs both ranks' lines.
    `kept`: this rank as built for an earlier world generation, whose engine core (model half,
    KV cache, block manager) is reused; everything tied to the world (boundary, graphs, driver)
    is built anew against `control` and the new process groups."""
    topology, gate = spec.topology, spec.afd.gate_on_attention
    role = "colocated" if topology.colocated else "attention"
    ffn_model = ffn_draft = None
    if kept is not None:
        if in_process:
            raise ValueError("an in-process 1A1F rank has no world to rejoin")
        core, memory = kept.core, kept.ready[0].memory
        assert core is not None, "an attention rank keeps its engine core"
    else:
        if in_process and not topology.colocated:
            # Loaded before the attention half: the KV cache is sized from the memory still
            # free, and it must leave the experts their room.
            ffn_model, _ = load_half(spec.engine, half_parts("ffn", gate), device, rank)
            ffn_draft = load_ffn_draft(spec.engine, ffn_model, device, rank)
        core, _, memory = create_engine_core(spec.engine, half_parts(role, gate), rank, device)
    ready = [
        _ready(
            rank, "attention", memory, core.model, core.limits, core.block_manager.prefix_caching
        )
    ]
    wire = inboxes = None
    if ffn_model is not None:
        wire = _wire(spec, 1)  # logs what FFN rank 1 ran: nothing travels
        ffn_memory = MemoryReport(
            "ffn", 1, parameter_bytes(ffn_model), 0, len(ffn_model.expected_tensors())
        )
        ready.append(_ready(1, "ffn", ffn_memory, ffn_model, None))
    elif not topology.colocated:
        wire = _wire(spec, rank)
        inboxes = _inboxes(spec, device, core.model.dtype, core.config)
        if inboxes is not None and core.mtp is not None:
            raise ValueError(f"MTP drafts on attention rank {rank}: {MTP_IPC_REFUSAL}")
    # An MTP draft's layer N crosses the boundary too: its config names every layer that does.
    layers = core.mtp.draft.config if core.mtp is not None else None
    boundary = attention_boundary(
        core.model,
        topology,
        rank,
        gate,
        wire,
        ffn_model,
        inboxes,
        spec.afd.a2e_dtype,
        layers,
        ffn_draft,
    )
    graphs = StepGraphs.of(spec)
    draft_graphs = graphs.draft_settings(device, core.max_model_len)
    if core.mtp is not None:  # a kept core's graphs held the earlier world's boundary
        core.mtp.passes.use_graphs(draft_graphs)
    log_ranks = tuple(range(topology.world_size)) if in_process else None
    driver = attention_driver(
        core,
        core.runner,
        boundary,
        graphs,
        graphs.recorder(rank, spec.log_path),
        control,
        topology=topology,
        rank=rank,
        max_model_len=core.max_model_len,
        log_ranks=log_ranks,
    )
    return BuiltRank(driver, core, wire, tuple(ready), boundary, core.model)


def build_ffn_rank(
    spec: WorkerSpec,
    rank: int,
    device: torch.device,
    control: Control,
    expert_group: dist.ProcessGroup | None = None,
    kept: BuiltRank | None = None,
) -> BuiltRank:
    """An FFN rank; in an expert-parallel topology it loads only its shard of the routed experts
    and exchanges rows with the other FFN ranks over `expert_group` (FFN ranks only). `kept`:
    this rank as built for an earlier world generation, whose model half is reused."""
    topology, gate = spec.topology, spec.afd.gate_on_attention
    parts = half_parts("ffn", gate)
    held = None
    if topology.expert_parallel:
        config = load_model_config(spec.engine.model)
        placement = resolve_placement(
            spec.afd.expert_placement, config.num_experts, topology.ffn_ranks
        )
        held = placement[topology.ffn_index(rank)]
        parts = dataclasses.replace(parts, experts=held)
    if kept is not None and kept.half is not None:
        model, draft = kept.half, kept.draft
    else:
        model, _ = load_half(spec.engine, parts, device, rank)
        draft = load_ffn_draft(spec.engine, model, device, rank)
    wire = _wire(spec, rank)
    expert = None
    if topology.expert_parallel:
        expert = ExpertGroup(model, topology.ffn_group, expert_group, wire)
    inboxes = _inboxes(spec, device, model.dtype, model.config)
    graphs = StepGraphs.of(spec)
    driver = ffn_driver(
        model,
        rank,
        device,
        wire,
        graphs,
        graphs.recorder(rank, spec.log_path),
        control,
        topology=topology,
        gate_on_attention=gate,
        expert=expert,
        inboxes=inboxes,
        a2e_dtype=spec.afd.a2e_dtype,
        draft=draft,
    )
    weights = parameter_bytes(model) + (parameter_bytes(draft) if draft is not None else 0)
    memory = MemoryReport("ffn", rank, weights, 0, len(model.expected_tensors()), experts=held)
    ready = (_ready(rank, "ffn", memory, model, None),)
    return BuiltRank(driver, None, wire, ready, half=model, draft=draft)
