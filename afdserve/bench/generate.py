"""`afdserve bench generate`: end-to-end offline throughput through `LLM.generate`, the path a user
takes: scheduler, chunked prefill, decode, sampling, detokenization and (1A1F) one process per
rank. Each batch is `batch` requests of `input_len` prompt token ids (bench/workloads.py: random,
or repetitive text) that each generate exactly `output_len` tokens (greedy, ignore_eos), once to
warm up and once timed.

With --speculative-config each run also reports the engine's acceptance counters over the timed
run; --compare-no-speculation then runs the same prompts on an engine without it, and reports the
speedup in output tokens/s and how many requests' greedy tokens came out the same.

Every engine flag `serve` takes is taken here, with the same defaults (graph mode auto included),
so the figures compare with the server's. Prefill is reported in tokens/s and, on CUDA, as a
share of the device's measured bf16 matmul rate by the model's active FLOPs (bench/flops.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from afdserve.bench.flags import (
    add_bench_flags,
    add_json_flag,
    model_dir_option,
    preset_option,
    sizes,
)
from afdserve.bench.flops import active_parameters, measure_matmul_tflops
from afdserve.bench.report import invalid, model_dir_for, report
from afdserve.bench.speculation import SpecCounts
from afdserve.bench.workloads import WORKLOADS, workload_prompts
from afdserve.config import ENGINE_CONFIGS, engine_configs
from afdserve.config_args import add_dataclass_arguments, build, option, values_of
from afdserve.engine.sampling_params import SamplingParams
from afdserve.frontend.outputs import RequestOutput
from afdserve.llm import LLM
from afdserve.model.families import load_model_config


@dataclass(frozen=True)
class GenerateBench:
    # The model's directory: --model's, or the temporary one written for --preset.
    model_dir: str | None = model_dir_option()
    preset: str | None = preset_option(", in a temporary dir (needs --load-format dummy)")
    batch_sizes: tuple[int, ...] = option(
        (64, 256), parse=sizes, help="requests per timed run, comma-separated"
    )
    input_len: int = option(512, help="prompt tokens per request")
    output_len: int = option(256, help="generated tokens per request")
    max_model_len: int | None = option(
        None,
        help="the engine's max_model_len, as serve's (a captured step of some layouts costs "
        "what one at max_model_len does)",
        shown="input_len + output_len",
    )
    workload: str = option(
        "random",
        choices=WORKLOADS,
        help="the prompts: random token ids, or 'repetitive' code-edit-like prompts (a random "
        "snippet, then copies of it with a few tokens edited) on which n-gram speculation finds "
        "drafts",
    )
    compare_no_speculation: bool = option(
        False,
        help="with --speculative-config: also run the same prompts without speculation, and "
        "report the speedup and whether the greedy tokens are the same",
    )
    # Every other engine option, as `LLM` keywords: the flags and defaults `serve` has, so the
    # figures compare with the server's.
    engine: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return invalid(self, name, allowed)

        if self.model_dir is None:
            raise bad("model_dir", "a model directory: give --model DIR, or --preset NAME")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise bad("batch_sizes", "a non-empty list of integers >= 1")
        for name in ("input_len", "output_len"):
            if getattr(self, name) < 1:
                raise bad(name, "an integer >= 1")
        needed = self.input_len + self.output_len
        if self.max_model_len is not None and self.max_model_len < needed:
            raise bad("max_model_len", f"at least input_len + output_len = {needed}, or unset")
        if self.workload not in WORKLOADS:
            raise bad("workload", f"one of {WORKLOADS}")
        if self.compare_no_speculation and self.engine.get("speculative_config") is None:
            raise bad("compare_no_speculation", "off unless --speculative-config is given")
        # The engine's own checks, with its messages, before any process starts.
        engine_configs({**self.llm_kwargs(), "model": self.model_dir}, owner="bench generate")

    def llm_kwargs(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in self.engine.items() if k != "model"},
            "max_model_len": self.max_model_len or self.input_len + self.output_len,
        }


@dataclass(frozen=True)
class GenerateResult:
    batch: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    prefill_s: float  # from the first arrival to the last request's first token
    active_parameters: int  # per token, 2 FLOPs each (bench/flops.py)
    peak_tflops: float | None  # the device's measured bf16 matmul rate (CUDA only)
    speculation: str = "none"  # the method and its k, as the engine ran it
    spec: SpecCounts | None = None  # the acceptance counters over the timed run
    # --compare-no-speculation: the same prompts' output tokens/s without speculation, and the
    # requests whose greedy tokens came out the same as there.
    baseline_output_tokens_per_s: float | None = None
    greedy_equal_requests: int | None = None

    @property
    def speedup(self) -> float | None:
        base = self.baseline_output_tokens_per_s
        return None if base is None else self.output_tokens_per_s / base

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.wall_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def prefill_tokens_per_s(self) -> float:
        """Prompt tokens over the time until every request had its first token (decodes of
        the early requests run in those steps too, so this is a lower bound)."""
        return self.input_tokens / self.prefill_s

    @property
    def prefill_tflops(self) -> float:
        return 2 * self.active_parameters * self.prefill_tokens_per_s / 1e12

    @property
    def prefill_share_of_peak(self) -> float | None:
        return None if self.peak_tflops is None else self.prefill_tflops / self.peak_tflops

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "total_tokens_per_s": self.total_tokens_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "prefill_tflops": self.prefill_tflops,
            "prefill_share_of_peak": self.prefill_share_of_peak,
            "spec": None if self.spec is None else self.spec.as_dict(),
            "speedup": self.speedup,
        }

    def line(self) -> str:
        share = self.prefill_share_of_peak
        peak = "" if share is None else f" ({share:.1%} of the bf16 matmul peak)"
        return (
            f"batch {self.batch:4d}: {self.wall_s:8.2f} s wall, "
            f"{self.total_tokens_per_s:10.1f} total tokens/s, "
            f"{self.output_tokens_per_s:10.1f} output tokens/s, "
            f"prefill of all {self.prefill_s:6.2f} s, "
            f"{self.prefill_tokens_per_s:9.1f} prefill tokens/s = "
            f"{self.prefill_tflops:6.1f} TFLOP/s{peak}{self._speculation_text()}"
        )

    def _speculation_text(self) -> str:
        if self.spec is None:
            return "" if self.speculation == "none" else f", {self.speculation}"
        text = f", {self.speculation}: {self.spec.text()}"
        if self.speedup is not None:
            text += (
                f", {self.speedup:.2f}x the output tokens/s of no speculation "
                f"({self.baseline_output_tokens_per_s:.1f}), greedy tokens the same in "
                f"{self.greedy_equal_requests} of {self.batch} requests"
            )
        return text


def open_llm(spec: GenerateBench, speculate: bool = True) -> LLM:
    kwargs = spec.llm_kwargs()
    if not speculate:
        kwargs["speculative_config"] = None
    return LLM(spec.model_dir, **kwargs)


def check_lengths(outputs: Sequence[RequestOutput], want: int) -> None:
    """Every request must have produced exactly `want` tokens, or the throughput is a lie."""
    for i, out in enumerate(outputs):
        got = len(out.outputs[0].token_ids)
        if got != want:
            raise RuntimeError(
                f"bench generate: request {i} produced {got} tokens "
                f"(finish_reason={out.finish_reason!r}), expected {want}"
            )


def speculation_of(llm: LLM) -> str:
    config = llm.engine_config.speculative_config
    if config is None:
        return "none"
    return f"{config.method} k={config.num_speculative_tokens}"


# What --compare-no-speculation's rows without speculation say they are.
BASELINE = "no speculation (the baseline)"


@dataclass(frozen=True)
class BatchRun:
    result: GenerateResult
    tokens: list[list[int]]  # each request's generated token ids, in prompt order


def run_batch(
    llm: LLM, spec: GenerateBench, batch: int, flops: tuple[int, float | None]
) -> BatchRun:
    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    seed = spec.engine.get("seed", 0)
    warm_prompts, prompts = workload_prompts(
        spec.workload, llm.engine.vocab_size, batch, spec.input_len, seed
    )
    # The warm-up has the timed run's shapes, so every kernel the timed run needs is compiled
    # (and tuned) before the clock starts.
    warm = llm.generate(warm_prompts, params, use_tqdm=False)
    check_lengths(warm, spec.output_len)
    speculation = speculation_of(llm)
    before = SpecCounts.of(llm.engine.stats()) if speculation != "none" else None
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    check_lengths(outputs, spec.output_len)
    counts = None
    if before is not None:
        counts = SpecCounts.of(llm.engine.stats()).since(before)
    # Both times come from the attention rank's monotonic clock.
    prefill = max(o.first_token_time for o in outputs) - min(o.arrival_time for o in outputs)
    inputs, generated = batch * spec.input_len, batch * spec.output_len
    result = GenerateResult(
        batch, inputs, generated, wall, prefill, *flops, speculation=speculation, spec=counts
    )
    return BatchRun(result, [list(o.outputs[0].token_ids) for o in outputs])


def run_engine(spec: GenerateBench, speculate: bool) -> tuple[list[BatchRun], str]:
    """Every batch on one engine, and the engine as it ran them (what "auto" became)."""
    with open_llm(spec, speculate) as llm:
        engine, graph = llm.engine_config, llm.graph_config
        device = torch.device(engine.device)
        peak = measure_matmul_tflops(device) if device.type == "cuda" else None
        flops = (active_parameters(load_model_config(engine.model)), peak)
        ran = (
            f"{llm.afd_config.topology}, {engine.dtype}, graph_mode={graph.mode}, "
            f"max_num_seqs={engine.max_num_seqs}, "
            f"max_num_batched_tokens={engine.max_num_batched_tokens}, "
            f"max_model_len={llm.engine.max_model_len}, speculation {speculation_of(llm)}"
        )
        return [run_batch(llm, spec, batch, flops) for batch in spec.batch_sizes], ran


def compared(run: BatchRun, baseline: BatchRun) -> GenerateResult:
    """`run`'s result with the baseline's (no speculation, same prompts) figures beside it."""
    same = sum(a == b for a, b in zip(run.tokens, baseline.tokens, strict=True))
    return dataclasses.replace(
        run.result,
        baseline_output_tokens_per_s=baseline.result.output_tokens_per_s,
        greedy_equal_requests=same,
    )


def run_generate_bench(spec: GenerateBench) -> tuple[list[GenerateResult], str]:
    """The timed runs (with --compare-no-speculation, each speculating run followed by the
    baseline's rows), and the engine as it ran them for the header."""
    runs, ran = run_engine(spec, speculate=True)
    if not spec.compare_no_speculation:
        return [r.result for r in runs], ran
    # One engine after the other: both at once would share the device's memory.
    baselines, _ = run_engine(spec, speculate=False)
    results = [compared(r, b) for r, b in zip(runs, baselines, strict=True)]
    baseline = [dataclasses.replace(b.result, speculation=BASELINE) for b in baselines]
    return results + baseline, ran


def add_generate_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "generate",
        help="end-to-end offline throughput through LLM.generate, with every engine flag "
        "serve takes and its defaults",
    )
    add_bench_flags(
        p,
        GenerateBench,
        (
            "model_dir",
            "preset",
            "batch_sizes",
            "input_len",
            "output_len",
            "max_model_len",
            "workload",
            "compare_no_speculation",
        ),
    )
    for cls in ENGINE_CONFIGS:
        add_dataclass_arguments(p, cls, skip=("model", "max_model_len"))
    add_json_flag(p)
    p.set_defaults(func=main_generate)


def main_generate(args: argparse.Namespace) -> int:
    engine = {k: v for cls in ENGINE_CONFIGS for k, v in values_of(args, cls).items()}
    engine.pop("model", None)
    load_format = engine.get("load_format", "auto")
    with model_dir_for(args.model_dir, args.preset, load_format) as model_dir:
        spec = build(GenerateBench, args, model_dir=model_dir, engine=engine)
        results, ran = run_generate_bench(spec)
    name = args.preset or args.model_dir
    header = (
        f"generate bench: {name} ({load_format} weights), {ran}, "
        f"input {spec.input_len}, output {spec.output_len}, {spec.workload} prompts"
    )
    report("generate", name, spec, header, results, args.json)
    return 0
