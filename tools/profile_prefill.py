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

import torch
from torch.profiler import ProfilerActivity, profile

from afdserve import LLM, SamplingParams
from afdserve.bench.flops import active_parameters, measure_matmul_tflops
from afdserve.bench.report import model_dir_for
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
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="e.g. fp8 (weights)")
    p.add_argument("--kv-cache-dtype", default="auto", help="e.g. fp8 (the paged cache)")
    p.add_argument("--rows", type=int, default=30, help="kernels printed")
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
            prompts = prompts_of(a.prompts, a.input_len, vocab, 2)
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                if cuda:
                    torch.cuda.synchronize()
                wall = time.perf_counter() - start
    if any(len(o.outputs[0].token_ids) != 1 for o in outs):
        raise RuntimeError("a request did not produce its one token")
    print(report(prof, a, config, wall, cuda))
    return 0


def report(prof, a: argparse.Namespace, config, wall: float, cuda: bool) -> str:
    tokens = a.prompts * a.input_len
    steps = math.ceil(tokens / a.max_num_batched_tokens)
    tflops = 2 * active_parameters(config) * tokens / wall / 1e12
    lines = [
        f"prefill: {a.prompts} x {a.input_len} tokens, {a.max_num_batched_tokens} a step "
        f"(~{steps} steps), {config.num_layers} layers: {wall * 1e3:.1f} ms wall, "
        f"{tokens / wall:.0f} tokens/s, {tflops:.1f} TFLOP/s by active parameters"
    ]
    events = prof.key_averages()
    if cuda:
        peak = measure_matmul_tflops(torch.device(a.device))
        kernels = [e for e in events if e.device_type.name == "CUDA" and e.device_time_total > 0]
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
        rows = sorted(kernels, key=lambda e: -e.device_time_total)[: a.rows]
        lines.append(f"  {'GPU ms':>8} {'share':>6} {'calls':>6}  kernel")
        for e in rows:
            ms = e.device_time_total / 1e3
            share = 100 * e.device_time_total / 1e6 / busy
            lines.append(f"  {ms:8.2f} {share:5.1f}% {e.count:6d}  {e.key[:110]}")
    else:
        ops = sorted(events, key=lambda e: -e.self_cpu_time_total)[: a.rows]
        lines.append(f"  {'CPU ms':>8} {'calls':>6}  operator (self time; no GPU here)")
        for e in ops:
            lines.append(f"  {e.self_cpu_time_total / 1e3:8.2f} {e.count:6d}  {e.key[:110]}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
