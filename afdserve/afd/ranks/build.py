"""Builds one rank (attention, FFN, or a whole one-process engine) from a WorkerSpec: loads its
half, picks its boundary, sets up CUDA graphs, and wraps it all in its role's step driver. The
offline API and the rank workers both build ranks here, so both get the same parts.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from afdserve.afd.dataplane.connector import AttentionConnector, InProcessConnector
from afdserve.afd.dataplane.expert_group import ExpertGroup
from afdserve.afd.dataplane.ffn import FFNExchange, FFNStepRunner
from afdserve.afd.dataplane.wire import Wire
from afdserve.afd.ranks.messages import RankReady, WorkerSpec
from afdserve.afd.step.driver import AttentionDriver, Control, FFNDriver
from afdserve.afd.step.recorder import StepRecorder
from afdserve.engine.cuda_graphs import CudaGraphRunner, PlannedForward
from afdserve.engine.engine_core import EngineCore
from afdserve.engine.factory import (
    MemoryReport,
    create_engine_core,
    half_parts,
    load_half,
    parameter_bytes,
)
from afdserve.engine.model_runner import FFNBoundary, LocalFFN
from afdserve.layout.experts import resolve_placement
from afdserve.model.config import load_model_config

log = logging.getLogger(__name__)


@dataclass
class BuiltRank:
    driver: AttentionDriver | FFNDriver
    core: EngineCore | None  # attention ranks
    wire: Wire | None
    ready: tuple[RankReady, ...]  # one per rank this process holds (two for in-process 1A1F)


def _recorder(spec: WorkerSpec, rank: int) -> StepRecorder:
    sizes = spec.graphs.capture_sizes(spec.engine.max_num_seqs)
    return StepRecorder(rank, spec.graphs.mode, sizes, spec.log_path, ubatches=spec.afd.ubatches)


def _wire(spec: WorkerSpec, rank: int) -> Wire:
    directory = spec.afd.log_data_plane
    return Wire(rank, os.path.join(directory, f"rank{rank}.jsonl") if directory else None)


def _uses_graphs(spec: WorkerSpec, device: torch.device) -> bool:
    sizes = spec.graphs.capture_sizes(spec.engine.max_num_seqs)
    if sizes and device.type != "cuda":
        log.info("graph_mode=%s on %s: capture and replay steps run eagerly with the graph "
                 "layout (CUDA graphs need device='cuda')", spec.graphs.mode, device)
    return bool(sizes) and device.type == "cuda"


def _inboxes(spec: WorkerSpec, device: torch.device, dtype: torch.dtype, config):
    """The symmetric inboxes of connector="ipc" (a collective over the whole world: every rank
    builds them once, with these same sizes), or None for the other connectors."""
    if spec.afd.connector != "ipc":
        return None
    from afdserve.afd.dataplane.ipc import Inboxes

    topology = spec.topology
    peers_cap = max(len(topology.peers(f)) for f in range(topology.ffn_ranks))
    # A tile is at most one attention rank's padded rows of a ubatch: its tokens, or a graph size.
    sizes = spec.graphs.capture_sizes(spec.engine.max_num_seqs)
    tile_cap = max((spec.engine.max_num_batched_tokens, *sizes))
    return Inboxes(dist.group.WORLD, device, dtype, config.hidden_size, config.top_k,
                   spec.afd.ubatches, peers_cap, tile_cap)


def _ready(rank: int, role: str, memory: MemoryReport, model, limits) -> RankReady:
    return RankReady(rank, role, memory, tuple(sorted(model.expected_tensors())), limits)


def build_attention_rank(spec: WorkerSpec, rank: int, device: torch.device, control: Control,
                         in_process: bool = False) -> BuiltRank:
    """An attention rank. Colocated topologies hold the FFN half too; `in_process` (1A1F on one
    device) holds the FFN rank's half behind an InProcessConnector and logs both ranks' lines."""
    topology, gate = spec.topology, spec.afd.gate_on_attention
    role = "colocated" if topology.colocated else "attention"
    ffn_model = None
    if in_process and not topology.colocated:
        # Loaded before the attention half: the KV cache is sized from the memory still free,
        # and it must leave the experts their room.
        ffn_model, _ = load_half(spec.engine, half_parts("ffn", gate), device, rank)
    core, _, memory = create_engine_core(spec.engine, half_parts(role, gate), rank, device)
    ready = [_ready(rank, "attention", memory, core.model, core.limits)]
    wire = None
    boundary: FFNBoundary
    if topology.colocated:
        boundary = LocalFFN(core.model)
    elif ffn_model is not None:
        wire = _wire(spec, 1)
        boundary = InProcessConnector(ffn_model, gate, wire)
        ffn_memory = MemoryReport("ffn", 1, parameter_bytes(ffn_model), 0,
                                  len(ffn_model.expected_tensors()))
        ready.append(_ready(1, "ffn", ffn_memory, ffn_model, None))
    else:
        wire = _wire(spec, rank)
        dtype = next(core.model.parameters()).dtype
        inboxes = _inboxes(spec, device, dtype, core.config)
        if inboxes is not None:
            from afdserve.afd.dataplane.ipc import IPCAttentionConnector

            boundary = IPCAttentionConnector(core.config, inboxes, rank, gate)
        else:
            boundary = AttentionConnector(core.config, dtype, device, gate, wire)
    graphs = None
    if _uses_graphs(spec, device):
        sizes = spec.graphs.capture_sizes(spec.engine.max_num_seqs)
        graphs = CudaGraphRunner(core.runner, max(sizes), core.max_model_len,
                                 allow_prefill=spec.graphs.mode == "full",
                                 ubatches=spec.afd.ubatches)
    forward = PlannedForward(core.runner, boundary, graphs)
    log_ranks = tuple(range(topology.world_size)) if in_process else None
    driver = AttentionDriver(core, forward, _recorder(spec, rank), control, topology, rank,
                             log_ranks)
    return BuiltRank(driver, core, wire, tuple(ready))


def build_ffn_rank(spec: WorkerSpec, rank: int, device: torch.device, control: Control,
                   expert_group: dist.ProcessGroup | None = None) -> BuiltRank:
    """An FFN rank; in an expert-parallel topology it loads only its shard of the routed experts
    and exchanges rows with the other FFN ranks over `expert_group` (FFN ranks only)."""
    topology, gate = spec.topology, spec.afd.gate_on_attention
    parts = half_parts("ffn", gate)
    held = None
    if topology.expert_parallel:
        config = load_model_config(spec.engine.model)
        placement = resolve_placement(spec.afd.expert_placement, config.num_experts,
                                      topology.ffn_ranks)
        held = placement[topology.ffn_index(rank)]
        parts = dataclasses.replace(parts, experts=held)
    model, _ = load_half(spec.engine, parts, device, rank)
    wire = _wire(spec, rank)
    expert = None
    if topology.expert_parallel:
        expert = ExpertGroup(model, topology.ffn_group, expert_group, wire)
    inboxes = _inboxes(spec, device, next(model.parameters()).dtype, model.config)
    transport = None
    if inboxes is not None:
        from afdserve.afd.dataplane.ipc import IPCTransport

        transport = IPCTransport(inboxes, rank)
    exchange = FFNExchange(model, rank, gate, device, wire, expert, transport)
    runner = FFNStepRunner(exchange, _uses_graphs(spec, device))
    driver = FFNDriver(runner, _recorder(spec, rank), control, topology, rank)
    memory = MemoryReport("ffn", rank, parameter_bytes(model), 0, len(model.expected_tensors()),
                          experts=held)
    return BuiltRank(driver, None, wire, (_ready(rank, "ffn", memory, model, None),))
