"""Profile prefill steps as the engine runs them: N prompts of L tokens through `LLM.generate`
(one output token each) after a warm-up of the same shape, under torch.profiler. Prints the
wall time, the achieved rate by active parameters (bench/flops.py) against the measured bf16
matmul peak, how busy the GPU was (launch-bound when well below 100%), kernel launches per step
and layer, and the kernels by GPU time; on a CPU the operators by CPU time instead.

    PYTHONPATH=. python tools/profile_prefill.py --preset deepseek-v4-flash:4 --prompts 8 \
        --input-len 1024 [--max-num-batched-tokens 8192] [--graph-mode none] [--rows 30] \
        [--set afdserve.kernels.triton.v4_attention.PREFILL_BLOCK_HEADS=32 ...]

--set overrides a kernel module's integer constant before the engine starts (the colocated
engine runs in this process), so one launch constant can be swept step by step.
"""

from __future__ import annotations

import argparse
import importlib
import math
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from afdserve import LLM, SamplingParams
from afdserve.bench.flops import active_parameters, measure_matmul_tflops
from afdserve.bench.report import model_dir_for
from afdserve.config_args import parse_sizes
from afdserve.model.families import load_model_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", help="NAME[:LAYERS], dummy weights")
    p.add_argument("--model", help="a model directory (its checkpoint, or --load-format dummy)")
    p.add_argument("--load-format", default="dummy", choices=("dummy", "auto", "safetensors"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--graph-mode", default="auto")
    p.add_argument(
        "--cuda-graph-sizes",
        type=parse_sizes,
        default=None,
        help="token counts captured, comma-separated (with --graph-mode full a prefill step of "
        "one of them replays a graph)",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="e.g. fp8 (weights)")
    p.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8 (the paged cache)")
    p.add_argument("--rows", type=int, default=30, help="kernels printed")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs without the profiler first (its per-op cost slows the host)",
    )
    p.add_argument("--gaps", type=int, default=8, help="largest GPU idle gaps printed")
    p.add_argument(
        "--stacks",
        action="store_true",
        help="record Python stacks to name each gap's launch line (slows the profiled host ~1.5x)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=INT",
        help="override a kernel module's integer constant first (repeatable)",
    )
    a = p.parse_args(argv)
    if min(a.prompts, a.input_len, a.max_num_batched_tokens, a.rows) < 1:
        p.error("--prompts, --input-len, --max-num-batched-tokens and --rows must be >= 1")
    if min(a.repeats, a.gaps) < 0:
        p.error("--repeats and --gaps must be >= 0")
    try:
        a.overrides = [override(text) for text in a.set]
    except ValueError as err:
        p.error(str(err))
    return a


def override(text: str) -> tuple[object, str, int]:
    """'MODULE.NAME=INT' -> (the module, NAME, INT), NAME an integer constant it defines (a
    switch, True or False, takes 1 or 0 and stays a bool)."""
    target, sep, value = text.partition("=")
    module_name, _, name = target.rpartition(".")
    if not sep or not module_name:
        raise ValueError(f"--set {text!r}: expected MODULE.NAME=INT")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--set {text!r}: cannot import {module_name} ({err})") from None
    if not isinstance(getattr(module, name, None), int):
        raise ValueError(f"--set {text!r}: {module_name} has no integer constant {name}")
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"--set {text!r}: {value!r} is not an integer") from None
    if isinstance(getattr(module, name), bool):
        if number not in (0, 1):
            raise ValueError(f"--set {text!r}: {name} is a switch: 0 or 1")
        return module, name, bool(number)
    return module, name, number


WINDOW = "profile_prefill.generate"  # the profiled call's range, the idle analysis's bounds


@dataclass(frozen=True)
class DeviceSpan:
    """One kernel, copy or fill on the GPU's timeline (us), with its host launch call's start
    (None where the profile links none) and the Python line that made that call."""

    start: float
    end: float
    name: str
    launched: float | None = None
    where: str = ""


@dataclass(frozen=True)
class Gap:
    idle: float  # us the GPU stood idle
    host_late: float  # of which the next span's launch came after the previous span had ended
    before: str
    after: DeviceSpan


@dataclass(frozen=True)
class Idle:
    first: float  # us from the window's start to the first span
    last: float  # us from the last span's end to the window's end
    gaps: list[Gap]  # between spans, largest first

    @property
    def between(self) -> float:
        return sum(g.idle for g in self.gaps)

    @property
    def host_late(self) -> float:
        return sum(g.host_late for g in self.gaps)


def idle_of(spans: list[DeviceSpan], begin: float, end: float) -> Idle:
    """Where the GPU stood idle inside [begin, end]: before its first span, after its last and
    between them (overlapping spans, as on several streams, leave no gap)."""
    spans = sorted(spans, key=lambda s: s.start)
    if not spans:
        return Idle(end - begin, 0.0, [])
    gaps: list[Gap] = []
    reach, previous = spans[0].end, spans[0].name
    for span in spans[1:]:
        if span.start > reach:
            late = 0.0 if span.launched is None else min(span.start, span.launched) - reach
            gaps.append(Gap(span.start - reach, max(0.0, late), previous, span))
        if span.end > reach:
            reach, previous = span.end, span.name
    gaps.sort(key=lambda g: -g.idle)
    return Idle(max(0.0, spans[0].start - begin), max(0.0, end - reach), gaps)


def timeline(events) -> tuple[list[DeviceSpan], float, float]:
    """The profiled window's device spans, each linked through the CUDA runtime call that
    launched it (the same correlation id) to the first afdserve frame of its Python stack, or
    the operators that made the call. The window is the host's range (the profiler also shows
    it on the GPU's timeline, as an annotation)."""
    window = next((e for e in events if e.name == WINDOW and e.device_type.name == "CPU"), None)
    if window is None:
        raise RuntimeError(f"the profile holds no {WINDOW!r} range")
    calls = {
        e.id: e
        for e in events
        if e.device_type.name == "CPU" and e.name.startswith("cu") and not e.is_async
    }
    spans = []
    for e in events:
        if e.device_type.name != "CUDA" or e.name == WINDOW:
            continue
        call = calls.get(e.id)
        # The first afdserve frame of the stacks (--stacks), else the operators around the call.
        where, names, op = "", [], call.cpu_parent if call is not None else None
        while op is not None and not where:
            where = next((f for f in op.stack or () if "afdserve/" in f), "")
            names.append(op.name)
            op = op.cpu_parent
        where = where or " < ".join(names[:3])
        launched = call.time_range.start if call is not None else None
        spans.append(DeviceSpan(e.time_range.start, e.time_range.end, e.name, launched, where))
    return spans, window.time_range.start, window.time_range.end


def idle_lines(found: tuple[list[DeviceSpan], float, float], top: int) -> list[str]:
    spans, begin, end = found
    idle = idle_of(spans, begin, end)
    linked = sum(s.launched is not None for s in spans)
    lines = [
        f"  GPU idle: {idle.first / 1e3:.1f} ms before the first kernel, {idle.last / 1e3:.1f} "
        f"ms after the last, {idle.between / 1e3:.1f} ms between in {len(idle.gaps)} gaps, "
        f"{idle.host_late / 1e3:.1f} ms of it waiting for the host's launch "
        f"({linked} of {len(spans)} spans linked to their launch)",
        f"  {'idle us':>8} {'late':>6}  after -> next kernel  [launched from]",
    ]
    for g in idle.gaps[:top]:
        lines.append(
            f"  {g.idle:8.0f} {g.host_late:6.0f}  {g.before[:40]} -> {g.after.name[:40]}"
            f"  [{g.after.where[-90:]}]"
        )
    return lines


def prompts_of(count: int, length: int, vocab: int, salt: int) -> list[list[int]]:
    """Distinct prompts (no shared prefix, so a prefix cache serves none of them)."""
    return [[(97 * i + 31 * j + salt) % vocab for j in range(length)] for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    for module, name, value in a.overrides:
        setattr(module, name, value)
    cuda = a.device.startswith("cuda")
    with model_dir_for(a.model, a.preset, a.load_format) as model_dir:
        config = load_model_config(model_dir)
        llm = LLM(
            model_dir,
            load_format=a.load_format,
            device=a.device,
            dtype=a.dtype,
            quantization=a.quantization,
            kv_cache_dtype=a.kv_cache_dtype,
            graph_mode=a.graph_mode,
            cuda_graph_sizes=a.cuda_graph_sizes,
            max_model_len=a.input_len + 1,
            max_num_batched_tokens=a.max_num_batched_tokens,
            max_num_seqs=a.prompts,
            enable_prefix_caching=False,
            use_tqdm_on_load=False,
        )
        with llm:
            vocab = llm.engine.vocab_size
            params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
            llm.generate(prompts_of(a.prompts, a.input_len, vocab, 1), params, use_tqdm=False)

            def timed(salt: int) -> tuple[float, list]:
                prompts = prompts_of(a.prompts, a.input_len, vocab, salt)
                start = time.perf_counter()
                with record_function(WINDOW):
                    outs = llm.generate(prompts, params, use_tqdm=False)
                    if cuda:
                        torch.cuda.synchronize()
                return time.perf_counter() - start, outs

            walls = sorted(timed(10 + i)[0] for i in range(a.repeats))
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities, with_stack=cuda and a.stacks) as prof:
                wall, outs = timed(2)
    if any(len(o.outputs[0].token_ids) != 1 for o in outs):
        raise RuntimeError("a request did not produce its one token")
    print(report(prof, a, config, wall, cuda, walls))
    return 0


def report(prof, a: argparse.Namespace, config, wall: float, cuda: bool, walls: list[float]) -> str:
    tokens = a.prompts * a.input_len
    steps = math.ceil(tokens / a.max_num_batched_tokens)
    flops = 2 * active_parameters(config) * tokens
    tflops = flops / wall / 1e12
    lines = [
        f"prefill: {a.prompts} x {a.input_len} tokens, {a.max_num_batched_tokens} a step "
        f"(~{steps} steps), {config.num_layers} layers: {wall * 1e3:.1f} ms wall, "
        f"{tokens / wall:.0f} tokens/s, {tflops:.1f} TFLOP/s by active parameters (profiled)"
    ]
    peak = measure_matmul_tflops(torch.device(a.device)) if cuda else None
    if walls:
        median = walls[len(walls) // 2]
        rate = flops / median / 1e12
        share = f", {100 * rate / peak:.1f}% of the measured bf16 matmul rate" if peak else ""
        lines.append(
            f"  without the profiler: median {median * 1e3:.1f} ms of {len(walls)} runs "
            f"({walls[0] * 1e3:.1f}..{walls[-1] * 1e3:.1f}), {rate:.1f} TFLOP/s{share}"
        )
    events = prof.key_averages()
    if cuda:
        # The window's own range shows on the GPU's timeline too (a user annotation): no kernel.
        kernels = [
            e
            for e in events
            if e.device_type.name == "CUDA" and e.device_time_total > 0 and e.key != WINDOW
        ]
        busy = sum(e.device_time_total for e in kernels) / 1e6  # us -> s
        launches = sum(e.count for e in kernels)
        lines.append(
            f"  {100 * tflops / peak:.1f}% of the measured bf16 matmul rate ({peak:.0f} TFLOP/s); "
            f"GPU busy {busy * 1e3:.1f} ms ({100 * busy / wall:.0f}% of the wall); {launches} "
            f"kernel launches, {launches / steps / config.num_layers:.0f} a step and layer"
        )
        if a.quantization == "fp8":
            fp8_peak = measure_matmul_tflops(torch.device(a.device), fp8=True)
            lines.append(
                f"  {100 * tflops / fp8_peak:.1f}% of the measured FP8 matmul rate "
                f"({fp8_peak:.0f} TFLOP/s)"
            )
        # The host's CUDA runtime calls: launches, and any synchronizing call (a copy to the host,
        # a stream sync) that drains the queue and leaves the GPU idle until the next launch.
        runtime = sorted(
            (e for e in events if e.device_type.name == "CPU" and e.key.startswith("cuda")),
            key=lambda e: -e.cpu_time_total,
        )[:6]
        lines.append(
            "  host runtime calls: "
            + ", ".join(f"{e.key} x{e.count} {e.cpu_time_total / 1e3:.1f} ms" for e in runtime)
        )
        if a.gaps:
            lines.extend(idle_lines(timeline(prof.events()), a.gaps))
        rows = sorted(kernels, key=lambda e: -e.device_time_total)[: a.rows]
        lines.append(f"  {'GPU ms':>8} {'share':>6} {'calls':>6}  kernel")
        for e in rows:
            ms = e.device_time_total / 1e3
            share = 100 * e.device_time_total / 1e6 / busy
            lines.append(f"  {ms:8.2f} {share:5.1f}% {e.count:6d}  {e.key[:110]}")
    else:
        ops = sorted((e for e in events if e.key != WINDOW), key=lambda e: -e.self_cpu_time_total)[
            : a.rows
        ]
        lines.append(f"  {'CPU ms':>8} {'calls':>6}  operator (self time; no GPU here)")
        for e in ops:
            lines.append(f"  {e.self_cpu_time_total / 1e3:8.2f} {e.count:6d}  {e.key[:110]}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
