"""Time the routed experts of a prefill chunk (kernels/moe/torch_grouped.py, `ops.moe_experts`
past the Triton grouped GEMM) stage by stage at Qwen3-30B-A3B's experts (128 experts, hidden
2048, intermediate 768, top-8), bf16, on CUDA: the sort and x's gather, the gate/up grouped
GEMM, the activation, the down grouped GEMM and the weighted sum, each by CUDA-graph replay,
beside the whole path, its TFLOP/s by the two GEMMs' FLOPs and the device's bf16 matmul rate.

    PYTHONPATH=. python tools/prefill_experts_bench.py [--tokens 8192,16384] [--sweep]

--sweep also times the sum's tile (hidden columns a program takes, warps) over a small grid.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from fp4_moe_bench import replay_seconds  # tools/, on sys.path as this script's folder

from afdserve.bench.flops import measure_matmul_tflops
from afdserve.kernels import ops
from afdserve.kernels.moe import decode, torch_grouped
from afdserve.kernels.triton.swiglu import swiglu

EXPERTS, HIDDEN, INTER, TOP_K = 128, 2048, 768, 8
SUM_GRID = ((512, 4), (1024, 4), (1024, 8), (2048, 8), (2048, 16), (256, 2))


def stages(tokens: int, sweep: bool, peak: float) -> None:
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen).bfloat16()
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen)
    gate_up = (gate_up * HIDDEN**-0.5).bfloat16()
    down = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen)
    down = (down * INTER**-0.5).bfloat16()
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=gen)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    flat = ids.reshape(-1)
    order, offsets, slots = torch_grouped.group_pairs(flat, EXPERTS)
    sorted_x = x.index_select(0, order // TOP_K)
    gu = F.grouped_mm(sorted_x, gate_up.mT, offs=offsets)
    h = swiglu(gu[:, :INTER], gu[:, INTER:], rows_end=offsets[-1:])
    y = F.grouped_mm(h, down.mT, offs=offsets)
    out = torch.empty_like(x)
    w = weights.reshape(-1)
    columns, warps = torch_grouped.SUM_TILE

    def sort_and_gather() -> None:
        x.index_select(0, torch_grouped.group_pairs(flat, EXPERTS)[0] // TOP_K)

    runs = {
        "sort, gather, slots": sort_and_gather,
        "gate/up grouped GEMM": lambda: F.grouped_mm(sorted_x, gate_up.mT, offs=offsets),
        "activation": lambda: swiglu(gu[:, :INTER], gu[:, INTER:], rows_end=offsets[-1:]),
        "down grouped GEMM": lambda: F.grouped_mm(h, down.mT, offs=offsets),
        "weighted sum": lambda: decode.sum_pairs(
            y, flat, out, EXPERTS, slots=slots, weights=w, columns=columns, warps=warps
        ),
        "whole path": lambda: ops.moe_experts(x, ids, weights, gate_up, down),
    }
    flops = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
    print(f"{tokens} tokens, {tokens * TOP_K} pairs:")
    for name, fn in runs.items():
        t = replay_seconds(fn)
        rate = f"  {flops / t / 1e12:6.1f} TFLOP/s, {flops / t / 1e12 / peak:5.1%}"
        print(f"  {name:22s} {t * 1e6:9.1f} us" + (rate if name == "whole path" else ""))
    if sweep:
        for columns, warps in SUM_GRID:
            t = replay_seconds(
                lambda c=columns, n=warps: decode.sum_pairs(
                    y, flat, out, EXPERTS, slots=slots, weights=w, columns=c, warps=n
                )
            )
            moved = (y.numel() * 2 + out.numel() * 2) / t / 1e9
            label = f"sum, {columns:5d} columns, {warps:2d} warps"
            print(f"  {label} {t * 1e6:9.1f} us {moved:6.0f} GB/s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="8192,16384", help="prefill tokens, comma separated")
    p.add_argument("--sweep", action="store_true", help="also time the sum's tile over a grid")
    args = p.parse_args()
    peak = measure_matmul_tflops(torch.device("cuda"))
    print(f"device bf16 matmul rate {peak:.0f} TFLOP/s")
    for tokens in (int(t) for t in args.tokens.split(",")):
        stages(tokens, args.sweep, peak)


if __name__ == "__main__":
    main()
