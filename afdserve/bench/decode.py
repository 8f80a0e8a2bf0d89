"""`afdserve bench decode`: time whole decode steps (embedding -> layers -> logits -> greedy sample)
at a fixed batch and context length, and set the bytes a step must read against the device's
measured copy bandwidth. Decode is memory-bound, so that fraction is the figure of merit.

Bytes a step must read: every non-expert weight once (attention, norms, routers, dense and shared
MLPs, lm_head), one embedding row per sequence, each routed expert the batch touches once per
layer, and every sequence's cached K/V (DeepSeek-V4: what its attention reads of its paged cache,
per layer type). Writes (one token of KV, activations) are left out.
With `--quantization fp8` the FP8 weights count one byte per element plus their float32 block
scales, and with `--kv-cache-dtype fp8` the cache one byte per element (bench/bytes.py).

`--num-speculative-tokens k` also times, at each batch, the verification step of speculative
decoding (1 + k rows a sequence, bench/decode_steps.py) beside the plain step, and gives the
speedup those step times make at a few acceptance rates (bench/speculation.py). On a model with
MTP layers (DeepSeek-V3's) the verification step includes its k MTP draft passes
(bench/decode_drafts.py), captured in CUDA graphs under a graph mode as the engine's are.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from afdserve.bench.bytes import measure_copy_bandwidth
from afdserve.bench.bytes import step_kv_bytes as step_kv_bytes  # the benches' names, here too
from afdserve.bench.decode_dp import DataParallelResult, format_dp_table, run_dp_decode_bench
from afdserve.bench.decode_p2p import run_p2p_decode_bench
from afdserve.bench.decode_steps import DecodeResult, bench_batch, build_drafts, build_halves
from afdserve.bench.decode_steps import DecodeSteps as DecodeSteps
from afdserve.bench.flags import (
    BENCH_CONNECTORS,
    add_bench_flags,
    model_dir_option,
    preset_option,
    sizes,
)
from afdserve.bench.hf import hf_sharing_weights, hf_tokens_per_s
from afdserve.bench.report import invalid
from afdserve.bench.speculation import VerifyResult, format_verify_table
from afdserve.config import A2E_DTYPES, DEVICES, GRAPH_MODES, KV_CACHE_DTYPES, QUANTIZATIONS
from afdserve.config_args import build, option
from afdserve.model.checkpoint.loader import TORCH_DTYPES
from afdserve.model.families import cache_layout, parse_model_config
from afdserve.model.presets import PRESETS, hf_config_of, parse_preset

# "1A1F": one process per rank, attention on GPU 0 and FFN on GPU 1 over NCCL (bench/decode_p2p.py).
TOPOLOGIES = ("colocated", "in-process", "1A1F")


@dataclass(frozen=True)
class DecodeBench:
    model_dir: str | None = model_dir_option()
    preset: str | None = preset_option(": its shape with random weights, no directory")
    random_weights: bool = option(
        False, help="random weights in --model's shape instead of its checkpoint"
    )
    batch_sizes: tuple[int, ...] = option(
        (1, 8, 64), parse=sizes, help="the decode batches timed, comma-separated"
    )
    context_len: int = option(1024, help="tokens already cached per sequence")
    topology: str = option("colocated", choices=TOPOLOGIES, help="the engine layout timed")
    connector: str = "p2p"  # the data plane of --topology 1A1F: one of BENCH_CONNECTORS
    graph_mode: str = "none"
    ubatches: int = 1
    steps: int = option(20, help="timed decode steps per batch")
    dtype: str = "bfloat16"
    device: str = "cuda"
    block_size: int | None = None  # None: the engine's "auto" (engine/factory.py auto_block_size)
    compare_hf: bool = option(False, help="also time transformers' model on the same weights")
    seed: int = option(0, help="seed of random weights and tokens")
    quantization: str | None = None  # "fp8": block-scaled FP8 weights (EngineConfig's option)
    kv_cache_dtype: str = "auto"  # "fp8" / "fp8_e4m3": the FP8 KV cache (EngineConfig's option)
    a2e_dtype: str = "auto"  # "fp8": the rows handed to the FFN half quantized (AFDConfig's option)
    # -dp N: N colocated replicas timed at once, one process and GPU each (bench/decode_dp.py).
    data_parallel_size: int = 1
    num_speculative_tokens: int = option(
        0,
        help="k > 0: also time verification steps of speculative decoding (1 + k rows a "
        "sequence) against the plain step at each batch, and the speedup at acceptance rates "
        "0.6 and 0.8 (colocated or in-process)",
    )

    def __post_init__(self) -> None:
        def bad(field: str, allowed: str) -> ValueError:
            return invalid(self, field, allowed)

        if (self.model_dir is None) == (self.preset is None):
            raise bad("model_dir", "give exactly one of --model DIR and --preset NAME")
        if self.preset is not None:
            try:
                parse_preset(self.preset)
            except ValueError as e:
                raise ValueError(f"bench.{e}") from None
        if self.preset is not None and not self.random_weights:
            raise bad("random_weights", "a preset has no checkpoint: add --random-weights")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise bad("batch_sizes", "a non-empty list of integers >= 1")
        for field in ("context_len", "ubatches", "block_size"):
            if getattr(self, field) is not None and getattr(self, field) < 1:
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
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"None or one of {QUANTIZATIONS}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise bad("kv_cache_dtype", f"one of {KV_CACHE_DTYPES}")
        if self.a2e_dtype not in A2E_DTYPES:
            raise bad("a2e_dtype", f"one of {A2E_DTYPES}")
        if self.a2e_dtype == "fp8" and self.topology == "1A1F" and self.connector == "ipc":
            raise bad(
                "a2e_dtype",
                "auto or bfloat16 with --connector ipc (its push kernel "
                "writes rows in the model dtype); fp8 over p2p or in-process",
            )
        replicas = self.data_parallel_size
        if replicas < 1 or (replicas > 1 and self.topology != "colocated"):
            raise bad(
                "data_parallel_size",
                "an integer >= 1; above 1 only with --topology "
                "colocated (replicas are colocated engines)",
            )
        if self.compare_hf and self.data_parallel_size > 1:
            raise bad(
                "compare_hf",
                "off with --data-parallel-size above 1 (time transformers against one replica)",
            )
        k = self.num_speculative_tokens
        if k < 0 or (k and (self.topology == "1A1F" or replicas > 1 or self.compare_hf)):
            raise bad(
                "num_speculative_tokens",
                "an integer >= 0; above 0 only with --topology colocated or in-process, one "
                "replica and no --compare-hf",
            )
        if self.compare_hf and (self.quantization or self.kv_cache_dtype != "auto"):
            raise bad(
                "compare_hf",
                "off with --quantization or an FP8 --kv-cache-dtype "
                "(the transformers model shares bf16 weights and caches)",
            )


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
        return run_p2p_decode_bench(spec), None
    raw = hf_config_of(spec.preset, spec.model_dir)
    dev = torch.device(spec.device)
    copy_gbps = measure_copy_bandwidth(dev) if dev.type == "cuda" else None
    attn, ffn = build_halves(spec, raw)
    results = [bench_batch(attn, ffn, spec, b, copy_gbps) for b in spec.batch_sizes]
    hf = None
    if spec.compare_hf:
        hf_model = hf_sharing_weights(attn, ffn, raw, TORCH_DTYPES[spec.dtype], dev)
        hf = {b: hf_tokens_per_s(hf_model, spec, b) for b in spec.batch_sizes}
    return results, hf


def run_verify_bench(spec: DecodeBench) -> tuple[list[DecodeResult], list[VerifyResult]]:
    """At each batch, plain decode steps and verification steps of 1 + k rows a sequence, both
    under the spec's graph mode (bench_batch's median of `spec.steps`)."""
    raw = hf_config_of(spec.preset, spec.model_dir)
    config = parse_model_config(raw)
    layout = cache_layout(config)
    why = layout.rollback_refusal or layout.draft_refusal(spec.num_speculative_tokens)
    if why is not None:
        raise ValueError(
            f"bench.num_speculative_tokens={spec.num_speculative_tokens}: {config.family} takes "
            f"no speculative decoding (rejected drafts' rows must be overwritable: {why})"
        )
    # An MTP layer's share of a step is one layer of the whole model's: NAME:LAYERS times the
    # first layers of a model that has the published count.
    layers = PRESETS[parse_preset(spec.preset)[0]] if spec.preset else raw
    dev = torch.device(spec.device)
    copy_gbps = measure_copy_bandwidth(dev) if dev.type == "cuda" else None
    attn, ffn = build_halves(spec, raw)
    # A model with MTP layers runs them: each verification step's k draft passes are timed in
    # it, under the spec's graph mode like the step.
    drafts = build_drafts(spec, raw, attn, ffn)
    plain, verify = [], []
    query_len = 1 + spec.num_speculative_tokens
    for batch in spec.batch_sizes:
        plain.append(bench_batch(attn, ffn, spec, batch, copy_gbps))
        step = bench_batch(attn, ffn, spec, batch, copy_gbps, query_len=query_len, drafts=drafts)
        alone = None
        if drafts is not None:  # the verification's own time, its draft passes not run
            alone = bench_batch(attn, ffn, spec, batch, copy_gbps, query_len=query_len).step_ms
        verify.append(
            VerifyResult(
                batch,
                spec.num_speculative_tokens,
                plain[-1].step_ms,
                step.step_ms,
                int(layers["num_hidden_layers"]),
                drafts is not None,
                alone,
            )
        )
    return plain, verify


def add_decode_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("decode", help="time decode steps at a fixed batch and context length")
    add_bench_flags(
        p,
        DecodeBench,
        (
            "model_dir",
            "preset",
            "random_weights",
            "batch_sizes",
            "context_len",
            "topology",
            "connector",
            "graph_mode",
            "ubatches",
            "data_parallel_size",
            "steps",
            "dtype",
            "device",
            "block_size",
            "quantization",
            "kv_cache_dtype",
            "a2e_dtype",
            "num_speculative_tokens",
            "compare_hf",
            "seed",
        ),
    )
    p.set_defaults(func=main_decode)


def main_decode(args: argparse.Namespace) -> int:
    spec = build(DecodeBench, args)
    replicas = spec.data_parallel_size
    dp: list[DataParallelResult] = []
    verify: list[VerifyResult] = []
    if spec.num_speculative_tokens:
        results, verify, hf = *run_verify_bench(spec), None
    elif replicas > 1:
        dp = run_dp_decode_bench(spec, replicas)
        results, hf = [row.replicas[0] for row in dp], None
    else:
        results, hf = run_decode_bench(spec)
    copy = results[0].copy_gbps if results else None
    name = spec.preset or spec.model_dir
    print(
        f"decode bench: {name}, context {spec.context_len}, {spec.dtype}"
        + (f", {spec.quantization} weights" if spec.quantization else "")
        + (f", {spec.kv_cache_dtype} KV cache" if spec.kv_cache_dtype != "auto" else "")
        + (f", {spec.a2e_dtype} A2E rows" if spec.a2e_dtype != "auto" else "")
        + f", {spec.topology}"
        + (f" x{replicas} replicas at once" if replicas > 1 else "")
        + ", "
        f"graph_mode={spec.graph_mode}, ubatches={spec.ubatches}, {spec.steps} steps (median)"
        + (f", device copy bandwidth {copy:.0f} GB/s" if copy else "")
    )
    print(format_dp_table(dp, spec.device) if dp else format_table(results, hf))
    if verify:
        print(
            f"verification steps of {1 + spec.num_speculative_tokens} rows a sequence against "
            "the plain steps above, same batch and graph mode:"
        )
        print(format_verify_table(verify))
    return 0
