"""Time the FP8 routed-expert kernels with the weights as the dots' left operand (the default)
against the first orientation (weights right), at Qwen3-30B-A3B's experts on one GPU.

For each batch (top-8 of 128 experts, random routing) and each mode (w8a8, weight-only): the
decode kernels (kernels/moe/fp8_decode.py, timed up to --decode-max pairs; ops takes them up to
MAX_PAIRS = 8, a batch of 1) and the grouped kernels (kernels/moe/grouped.py), each
orientation, a whole experts call replayed in a CUDA graph (triton.testing.do_bench_cudagraph,
median); the FP8 bytes the touched experts hold and the GB/s that makes, beside the device's
copy bandwidth (bench/bytes.py, read plus write), and new / old. A config that fails (to
compile, or to run) is reported and skipped.

    PYTHONPATH=$PWD python tools/fp8_moe_bench.py [--batches 1,8,64,256] [--variants]

--variants also times a few other weights-left decode tiles at a batch of 1 (w8a8): 16-row
tiles (sm_90's wgmma rather than mma at 8), wider and narrower columns, fewer stages.
About a minute, most of it compiling.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from triton.testing import do_bench_cudagraph

from afdserve.bench.bytes import measure_copy_bandwidth
from afdserve.kernels.moe import fp8_decode as triton_fp8_moe
from afdserve.kernels.moe import grouped as triton_grouped_moe
from afdserve.kernels.moe.fp8_decode import Tiles
from afdserve.model.layers.fp8 import quantize_weight

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8
BLOCK = (128, 128)
VARIANTS = (
    Tiles(32, 64, 16, 4, 4, True),
    Tiles(32, 128, 8, 4, 4, True),
    Tiles(64, 64, 8, 4, 4, True),
    Tiles(16, 32, 8, 2, 4, True),
    Tiles(64, 128, 8, 4, 4, True),
    Tiles(32, 64, 8, 4, 3, True),
)


def timed_us(fn, *args, **kwargs) -> float | str:
    """Median us of graph replays of fn(*args, **kwargs), or why it failed."""
    try:
        fn(*args, **kwargs)  # compile outside the capture
        torch.cuda.synchronize()
        return do_bench_cudagraph(partial(fn, *args, **kwargs), rep=30) * 1e3
    except Exception as e:  # a config the device cannot build or run: reported, skipped
        return f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:100]}"


def show(label: str, us: float | str, nbytes: float, copy: float, old: float | str | None) -> None:
    if isinstance(us, str):
        print(f"  {label:<44} {us}")
        return
    gbps = nbytes / us / 1e3
    ratio = f"  new/old {us / old:5.2f}" if isinstance(old, float) else ""
    print(f"  {label:<44} {us:8.1f} us {gbps:6.0f} GB/s {gbps / copy:6.1%} of copy{ratio}")


def bench_batch(batch: int, gu, dn, gen, copy: float, decode_max: int, variants: bool) -> None:
    x = torch.randn(batch, HIDDEN, device="cuda", generator=gen).bfloat16()
    logits = torch.randn(batch, EXPERTS, device="cuda", generator=gen)
    weights, ids = logits.softmax(-1).topk(TOP_K)
    pairs, touched = ids.numel(), int(ids.unique().numel())
    nbytes = touched * 3 * HIDDEN * INTER
    print(f"batch {batch}: {pairs} pairs, {touched} experts touched, {nbytes / 1e6:.1f} MB")
    decode = partial(triton_fp8_moe.moe_experts, x, ids, weights, gu, dn)
    grouped = partial(triton_grouped_moe.moe_experts, x, ids, weights, gu[0], dn[0], (gu[1], dn[1]))
    for a8 in (True, False):
        mode = "w8a8" if a8 else "weight-only"
        if pairs <= decode_max:
            old = timed_us(decode, a8=a8, tiles=triton_fp8_moe.tiles_for(pairs, False))
            show(f"decode {mode} weights right", old, nbytes, copy, None)
            new = timed_us(decode, a8=a8, tiles=triton_fp8_moe.tiles_for(pairs, True))
            show(f"decode {mode} weights left", new, nbytes, copy, old)
            for tiles in VARIANTS if variants and a8 and batch == 1 else ():
                show(
                    f"  {tuple(tiles)[:5]}", timed_us(decode, a8=a8, tiles=tiles), nbytes, copy, old
                )
        old = timed_us(grouped, a8=a8, weights_left=False)
        show(f"grouped {mode} weights right", old, nbytes, copy, None)
        new = timed_us(grouped, a8=a8, weights_left=True)
        show(f"grouped {mode} weights left", new, nbytes, copy, old)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--decode-max", type=int, default=64, help="most pairs the decode kernels time")
    p.add_argument("--variants", action="store_true", help="more weights-left decode tiles")
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) * HIDDEN**-0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) * INTER**-0.5
    gu, dn = quantize_weight(w13, True, BLOCK), quantize_weight(w2, False, BLOCK)
    del w13, w2
    copy = measure_copy_bandwidth(torch.device("cuda"))
    print(
        f"{torch.cuda.get_device_name()}: Qwen3-30B-A3B's experts in FP8 ({EXPERTS}, hidden "
        f"{HIDDEN}, intermediate {INTER}, top-{TOP_K}); copy {copy:.0f} GB/s"
    )
    for batch in (int(b) for b in args.batches.split(",")):
        bench_batch(batch, gu, dn, gen, copy, args.decode_max, args.variants)


if __name__ == "__main__":
    main()
