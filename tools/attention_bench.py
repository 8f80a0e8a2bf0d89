"""Time paged decode attention (kernels/triton/attention.py through `ops.paged_attention`) over a
bf16 and an FP8 (float8_e4m3fn) KV cache at Qwen3-30B-A3B's heads (32 query heads, 4 KV heads,
head dim 128, cache block 16), one query row per sequence, on CUDA.

For each (batch, context): the median of CUDA-graph replays of one layer's attention (its split
combine included), the K+V bytes the cache holds for the batch (FP8: one byte per element) and
the GB/s that makes, beside the device's copy bandwidth (bench/bytes.py), and FP8's speedup over
bf16. Each config is also checked against the reference over the same cache (relative error),
and one that fails (to compile, launch or match) is reported and skipped. About a minute.

    PYTHONPATH=. python tools/attention_bench.py [--shapes 1x1024,8x8192,64x1024,64x8192,128x8192]

--sweep also times, per shape and cache, a small grid of launch constants
(`triton_attention.Launch`: context tokens per tile, warps, pipeline stages, programs per SM,
register cap) and prints the fastest per shape (each compiles once: about two more minutes).

    PYTHONPATH=. python tools/attention_bench.py --sweep

--prefill SxL,... times prefill instead: S sequences of L new tokens each over a bf16 cache
(causal), by TFLOP/s (4 x head dim FLOPs per query head and visible key) against the device's
measured bf16 matmul rate; with --sweep, over a grid that adds the query rows a program takes.

    PYTHONPATH=. python tools/attention_bench.py --prefill 8x1024,2x4096 --sweep

--mixed L+DxC,... times a mixed step's attention (a chunk of L new tokens beside D decodes at
context C) on the flat grid of query blocks and on a grid of segments (`FLAT_RATIO`).

    PYTHONPATH=. python tools/attention_bench.py --mixed 1024+63x1024,512+255x4096
"""

from __future__ import annotations

import argparse

import torch
from fp4_moe_bench import replay_seconds  # tools/, on sys.path as this script's folder

from afdserve.bench.bytes import measure_copy_bandwidth
from afdserve.bench.flops import measure_matmul_tflops
from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.kernels.reference import layers as reference
from afdserve.kernels.triton import attention as triton_attention
from afdserve.kernels.triton.attention import Launch

HEADS, KV_HEADS, DIM, BLOCK = 32, 4, 128, 16
SHAPES = "1x1024,8x8192,64x1024,64x8192,128x8192"
FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.05, 0.03  # not 1.0, so the scales' folding is exercised


def decode_case(batch: int, ctx: int, gen: torch.Generator):
    """q [batch, heads, dim] bf16, bf16 and FP8 caches of batch * ctx tokens in shuffled blocks,
    and the decode step's metadata (each sequence `ctx` long, its last token the query)."""
    per_seq = -(-ctx // BLOCK)
    blocks = batch * per_seq
    shape = (blocks, BLOCK, KV_HEADS, DIM)
    k = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    v = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    perm = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32)
    tables = perm.view(batch, per_seq)
    segments = tuple(Segment(i, i + 1, tables[i], ctx) for i in range(batch))
    meta = AttentionMetadata(
        positions=torch.full((batch,), ctx - 1, dtype=torch.int64, device="cuda"),
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"),
        segments=segments,
        batched=batch_segments(segments, torch.device("cuda")),
    )
    q = torch.randn(batch, HEADS, DIM, device="cuda", generator=gen).bfloat16()
    k8, v8 = reference.quantize_kv(k, FP8, K_SCALE), reference.quantize_kv(v, FP8, V_SCALE)
    return q, (k, v), (k8, v8), meta


def prefill_case(seqs: int, length: int, gen: torch.Generator):
    """q [seqs * length, heads, dim] bf16, a bf16 cache of the same tokens in shuffled blocks,
    and a prefill step's metadata (each sequence's `length` tokens all new)."""
    per_seq = -(-length // BLOCK)
    blocks = seqs * per_seq
    shape = (blocks, BLOCK, KV_HEADS, DIM)
    k = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    v = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    tables = torch.randperm(blocks, device="cuda", generator=gen).to(torch.int32).view(seqs, -1)
    segments = tuple(Segment(i * length, (i + 1) * length, tables[i], length) for i in range(seqs))
    rows = seqs * length
    meta = AttentionMetadata(
        positions=torch.arange(length, device="cuda").repeat(seqs),
        slot_mapping=torch.zeros(rows, dtype=torch.int64, device="cuda"),
        segments=segments,
        batched=batch_segments(segments, torch.device("cuda")),
    )
    q = torch.randn(rows, HEADS, DIM, device="cuda", generator=gen).bfloat16()
    return q, (k, v), meta


def mixed_case(length: int, decodes: int, ctx: int, gen: torch.Generator):
    """q, a bf16 cache in shuffled blocks and the metadata of a mixed step: one sequence's chunk
    of `length` new tokens (its whole context), then `decodes` sequences of one row each at
    context `ctx`."""
    lens = [length] + [ctx] * decodes
    per_seq = [-(-n // BLOCK) for n in lens]
    shape = (sum(per_seq), BLOCK, KV_HEADS, DIM)
    k = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    v = torch.randn(shape, device="cuda", generator=gen).bfloat16()
    perm = torch.randperm(shape[0], device="cuda", generator=gen).to(torch.int32)
    width, used, row, segments = max(per_seq), 0, 0, []
    for i, (n, blocks) in enumerate(zip(lens, per_seq, strict=True)):
        table = torch.zeros(width, dtype=torch.int32, device="cuda")
        table[:blocks] = perm[used : used + blocks]
        used += blocks
        q_len = length if i == 0 else 1
        segments.append(Segment(row, row + q_len, table, n))
        row += q_len
    positions = torch.cat(
        [torch.arange(length), torch.full((decodes,), ctx - 1, dtype=torch.int64)]
    ).cuda()
    meta = AttentionMetadata(
        positions=positions,
        slot_mapping=torch.zeros(row, dtype=torch.int64, device="cuda"),
        segments=tuple(segments),
        batched=batch_segments(tuple(segments), torch.device("cuda")),
    )
    q = torch.randn(row, HEADS, DIM, device="cuda", generator=gen).bfloat16()
    return q, (k, v), meta


def bench_mixed(length: int, decodes: int, ctx: int, gen) -> None:
    """One mixed step's attention on the flat grid (`FLAT_RATIO`, shipped) and on a segment's
    grid (FLAT_RATIO 0), each checked against the reference."""
    q, (k, v), meta = mixed_case(length, decodes, ctx, gen)
    ref = reference.paged_attention(q.float(), k.float(), v.float(), meta, DIM**-0.5)
    shipped = triton_attention.FLAT_RATIO

    def run() -> torch.Tensor:
        return ops.paged_attention(q, k, v, meta, DIM**-0.5)

    try:
        for ratio, label in ((shipped, "flat grid (shipped)"), (0, "a segment's grid")):
            triton_attention.FLAT_RATIO = ratio
            err = rel_err(run(), ref)
            if not err < 2e-2:
                raise RuntimeError(f"{label}: relative error {err:.2e} against the reference")
            t = replay_seconds(run)
            row = f"{length:6d} + {decodes:4d} x {ctx:6d}  {t * 1e6:9.1f} us {err:9.1e}"
            print(f"{row}  {label}")
    finally:
        triton_attention.FLAT_RATIO = shipped


def prefill_grid() -> list[Launch]:
    """Context tiles of 32-128 tokens over 4 or 8 warps and 2-4 stages, at 64 and 128 query rows
    a program (the shipped launch is the "shipped" row before them)."""
    grid = []
    for rows in (64, 128):
        for block_n, warps, stages in (
            (64, 4, 3),
            (128, 4, 3),
            (64, 8, 3),
            (128, 8, 3),
            (32, 4, 3),
            (64, 8, 2),
            (128, 8, 2),
            (64, 4, 2),
            (64, 8, 4),
        ):
            grid.append(Launch(block_n, warps, stages, prefill_rows=rows))
    return grid


def bench_prefill(seqs: int, length: int, peak: float, sweep: bool, gen, best: dict) -> None:
    q, (k, v), meta = prefill_case(seqs, length, gen)
    flops = 4 * DIM * HEADS * seqs * length * (length + 1) / 2
    one = AttentionMetadata(meta.positions[:length], meta.slot_mapping[:length], meta.segments[:1])
    ref = reference.paged_attention(q[:length].float(), k.float(), v.float(), one, DIM**-0.5)
    for launch in [None, *(prefill_grid() if sweep else [])]:

        def run(launch=launch) -> torch.Tensor:
            if launch is None:
                return ops.paged_attention(q, k, v, meta, DIM**-0.5)
            return triton_attention.paged_attention(q, k, v, meta, DIM**-0.5, launch=launch)

        label = "shipped" if launch is None else str(launch)
        try:
            err = rel_err(run()[:length], ref)
            if not err < 2e-2:
                raise RuntimeError(f"relative error {err:.2e} against the reference")
            t = replay_seconds(run)
        except Exception as e:  # a launch the device cannot run: reported, skipped
            msg = str(e).splitlines()[0][:90] if str(e) else ""
            print(f"{seqs:5d} {length:6d}  {label}: failed, {type(e).__name__}: {msg}")
            continue
        tflops = flops / t / 1e12
        row = f"{seqs:5d} {length:6d} {t * 1e6:9.1f} {tflops:7.1f} {tflops / peak:7.1%}"
        print(f"{row} {err:9.1e}  {label}")
        key = (seqs, length, "prefill")
        if launch is not None and (key not in best or t < best[key][0]):
            best[key] = (t, launch)
    bench_flash(q, k, v, meta, seqs, length, flops, peak, ref)


def bench_flash(q, k, v, meta, seqs: int, length: int, flops: float, peak: float, ref) -> None:
    """torch's own FlashAttention-2 varlen kernel over the same step, k and v gathered out of
    the pages into contiguous rows first (not timed): the yardstick for a prefill of no cached
    prefix. On an H100 it lost to the paged kernel at 8 x 1024 and won by 8% at 2 x 4096; in
    the engine's 8192-token step it took 16.3 ms against 14.2 (docs/benchmarks.md, 2026-12-07),
    so the engine does not call it."""
    slots = torch.cat(
        [
            (seg.block_table[:, None] * BLOCK + torch.arange(BLOCK, device="cuda")).view(-1)[
                :length
            ]
            for seg in meta.segments
        ]
    )
    kc, vc = k.view(-1, KV_HEADS, DIM)[slots], v.view(-1, KV_HEADS, DIM)[slots]
    cu = torch.arange(0, (seqs + 1) * length, length, dtype=torch.int32, device="cuda")

    def run() -> torch.Tensor:
        return torch.ops.aten._flash_attention_forward(
            q, kc, vc, cu, cu, length, length, 0.0, True, False, scale=DIM**-0.5
        )[0]

    try:
        err = rel_err(run()[:length], ref)
        t = replay_seconds(run)
    except Exception as e:  # no flash kernel in this build, or it refuses the shape
        print(f"{seqs:5d} {length:6d}  torch flash varlen: failed, {type(e).__name__}: {e}"[:200])
        return
    tflops = flops / t / 1e12
    row = f"{seqs:5d} {length:6d} {t * 1e6:9.1f} {tflops:7.1f} {tflops / peak:7.1%}"
    print(f"{row} {err:9.1e}  torch flash varlen (contiguous k, v)")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))


def reference_out(q, k, v, meta, scales) -> torch.Tensor:
    """The reference over the first 8 sequences (float32; the whole batch would take longer
    than the timing)."""
    n = min(8, q.shape[0])
    if k.dtype == FP8:
        k, v = k.float() * scales[0], v.float() * scales[1]
    segs = meta.segments[:n]
    sub = AttentionMetadata(meta.positions[:n], meta.slot_mapping[:n], segs)
    return reference.paged_attention(q[:n].float(), k.float(), v.float(), sub, DIM**-0.5)


def time_one(q, k, v, meta, scales, launch: Launch | None) -> tuple[float, float]:
    """(seconds, relative error over the first sequences) of one cache at one launch."""

    def run() -> torch.Tensor:
        if launch is None:
            return ops.paged_attention(q, k, v, meta, DIM**-0.5, *scales)
        return triton_attention.paged_attention(q, k, v, meta, DIM**-0.5, *scales, launch)

    out = run()
    ref = reference_out(q, k, v, meta, scales)
    err = rel_err(out[: ref.shape[0]], ref)
    if not err < 2e-2:
        raise RuntimeError(f"relative error {err:.2e} against the reference")
    return replay_seconds(run), err


def sweep_grid() -> list[Launch]:
    """10 launches, the shipped two first: 64-token tiles at 4-6 stages (5 and up are where
    Triton keeps a program's next tile in flight during its compute), the 128-register cap or
    none, 2 or 3 programs per SM planned; 8 warps; 32-token tiles 3 and 5 tiles deep; 128-token
    tiles over 8 warps."""
    return [
        triton_attention.DEFAULT_LAUNCH,
        triton_attention.FP8_DECODE_LAUNCH,
        Launch(64, 4, 5, 2),
        Launch(64, 4, 5, 3),
        Launch(64, 4, 4, 2, 128),
        Launch(64, 4, 6, 2, 128),
        Launch(64, 8, 5, 2),
        Launch(32, 4, 5, 2, 128),
        Launch(32, 4, 7, 2, 128),
        Launch(128, 8, 5, 2),
    ]


def bench_shape(batch: int, ctx: int, copy: float, sweep: bool, gen, best: dict) -> None:
    """Print one (batch, context)'s rows: the shipped launch of each cache, then the grid's."""
    q, bf16, fp8, meta = decode_case(batch, ctx, gen)
    elements = 2 * batch * ctx * KV_HEADS * DIM
    shipped: dict[str, float] = {}
    caches = (("bf16", bf16, (1.0, 1.0), 2), ("fp8", fp8, (K_SCALE, V_SCALE), 1))
    for name, (k, v), scales, size in caches:
        for launch in [None, *(sweep_grid() if sweep else [])]:
            label = name if launch is None else f"{name} {launch}"
            try:
                t, err = time_one(q, k, v, meta, scales, launch)
            except Exception as e:  # a launch the device cannot run: reported, skipped
                msg = str(e).splitlines()[0][:90] if str(e) else ""
                print(f"{batch:5d} {ctx:6d}  {label}: failed, {type(e).__name__}: {msg}")
                continue
            gbps = elements * size / t / 1e9
            row = f"{batch:5d} {ctx:6d}  {name:5s} {t * 1e6:8.1f} {gbps:7.0f} {gbps / copy:8.1%}"
            if launch is None:
                shipped[name] = t
                faster = shipped["bf16"] / t if name == "fp8" and "bf16" in shipped else None
                print(f"{row} {err:9.1e}" + (f"  {faster:10.2f}x" if faster else ""))
            else:
                print(f"{row} {err:9.1e}  {launch}")
                key = (batch, ctx, name)
                if key not in best or t < best[key][0]:
                    best[key] = (t, launch)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=SHAPES, help="batch x context, comma separated")
    p.add_argument("--sweep", action="store_true", help="also time a grid of launch constants")
    p.add_argument("--prefill", help="sequences x new tokens, comma separated: prefill instead")
    p.add_argument(
        "--mixed",
        help="L+DxC, comma separated: a chunk of L new tokens beside D decodes at context C, "
        "on the flat grid and on a segment's",
    )
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    best: dict[tuple[int, int, str], tuple[float, Launch]] = {}
    if args.mixed:
        print(f"paged attention of mixed steps, {HEADS} q heads, {KV_HEADS} KV heads, dim {DIM}")
        for case in args.mixed.split(","):
            length, rest = case.split("+")
            decodes, ctx = rest.split("x")
            bench_mixed(int(length), int(decodes), int(ctx), gen)
            torch.cuda.empty_cache()
        return
    if args.prefill:
        peak = measure_matmul_tflops(torch.device("cuda"))
        print(f"paged prefill attention, causal, {HEADS} q heads, {KV_HEADS} KV heads, dim {DIM}")
        print(f"device bf16 matmul rate {peak:.0f} TFLOP/s")
        print(" seqs length        us  TFLOP/s of_peak   rel_err  launch")
        for seqs, length in (tuple(int(n) for n in s.split("x")) for s in args.prefill.split(",")):
            bench_prefill(seqs, length, peak, args.sweep, gen, best)
            torch.cuda.empty_cache()
        for (seqs, length, _), (t, launch) in best.items():
            print(f"fastest: {seqs} x {length} {t * 1e6:8.1f} us  {launch}")
        return
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    copy = measure_copy_bandwidth(torch.device("cuda"))
    print(
        f"paged decode attention, {HEADS} q heads, {KV_HEADS} KV heads, dim {DIM}, block "
        f"{BLOCK}; device copy bandwidth {copy:.0f} GB/s"
    )
    print("batch    ctx  cache      us    GB/s  of_copy   rel_err  fp8_speedup / launch")
    for batch, ctx in shapes:
        try:
            bench_shape(batch, ctx, copy, args.sweep, gen, best)
        except Exception as e:  # e.g. out of memory setting it up: reported, skipped
            print(f"{batch:5d} {ctx:6d}  failed, {type(e).__name__}: {str(e)[:90]}")
        torch.cuda.empty_cache()
    if best:
        print("fastest launch per shape and cache:")
        for (batch, ctx, name), (t, launch) in best.items():
            print(f"  {batch:4d} x {ctx:5d} {name:5s} {t * 1e6:8.1f} us  {launch}")


if __name__ == "__main__":
    main()
