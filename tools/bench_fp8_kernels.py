"""Time the FP8 and grouped expert kernels against their bf16 counterparts on one GPU, at
Qwen3-30B-A3B's shapes, each call replayed in a CUDA graph (triton.testing.do_bench_cudagraph,
median). Prints microseconds per call and the weight bytes read per second.

    PYTHONPATH=$PWD python tools/bench_fp8_kernels.py [--batches 1,8,64,256]

Rows: the dense projections (q/k/v packed into one GEMM, as model/layers/attention.py runs them in
bf16 and in FP8), o_proj (each over COPIES weights, out of L2), and the routed experts of one layer
(top-8 of 128, random routing): bf16 decode kernels / sort-free grouped path / torch's grouped
GEMM, FP8 kernels, each FP8 kernel weight-only and w8a8 (activations quantized per 128-group).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from afdserve.kernels import ops
from afdserve.kernels.moe import decode as triton_moe
from afdserve.kernels.moe import fp8_decode as triton_fp8_moe
from afdserve.kernels.moe import grouped as triton_grouped_moe
from afdserve.kernels.moe import torch_grouped as moe_gpu
from afdserve.kernels.reference import fp8
from afdserve.kernels.triton import fp8_w8a8 as triton_fp8_w8a8
from afdserve.kernels.triton import fp8_weight_only as triton_fp8
from afdserve.model.layers.fp8 import quantize_weight

HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 2048, 32, 4, 128
EXPERTS, INTER, TOP_K = 128, 768, 8
BLOCK = (128, 128)


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench_cudagraph(fn, rep=50) * 1e3  # us


def line(name: str, us: float, nbytes: int) -> str:
    return f"  {name:<34} {us:9.1f} us  {nbytes / us / 1e3:7.0f} GB/s"


# Copies of each dense weight a timed call cycles through, so that the weights (8 x 10 MB and
# more) stream from HBM as a model's layers do, not from the 50 MB L2 a repeated call hits.
COPIES = 8


def projection(name: str, m: int, n: int, k: int, splits: tuple[int, ...]) -> None:
    """One bf16 GEMM [n, k] against the same weight in FP8 as `splits` row blocks, per call
    over COPIES weights."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(n, k, device="cuda") * k**-0.5 for _ in range(COPIES)]
    wbs = [w.bfloat16() for w in ws]

    def bf16() -> None:
        for wb in wbs:
            F.linear(x, wb)

    print(line(f"{name} bf16 F.linear", timed(bf16) / COPIES, n * k * 2))
    parts = [[fp8.quantize_blockwise(p, BLOCK) for p in w.split(list(splits))] for w in ws]

    fused = triton_fp8_w8a8.QUANTIZE_IN_GEMM_ROWS
    variants = [
        ("weight-only", triton_fp8.fp8_linear, fused),
        ("w8a8", triton_fp8_w8a8.fp8_linear, fused),
    ]
    if m <= fused:  # also with the quantize launch the GEMM does without at these rows
        variants.append(("w8a8 quantize launch", triton_fp8_w8a8.fp8_linear, 0))
    for label, linear, fuse_rows in variants:

        def run(linear=linear) -> None:
            for weight in parts:
                for q, s in weight:
                    linear(x, q, s, None)

        triton_fp8_w8a8.QUANTIZE_IN_GEMM_ROWS = fuse_rows
        us = timed(run) / COPIES
        print(line(f"{name} fp8 {label} ({len(splits)} GEMMs)", us, n * k))
    triton_fp8_w8a8.QUANTIZE_IN_GEMM_ROWS = fused


def dense(m: int) -> None:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    projection("qkv", m, q + 2 * kv, HIDDEN, (q + 2 * kv,))  # packed, as the model runs it
    projection("o_proj", m, HIDDEN, q, (HIDDEN,))


def experts(m: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, HIDDEN, device="cuda", generator=gen).bfloat16()
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) * INTER**-0.5
    weights, ids = torch.randn(m, EXPERTS, device="cuda", generator=gen).softmax(-1).topk(TOP_K)
    touched = int(ids.unique().numel())
    per_expert = 3 * INTER * HIDDEN
    b13, b2 = w13.bfloat16(), w2.bfloat16()
    g13, g2 = quantize_weight(w13, True, BLOCK), quantize_weight(w2, False, BLOCK)
    del w13, w2
    bf16_bytes, fp8_bytes = touched * per_expert * 2, touched * per_expert
    print(
        line(
            "experts bf16 (ops)",
            timed(lambda: ops.moe_experts(x, ids, weights, b13, b2)),
            bf16_bytes,
        )
    )
    # Each path at every batch, so that the crossovers ops.py picks by pair count show.
    if m * TOP_K <= 2 * triton_moe.MAX_PAIRS:
        decode = lambda: triton_moe.moe_experts(x, ids, weights, b13, b2)  # noqa: E731
        print(line("experts bf16 decode kernels", timed(decode), bf16_bytes))
    grouped = lambda: triton_grouped_moe.moe_experts(x, ids, weights, b13, b2)  # noqa: E731
    print(line("experts bf16 grouped (sort-free)", timed(grouped), bf16_bytes))
    if m * TOP_K > 1024:
        torch_grouped = lambda: moe_gpu.moe_experts(x, ids, weights, b13, b2)  # noqa: E731
        print(line("experts bf16 torch grouped_mm", timed(torch_grouped), bf16_bytes))
    fp8_run = lambda: ops.moe_experts_fp8(x, ids, weights, g13, g2, BLOCK)  # noqa: E731
    print(line("experts fp8 (ops)", timed(fp8_run), fp8_bytes))
    for a8 in (False, True):
        label = "w8a8" if a8 else "weight-only"
        if m * TOP_K <= 2 * triton_moe.MAX_PAIRS:
            fp8_decode = lambda a8=a8: triton_fp8_moe.moe_experts(  # noqa: E731
                x, ids, weights, g13, g2, a8=a8
            )
            print(line(f"experts fp8 {label} decode kernels", timed(fp8_decode), fp8_bytes))
        fp8_grouped = lambda a8=a8: triton_grouped_moe.moe_experts(  # noqa: E731
            x, ids, weights, g13[0], g2[0], (g13[1], g2[1]), a8=a8
        )
        print(line(f"experts fp8 {label} grouped (sort-free)", timed(fp8_grouped), fp8_bytes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8,64,256")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}; bytes: the weights each call must read")
    for m in (int(b) for b in args.batches.split(",")):
        print(f"batch {m}")
        dense(m)
        experts(m)


if __name__ == "__main__":
    main()
