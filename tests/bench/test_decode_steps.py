"""The decode benches assemble their ranks through afdserve/afd/ranks/build.py, as the engine's
ranks are: on CPU, the colocated batch, the in-process 1A1F batch and a 1A1F batch across two
gloo processes (the assembly `bench decode --topology 1A1F` runs over NCCL or ipc) decode the
same greedy tokens from the same random weights and cache."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from afdserve.afd.dataplane.connector import InProcessConnector
from afdserve.afd.dataplane.wire import Wire
from afdserve.afd.ranks.build import StepGraphs, attention_boundary, ffn_driver
from afdserve.bench.decode import DecodeBench
from afdserve.bench.decode_steps import DecodeSteps, build_half, build_halves
from afdserve.engine.control_round import FixedControl
from afdserve.engine.model_runner import LocalFFN
from afdserve.frontend.process import free_port
from afdserve.layout.plan import RankStep
from afdserve.layout.topology import Topology
from afdserve.model.parts import ModelParts
from afdserve.model.presets import preset_hf_config

BATCH, STEPS = 3, 4


def spec(**overrides) -> DecodeBench:
    fields = dict(
        model_dir=None,
        preset="tiny",
        random_weights=True,
        batch_sizes=(BATCH,),
        context_len=10,
        steps=STEPS,
        dtype="float32",
        device="cpu",
    )
    fields.update(overrides)
    return DecodeBench(**fields)


def _tokens(steps: DecodeSteps) -> list[list[int]]:
    return [steps.step()[0].tolist() for _ in range(STEPS)]


def _colocated_tokens() -> list[list[int]]:
    s = spec()
    attn, ffn = build_halves(s, preset_hf_config("tiny"))
    return _tokens(DecodeSteps(attn, ffn, s, BATCH))


@pytest.mark.parametrize("ubatches", [1, 2])
def test_in_process_steps_decode_the_colocated_tokens(ubatches):
    s = spec(topology="in-process", ubatches=ubatches)
    attn, ffn = build_halves(s, preset_hf_config("tiny"))
    steps = DecodeSteps(attn, ffn, s, BATCH)
    assert isinstance(steps.driver.forward.boundary, InProcessConnector)
    assert steps.driver.forward.graphs is None  # CUDA graphs only on cuda
    assert _tokens(steps) == _colocated_tokens()
    records = steps.driver.recorder.records
    assert {r["role"] for r in records} == {"attention", "ffn"}  # both ranks' lines
    split = [r["ubatch_real_rows"] for r in records if r["role"] == "attention"]
    assert split and all(len(rows) == ubatches and sum(rows) == BATCH for rows in split)


def test_colocated_steps_hold_the_ffn_half_locally():
    s = spec()
    attn, ffn = build_halves(s, preset_hf_config("tiny"))
    steps = DecodeSteps(attn, ffn, s, BATCH)
    assert isinstance(steps.driver.forward.boundary, LocalFFN)
    assert steps.driver.topology == Topology(1, 0)


def _rank(rank: int, port: int, results) -> None:
    """One rank of the 1A1F decode bench's assembly, over gloo: the attention rank steps the
    decode batch through a point-to-point boundary, the FFN rank its driver on fixed reports."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    torch.set_num_threads(1)
    s = spec(topology="1A1F")
    parts = ModelParts(True, False) if rank == 0 else ModelParts(False, True)
    model = build_half(s, preset_hf_config("tiny"), parts, torch.device("cpu"))
    topology = Topology(1, 1)
    if rank == 0:
        boundary = attention_boundary(model, topology, 0, False, Wire(0))
        results.put((0, _tokens(DecodeSteps(model, None, s, BATCH, boundary=boundary))))
    else:
        graphs = StepGraphs(s.graph_mode, (BATCH,), s.ubatches)
        driver = ffn_driver(
            model,
            1,
            torch.device("cpu"),
            Wire(1),
            graphs,
            graphs.recorder(1),
            FixedControl((RankStep(BATCH, BATCH, True),)),
            topology=topology,
        )
        for _ in range(STEPS):
            driver.step()
        results.put((1, driver.recorder.mode_counts["ffn:eager"]))
    dist.barrier()
    dist.destroy_process_group()


def test_1a1f_over_gloo_decodes_the_colocated_tokens():
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert got[1] == STEPS
    assert got[0] == _colocated_tokens()
