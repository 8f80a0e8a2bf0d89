"""Times the fp8 A2E format (kernels/a2e.py) on the GPU: a2e.py's torch functions against
the Triton kernels (kernels/triton/a2e.py), as CUDA-graph replays.

    PYTHONPATH=$PWD python tools/time_a2e.py [--rows 1 64 256] [--hidden 2048] [--layers 48]

For each row count and each of two uses, one graph of --layers calls (a decode step of
Qwen3-30B-A3B runs the boundary in each of its 48 layers) is captured per path and replayed
--repeats times; prints one JSON line per (rows, use) with the median microseconds per call and
per step of each path:
  ffn_rows   the round trip of a boundary with no wire (colocated, in process): pad rows zeroed,
             quantized, dequantized; one fused launch against torch's
  wire       encode then decode (a connector's two sides): two launches against torch's
and whether the two paths' outputs are equal bit for bit.
"""

from __future__ import annotations

import argparse
import json

import torch
from fp4_moe_bench import replay_seconds  # tools/, on sys.path as this script's folder

from afdserve.kernels import a2e
from afdserve.kernels.triton import a2e as triton_a2e


def torch_ffn_rows(x, ids, dtype):
    return a2e.dequantize_rows_torch(*a2e.quantize_rows_torch(a2e.pad_zeroed(x, ids)), dtype)


def kernel_ffn_rows(x, ids, dtype):
    return triton_a2e.roundtrip(x, dtype, ids)


def torch_wire(x, ids, dtype):
    return a2e.dequantize_rows_torch(*a2e.quantize_rows_torch(x), dtype)


def kernel_wire(x, ids, dtype):
    return triton_a2e.dequantize_rows(*triton_a2e.quantize_rows(x), dtype)


USES = {"ffn_rows": (torch_ffn_rows, kernel_ffn_rows), "wire": (torch_wire, kernel_wire)}


def step_us(fn, x, ids, layers: int, repeats: int) -> float:
    """Median microseconds of one replay of a graph of `layers` calls."""

    def step() -> list[torch.Tensor]:
        return [fn(x, ids, x.dtype) for _ in range(layers)]

    return replay_seconds(step, repeats=repeats) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for rows in args.rows:
        x = (torch.randn(rows, args.hidden, generator=gen, device="cuda") * 3).to(dtype)
        ids = torch.arange(rows, device="cuda")
        ids[rows // 2 :: 4] = -1  # some pad rows
        for use, (plain, fused) in USES.items():
            t_torch = step_us(plain, x, ids, args.layers, args.repeats)
            t_kernel = step_us(fused, x, ids, args.layers, args.repeats)
            want, got = plain(x, ids, dtype), fused(x, ids, dtype)
            same = torch.equal(got.view(torch.uint8), want.view(torch.uint8))
            print(
                json.dumps(
                    {
                        "rows": rows,
                        "hidden": args.hidden,
                        "dtype": args.dtype,
                        "use": use,
                        "layers": args.layers,
                        "torch_us_per_call": round(t_torch / args.layers, 2),
                        "kernel_us_per_call": round(t_kernel / args.layers, 2),
                        "torch_us_per_step": round(t_torch, 1),
                        "kernel_us_per_step": round(t_kernel, 1),
                        "bit_exact": same,
                    }
                )
            )


if __name__ == "__main__":
    main()
