"""`afdserve bench capacity`: how many sequences of `context_len` tokens fit in the KV cache of a
colocated engine and of the attention rank of 1A1F, under the same `gpu_memory_utilization`.

The numbers are what the engines really allocated: each topology starts through `LLM` (dummy or
real weights, as asked), and every attention rank reports its cache (blocks and bytes) in its
ready message. An attention rank holds no experts, so on a GPU it has far more room for cache.
With `--measure`, the decode bench (afdserve/bench/decode.py, and bench/decode_p2p.py for 1A1F
across two GPUs) times decode steps at that batch and context. With `--cache-gib`, no engine
starts: the blocks a cache of that size holds come from the model's cache layout by the engine's
own arithmetic (`blocks_by_bytes`), which runs on any machine for any preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from dataclasses import asdict, dataclass

import torch

from afdserve.bench.decode import DecodeBench, run_decode_bench
from afdserve.bench.flags import (
    BENCH_CONNECTORS,
    add_bench_flags,
    add_json_flag,
    model_dir_option,
    names,
    preset_option,
)
from afdserve.bench.report import invalid, model_dir_for, report
from afdserve.config import GRAPH_MODES, KV_CACHE_DTYPES, LOAD_FORMATS, QUANTIZATIONS
from afdserve.config_args import build, option
from afdserve.engine.factory import auto_block_size, blocks_in_budget, split_budget
from afdserve.engine.kv_cache import slots_for, window_pool_bound
from afdserve.kernels import ops
from afdserve.llm import LLM
from afdserve.model.config import ModelConfig
from afdserve.model.families import cache_layout, load_model_config

TOPOLOGIES = ("colocated", "1A1F")
BY_BYTES = "by bytes"  # the topology of a --cache-gib row: no engine started


@dataclass(frozen=True)
class CapacityBench:
    # The model's directory: --model's, or the temporary one written for --preset.
    model_dir: str | None = model_dir_option()
    preset: str | None = preset_option(", in a temporary dir (needs --load-format dummy)")
    topologies: tuple[str, ...] = option(
        TOPOLOGIES, parse=names, help="the engine layouts measured, comma-separated"
    )
    context_len: int = option(8192, help="tokens per sequence the largest batch is found for")
    gpu_memory_utilization: float = 0.9
    load_format: str = "auto"
    connector: str = "p2p"  # the data plane of 1A1F: one of BENCH_CONNECTORS
    device: str = "cuda"
    dtype: str = "bfloat16"
    block_size: int | None = None  # None: the engine's "auto" (engine/factory.py auto_block_size)
    # The scheduler never runs more than max_num_seqs sequences, nor more tokens than
    # max_num_batched_tokens, in one step: the batch is capped by both.
    max_num_seqs: int = 1024
    max_num_batched_tokens: int = 16384
    measure: bool = option(False, help="also time decode steps at that batch, the decode bench")
    graph_mode: str = "none"  # of the measured decode steps
    kv_cache_dtype: str = "auto"  # "fp8": the FP8 KV cache, twice the tokens per byte
    quantization: str | None = None  # "fp8": block-scaled FP8 weights (EngineConfig's option)
    steps: int = option(20, help="timed steps with --measure")
    seed: int = 0
    cache_gib: float | None = option(
        None,
        help="no engine: the sequences a KV cache of this many GiB holds, from the model's "
        "cache layout (the state slots of max_num_seqs first, as the engine budgets them)",
    )

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> ValueError:
            return invalid(self, field, allowed)

        if self.model_dir is None:
            raise bad("model_dir", "a model directory: give --model DIR, or --preset NAME")
        if not self.topologies or any(t not in TOPOLOGIES for t in self.topologies):
            raise bad("topologies", f"a non-empty list of {TOPOLOGIES}")
        for field in ("context_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
                raise bad(field, "an integer >= 1")
        if self.steps < 2:
            raise bad("steps", "an integer >= 2")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise bad("gpu_memory_utilization", "a float in (0, 1]")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"one of {LOAD_FORMATS}")
        if self.connector not in BENCH_CONNECTORS:
            raise bad("connector", "p2p or ipc")
        if self.graph_mode not in GRAPH_MODES:
            raise bad("graph_mode", f"one of {GRAPH_MODES}")
        if self.graph_mode != "none" and self.device != "cuda":
            raise bad("graph_mode", "'none' unless --device cuda")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"one of {KV_CACHE_DTYPES}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"None or one of {QUANTIZATIONS}")
        if self.cache_gib is not None and (self.cache_gib <= 0 or self.measure):
            raise bad("cache_gib", "None, or a size in GiB > 0 without --measure")
        if self.measure and "1A1F" in self.topologies and self.device != "cuda":
            raise bad("device", "'cuda' to --measure 1A1F (its decode bench runs on two GPUs)")


@dataclass(frozen=True)
class Capacity:
    """One attention rank's KV cache as its engine allocated it, and the batch that fits."""

    topology: str
    rank: int
    num_blocks: int
    block_size: int
    cache_bytes: int
    parameter_bytes: int
    context_len: int
    scheduler_limit: int  # sequences one step may hold: min(max_num_seqs, max_num_batched_tokens)
    decode_tokens_per_s: float | None = None
    # Blocks each sequence's state slot takes where the slots live in the pool's pages.
    slot_pages: int = 0

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def sequences_that_fit(self) -> int:
        """Sequences of context_len tokens held at once (the block manager gives whole blocks,
        and a slot's pages where the slots live in the pool)."""
        return self.num_blocks // (-(-self.context_len // self.block_size) + self.slot_pages)

    @property
    def batch(self) -> int:
        return min(self.sequences_that_fit, self.scheduler_limit)

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "capacity_tokens": self.capacity_tokens,
            "sequences_that_fit": self.sequences_that_fit,
            "batch": self.batch,
        }

    def line(self) -> str:
        measured = (
            ""
            if self.decode_tokens_per_s is None
            else f", decode {self.decode_tokens_per_s:.1f} tokens/s at that batch"
        )
        who = {"colocated": "engine", BY_BYTES: "cache"}.get(
            self.topology, f"attention rank {self.rank}"
        )
        return (
            f"{self.topology} {who}: parameters {self.parameter_bytes / 1e9:.3g} GB, "
            f"KV cache {self.cache_bytes / 1e9:.3g} GB = {self.capacity_tokens} tokens = "
            f"{self.sequences_that_fit} sequences of {self.context_len}; batch {self.batch} "
            f"(scheduler limit {self.scheduler_limit})" + measured
        )


def open_llm(spec: CapacityBench, topology: str) -> LLM:
    """The engine whose allocation is read: sized exactly as a serving engine would be."""
    return LLM(
        spec.model_dir,
        topology=topology,
        device=spec.device,
        dtype=spec.dtype,
        connector=spec.connector if topology == "1A1F" else "auto",
        max_num_seqs=spec.max_num_seqs,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        max_model_len=spec.context_len,
        block_size=spec.block_size,
        gpu_memory_utilization=spec.gpu_memory_utilization,
        load_format=spec.load_format,
        kv_cache_dtype=spec.kv_cache_dtype,
        quantization=spec.quantization,
        seed=spec.seed,
    )


def read_capacity(llm: LLM, topology: str, spec: CapacityBench) -> list[Capacity]:
    """Every attention rank's allocation, from its ready message."""
    return [
        Capacity(
            topology,
            rank,
            ready.limits.num_blocks,
            ready.limits.block_size,
            ready.memory.cache_bytes,
            ready.memory.parameter_bytes,
            spec.context_len,
            min(spec.max_num_seqs, spec.max_num_batched_tokens),
            slot_pages=ready.limits.slot_pages,
        )
        for rank, ready in llm.rank_ready.items()
        if ready.limits is not None
    ]


def measure_decode(spec: CapacityBench, capacity: Capacity) -> float:
    """Decode tokens/s at the capacity's batch and context (its engine is shut down by now)."""
    bench = DecodeBench(
        model_dir=spec.model_dir,
        preset=None,
        random_weights=spec.load_format == "dummy",
        batch_sizes=(capacity.batch,),
        context_len=spec.context_len,
        topology=capacity.topology,
        connector=spec.connector,
        graph_mode=spec.graph_mode,
        steps=spec.steps,
        dtype=spec.dtype,
        device=spec.device,
        block_size=spec.block_size,
        kv_cache_dtype=spec.kv_cache_dtype,
        quantization=spec.quantization,
        seed=spec.seed,
    )
    results, _ = run_decode_bench(bench)
    if spec.device == "cuda":  # hand the colocated bench's weights back to the device
        gc.collect()
        torch.cuda.empty_cache()
    return results[0].tokens_per_s


def blocks_by_bytes(
    config: ModelConfig,
    budget: int,
    block_size: int,
    dtype: torch.dtype,
    max_num_seqs: int,
    max_num_batched_tokens: int = 16384,
) -> int:
    """Blocks a cache of `budget` bytes holds, as engine/factory.py's cache_blocks_for counts
    them on a GPU: the state slots of max_num_seqs sequences first where the layout keeps them
    in memory of their own (where it keeps them in the pages, only the slots' scratch), then
    the windowed layers' pool at its bound (where it has one), then whole blocks."""
    layout = cache_layout(config)
    per_window = layout.bytes_per_window_block(block_size, dtype)
    per_block = layout.bytes_per_block(block_size, dtype) - per_window
    if pages := layout.slot_pages(block_size, dtype):
        return max(0, budget // per_block - pages)
    slots = slots_for(config, max_num_seqs, dtype) * layout.bytes_per_slot(dtype)
    if layout.window is None:
        return max(0, blocks_in_budget(budget - slots, budget, 1.0, per_block))
    bound = window_pool_bound(layout.window, block_size, max_num_seqs, max_num_batched_tokens)
    return split_budget(max(0, budget - slots), per_block, per_window, bound).blocks


def sequences_by_bytes(
    config: ModelConfig,
    budget: int,
    context_len: int,
    block_size: int,
    dtype: torch.dtype,
    max_num_seqs: int,
    max_num_batched_tokens: int = 16384,
) -> int:
    """Sequences of context_len tokens that fit in a cache of `budget` bytes."""
    limits = (max_num_seqs, max_num_batched_tokens)
    blocks = blocks_by_bytes(config, budget, block_size, dtype, *limits)
    pages = cache_layout(config).slot_pages(block_size, dtype)
    return blocks // (-(-context_len // block_size) + pages)


def capacity_by_bytes(spec: CapacityBench) -> Capacity:
    """--cache-gib: the cache's blocks in the model's cache dtype, no engine started."""
    config = load_model_config(spec.model_dir)
    fp8 = spec.kv_cache_dtype != "auto"
    dtype = ops.FP8_DTYPE if fp8 else getattr(torch, spec.dtype)
    budget = int(spec.cache_gib * 2**30)
    limits = (spec.max_num_seqs, spec.max_num_batched_tokens)
    block_size = spec.block_size or auto_block_size(config)
    blocks = blocks_by_bytes(config, budget, block_size, dtype, *limits)
    limit = min(spec.max_num_seqs, spec.max_num_batched_tokens)
    pages = cache_layout(config).slot_pages(block_size, dtype)
    return Capacity(
        BY_BYTES, 0, blocks, block_size, budget, 0, spec.context_len, limit, slot_pages=pages
    )


def run_capacity_bench(spec: CapacityBench) -> list[Capacity]:
    """1A1F first: a colocated engine (and its decode bench) runs in this process, and the CUDA
    context and cache it leaves here would take memory from rank 0 of a later 1A1F world."""
    if spec.cache_gib is not None:
        return [capacity_by_bytes(spec)]
    found: list[Capacity] = []
    for topology in sorted(spec.topologies, key=lambda t: t == "colocated"):
        with open_llm(spec, topology) as llm:
            ranks = read_capacity(llm, topology, spec)
        if spec.measure:
            ranks = [
                dataclasses.replace(c, decode_tokens_per_s=measure_decode(spec, c)) for c in ranks
            ]
        found += ranks
    return found


def add_capacity_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser(
        "capacity",
        help="KV-cache capacity of colocated vs the 1A1F attention "
        "rank, and the largest batch at a context length",
    )
    add_bench_flags(
        p,
        CapacityBench,
        (
            "model_dir",
            "preset",
            "load_format",
            "topologies",
            "connector",
            "context_len",
            "gpu_memory_utilization",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "device",
            "dtype",
            "kv_cache_dtype",
            "quantization",
            "measure",
            "graph_mode",
            "steps",
            "seed",
            "cache_gib",
        ),
    )
    add_json_flag(p)
    p.set_defaults(func=main_capacity)


def main_capacity(args: argparse.Namespace) -> int:
    with model_dir_for(args.model_dir, args.preset, args.load_format) as model_dir:
        spec = build(CapacityBench, args, model_dir=model_dir)
        found = run_capacity_bench(spec)
    name = args.preset or args.model_dir
    header = (
        f"capacity bench: {name} ({spec.load_format} weights), {spec.dtype}, context "
        f"{spec.context_len}, gpu_memory_utilization {spec.gpu_memory_utilization}"
        + (f", {spec.quantization} weights" if spec.quantization else "")
        + (f", {spec.kv_cache_dtype} KV cache" if spec.kv_cache_dtype != "auto" else "")
    )
    report("capacity", name, spec, header, found, args.json)
    return 0
