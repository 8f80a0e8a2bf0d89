"""`afdserve bench decode`: time whole decode steps (embedding -> layers -> logits -> greedy sample)
at a fixed batch and context length, and set the bytes a step must read against the device's
measured copy bandwidth. Decode is memory-bound, so that fraction is the figure of merit.

Bytes a step must read: every non-expert weight once (attention, norms, routers, dense and shared
MLPs, lm_head), one embedding row per sequence, each routed expert the batch touches once per
layer, and every sequence's cached K/V. Writes (one token of KV, activations) are left out.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from afdserve.afd.dataplane.connector import InProcessConnector
from afdserve.afd.step.control import LocalControl
from afdserve.afd.step.driver import AttentionDriver
from afdserve.afd.step.recorder import StepRecorder
from afdserve.bench.bytes import (
    measure_copy_bandwidth,
    step_kv_bytes,
    step_weight_bytes,
    touched_experts,
)
from afdserve.bench.flags import BENCH_CONNECTORS, add_engine_flags
from afdserve.config import DEVICES, GRAPH_MODES
from afdserve.config_args import build
from afdserve.engine.cuda_graphs import CudaGraphRunner, PlannedForward
from afdserve.engine.kv_cache import KVCache
from afdserve.engine.model_runner import FFNBoundary, LocalFFN, ModelRunner, StepInputs
from afdserve.kernels.metadata import AttentionMetadata, BatchedSegments, Segment
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
from afdserve.model.model import ModelParts, MoECausalLM
from afdserve.model.presets import PRESETS, preset_hf_config

# "1A1F": one process per rank, attention on GPU 0 and FFN on GPU 1 over NCCL (bench/decode_p2p.py).
TOPOLOGIES = ("colocated", "in-process", "1A1F")
WARMUP_STEPS = 3


def invalid(spec: object, field: str, allowed: str) -> ValueError:
    """The error of a bench spec's field: its name, its value, and what is allowed."""
    return ValueError(f"bench.{field}={getattr(spec, field)!r} is not allowed: {allowed}")


@dataclass(frozen=True)
class DecodeBench:
    model_dir: str | None
    preset: str | None
    random_weights: bool
    batch_sizes: tuple[int, ...]
    context_len: int
    topology: str = "colocated"
    connector: str = "p2p"  # the data plane of --topology 1A1F: one of BENCH_CONNECTORS
    graph_mode: str = "none"
    ubatches: int = 1
    steps: int = 20
    dtype: str = "bfloat16"
    device: str = "cuda"
    block_size: int = 16
    compare_hf: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> ValueError:
            return invalid(self, field, allowed)

        if (self.model_dir is None) == (self.preset is None):
            raise bad("model_dir", "give exactly one of --model DIR and --preset NAME")
        if self.preset is not None and self.preset not in PRESETS:
            raise bad("preset", f"one of {sorted(PRESETS)}")
        if self.preset is not None and not self.random_weights:
            raise bad("random_weights", "a preset has no checkpoint: add --random-weights")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise bad("batch_sizes", "a non-empty list of integers >= 1")
        for field in ("context_len", "ubatches", "block_size"):
            if getattr(self, field) < 1:
                raise bad(field, "an integer >= 1")
        if self.steps < 2:
            raise bad("steps", "an integer >= 2")
        if self.topology not in TOPOLOGIES:
            raise bad("topology", f"one of {TOPOLOGIES}")
        if self.connector not in BENCH_CONNECTORS:
            raise bad("connector", "p2p or ipc (with --topology 1A1F)")
        if self.graph_mode not in GRAPH_MODES:
            raise bad("graph_mode", f"one of {GRAPH_MODES}")
        if self.graph_mode != "none" and self.device != "cuda":
            raise bad("graph_mode", "'none' unless --device cuda")
        if self.dtype not in TORCH_DTYPES:
            raise bad("dtype", f"one of {sorted(TORCH_DTYPES)}")
        if self.device not in DEVICES:
            raise bad("device", "'cpu' or 'cuda'")


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


class DecodeSteps:
    """A batch of `batch` sequences with `context_len` random cached tokens, decoded in lockstep.

    Steps run the engine's own path: a one-rank StepPlan decides capture / replay / eager, and
    graph steps go through the engine's `CudaGraphRunner` (its input copies included in the
    timing); in-process 1A1F hands tiles to the FFN half through the `InProcessConnector`."""

    def __init__(self, model: MoECausalLM, ffn: MoECausalLM | None, spec: DecodeBench, batch: int,
                 boundary: FFNBoundary | None = None):
        config, dev = model.config, next(model.parameters()).device
        self.model, self.spec, self.batch, self.device = model, spec, batch, dev
        self.stamps = None  # kernels/triton_stamp.Stamps at the start and end of each step
        bs, last = spec.block_size, spec.context_len + WARMUP_STEPS + spec.steps
        self.width = math.ceil(last / bs)
        dtype = TORCH_DTYPES[spec.dtype]
        self.kv = KVCache(config, batch * self.width, bs, dtype, dev)
        gen = torch.Generator(device=dev).manual_seed(spec.seed + 1)
        for first, second in self.kv.layers:
            for t in (first, second):
                if t is not None:
                    t.normal_(generator=gen)
        self.tables = torch.arange(batch * self.width, device=dev, dtype=torch.int32).view(
            batch, self.width
        )
        self.input_ids = torch.randint(0, config.vocab_size, (batch,), device=dev, generator=gen)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.slots = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.context_lens = torch.zeros(batch, dtype=torch.int32, device=dev)
        self.query_start = torch.arange(batch + 1, dtype=torch.int32, device=dev)
        self.runner = ModelRunner(model, self.kv, dev)
        colocated = spec.topology == "colocated"
        topology = Topology(1, 0 if colocated else 1)
        if boundary is None:
            boundary = LocalFFN(ffn) if colocated else InProcessConnector(ffn, False)
        graphs = None
        if spec.graph_mode != "none":
            graphs = CudaGraphRunner(self.runner, batch, last, spec.graph_mode == "full",
                                     spec.ubatches)  # fmt: skip
        self.eager = PlannedForward(self.runner, boundary)
        recorder = StepRecorder(0, spec.graph_mode, (batch,), keep_records=True,
                                ubatches=spec.ubatches)  # fmt: skip
        self.driver = AttentionDriver(self, PlannedForward(self.runner, boundary, graphs),
                                      recorder, LocalControl(), topology, 0,
                                      tuple(range(topology.world_size)))  # fmt: skip
        self.step_index = 0

    def _inputs(self) -> StepInputs:
        context = self.spec.context_len + self.step_index + 1
        segments = tuple(Segment(i, i + 1, self.tables[i], context) for i in range(self.batch))
        batched = None
        if self.device.type == "cuda":
            batched = BatchedSegments(self.query_start, self.context_lens, self.tables, 1, context)
        meta = AttentionMetadata(self.positions, self.slots, segments, batched)
        sample_rows = self.query_start[:-1].long()
        return StepInputs(self.input_ids, self.input_ids, meta, sample_rows, [], self.batch)

    def _advance(self) -> None:
        """Point the step's tensors at the next position (device-side writes only)."""
        position = self.spec.context_len + self.step_index
        bs = self.spec.block_size
        self.positions.fill_(position)
        base = self.tables[:, position // bs].long() * bs
        self.slots.copy_(base + position % bs)
        self.context_lens.fill_(position + 1)

    # ----- the attention driver's work source: one fixed decode batch -----
    def schedule(self) -> tuple[None, RankStep]:
        return None, RankStep(self.batch, self.batch, True)

    def idle_work(self) -> None:
        return None

    @torch.inference_mode()
    def execute(self, work: None, plan, forward: PlannedForward, step: int
                ) -> tuple[torch.Tensor, float]:
        """One decode step: (next token ids, seconds of device time). The timed span is the
        engine's step on the device: the graph runner's copies into its buffers and the replay
        (or the eager forward), logits and the greedy pick. The plan and this bench's stand-in
        for the scheduler's input preparation (`_advance`) come before it."""
        inputs = self._inputs()
        self._advance()
        timer = _Timer(self.device)
        if self.stamps is not None:
            self.stamps.mark()
        hidden = forward(inputs, plan, step)
        next_ids = self.runner.logits(hidden, inputs).argmax(dim=-1)
        self.input_ids.copy_(next_ids)
        if self.stamps is not None:
            self.stamps.mark()
        seconds = timer.stop()
        self.step_index += 1
        return next_ids, seconds

    def step(self, eager: bool = False) -> tuple[torch.Tensor, float]:
        """One step through the attention driver; `eager` runs one outside it, without graphs
        and unrecorded (so it marks no graph as captured)."""
        if not eager:
            return self.driver.step().outputs
        recorder = self.driver.recorder
        plan = recorder.plan([self.schedule()[1]], self.driver.topology).attention[0]
        return self.execute(None, plan, self.eager, recorder.step)


class _Timer:
    """Device time from construction to `stop()`: CUDA events on CUDA, wall time elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.end = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.t0
        self.end.record()
        self.end.synchronize()
        return self.start.elapsed_time(self.end) / 1e3


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    timer = _Timer(device)
    fn()
    return timer.stop()


def build_halves(spec: DecodeBench, raw: dict) -> tuple[MoECausalLM, MoECausalLM]:
    config = parse_model_config(raw)
    dtype, dev = TORCH_DTYPES[spec.dtype], torch.device(spec.device)
    if spec.topology == "colocated":
        parts = [ModelParts.colocated()]
    else:
        parts = [ModelParts(True, False), ModelParts(False, True)]
    halves = []
    for part in parts:
        model = build_model(config, part, dtype, dev)
        if spec.random_weights:  # the halves hold what a colocated model of this seed holds
            init_random_weights(model, spec.seed)
        else:
            load_weights(model, spec.model_dir, all_tensor_names(config))
        halves.append(model)
    return halves[0], halves[-1]


def bench_batch(
    attn: MoECausalLM, ffn: MoECausalLM, spec: DecodeBench, batch: int, copy_gbps: float | None
) -> DecodeResult:
    steps = DecodeSteps(attn, ffn, spec, batch)
    hit = touched_experts(steps, ffn)
    for _ in range(WARMUP_STEPS - 1):  # the first of these captures the graph, if any
        steps.step()
    times = [steps.step()[1] for _ in range(spec.steps)]
    mean_context = spec.context_len + WARMUP_STEPS + (spec.steps + 1) / 2
    itemsize = TORCH_DTYPES[spec.dtype].itemsize
    result = DecodeResult(
        batch=batch,
        step_ms=statistics.median(times) * 1e3,
        weight_bytes=step_weight_bytes(attn, ffn, batch, hit),
        kv_bytes=step_kv_bytes(attn, batch, mean_context, itemsize),
        copy_gbps=copy_gbps,
    )
    del steps
    if spec.device == "cuda":
        torch.cuda.empty_cache()
    return result


def format_table(results: list[DecodeResult], hf: dict[int, float] | None = None) -> str:
    head = "batch  step_ms  tokens/s  weights_MB  kv_MB  GB/s  of_copy_bw"
    if hf is not None:
        head += "  hf_tokens/s  speedup"
    lines = [head]
    for r in results:
        frac = f"{r.achieved_gbps / r.copy_gbps:10.1%}" if r.copy_gbps else "         -"
        line = (
            f"{r.batch:5d}  {r.step_ms:7.2f}  {r.tokens_per_s:8.1f}  {r.weight_bytes / 1e6:10.1f}"
            f"  {r.kv_bytes / 1e6:5.1f}  {r.achieved_gbps:4.0f}  {frac}"
        )
        if hf is not None and r.batch in hf:
            line += f"  {hf[r.batch]:11.1f}  {r.tokens_per_s / hf[r.batch]:6.1f}x"
        lines.append(line)
    return "\n".join(lines)


def run_decode_bench(spec: DecodeBench) -> tuple[list[DecodeResult], dict[int, float] | None]:
    if spec.topology == "1A1F":
        from afdserve.bench.decode_p2p import run_p2p_decode_bench

        return run_p2p_decode_bench(spec), None
    raw = preset_hf_config(spec.preset) if spec.preset else read_hf_config(spec.model_dir)
    dev = torch.device(spec.device)
    copy_gbps = measure_copy_bandwidth(dev) if dev.type == "cuda" else None
    attn, ffn = build_halves(spec, raw)
    results = [bench_batch(attn, ffn, spec, b, copy_gbps) for b in spec.batch_sizes]
    hf = None
    if spec.compare_hf:
        from afdserve.bench.hf import hf_sharing_weights, hf_tokens_per_s

        hf_model = hf_sharing_weights(attn, ffn, raw, TORCH_DTYPES[spec.dtype], dev)
        hf = {b: hf_tokens_per_s(hf_model, spec, b) for b in spec.batch_sizes}
    return results, hf


def add_decode_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("decode", help="time decode steps at a fixed batch and context length")
    p.add_argument("--model", dest="model_dir", default=None, help="a Hugging Face model dir")
    p.add_argument("--preset", default=None, choices=sorted(PRESETS))
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--context-len", type=int, default=1024)
    p.add_argument("--topology", default="colocated", choices=TOPOLOGIES)
    add_engine_flags(p, DecodeBench, ("connector", "graph_mode", "ubatches"))
    p.add_argument("--steps", type=int, default=20)
    add_engine_flags(p, DecodeBench, ("dtype", "device", "block_size"))
    p.add_argument("--compare-hf", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=main_decode)


def main_decode(args: argparse.Namespace) -> int:
    try:
        sizes = tuple(int(s) for s in str(args.batch_sizes).split(",") if s.strip())
    except ValueError as e:
        raise ValueError(f"bench.batch_sizes={args.batch_sizes!r}: comma-separated integers") from e
    spec = build(DecodeBench, args, batch_sizes=sizes)
    results, hf = run_decode_bench(spec)
    copy = results[0].copy_gbps if results else None
    name = spec.preset or spec.model_dir
    print(
        f"decode bench: {name}, context {spec.context_len}, {spec.dtype}, {spec.topology}, "
        f"graph_mode={spec.graph_mode}, ubatches={spec.ubatches}, {spec.steps} steps (median)"
        + (f", device copy bandwidth {copy:.0f} GB/s" if copy else "")
    )
    print(format_table(results, hf))
    return 0

