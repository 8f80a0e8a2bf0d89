"""`afdserve bench generate`: end-to-end offline throughput through `LLM.generate`, the path a user
takes: scheduler, chunked prefill, decode, sampling, detokenization and (1A1F) one process per
rank. Each batch is `batch` requests of `input_len` random prompt token ids that each generate
exactly `output_len` tokens (greedy, ignore_eos), once to warm up and once timed.

Colocated runs in this process on one device; 1A1F starts one process per rank over
torch.distributed (on CUDA rank r uses cuda:r: attention on GPU 0, the FFN half on GPU 1).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from afdserve.bench.flags import (
    BENCH_CONNECTORS,
    add_bench_flags,
    add_json_flag,
    model_dir_option,
    preset_option,
    sizes,
)
from afdserve.bench.report import invalid, model_dir_for, report
from afdserve.config import GRAPH_MODES, LOAD_FORMATS
from afdserve.config_args import build, option
from afdserve.engine.sampling_params import SamplingParams
from afdserve.frontend.outputs import RequestOutput
from afdserve.llm import LLM

TOPOLOGIES = ("colocated", "1A1F")


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
    topology: str = option(
        "colocated", choices=TOPOLOGIES, help="colocated (with -dp N: N replicas) or 1A1F"
    )
    connector: str = "p2p"  # the data plane of 1A1F: one of BENCH_CONNECTORS
    # Colocated replicas, one rank process (one GPU) each: what AFD on N GPUs is measured against.
    data_parallel_size: int = 1
    load_format: str = "auto"
    graph_mode: str = "none"
    cuda_graph_sizes: tuple[int, ...] | None = None
    ubatches: int = 1
    device: str = "cuda"
    dtype: str = "bfloat16"
    gpu_memory_utilization: float = 0.85
    # Prefill chunk budget: 32 prompts of 512 tokens per step (vLLM's offline default is alike).
    max_num_batched_tokens: int = 16384
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> ValueError:
            return invalid(self, field, allowed)

        if self.model_dir is None:
            raise bad("model_dir", "a model directory: give --model DIR, or --preset NAME")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise bad("batch_sizes", "a non-empty list of integers >= 1")
        for field in ("input_len", "output_len", "ubatches", "max_num_batched_tokens"):
            if getattr(self, field) < 1:
                raise bad(field, "an integer >= 1")
        if self.topology not in TOPOLOGIES:
            raise bad("topology", f"one of {TOPOLOGIES}")
        if self.data_parallel_size < 1 or (
            self.data_parallel_size > 1 and self.topology != "colocated"
        ):
            raise bad(
                "data_parallel_size",
                "an integer >= 1; above 1 only with --topology "
                "colocated (replicas are colocated engines)",
            )
        if self.connector not in BENCH_CONNECTORS:
            raise bad("connector", "p2p or ipc")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"one of {LOAD_FORMATS}")
        if self.graph_mode not in GRAPH_MODES:
            raise bad("graph_mode", f"one of {GRAPH_MODES}")

    @property
    def max_num_seqs(self) -> int:
        """Every request of the largest batch runs at once; smaller batches submit fewer."""
        return max(self.batch_sizes)


@dataclass(frozen=True)
class GenerateResult:
    batch: int
    input_tokens: int
    output_tokens: int
    wall_s: float
    prefill_s: float  # from the first arrival to the last request's first token

    @property
    def total_tokens_per_s(self) -> float:
        return (self.input_tokens + self.output_tokens) / self.wall_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "total_tokens_per_s": self.total_tokens_per_s,
            "output_tokens_per_s": self.output_tokens_per_s,
        }

    def line(self) -> str:
        return (
            f"batch {self.batch:4d}: {self.wall_s:8.2f} s wall, "
            f"{self.total_tokens_per_s:10.1f} total tokens/s, "
            f"{self.output_tokens_per_s:10.1f} output tokens/s, "
            f"prefill of all {self.prefill_s:6.2f} s"
        )


def open_llm(spec: GenerateBench) -> LLM:
    sizes = list(spec.cuda_graph_sizes) if spec.cuda_graph_sizes is not None else None
    return LLM(
        spec.model_dir,
        topology=spec.topology,
        device=spec.device,
        dtype=spec.dtype,
        data_parallel_size=spec.data_parallel_size,
        connector=spec.connector if spec.topology == "1A1F" else "auto",
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.input_len + spec.output_len,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        graph_mode=spec.graph_mode,
        cuda_graph_sizes=sizes,
        ubatches=spec.ubatches,
        load_format=spec.load_format,
        seed=spec.seed,
    )


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


def run_batch(llm: LLM, spec: GenerateBench, batch: int, gen: torch.Generator) -> GenerateResult:
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
    return GenerateResult(batch, batch * spec.input_len, batch * spec.output_len, wall, prefill)


def run_generate_bench(spec: GenerateBench) -> list[GenerateResult]:
    gen = torch.Generator().manual_seed(spec.seed)
    with open_llm(spec) as llm:
        return [run_batch(llm, spec, batch, gen) for batch in spec.batch_sizes]


def add_generate_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("generate", help="end-to-end offline throughput through LLM.generate")
    add_bench_flags(
        p,
        GenerateBench,
        (
            "model_dir",
            "preset",
            "load_format",
            "topology",
            "connector",
            "data_parallel_size",
            "batch_sizes",
            "input_len",
            "output_len",
            "graph_mode",
            "cuda_graph_sizes",
            "ubatches",
            "device",
            "dtype",
            "gpu_memory_utilization",
            "max_num_batched_tokens",
            "seed",
        ),
    )
    add_json_flag(p)
    p.set_defaults(func=main_generate)


def main_generate(args: argparse.Namespace) -> int:
    with model_dir_for(args.model_dir, args.preset, args.load_format) as model_dir:
        graph_sizes = args.cuda_graph_sizes
        spec = build(
            GenerateBench,
            args,
            model_dir=model_dir,
            cuda_graph_sizes=tuple(graph_sizes) if graph_sizes else None,
        )
        results = run_generate_bench(spec)
    name = args.preset or args.model_dir
    replicas = f" x{spec.data_parallel_size} replicas" if spec.data_parallel_size > 1 else ""
    header = (
        f"generate bench: {name} ({spec.load_format} weights), {spec.topology}{replicas}"
        f"{' over ' + spec.connector if spec.topology == '1A1F' else ''}, "
        f"{spec.dtype}, input {spec.input_len}, output {spec.output_len}, "
        f"graph_mode={spec.graph_mode}, ubatches={spec.ubatches}"
    )
    report("generate", name, spec, header, results, args.json)
    return 0
