"""Time DeepSeek-V4's fused mHC site (kernels/triton/mhc.py) at V4-Flash's shape (4 streams of
4096, 20 Sinkhorn rounds, bf16 streams, with the update) on CUDA, each way of its mixing kernel
(per row; blocks of BLOCK_ROWS rows, ROWS_CHUNK columns of each stream a program in steps of
ROWS_STEP, ROWS_WARPS warps, their products as ROWS_DOT says) at each row count, against the
time the site's bytes need at the device's copy bandwidth (the streams read and written, the
collapse written, `fn` once). Each way's streams and collapse are checked against the per-row
kernel's. `--block-rows`, `--chunks`, `--steps`, `--warps` and `--dots` sweep those constants;
the fastest way per row count sets ROWS_KERNEL_FROM.

    PYTHONPATH=. python tools/mhc_bench.py [--rows 1,64,1024,8192] [--block-rows 32,64] \
        [--chunks 32,256] [--steps 16,32] [--warps 4,8] [--dots bf16x3,tf32x3,ieee]
"""

from __future__ import annotations

import argparse

import torch
from fp4_moe_bench import replay_seconds

from afdserve.bench.bytes import measure_copy_bandwidth
from afdserve.kernels.triton import mhc
from afdserve.model.families.deepseek_v4.mhc import HyperConnection

N, HIDDEN, ITERS = 4, 4096, 20


def site_bytes(rows: int) -> int:
    streams = rows * N * HIDDEN * 2
    return 2 * streams + rows * HIDDEN * 2 * 2 + (2 + N) * N * N * HIDDEN * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,64,256,1024,8192")
    parser.add_argument("--block-rows", default=str(mhc.BLOCK_ROWS))
    parser.add_argument("--chunks", default=str(mhc.ROWS_CHUNK), help="ROWS_CHUNK values swept")
    parser.add_argument("--steps", default=str(mhc.ROWS_STEP), help="ROWS_STEP values swept")
    parser.add_argument("--dots", default=mhc.ROWS_DOT, help="ROWS_DOT values swept")
    parser.add_argument("--warps", default=str(mhc.ROWS_WARPS), help="ROWS_WARPS values swept")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    hc = HyperConnection(HIDDEN, N, ITERS, 1e-6, 1e-6).cuda()
    with torch.no_grad():
        hc.fn.normal_(generator=gen).mul_((N * HIDDEN) ** -0.5)
        hc.base.normal_(generator=gen).mul_(0.5)
        hc.scale.uniform_(0.5, 1.5, generator=gen)
    weight = torch.ones(HIDDEN, device="cuda")
    copy = measure_copy_bandwidth(torch.device("cuda"))
    print(f"copy bandwidth {copy:.0f} GB/s")
    ways = [("per row", 1 << 30, mhc.BLOCK_ROWS, 0, 0, 0, mhc.ROWS_DOT)]
    ways += [
        (f"{b} rows, {c} x {s} columns, {w} warps, {dot}", 0, b, c, s, w, dot)
        for b in map(int, args.block_rows.split(","))
        for c in map(int, args.chunks.split(","))
        for s in map(int, args.steps.split(","))
        for w in map(int, args.warps.split(","))
        for dot in args.dots.split(",")
        if s <= c
    ]
    print("| rows | bytes' time | " + " | ".join(w[0] for w in ways) + " |")
    print("| --- " * (len(ways) + 2) + "|")
    for rows in map(int, args.rows.split(",")):
        h = torch.randn(rows, N, HIDDEN, device="cuda", generator=gen).bfloat16()
        y = torch.randn(rows, HIDDEN, device="cuda", generator=gen).bfloat16()
        post = torch.rand(rows, N, device="cuda", generator=gen) * 2
        comb = torch.rand(rows, N, N, device="cuda", generator=gen)
        site = (h, y, post, comb, hc.fn, hc.base, hc.scale, weight, ITERS, 1e-6, 1e-6, 1e-6)
        cells, first = [], None
        for name, start, block, chunk, step, warps, dot in ways:
            mhc.ROWS_KERNEL_FROM, mhc.BLOCK_ROWS, mhc.ROWS_DOT = start, block, dot
            if chunk:
                mhc.ROWS_CHUNK, mhc.ROWS_STEP, mhc.ROWS_WARPS = chunk, step, warps
            got = mhc.hyper_connection(*site)
            first = first or got
            for what, a, b in zip(("streams", "collapse"), got[:2], first[:2]):
                err = float((a.double() - b.double()).norm() / b.double().norm())
                assert err < 1e-2, (name, rows, what, err)
            cells.append(f"{replay_seconds(mhc.hyper_connection, *site) * 1e3:.3f} ms")
        bound = site_bytes(rows) / (copy * 1e9) * 1e3
        print(f"| {rows} | {bound:.3f} ms | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
