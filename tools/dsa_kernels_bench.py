"""Time DSA's decode kernels on CUDA at DeepSeek-V3.2's widths against the torch path they replace:
the indexer's selection (`ops.dsa_select`: scores over the paged keys and the top-2048; torch:
`select_batched`) and the sparse MLA over the selected latent rows (`ops.dsa_sparse_mla`; torch:
`DSAAttention._attend_reference`), one query row per sequence, as a captured decode runs them.

Each (batch, context): the median of CUDA-graph replays of one layer's call, the bytes it must
read (indexer keys up to each row's position; 2048 latent rows a row) and the GB/s that makes.
Block tables span --max-model-len, as a decode graph's do, so the figures include what skipping
the positions past each row costs. bf16 pages, or FP8 with --fp8. About a minute.

    PYTHONPATH=. python tools/dsa_kernels_bench.py [--shapes 1x4096,64x4096,64x32768] [--fp8]
"""

from __future__ import annotations

import argparse

import torch
from fp4_moe_bench import replay_seconds  # tools/, on sys.path as this script's folder

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.model.families.dsa.indexer import select_batched
from tests.kernels.dsa_cases import dsa_layer

BLOCK = 64


def decode_step(batch: int, context: int, max_model_len: int) -> AttentionMetadata:
    """`batch` sequences of `context` tokens, one query row each, tables max_model_len wide and
    scattered over the cache."""
    width = max_model_len // BLOCK
    order = torch.randperm(batch * width, device="cuda")
    segments = tuple(
        Segment(i, i + 1, order[i * width : (i + 1) * width], context) for i in range(batch)
    )
    positions = torch.full((batch,), context - 1, device="cuda")
    slots = torch.full_like(positions, -1)
    return AttentionMetadata(positions, slots, segments, batch_segments(segments, "cuda"))


def bench(batch: int, context: int, max_model_len: int, fp8: bool) -> None:
    attn = dsa_layer("cuda")  # DeepSeek-V3.2: 128 heads, latent 512 + 64; indexer 64 x 128
    indexer, dtype = attn.indexer, torch.bfloat16
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    blocks = batch * (max_model_len // BLOCK)
    keys = torch.randn(blocks, BLOCK, 1, indexer.dim, device="cuda").to(cache_dtype)
    latent = torch.randn(blocks, BLOCK, 1, 576, device="cuda").to(cache_dtype)
    meta = decode_step(batch, context, max_model_len)
    q = torch.randn(batch, indexer.heads, indexer.dim, device="cuda", dtype=dtype)
    w = torch.randn(batch, indexer.heads, device="cuda")
    rows = meta.batched
    tables = rows.block_tables.long()
    real = torch.ones(batch, dtype=torch.bool, device="cuda")
    fast_args = (q, w, keys, (tables, meta.positions, real), indexer.topk, indexer.scale)
    selected = ops.dsa_select(*fast_args)
    q_attn = torch.randn(batch, attn.heads, 576, device="cuda", dtype=dtype)
    times = {
        "select": replay_seconds(ops.dsa_select, *fast_args),
        "select (torch)": replay_seconds(select_batched, indexer, q, w, keys, meta),
        "attend": replay_seconds(ops.dsa_sparse_mla, q_attn, latent, selected, 512, 0.1, 1.0),
        "attend (torch)": replay_seconds(attn._attend_reference, q_attn, latent, selected),
    }
    item = cache_dtype.itemsize
    need = {"select": batch * context * indexer.dim * item, "attend": batch * 2048 * 576 * item}
    for name, seconds in times.items():
        moved = need[name.split()[0]]
        print(
            f"{batch:>4} x {context:>6}  {name:<15} {seconds * 1e6:9.1f} us"
            f"  {moved / seconds / 1e9:8.1f} GB/s"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="1x4096,64x4096,64x32768")
    parser.add_argument("--max-model-len", type=int, default=163840)
    parser.add_argument("--fp8", action="store_true")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    for shape in args.shapes.split(","):
        batch, context = (int(v) for v in shape.split("x"))
        bench(batch, context, args.max_model_len, args.fp8)


if __name__ == "__main__":
    main()
