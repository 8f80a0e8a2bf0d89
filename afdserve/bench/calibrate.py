"""`afdserve bench calibrate`: measure on the machine at hand what `afdserve plan` predicts from,
and write it as one JSON profile (planner/profile.py says what it holds).

Everything runs on one device with the decode benches' own steps (bench/decode_steps.py, CUDA
graphs as `--graph-mode` says): the attention rank alone (an FFN boundary that answers zeros at
once, `NoFFN`) on a grid of batches x contexts up to what its KV cache can hold; the FFN half of
every layer over `--ffn-tokens` rows; the per-step work outside the layers per batch; and whole
deployments as validation, which the curves are not drawn through: colocated steps and in-process
1A1F (1 and 2 ubatches) at `--check-batches`, whose batch 1 also gives the hand-over cost of the
split on one device. The hand-over between two GPUs cannot be measured on one: the profile
carries the two-GPU figures of docs/benchmarks.md (TWO_GPU_HANDOVER, with their source).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import os
import platform
import statistics

import torch

import afdserve
from afdserve.bench.decode import DecodeBench
from afdserve.bench.decode_steps import DecodeSteps, build_half
from afdserve.bench.flags import add_bench_flags, sizes
from afdserve.bench.report import WARMUP_STEPS, Timer
from afdserve.config_args import build, option
from afdserve.engine.factory import auto_block_size
from afdserve.engine.kv_cache import bytes_per_block
from afdserve.engine.model_runner import Ready
from afdserve.kernels.a2e import A2EFormat
from afdserve.model.checkpoint.loader import TORCH_DTYPES
from afdserve.model.families import parse_model_config
from afdserve.model.parts import CausalLM, ModelParts
from afdserve.model.presets import PRESETS, hf_config_of, parse_preset
from afdserve.planner.kernels import running_expert_kernels
from afdserve.planner.memory import model_bytes
from afdserve.planner.profile import (
    ExpertKernels,
    FFNPoint,
    FixedPoint,
    Handover,
    ModelShape,
    Profile,
    StepPoint,
    ValidationPoint,
)

# (1A1F step - colocated step) / 48 layers at batch 1, context 1024, Qwen3-30B-A3B, two H200s of one
# host, CUDA graphs on both roles (docs/benchmarks.md, 2026-11-30: ipc 4.97 vs 3.80 ms, NCCL 6.37 vs
# 3.56 ms). One point each; the other two-GPU figures there are left to check the planner against.
TWO_GPU_HANDOVER = {
    "ipc": Handover(24.4, "docs/benchmarks.md 2026-11-30, 1A1F over ipc, batch 1, context 1024"),
    "nccl": Handover(58.5, "docs/benchmarks.md 2026-11-30, 1A1F over NCCL, batch 1, context 1024"),
}


@dataclasses.dataclass(frozen=True)
class CalibrateBench:
    out: str = option(help="where to write the profile (JSON)")
    model_dir: str | None = option(None, flag="--model", help="a Hugging Face model directory")
    preset: str | None = option(
        None,
        metavar="NAME[:LAYERS]",
        help=f"a published config: one of {sorted(PRESETS)}, optionally NAME:LAYERS for its "
        "first LAYERS layers (a model no GPU holds whole: `plan` scales its per-layer costs to "
        "the whole depth)",
    )
    random_weights: bool = option(False, help="random weights (a preset has no others)")
    # 80 and 96: from 66 sequences on, the attention kernel gives each sequence one split on an
    # H200 with Qwen3-30B-A3B's 4 KV heads (triton_attention.plan_splits; two at 64), so 64 and
    # 128 alone leave the switch unmeasured.
    fit_batches: tuple[int, ...] = option(
        (1, 4, 16, 32, 64, 80, 96, 128, 160, 256),
        parse=sizes,
        help="attention-rank batches the curves go through",
    )
    check_batches: tuple[int, ...] = option(
        (1, 8, 64, 256),
        parse=sizes,
        help="batches of the colocated and in-process steps measured to check the prediction",
    )
    contexts: tuple[int, ...] = option(
        (1024, 8192, 32768), parse=sizes, help="context lengths of the attention points"
    )
    check_contexts: tuple[int, ...] = option(
        (1024, 8192), parse=sizes, help="context lengths of the checks"
    )
    # Powers of two are the tops of the decode kernels' padded pair buckets; 24, 48, 96 and 192
    # are inside buckets, where the planner's rule for a bucket (profile.ExpertKernels) is checked.
    ffn_tokens: tuple[int, ...] = option(
        (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024),
        parse=sizes,
        help="rows of the FFN-half points",
    )
    steps: int = option(10, help="timed steps per point (median)")
    graph_mode: str = "full_decode_only"
    dtype: str = "bfloat16"
    device: str = "cuda"
    block_size: int | None = None  # None: the engine's "auto" (engine/factory.py auto_block_size)
    seed: int = 0

    def __post_init__(self) -> None:
        if (self.model_dir is None) == (self.preset is None):
            raise ValueError("calibrate: give exactly one of --model DIR and --preset NAME")
        if self.preset is not None:
            parse_preset(self.preset)  # an unknown name or layer count, refused by name
        if self.preset is not None and not self.random_weights:
            raise ValueError(
                "calibrate.random_weights: a preset has no checkpoint: add --random-weights"
            )
        for name in ("fit_batches", "check_batches", "contexts", "check_contexts", "ffn_tokens"):
            if not getattr(self, name) or min(getattr(self, name)) < 1:
                raise ValueError(f"calibrate.{name}: a non-empty list of integers >= 1")
        if self.steps < 2:
            raise ValueError("calibrate.steps: an integer >= 2")

    def decode_spec(
        self, topology: str = "colocated", ubatches: int = 1, context: int = 1024
    ) -> DecodeBench:
        return DecodeBench(
            self.model_dir,
            self.preset,
            self.random_weights,
            (1,),
            context,
            topology=topology,
            graph_mode=self.graph_mode,
            ubatches=ubatches,
            steps=self.steps,
            dtype=self.dtype,
            device=self.device,
            block_size=self.block_size,
            seed=self.seed,
        )


def _median_ms(fn, device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        timer = Timer(device)
        fn()
        times.append(timer.stop() * 1e3)
    return statistics.median(times)


def _graphed(fn, device: torch.device):
    """`fn` captured in a CUDA graph (its replay), where the device is CUDA and capture works."""
    if device.type != "cuda":
        return fn
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            fn()
    except RuntimeError:
        torch.cuda.synchronize(device)
        return fn
    return graph.replay


class NoFFN:
    """An FFN boundary that answers every layer with zeros at once: the attention rank's own
    time, with nothing to wait for."""

    def __init__(self, model: CausalLM, rows: int) -> None:
        param = next(model.parameters())
        self.a2e = A2EFormat("auto", model.dtype)
        self.zeros = torch.zeros(
            rows, model.config.hidden_size, dtype=model.dtype, device=param.device
        )

    def begin_step(self, plan, step: int) -> None:
        return None

    def post(self, layer, ubatch, x, route_ids, routing) -> Ready:
        return Ready(self.zeros[: x.shape[0]])


class Calibration:
    def __init__(self, spec: CalibrateBench) -> None:
        self.spec = spec
        self.raw = hf_config_of(spec.preset, spec.model_dir)
        self.config = parse_model_config(self.raw)
        self.device = torch.device(spec.device)
        self.kv_per_token = bytes_per_block(self.config, 1, TORCH_DTYPES[spec.dtype])
        self.model: CausalLM | None = None

    def build(self, parts: ModelParts) -> CausalLM:
        self.model = None
        self.release()
        self.model = build_half(self.spec.decode_spec(), self.raw, parts, self.device)
        return self.model

    def release(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def fits(self, batch: int, context: int) -> bool:
        if self.device.type != "cuda":
            return True
        self.release()
        block = self.spec.block_size or auto_block_size(self.config)
        tokens = batch * (context + WARMUP_STEPS + self.spec.steps + 2 * block)
        free, _ = torch.cuda.mem_get_info(self.device)
        free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        return tokens * self.kv_per_token < 0.97 * free - (1 << 30)

    @torch.inference_mode()
    def decode_ms(
        self,
        batch: int,
        context: int,
        topology: str = "colocated",
        ubatches: int = 1,
        attention_only: bool = False,
    ) -> float:
        spec = self.spec.decode_spec(topology, ubatches, context)
        ffn = self.model if topology == "in-process" else None
        boundary = NoFFN(self.model, batch) if attention_only else None
        steps = DecodeSteps(self.model, ffn, spec, batch, boundary=boundary)
        for _ in range(WARMUP_STEPS - 1):
            steps.step()
        ms = statistics.median(steps.step()[1] * 1e3 for _ in range(self.spec.steps))
        del steps
        self.release()
        return ms

    @torch.inference_mode()
    def ffn_ms(self, tokens: int) -> float:
        c, gen = self.config, torch.Generator(device=self.device).manual_seed(self.spec.seed)
        x = torch.randn(
            tokens,
            c.hidden_size,
            device=self.device,
            generator=gen,
            dtype=TORCH_DTYPES[self.spec.dtype],
        )
        ids = torch.randint(0, c.vocab_size, (tokens,), device=self.device, generator=gen)

        def layers() -> None:
            for layer in range(c.num_layers):
                self.model.ffn_half(layer, x, ids)

        return _median_ms(_graphed(layers, self.device), self.device, self.spec.steps)

    @torch.inference_mode()
    def fixed_ms(self, batch: int) -> float:
        c = self.config
        ids = torch.randint(0, c.vocab_size, (batch,), device=self.device)

        def work() -> None:
            self.model.logits(self.model.embed(ids)).argmax(dim=-1)

        return _median_ms(_graphed(work, self.device), self.device, self.spec.steps)


def _hardware(device: torch.device) -> dict[str, str | float]:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        from afdserve.bench.bytes import measure_copy_bandwidth

        return {
            "device": props.name,
            "memory_bytes": float(props.total_memory),
            "copy_gbps": measure_copy_bandwidth(device),
        }
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {
        "device": f"CPU ({platform.processor() or platform.machine()})",
        "memory_bytes": float(memory),
    }


def _versions() -> dict[str, str]:
    out = {
        "afdserve": afdserve.__version__ if hasattr(afdserve, "__version__") else "0.1.0",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.version.cuda:
        out["cuda"] = torch.version.cuda
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        pass
    return out


def run_calibration(spec: CalibrateBench, log=print) -> Profile:
    cal = Calibration(spec)
    c = cal.config
    attention, validation = [], []
    cal.build(ModelParts(True, False))
    for context in spec.contexts:
        for batch in spec.fit_batches:
            if not cal.fits(batch, context):
                log(
                    f"  attention rank, batch {batch}, context {context}: the KV cache does not "
                    f"fit, skipped"
                )
                continue
            ms = cal.decode_ms(batch, context, "in-process", attention_only=True)
            log(f"  attention rank, batch {batch}, context {context}: {ms:.3f} ms")
            attention.append(StepPoint(batch, context, ms))
    cal.build(ModelParts.colocated())
    ffn = [FFNPoint(n, cal.ffn_ms(n)) for n in spec.ffn_tokens]
    log("  FFN half: " + ", ".join(f"{p.tokens} rows {p.step_ms:.3f} ms" for p in ffn))
    fixed = [FixedPoint(b, cal.fixed_ms(b)) for b in sorted(set(spec.fit_batches))]
    first = spec.check_contexts[0]
    colocated_one = cal.decode_ms(1, first)
    split_one = cal.decode_ms(1, first, "in-process")
    handover = {
        "inprocess": Handover(
            max(0.0, (split_one - colocated_one) / c.num_layers * 1e3),
            f"calibrate: in-process 1A1F - colocated at batch 1, context {first}",
        )
    }
    handover.update(TWO_GPU_HANDOVER)
    for context in spec.check_contexts:
        for batch in spec.check_batches:
            if not cal.fits(batch, context):
                log(f"  check batch {batch}, context {context}: the KV cache does not fit")
                continue
            runs = [("colocated", 1)] + [("in-process", u) for u in (1, 2) if batch >= u]
            for topology, ubatches in runs:
                if (batch, context, topology, ubatches) == (1, first, "in-process", 1):
                    continue  # the hand-over's own point
                ms = cal.decode_ms(batch, context, topology, ubatches)
                log(
                    f"  {topology} batch {batch}, context {context}, ubatches {ubatches}: "
                    f"{ms:.3f} ms"
                )
                validation.append(
                    ValidationPoint(
                        "colocated" if topology == "colocated" else "1A1F",
                        batch,
                        context,
                        ms,
                        ubatches,
                        "inprocess",
                        "calibrate",
                    )
                )
    # As stored: FP8 and FP4 experts are a half and about a quarter of bf16's bytes.
    expert_bytes = model_bytes(c, spec.dtype).expert_bytes
    shape = ModelShape(
        spec.preset or os.path.basename(os.path.normpath(spec.model_dir)),
        c.num_layers,
        c.num_experts,
        c.top_k,
        spec.dtype,
        expert_bytes,
    )
    return Profile(
        date=datetime.date.today().isoformat(),
        hardware=_hardware(cal.device),
        versions=_versions(),
        model=shape,
        attention=tuple(attention),
        ffn=tuple(ffn),
        fixed=tuple(fixed),
        handover=handover,
        validation=tuple(validation),
        expert_kernels=_expert_kernels(spec),
    )


def _expert_kernels(spec: CalibrateBench) -> ExpertKernels | None:
    """Where `ops.moe_experts` switched from the decode kernels to the grouped GEMM while the FFN
    points were timed (None: the decode kernels did not run, e.g. on the CPU or in float32)."""
    if spec.device != "cuda":
        return None
    return running_expert_kernels(spec.dtype)


def add_calibrate_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("calibrate", help="measure the costs `afdserve plan` predicts from")
    add_bench_flags(p, CalibrateBench)
    p.set_defaults(func=main_calibrate)


def main_calibrate(args: argparse.Namespace) -> int:
    spec = build(CalibrateBench, args)
    profile = run_calibration(spec)
    profile.save(spec.out)
    print(
        f"calibrate: {len(profile.attention)} attention steps, {len(profile.ffn)} FFN points, "
        f"{len(profile.validation)} checks -> {spec.out}"
    )
    return 0
