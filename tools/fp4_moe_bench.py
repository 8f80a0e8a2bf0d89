"""Time the FP4 routed-expert kernels (kernels/moe/fp4_decode.py) at DeepSeek-V4-Flash's expert
shape against the bf16 decode kernels (kernels/moe/decode.py) on the same routing, on CUDA.

For each batch: the median of graph replays of one layer's routed experts (256 experts, hidden
4096, intermediate 2048, top-6, random routing), the bytes the touched experts hold (FP4: 4.25
bits per weight with the ue8m0 scales; bf16: 16) and the GB/s that makes, beside the device's
copy bandwidth (bench/bytes.py), so the FP4 path's share of it can be read off.

    PYTHONPATH=. python tools/fp4_moe_bench.py [--batch-sizes 1,8,64] [--experts 256]

--sweep times instead a small grid of the kernels' tile shapes (`triton_fp4_moe.Tiles`) at each
batch, the same graph replays, and prints the best per batch and a `TILES` table made of them
(each config compiles once for every batch: about two minutes for the grid, then the cache).

    PYTHONPATH=. python tools/fp4_moe_bench.py --sweep

--splits times instead the shipped shape at each of these K splits (`Tiles.splits`), each with
four quarter dots a K step and with one (`Tiles.one_dot`), at each batch, routed over all
experts, as the sweep does.

    PYTHONPATH=. python tools/fp4_moe_bench.py --splits 1,2,4,8 --batch-sizes 1,2,4,8

--prefill times instead, at each batch, the decode kernels (in row chunks of their MAX_PAIRS)
against both ways of the prefill path (kernels/moe/fp4_grouped.py: the weights decoded in
registers per tile of pairs, `DIRECT`; or a bf16 copy of a group of experts and grouped GEMMs),
for `fp4_grouped.DIRECT`, the crossover `fp4_grouped.MIN_PAIRS` and the step's experts at prefill
sizes.

    PYTHONPATH=. python tools/fp4_moe_bench.py --prefill --batch-sizes 64,128,256,512,1024,8192 \
        [--direct-launches "64,128,128,8,3;32,64,128,4,3;64,128,128,4,3,1"]
"""

from __future__ import annotations

import argparse
import statistics

import torch

from afdserve.bench.bytes import measure_copy_bandwidth
from afdserve.kernels import ops
from afdserve.kernels.moe import decode as triton_moe
from afdserve.kernels.moe import fp4_decode as triton_fp4_moe
from afdserve.kernels.moe.fp4_decode import MAX_PAIRS, Tiles, tiles_for
from afdserve.kernels.reference import fp4

HIDDEN, INTER, TOP_K, LIMIT = 4096, 2048, 6, 10.0
TILES_SHIPPED = tiles_for(MAX_PAIRS)  # every batch's shape but a single row's (fp4_decode.TILES)


def replay_seconds(fn, *args, repeats: int = 50) -> float:
    fn(*args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def sweep_grid() -> list[Tiles]:
    """28 shapes, the weights the dot's A operand but for one control: columns per gate/up and
    down program at 4 warps, by K step and stages; 8 warps over wider tiles; a 512 K step; the
    shipped shape by its register cap (none: two programs an SM; 128: four, if ptxas fits it),
    and 8 warps at 128 (two programs of 8). (Its B-operand shapes and gate/up tiles under 64
    rows compile to 2-3x the instructions per weight: tests/kernels/test_fp4_moe_compile.py's
    SASS, 2026-12-02.)"""
    widths = ((32, 64), (32, 128), (64, 64), (64, 128))
    grid = [Tiles(gu, dn, k_block=k) for k in (128, 256) for gu, dn in widths]
    grid += [Tiles(gu, dn, stages=st) for st in (2, 4) for gu, dn in widths]
    grid += [Tiles(64, 128, warps=8), Tiles(128, 256, warps=8)]
    grid += [Tiles(32, 64, k_block=512), Tiles(64, 128, k_block=512)]
    grid += [Tiles(gu, dn, k_block=64) for gu, dn in widths[1:]]  # fewer registers a thread
    shipped = TILES_SHIPPED
    grid += [shipped._replace(max_registers=r) for r in (None, 128)]
    grid += [shipped._replace(warps=8, max_registers=128), shipped._replace(stages=4)]
    # One dot a K step won at every batch (`--splits`), so the grid's A-operand shapes take it.
    return [*(t._replace(one_dot=True) for t in grid), Tiles(64, 64, weights_left=False)]


def sweep(
    batches: list[int], experts: int, gu, dn, gen: torch.Generator, grid: list[Tiles]
) -> None:
    """Every shape of `grid` at every batch; a shape that fails (to compile, or for want of
    shared memory) is reported and skipped."""
    best: dict[int, tuple[float, Tiles]] = {}
    for batch in batches:
        x = torch.randn(batch, HIDDEN, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(batch, experts, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
        weights = torch.rand(batch, TOP_K, device="cuda", generator=gen)
        touched = int(ids.unique().numel())
        fp4_bytes = touched * 3 * HIDDEN * INTER * 4.25 / 8
        print(
            f"batch {batch}: routed over all {experts} experts (the plain table's routing takes "
            f"64, for its bf16 side), {touched} touched, {fp4_bytes / 1e6:.0f} MB"
        )
        for tiles in grid:
            try:
                t = replay_seconds(
                    triton_fp4_moe.moe_experts,
                    x,
                    ids,
                    weights,
                    gu,
                    dn,
                    LIMIT,
                    lambda pairs, tiles=tiles: tiles,
                )
            except Exception as e:  # a shape the device cannot run: reported, skipped
                print(f"  {tiles}: failed, {type(e).__name__}: {str(e).splitlines()[0][:80]}")
                continue
            print(f"  {t * 1e6:8.1f} us  {fp4_bytes / t / 1e9:6.0f} GB/s  {tiles}")
            if batch not in best or t < best[batch][0]:
                best[batch] = (t, tiles)
    print_best(best)


def prefill(
    batches: list[int],
    experts: int,
    gu,
    dn,
    gen: torch.Generator,
    launches: tuple[tuple[int, ...], ...] = (),
) -> None:
    """The decode kernels and both ways of the prefill path at every batch, on the same routing,
    and the in-register way at each of `launches` (`fp4_grouped.DIRECT_LAUNCH`'s fields); the
    fastest named."""
    from afdserve.kernels.moe import fp4_grouped

    for batch in batches:
        x = torch.randn(batch, HIDDEN, device="cuda", generator=gen).bfloat16()
        ids = torch.rand(batch, experts, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
        weights = torch.rand(batch, TOP_K, device="cuda", generator=gen)
        flops = 2 * batch * TOP_K * 3 * HIDDEN * INTER
        times = {
            "decode kernels": replay_seconds(
                triton_fp4_moe.moe_experts, x, ids, weights, gu, dn, LIMIT
            ),
            **{
                name: replay_seconds(
                    lambda *a, d=direct: fp4_grouped.moe_experts(*a, direct=d),
                    x,
                    ids,
                    weights,
                    gu,
                    dn,
                    LIMIT,
                )
                for name, direct in (("in registers", True), ("bf16 copy", False))
            },
        }
        for launch in launches:
            times[f"in registers {launch}"] = replay_seconds(
                lambda *a, t=launch: fp4_grouped.moe_experts(*a, direct=True, launch=t),
                x,
                ids,
                weights,
                gu,
                dn,
                LIMIT,
            )
        cells = ", ".join(
            f"{name} {t * 1e3:.3f} ms ({flops / t / 1e12:.0f} TFLOP/s)" for name, t in times.items()
        )
        print(f"batch {batch:5d} ({batch * TOP_K} pairs): {cells}: {min(times, key=times.get)}")


def print_best(best: dict[int, tuple[float, Tiles]]) -> None:
    """The fastest shape of each batch, and a `TILES` table of them to paste."""
    print("best per batch:")
    for batch, (t, tiles) in sorted(best.items()):
        print(f"  batch {batch:3d} (pairs <= {batch * TOP_K}): {t * 1e6:.1f} us  {tiles}")
    rows = [f"({batch * TOP_K}, {tiles!r})" for batch, (_, tiles) in sorted(best.items())]
    if rows:  # the largest batch's shape also serves every larger chunk
        rows[-1] = f"(MAX_PAIRS, {max(best.items())[1][1]!r})"
    print("TILES = (" + ", ".join(rows) + ",)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--sweep", action="store_true", help="time a grid of tile shapes instead")
    p.add_argument(
        "--splits", default="", help="time the shipped shape at these K splits (and one dot)"
    )
    p.add_argument(
        "--prefill", action="store_true", help="time the decode kernels against the prefill path"
    )
    p.add_argument(
        "--direct-launches",
        default="",
        help="with --prefill, also the in-register way at these launches, ';'-separated, each "
        "'gate_up_columns,down_columns,k_block,warps,stages[,one_dot]'",
    )
    args = p.parse_args()
    named = [launch for launch in args.direct_launches.split(";") if launch]
    launches = tuple(tuple(int(v) for v in launch.split(",")) for launch in named)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    experts = args.experts
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up, down = [], []
    for _ in range(experts):  # quantized one expert at a time: a whole bf16 stack is 12 GB
        w13 = torch.randn(2 * INTER, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5
        w2 = torch.randn(HIDDEN, INTER, device="cuda", generator=gen) / INTER**0.5
        gate_up.append(fp4.quantize_fp4(w13))
        down.append(fp4.quantize_fp4(w2))
    gu = tuple(torch.stack(t) for t in zip(*gate_up, strict=True))
    dn = tuple(torch.stack(t) for t in zip(*down, strict=True))
    if args.sweep or args.splits:
        splits = [int(n) for n in args.splits.split(",") if n]
        grid = [TILES_SHIPPED._replace(splits=n, one_dot=d) for d in (False, True) for n in splits]
        sweep(batches, experts, gu, dn, gen, grid or sweep_grid())
        return
    if args.prefill:
        prefill(batches, experts, gu, dn, gen, launches)
        return
    bf16_experts = min(experts, 64)  # the bf16 comparison on a 64-expert stack (6 GB)
    gu16 = fp4.dequantize_fp4(gu[0][:bf16_experts], gu[1][:bf16_experts], torch.bfloat16)
    dn16 = fp4.dequantize_fp4(dn[0][:bf16_experts], dn[1][:bf16_experts], torch.bfloat16)
    copy = measure_copy_bandwidth(torch.device("cuda"))
    print(
        f"FP4 experts, hidden {HIDDEN}, intermediate {INTER}, top-{TOP_K}, {experts} experts; "
        f"device copy bandwidth {copy:.0f} GB/s"
    )
    print("batch  touched  fp4_us  fp4_GB/s  of_copy  bf16_us(64 experts)  speedup")
    for batch in batches:
        x = torch.randn(batch, HIDDEN, device="cuda", generator=gen).bfloat16()
        scores = torch.rand(batch, bf16_experts, device="cuda", generator=gen)
        ids = scores.topk(TOP_K, dim=-1).indices
        weights = torch.rand(batch, TOP_K, device="cuda", generator=gen)
        touched = int(ids.unique().numel())
        t4 = replay_seconds(ops.moe_experts_fp4, x, ids, weights, gu, dn, LIMIT)
        # The bf16 kernels have no clamp: the same bytes' worth of work, timed for bandwidth.
        t16 = replay_seconds(triton_moe.moe_experts, x, ids, weights, gu16, dn16)
        fp4_bytes = touched * 3 * HIDDEN * INTER * 4.25 / 8
        gbps = fp4_bytes / t4 / 1e9
        print(
            f"{batch:5d}  {touched:7d}  {t4 * 1e6:6.1f}  {gbps:8.0f}  {gbps / copy:7.1%}  "
            f"{t16 * 1e6:19.1f}  {t16 / t4:6.2f}x"
        )


if __name__ == "__main__":
    main()
