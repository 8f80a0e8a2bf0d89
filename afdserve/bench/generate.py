"""`afdserve bench generate`: end-to-end offline throughput through `LLM.generate`, the path a user
takes: scheduler, chunked prefill, decode, sampling, detokenization and (1A1F) one process per
rank. Each batch is `batch` requests of `input_len` random prompt token ids that each generate
exactly `output_len` tokens (greedy, ignore_eos), once to warm up and once timed.

Every engine flag `serve` takes is taken here, with the same defaults (graph mode auto included),
so the figures compare with the server's. Prefill is reported in tokens/s and, on CUDA, as a
share of the device's measured bf16 matmul rate by the model's active FLOPs (bench/flops.py).
"""

from __future__ import annotations

import argparse
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
    # Every other engine option, as `LLM` keywords: the flags and defaults `serve` has, so the
    # figures compare with the server's. max_model_len is input_len + output_len.
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
        # The engine's own checks, with its messages, before any process starts.
        engine_configs({**self.llm_kwargs(), "model": self.model_dir}, owner="bench generate")

    def llm_kwargs(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in self.engine.items() if k != "model"},
            "max_model_len": self.input_len + self.output_len,
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
            f"{self.prefill_tflops:6.1f} TFLOP/s{peak}"
        )


def open_llm(spec: GenerateBench) -> LLM:
    return LLM(spec.model_dir, **spec.llm_kwargs())


def random_prompts(
    vocab_size: int, batch: int, input_len: int, gen: torch.Generator
) -> list[list[int]]:
    return torch.randint(0, vocab_size, (batch, input_len), generator=gen).tolist()


def check_lengths(outputs: Sequence[RequestOutput], want: int) -> None:
    """Every request must have produced exactly `want` tokens, or the throughput is a lie."""
    for i, out in enumerate(outputs):
        got = len(out.outputs[0].token_ids)
        if got != want:
            raise RuntimeError(
                f"bench generate: request {i} produced {got} tokens "
                f"(finish_reason={out.finish_reason!r}), expected {want}"
            )


def run_batch(
    llm: LLM, spec: GenerateBench, batch: int, gen: torch.Generator, flops: tuple[int, float | None]
) -> GenerateResult:
    params = SamplingParams(max_tokens=spec.output_len, temperature=0.0, ignore_eos=True)
    vocab = llm.engine.vocab_size
    # The warm-up has the timed run's shapes, so every kernel the timed run needs is compiled
    # (and tuned) before the clock starts.
    warm = llm.generate(random_prompts(vocab, batch, spec.input_len, gen), params, use_tqdm=False)
    check_lengths(warm, spec.output_len)
    prompts = random_prompts(vocab, batch, spec.input_len, gen)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    check_lengths(outputs, spec.output_len)
    # Both times come from the attention rank's monotonic clock.
    prefill = max(o.first_token_time for o in outputs) - min(o.arrival_time for o in outputs)
    inputs, generated = batch * spec.input_len, batch * spec.output_len
    return GenerateResult(batch, inputs, generated, wall, prefill, *flops)


def run_generate_bench(spec: GenerateBench) -> tuple[list[GenerateResult], str]:
    """The timed runs, and the engine as it ran them (what "auto" became) for the header."""
    gen = torch.Generator().manual_seed(spec.engine.get("seed", 0))
    with open_llm(spec) as llm:
        engine, graph = llm.engine_config, llm.graph_config
        device = torch.device(engine.device)
        peak = measure_matmul_tflops(device) if device.type == "cuda" else None
        flops = (active_parameters(load_model_config(engine.model)), peak)
        ran = (
            f"{llm.afd_config.topology}, {engine.dtype}, graph_mode={graph.mode}, "
            f"max_num_seqs={engine.max_num_seqs}, "
            f"max_num_batched_tokens={engine.max_num_batched_tokens}"
        )
        return [run_batch(llm, spec, batch, gen, flops) for batch in spec.batch_sizes], ran


def add_generate_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "generate",
        help="end-to-end offline throughput through LLM.generate, with every engine flag "
        "serve takes and its defaults",
    )
    add_bench_flags(
        p, GenerateBench, ("model_dir", "preset", "batch_sizes", "input_len", "output_len")
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
        f"input {spec.input_len}, output {spec.output_len}"
    )
    report("generate", name, spec, header, results, args.json)
    return 0
