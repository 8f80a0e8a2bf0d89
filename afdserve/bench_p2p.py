"""`afdserve bench decode --topology 1A1F`: decode steps with attention on GPU 0 and the FFN half on
GPU 1, one process each, over NCCL. The attention process steps `DecodeSteps` through its
attention driver with an `AttentionConnector`; the FFN process steps its FFN driver with the same
reports, so both plan the same steps (capture on the first, replay after, when graphs are on).

Also measured, per batch: the data plane alone (a layer's A2E send and E2A reply of the batch's
tile, no compute, captured in a CUDA graph over every layer) and each GPU's busy share of a step
(kernel time other than NCCL's, from the profiler, over the step time).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from afdserve.afd.connector import HEADER, AttentionConnector
from afdserve.afd.driver import FFNDriver, FixedControl
from afdserve.afd.ffn import FFNExchange, FFNStepRunner
from afdserve.afd.recorder import StepRecorder
from afdserve.afd.wire import P2P, Wire
from afdserve.bench import WARMUP_STEPS, DecodeBench, DecodeResult, DecodeSteps
from afdserve.layout.plan import RankStep
from afdserve.layout.topology import Topology
from afdserve.model.config import parse_model_config, read_hf_config
from afdserve.model.loader import (
    TORCH_DTYPES,
    all_tensor_names,
    build_model,
    init_random_weights,
    load_weights,
)
from afdserve.model.model import ModelParts
from afdserve.model.presets import preset_hf_config

PROFILED_STEPS = 5


def _half(spec: DecodeBench, raw: dict, rank: int, device: torch.device):
    config = parse_model_config(raw)
    part = ModelParts(True, False) if rank == 0 else ModelParts(False, True)
    model = build_model(config, part, TORCH_DTYPES[spec.dtype], device)
    if spec.random_weights:
        init_random_weights(model, spec.seed)
    else:
        load_weights(model, spec.model_dir, all_tensor_names(config))
    return model


def _busy_share(fn, steps: int) -> float:
    """Share of the wall time of `steps` calls during which the GPU ran kernels other than
    NCCL's (NCCL kernels include the wait for the peer, which is not work)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
    spans = sorted(
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA" and "nccl" not in e.name.lower() and e.time_range.end
    )
    busy, last = 0.0, float("-inf")
    for lo, hi in spans:  # union of the kernels' intervals (concurrent kernels count once)
        lo = max(lo, last)
        if hi > lo:
            busy += hi - lo
            last = hi
    return busy / 1e3 / max(start.elapsed_time(end), 1e-9)


def _wire_only(rank: int, layers: int, tile: int, hidden: int, dtype: torch.dtype,
               device: torch.device, steps: int) -> float:
    """Microseconds per layer for the A2E send and E2A reply of one tile, nothing else: each
    side posts its two mirrored batches per layer, all layers in one CUDA graph."""
    wire = Wire(rank)
    x = torch.zeros(tile, hidden, dtype=dtype, device=device)
    ids = torch.zeros(HEADER + tile, dtype=torch.int32, device=device)
    out = torch.empty_like(x)
    peer = 1 - rank

    def layer_loop() -> None:
        for _ in range(layers):
            if rank == 0:
                works = wire.post([P2P("send", x, peer), P2P("send", ids, peer)])
                works += wire.post([P2P("recv", out, peer)])
            else:
                works = wire.post([P2P("recv", x, peer), P2P("recv", ids, peer)])
                works += wire.post([P2P("send", out, peer)])
            for work in works:
                work.wait()

    layer_loop()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        layer_loop()
    graph.replay()
    times = []
    for _ in range(steps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / layers)
    return statistics.median(times)


def _ipc_only(inboxes, rank: int, layers: int, tile: int, hidden: int, dtype: torch.dtype,
              device: torch.device, steps: int) -> float:
    """As `_wire_only`, over connector="ipc"'s inboxes and push kernels."""
    from afdserve.bench_transport import ipc_layers, time_graph

    x = torch.zeros(tile, hidden, dtype=dtype, device=device)
    ids = torch.zeros(tile, dtype=torch.int32, device=device)
    step = torch.zeros(1, dtype=torch.int32, device=device)
    return time_graph(lambda: ipc_layers(inboxes, rank, layers, x, ids, step), layers, steps)


def recorder_plan(spec: DecodeBench, batch: int, topology: Topology):
    """The step plan both ranks run for a decode batch of `batch` (the graph size is `batch`)."""
    return StepRecorder(0, spec.graph_mode, (batch,), ubatches=spec.ubatches).plan(
        (RankStep(batch, batch, True),), topology)


def _rank_main(rank: int, spec: DecodeBench, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device,
                            timeout=timedelta(seconds=300))
    raw = preset_hf_config(spec.preset) if spec.preset else read_hf_config(spec.model_dir)
    model = _half(spec, raw, rank, device)
    config = model.config
    dtype = TORCH_DTYPES[spec.dtype]
    topology = Topology(1, 1)
    rows = []
    for batch in spec.batch_sizes:
        steps_total = WARMUP_STEPS - 1 + spec.steps
        tile = max(recorder_plan(spec, batch, topology).ffn[0].tile_rows)  # the plan's tile
        inboxes = None
        if spec.connector == "ipc":
            from afdserve.afd.ipc import Inboxes

            inboxes = Inboxes(dist.group.WORLD, device, dtype, config.hidden_size, config.top_k,
                              spec.ubatches, 1, tile)
        if rank == 0:
            if inboxes is not None:
                from afdserve.afd.ipc import IPCAttentionConnector

                connector = IPCAttentionConnector(config, inboxes, 0, False)
            else:
                connector = AttentionConnector(config, dtype, device, False, Wire(0))
            # The KV cache of the batch is sized for the profiled steps too.
            sized = dataclasses.replace(spec, steps=spec.steps + PROFILED_STEPS)
            steps = DecodeSteps(model, None, sized, batch, boundary=connector)
            times = [steps.step()[1] for _ in range(steps_total)][WARMUP_STEPS - 1:]
            busy = _busy_share(steps.step, PROFILED_STEPS)
            del steps
        else:
            transport = None
            if inboxes is not None:
                from afdserve.afd.ipc import IPCTransport

                transport = IPCTransport(inboxes, 1)
            exchange = FFNExchange(model, 1, False, device, Wire(1), transport=transport)
            recorder = StepRecorder(1, spec.graph_mode, (batch,), ubatches=spec.ubatches)
            runner = FFNStepRunner(exchange, spec.graph_mode != "none")
            driver = FFNDriver(runner, recorder, FixedControl((RankStep(batch, batch, True),)),
                               topology, 1)
            for _ in range(steps_total):
                driver.step()
            busy = _busy_share(driver.step, PROFILED_STEPS)
            del driver, runner
        if inboxes is None:
            wire_us = _wire_only(rank, config.num_layers, tile, config.hidden_size, dtype, device,
                                 spec.steps)
        else:
            wire_us = _ipc_only(inboxes, rank, config.num_layers, tile, config.hidden_size,
                                dtype, device, spec.steps)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        if rank == 0:
            rows.append((batch, statistics.median(times) * 1e3, busy, wire_us))
        else:
            rows.append((batch, busy))
    results.put((rank, rows))
    dist.barrier()
    dist.destroy_process_group()


def run_p2p_decode_bench(spec: DecodeBench) -> list[DecodeResult]:
    if torch.cuda.device_count() < 2:
        raise ValueError("bench --topology 1A1F needs two GPUs (attention on 0, FFN on 1)")
    from afdserve.afd.launcher import free_port

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
        print(f"1A1F batch {batch}: step {step_ms:.2f} ms, A2E+E2A {wire_us:.1f} us/layer "
              f"(data plane alone), busy: attention GPU {attention_busy:.0%}, "
              f"FFN GPU {ffn_busy[batch]:.0%}")
        out.append(DecodeResult(batch, step_ms, 0, 0, None))
    return out
