"""`afdserve bench decode --topology 1A1F`: decode steps with attention on GPU 0 and the FFN half on
GPU 1, one process each, over NCCL. The attention process steps `DecodeSteps` through its
attention driver with an `AttentionConnector`; the FFN process steps its FFN driver with the same
reports, so both plan the same steps (capture on the first, replay after, when graphs are on).

Also measured, per batch: the data plane alone (a layer's A2E send and E2A reply of the batch's
tile, no compute, captured in a CUDA graph over every layer) and each GPU's busy time per step:
the step's span less the time its stream stood waiting for the peer, from device timestamps
around every wait (kernels/triton/stamp.py), in a second run whose graphs hold the stamps.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from afdserve.afd.dataplane.payload import HEADER
from afdserve.afd.dataplane.wire import Wire
from afdserve.afd.ranks.build import StepGraphs, attention_boundary, ffn_driver, open_inboxes
from afdserve.bench.decode_steps import DecodeResult, DecodeSpec, DecodeSteps, build_half
from afdserve.bench.report import WARMUP_STEPS
from afdserve.engine.control_round import FixedControl
from afdserve.layout.plan import RankStep
from afdserve.layout.step import StepPlan
from afdserve.layout.topology import Topology
from afdserve.model.checkpoint.loader import TORCH_DTYPES
from afdserve.model.parts import ModelParts
from afdserve.model.presets import hf_config_of

PROFILED_STEPS = 5


def busy_ns(stamps: list[int]) -> tuple[int, int]:
    """(span, busy) of one step stamped as [start, (before wait, after wait)..., end]: busy is the
    span less the time the stream stood in waits for its peer."""
    if len(stamps) < 2 or len(stamps) % 2:
        raise ValueError(f"a step needs a start, pairs around waits and an end: {len(stamps)}")
    span = stamps[-1] - stamps[0]
    waiting = sum(after - before for before, after in zip(stamps[1:-1:2], stamps[2:-1:2]))
    return span, span - waiting


def _busy(stamps, steps: int) -> float:
    """Median seconds per step during which the GPU was not waiting for its peer: each step
    stamped [start, (before, after) every wait..., end] (kernels/triton/stamp.py)."""
    marks = stamps.read()
    if len(marks) % steps:
        raise RuntimeError(f"{len(marks)} stamps do not split into {steps} steps")
    per = len(marks) // steps
    return statistics.median(busy_ns(marks[i * per : (i + 1) * per])[1] for i in range(steps)) / 1e9


def _data_plane_only(
    inboxes,
    rank: int,
    layers: int,
    tile: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
    steps: int,
) -> float:
    """Microseconds per layer for the A2E send and E2A reply of one tile, nothing else, all
    layers in one CUDA graph: NCCL's mirrored batches, or connector="ipc"'s push kernels and
    flags when `inboxes` is given (the bodies `afdserve bench transport` times)."""
    from afdserve.bench.transport import ipc_layers, nccl_layers, time_graph

    x = torch.zeros(tile, hidden, dtype=dtype, device=device)
    if inboxes is None:
        ids = torch.zeros(HEADER + tile, dtype=torch.int32, device=device)
        out = torch.empty_like(x)
        return time_graph(lambda: nccl_layers(rank, layers, x, ids, out), layers, steps)
    ids = torch.zeros(tile, dtype=torch.int32, device=device)
    step = torch.zeros(1, dtype=torch.int32, device=device)
    return time_graph(lambda: ipc_layers(inboxes, rank, layers, x, ids, step), layers, steps)


def _graphs(spec: DecodeSpec, batch: int) -> StepGraphs:
    """Both ranks' graph settings for a decode batch of `batch`: the batch is the one size."""
    return StepGraphs(spec.graph_mode, (batch,), spec.ubatches)


def recorder_plan(spec: DecodeSpec, batch: int, topology: Topology) -> StepPlan:
    """The step plan both ranks run for a decode batch of `batch` (the graph size is `batch`)."""
    return _graphs(spec, batch).recorder(0).plan((RankStep(batch, batch, True),), topology)


def _attention_steps(
    spec: DecodeSpec, model, batch: int, inboxes, stamps, count: int
) -> list[float]:
    """`count` decode steps of the attention rank; with `stamps`, the last PROFILED_STEPS are
    stamped. Returns the step times after warm-up."""
    connector = attention_boundary(
        model, Topology(1, 1), 0, False, Wire(0), inboxes=inboxes, a2e_dtype=spec.a2e_dtype
    )
    connector.stamps = stamps
    steps = DecodeSteps(
        model, None, dataclasses.replace(spec, steps=count), batch, boundary=connector
    )
    times = []
    for i in range(count):
        steps.stamps = stamps if stamps is not None and i >= count - PROFILED_STEPS else None
        if steps.stamps is not None and i == count - PROFILED_STEPS:
            torch.cuda.synchronize()
            stamps.reset()
        times.append(steps.step()[1])
    del steps, connector
    torch.cuda.synchronize()
    gc.collect()  # the graphs and the KV cache of this run go before the next run's
    torch.cuda.empty_cache()
    return times[WARMUP_STEPS - 1 :]


def _ffn_steps(spec: DecodeSpec, model, batch: int, inboxes, stamps, count: int) -> None:
    """The FFN rank's side of `_attention_steps`."""
    device = next(model.parameters()).device
    graphs = _graphs(spec, batch)
    driver = ffn_driver(
        model,
        1,
        device,
        Wire(1),
        graphs,
        graphs.recorder(1),
        FixedControl((RankStep(batch, batch, True),)),
        topology=Topology(1, 1),
        inboxes=inboxes,
        a2e_dtype=spec.a2e_dtype,
    )
    # Captured into the graphs, so set from the first step.
    driver.runner.exchange.transport.stamps = stamps
    for i in range(count):
        profiled = stamps is not None and i >= count - PROFILED_STEPS
        if profiled and i == count - PROFILED_STEPS:
            torch.cuda.synchronize()
            stamps.reset()
        if profiled:
            stamps.mark()
        driver.step()
        if profiled:
            stamps.mark()
    torch.cuda.synchronize()
    del driver
    gc.collect()
    torch.cuda.empty_cache()


def _rank_main(rank: int, spec: DecodeSpec, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", rank=rank, world_size=2, device_id=device, timeout=timedelta(seconds=300)
    )
    raw = hf_config_of(spec.preset, spec.model_dir)
    parts = ModelParts(True, False) if rank == 0 else ModelParts(False, True)
    model = build_half(spec, raw, parts, device)
    config = model.config
    dtype = TORCH_DTYPES[spec.dtype]
    topology = Topology(1, 1)
    rows = []
    for batch in spec.batch_sizes:
        steps_total = WARMUP_STEPS - 1 + spec.steps
        tile = max(recorder_plan(spec, batch, topology).ffn[0].tile_rows)  # the plan's tile
        inboxes = None
        if spec.connector == "ipc":
            inboxes = open_inboxes(topology, config, dtype, device, spec.ubatches, tile)
        # A timed run, then a run with device timestamps around every wait (its graphs hold the
        # stamp kernels, so it is not the timed one): each role's busy time per step.
        from afdserve.kernels.triton.stamp import Stamps

        if rank == 0:
            times = _attention_steps(spec, model, batch, inboxes, None, steps_total)
            stamps = Stamps(device)
            _attention_steps(spec, model, batch, inboxes, stamps, WARMUP_STEPS + PROFILED_STEPS)
        else:
            _ffn_steps(spec, model, batch, inboxes, None, steps_total)
            stamps = Stamps(device)
            _ffn_steps(spec, model, batch, inboxes, stamps, WARMUP_STEPS + PROFILED_STEPS)
        busy = _busy(stamps, PROFILED_STEPS)
        wire_us = _data_plane_only(
            inboxes, rank, config.num_layers, tile, config.hidden_size, dtype, device, spec.steps
        )
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if rank == 0:
            rows.append((batch, statistics.median(times) * 1e3, busy, wire_us))
        else:
            rows.append((batch, busy))
    results.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def run_p2p_decode_bench(spec: DecodeSpec) -> list[DecodeResult]:
    if torch.cuda.device_count() < 2:
        raise ValueError("bench --topology 1A1F needs two GPUs (attention on 0, FFN on 1)")
    from afdserve.frontend.process import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, spec, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=1800) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    ffn_busy = dict(got[1])
    out = []
    for batch, step_ms, attention_busy, wire_us in got[0]:
        busy = (attention_busy * 1e3, ffn_busy[batch] * 1e3)  # ms per step
        print(
            f"1A1F over {spec.connector}, batch {batch}, ubatches {spec.ubatches}: step "
            f"{step_ms:.2f} ms, A2E+E2A {wire_us:.1f} us/layer (data plane alone); busy per "
            f"step (not waiting for the peer): attention GPU {busy[0]:.2f} ms "
            f"({busy[0] / step_ms:.0%}), FFN GPU {busy[1]:.2f} ms ({busy[1] / step_ms:.0%}); "
            f"step / busier role {step_ms / max(busy):.2f}"
        )
        out.append(DecodeResult(batch, step_ms, 0, 0, None))
    return out
