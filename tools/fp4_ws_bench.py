"""A warp-specialized FP4 expert GEMM for decode batches (Gluon, sm_90), checked and timed against
the shipped gate/up kernel (kernels/moe/fp4_decode.py) on the same experts' bytes.

The question it answers (issue 43): does moving the e2m1 decode off the `wgmma` warps lift the FP4
experts toward their bytes' time? The shipped kernels decode into registers and feed `wgmma` from
there, and Triton waits on every such dot before the next K step. Here each program (one expert
slot, BM weight rows = output columns, all K) splits into partitions that meet only at mbarriers:
  - the default partition (4 warps) issues async `wgmma`s from shared memory, one in flight;
  - `parts` decode partitions each turn their share of the rows of each K step's packed words
    (shared memory, by TMA) into bf16 weights (shared memory, `wgmma`'s A operand), with the same
    bit moves and packed scale multiply as `fp4_decode._fp4_step`;
  - two 1-warp loaders: TMA of the packed words over a ring, and once per program x's rows
    ([N, H], pre-gathered per expert slot) and the tile's scales (a group-major copy,
    [E * H / 32, R], so that a K step's groups are rows of shared memory).
Its output is the dot alone, acc[slot, n, column] in float32 (no GLU, no routing): what is
measured is the rate at which the weights stream. The shipped kernel is timed on a routing that
touches the same experts with two pairs each (its kernel time in the profiler).

    PYTHONPATH=. python tools/fp4_ws_bench.py [--slots 6,36,200] [--configs "128,8,6,2,4"]

A config is BM, decode warps, word stages, decoded-weight stages, decode partitions.

On one H100 (docs/benchmarks.md, 2026-12-07, twenty-third session) it loses to the shipped kernel:
its best, 4 decode partitions of 2 warps, streams 51% of copy bandwidth at 200 experts against
the shipped kernel's 54%; what bounds it is in that section.
"""

from __future__ import annotations

import argparse
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from afdserve.bench.bytes import measure_copy_bandwidth
from afdserve.kernels.moe import fp4_decode
from afdserve.kernels.moe.fp4_decode import BF16_PAIR, BF16_SHIFT, HIGH_SIGNS, LOW_MAGNITUDES
from afdserve.kernels.reference import fp4
from tools.fp4_moe_bench import replay_seconds

# Gluon's names that changed after Triton 3.6 (the device's): shared memory seen as another
# shape (`_reinterpret` there) and a TMA load (`async_copy_global_to_shared` there).
_REINTERPRET = getattr(
    gl.shared_memory_descriptor,
    "reinterpret",
    getattr(gl.shared_memory_descriptor, "_reinterpret", None),
)
_TMA_LOAD = getattr(tma, "async_load", tma.async_copy_global_to_shared)
# Registers a thread of each decode partition and of each loader (setmaxnreg's steps of 8).
DECODE_REGISTERS = gl.constexpr(152)
LOADER_REGISTERS = gl.constexpr(24)


@gluon.jit
def _bf16x2_mul(bits, factor):
    return gl.inline_asm_elementwise(
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [bits, factor], dtype=gl.int32, is_pure=True, pack=1
    )


@gluon.jit
def _load_words(descs, bufs, bars, at, steps, part):
    """The packed words of each K step, BM rows x KW int32, over a ring of NA stages."""
    # (Every worker takes the same arguments: the tuples `fp4_ws_kernel` packs.)
    row0, w_desc, words, w_ready, w_empty = at[0], descs[0], bufs[0], bars[0], bars[1]
    NA: gl.constexpr = words.type.shape[0]
    KW: gl.constexpr = words.type.shape[2]
    for i in range(steps):
        a = i % NA
        mbarrier.wait(w_empty.index(a), ((i // NA) & 1) ^ 1)
        mbarrier.expect(w_ready.index(a), w_desc.block_type.nbytes)
        _TMA_LOAD(w_desc, [row0, i * KW], w_ready.index(a), words.index(a))


@gluon.jit
def _load_once(descs, bufs, bars, at, steps, part):
    """x's whole [N, H] rows and the tile's scales, group-major [H / 32, BM], once."""
    row0, col0, xrow0, expert = at
    w_desc, x_desc, s_desc = descs
    words, dec, xs, scales = bufs
    x_ready, s_ready = bars[4], bars[5]
    STEPS: gl.constexpr = xs.type.shape[0]
    KB: gl.constexpr = xs.type.shape[2]
    mbarrier.expect(s_ready, s_desc.block_type.nbytes)
    groups = expert * STEPS * (KB // 32)
    _TMA_LOAD(s_desc, [groups, col0], s_ready, scales)
    mbarrier.expect(x_ready, STEPS * x_desc.block_type.nbytes)
    for i in gl.static_range(STEPS):
        _TMA_LOAD(x_desc, [xrow0, i * KB], x_ready, xs.index(i))


@gluon.jit
def _decode(descs, bufs, bars, at, steps, part):
    """Partition part[0] of part[1]: its rows of each K step, packed words to bf16 weights."""
    words, dec, xs, scales = bufs
    w_ready, w_empty, d_ready, d_empty, x_ready, s_ready = bars
    NA: gl.constexpr = words.type.shape[0]
    NB: gl.constexpr = dec.type.shape[0]
    PARTS: gl.constexpr = part[1]
    ROWS: gl.constexpr = words.type.shape[1] // PARTS
    R0: gl.constexpr = part[0] * ROWS
    KW: gl.constexpr = words.type.shape[2]  # int32 words a K step, 8 inputs each
    KB: gl.constexpr = KW * 8
    G: gl.constexpr = KW // 4  # scale groups a K step, 32 inputs each
    W: gl.constexpr = gl.num_warps()
    # A thread takes one row's group at a time: 4 words, 32 weights.
    L2: gl.constexpr = gl.BlockedLayout([1, 4], [32 // G, G], [W, 1], [1, 0])
    L3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32 // G, G, 1], [W, 1, 1], [2, 1, 0])
    LS: gl.constexpr = gl.SliceLayout(2, L3)
    LT: gl.constexpr = gl.BlockedLayout([1, 1], [G, 32 // G], [1, W], [0, 1])
    plain: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
    # Step i's scales are groups G i .. G i + G - 1: rows of the group-major copy.
    by_step = _REINTERPRET(scales, gl.uint8, [scales.type.shape[0] // G, G, ROWS * PARTS], plain)
    mbarrier.wait(s_ready, 0)
    for i in range(steps):
        a = i % NA
        mbarrier.wait(w_ready.index(a), (i // NA) & 1)
        w = words.index(a).slice(R0, ROWS).load(L2)
        # The read ordered before the next TMA write of this stage: without this fence the
        # loader's TMA overwrote words still being read (wrong sums on an H100).
        fence_async_shared()
        mbarrier.arrive(w_empty.index(a), count=1)
        scale = by_step.index(i).slice(R0, ROWS, 1).load(LT)
        scale = gl.convert_layout(gl.permute(scale, (1, 0)), LS).to(gl.int32)
        w = gl.convert_layout(gl.reshape(w, [ROWS, G, 4]), L3)
        low = (w & LOW_MAGNITUDES) | ((w << 6) & ~LOW_MAGNITUDES)
        high = (w & HIGH_SIGNS) | ((w >> 6) & ~HIGH_SIGNS)
        f = (scale + (126 - BF16_SHIFT)) << 7
        f = gl.expand_dims(f | (f << 16), 2)
        b0 = _bf16x2_mul((low << 6) & BF16_PAIR, f)  # inputs 8j + 0 and 8j + 4
        b1 = _bf16x2_mul((low << 2) & BF16_PAIR, f)  # 8j + 1, 8j + 5
        b2 = _bf16x2_mul((high << 4) & BF16_PAIR, f)  # 8j + 2, 8j + 6
        b3 = _bf16x2_mul(high & BF16_PAIR, f)  # 8j + 3, 8j + 7
        v = gl.join(gl.join(b0, b2), gl.join(b1, b3))  # [..., c, d]: b_(2c + d)
        v = gl.reshape(v, [ROWS, G, 4, 4])  # [row, group, word, i]
        u = gl.join(v.to(gl.int16), (v >> 16).to(gl.int16))  # [..., i, h]: input 8j + i + 4h
        u = gl.reshape(gl.permute(u, [0, 1, 2, 4, 3]), [ROWS, KB]).to(gl.bfloat16, bitcast=True)
        b = i % NB
        mbarrier.wait(d_empty.index(b), ((i // NB) & 1) ^ 1)
        dec.index(b).slice(R0, ROWS).store(u)
        fence_async_shared()  # the weights visible to wgmma (the async proxy)
        mbarrier.arrive(d_ready.index(b), count=1)


@gluon.jit
def _mma(bufs, bars, steps, out_ptr, slot, col0, out_row, N: gl.constexpr, num_warps: gl.constexpr):
    """acc^T += W x^T a K step at a time, one wgmma group in flight; then acc to out."""
    words, dec, xs, scales = bufs
    w_ready, w_empty, d_ready, d_empty, x_ready, s_ready = bars
    NB: gl.constexpr = dec.type.shape[0]
    BM: gl.constexpr = dec.type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, N, 16]
    )
    acc = gl.zeros((BM, N), dtype=gl.float32, layout=layout)
    mbarrier.wait(x_ready, 0)
    for i in range(steps):
        b = i % NB
        mbarrier.wait(d_ready.index(b), (i // NB) & 1)
        acc = warpgroup_mma(dec.index(b), xs.index(i).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        # The previous step's dot is done: its stage is free.
        mbarrier.arrive(d_empty.index((i + NB - 1) % NB), count=1, pred=i > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    m = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    n = gl.arange(0, N, layout=gl.SliceLayout(0, layout))
    out = out_ptr + (slot * N + n)[None, :].to(gl.int64) * out_row + (col0 + m)[:, None]
    gl.store(out, acc * (1 << BF16_SHIFT))


@gluon.jit
def fp4_ws_kernel(
    w_desc,
    x_desc,
    s_desc,
    slot_expert_ptr,
    out_ptr,
    rows_per_expert,
    out_row,
    HIDDEN: gl.constexpr,
    NA: gl.constexpr,
    NB: gl.constexpr,
    DECODE_WARPS: gl.constexpr,
    PARTS: gl.constexpr,
    num_warps: gl.constexpr,
):
    BM: gl.constexpr = w_desc.block_type.shape[0]
    KW: gl.constexpr = w_desc.block_type.shape[1]
    N: gl.constexpr = x_desc.block_type.shape[0]
    KB: gl.constexpr = x_desc.block_type.shape[1]
    gl.static_assert(KB == KW * 8)
    STEPS: gl.constexpr = HIDDEN // KB
    col0 = gl.program_id(0) * BM
    slot = gl.program_id(1)
    expert = gl.load(slot_expert_ptr + slot)
    row0 = expert * rows_per_expert + col0
    xrow0 = slot * N

    words = gl.allocate_shared_memory(gl.int32, [NA, BM, KW], w_desc.layout)
    dec_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, KB], gl.bfloat16)
    dec = gl.allocate_shared_memory(gl.bfloat16, [NB, BM, KB], dec_layout)
    xs = gl.allocate_shared_memory(gl.bfloat16, [STEPS, N, KB], x_desc.layout)
    scales = gl.allocate_shared_memory(gl.uint8, [HIDDEN // 32, BM], s_desc.layout)
    w_ready = gl.allocate_shared_memory(gl.int64, [NA, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [NA, 1], mbarrier.MBarrierLayout())
    d_ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    d_empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
    x_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    s_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(x_ready, count=1)
    mbarrier.init(s_ready, count=1)
    for j in gl.static_range(NA):
        mbarrier.init(w_ready.index(j), count=1)
        mbarrier.init(w_empty.index(j), count=PARTS)  # every decode partition read it
    for j in gl.static_range(NB):
        mbarrier.init(d_ready.index(j), count=PARTS)  # every decode partition wrote it
        mbarrier.init(d_empty.index(j), count=1)

    descs = (w_desc, x_desc, s_desc)
    bufs = (words, dec, xs, scales)
    bars = (w_ready, w_empty, d_ready, d_empty, x_ready, s_ready)
    at = (row0, col0, xrow0, expert)
    # The partitions are listed out: a jitted function takes no list built at trace time.
    if PARTS == 1:
        gl.warp_specialize(
            [
                (_mma, (bufs, bars, STEPS, out_ptr, slot, col0, out_row, N, num_warps)),
                (_decode, (descs, bufs, bars, at, STEPS, (0, 1))),
                (_load_words, (descs, bufs, bars, at, STEPS, (0, 1))),
                (_load_once, (descs, bufs, bars, at, STEPS, (0, 1))),
            ],
            [DECODE_WARPS, 1, 1],
            [DECODE_REGISTERS, LOADER_REGISTERS, LOADER_REGISTERS],
        )
    elif PARTS == 2:
        gl.warp_specialize(
            [
                (_mma, (bufs, bars, STEPS, out_ptr, slot, col0, out_row, N, num_warps)),
                (_decode, (descs, bufs, bars, at, STEPS, (0, 2))),
                (_decode, (descs, bufs, bars, at, STEPS, (1, 2))),
                (_load_words, (descs, bufs, bars, at, STEPS, (0, 1))),
                (_load_once, (descs, bufs, bars, at, STEPS, (0, 1))),
            ],
            [DECODE_WARPS // 2, DECODE_WARPS // 2, 1, 1],
            [DECODE_REGISTERS, DECODE_REGISTERS, LOADER_REGISTERS, LOADER_REGISTERS],
        )
    else:
        gl.static_assert(PARTS == 4, "1, 2 or 4 decode partitions")
        gl.warp_specialize(
            [
                (_mma, (bufs, bars, STEPS, out_ptr, slot, col0, out_row, N, num_warps)),
                (_decode, (descs, bufs, bars, at, STEPS, (0, 4))),
                (_decode, (descs, bufs, bars, at, STEPS, (1, 4))),
                (_decode, (descs, bufs, bars, at, STEPS, (2, 4))),
                (_decode, (descs, bufs, bars, at, STEPS, (3, 4))),
                (_load_words, (descs, bufs, bars, at, STEPS, (0, 1))),
                (_load_once, (descs, bufs, bars, at, STEPS, (0, 1))),
            ],
            [DECODE_WARPS // 4] * 4 + [1, 1],
            [DECODE_REGISTERS] * 4 + [LOADER_REGISTERS] * 2,
        )


class Config(tuple):
    """(BM, decode warps, word stages, decoded stages, decode partitions)."""

    @classmethod
    def parse(cls, text: str) -> Config:
        values = [int(v) for v in text.split(",")]
        if len(values) != 5:
            raise ValueError(
                f"config {text!r}: wanted 5 integers, BM, decode warps, word stages, decoded "
                "stages and decode partitions (1, 2 or 4), e.g. '128,8,6,2,4'"
            )
        return cls(values)


# What the tool times unless told otherwise (and what its compile test builds).
DEFAULT_CONFIGS = "128,8,6,2,4;128,8,4,2,2;128,8,4,2,1"


def parse_configs(text: str) -> list[Config]:
    """';'-separated configs."""
    return [Config.parse(c) for c in text.split(";") if c]


def launch_options(config: Config, hidden: int) -> dict:
    """`fp4_ws_kernel`'s constexprs and launch options for a config at reduction dim `hidden`."""
    rows, decode_warps, word_stages, decoded_stages, parts = config
    return {
        "HIDDEN": hidden,
        "NA": word_stages,
        "NB": decoded_stages,
        "DECODE_WARPS": decode_warps,
        "PARTS": parts,
        "num_warps": 4,  # the default partition: one warpgroup issuing the wgmmas
        "maxnreg": 128,  # 16 warps an SM at 128 registers; the partitions then reallocate
    }


def descriptors(words2d, x2d, scales_t2d, rows: int, k_block: int, n: int):
    """TMA descriptors: words2d [E * R, H / 8] int32, x2d [S * N, H] bf16, scales_t2d
    [E * H / 32, R] uint8 (group-major)."""
    w_layout = gl.NVMMASharedLayout.get_default_for([rows, k_block // 8], gl.int32)
    x_layout = gl.NVMMASharedLayout.get_default_for([n, k_block], gl.bfloat16)
    s_layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    return (
        TensorDescriptor.from_tensor(words2d, [rows, k_block // 8], w_layout),
        TensorDescriptor.from_tensor(x2d, [n, k_block], x_layout),
        TensorDescriptor.from_tensor(scales_t2d, [x2d.shape[1] // 32, rows], s_layout),
    )


def fp4_ws(packed, scales_t, x_slots, slot_expert, config: Config, k_block: int = 128):
    """packed [E, R, H / 2] uint8, scales_t [E, H / 32, R] uint8, x_slots [S, N, H] bf16,
    slot_expert [S] int32 -> [S, N, R] float32: x_slots[s] @ W[slot_expert[s]]^T."""
    rows = config[0]
    experts, width, half = packed.shape
    hidden = 2 * half
    slots, n, _ = x_slots.shape
    w_desc, x_desc, s_desc = descriptors(
        packed.view(torch.int32).reshape(experts * width, hidden // 8),
        x_slots.reshape(slots * n, hidden),
        scales_t.reshape(experts * hidden // 32, width),
        rows,
        k_block,
        n,
    )
    out = torch.empty(slots, n, width, dtype=torch.float32, device=x_slots.device)
    fp4_ws_kernel[(width // rows, slots)](
        w_desc, x_desc, s_desc, slot_expert, out, width, width, **launch_options(config, hidden)
    )
    return out


def kernel_seconds(fn, name: str, repeats: int = 10) -> float:
    """GPU time a call of the kernels whose name holds `name` (the profiler's sum)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    total = sum(e.device_time_total for e in prof.key_averages() if name in e.key)
    return total / repeats / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", default="6,36,200", help="experts touched, one slot each")
    p.add_argument("--rows", type=int, default=8, choices=(8, 16), help="x rows a slot (wgmma's N)")
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="';'-separated configs (Config)")
    args = p.parse_args()
    hidden, width, experts = 4096, 4096, 256  # V4-Flash's gate and up rows, 256 experts
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    packed = torch.randint(0, 256, (experts, width, hidden // 2), dtype=torch.uint8, device=dev,
                           generator=gen)  # fmt: skip
    scales = torch.randint(119, 124, (experts, width, hidden // 32), dtype=torch.uint8,
                           device=dev, generator=gen)  # fmt: skip
    scales_t = scales.transpose(1, 2).contiguous()
    # The down projection the shipped launch also runs (its own kernel, not timed here).
    down = (
        packed[:, :hidden, : width // 4].contiguous(),
        scales[:, :hidden, : width // 64].contiguous(),
    )
    copy = measure_copy_bandwidth(dev)
    name = torch.cuda.get_device_name()
    print(f"{name}, copy bandwidth {copy:.0f} GB/s, Triton {triton.__version__}")
    configs = parse_configs(args.configs)
    for slots in (int(s) for s in args.slots.split(",")):
        slot_expert = torch.randperm(experts, device=dev, generator=gen)[:slots].to(torch.int32)
        nbytes = slots * width * (hidden // 2 + hidden // 32)
        ids = torch.stack([slot_expert, slot_expert.roll(1)], 1).long()  # two pairs an expert
        x = torch.randn(slots, hidden, device=dev, generator=gen).bfloat16()
        weights = torch.rand(slots, 2, device=dev, generator=gen)
        shipped_call = functools.partial(
            fp4_decode.moe_experts, x, ids, weights, (packed, scales), down, 10.0
        )
        shipped = kernel_seconds(shipped_call, "_gate_up_kernel")
        print(f"{slots} experts, {nbytes / 1e6:.0f} MB: shipped gate/up {shipped * 1e6:.1f} us, "
              f"{nbytes / shipped / 1e9 / copy:.1%} of copy bandwidth")  # fmt: skip
        x_slots = torch.randn(slots, args.rows, hidden, device=dev, generator=gen).bfloat16()
        for config in configs:
            out = fp4_ws(packed, scales_t, x_slots, slot_expert, config)
            worst = 0.0
            for s in range(min(slots, 6)):
                e = int(slot_expert[s])
                weight = fp4.dequantize_fp4(packed[e], scales[e], torch.float32)
                ref = x_slots[s].float() @ weight.T
                worst = max(worst, float(((out[s] - ref).abs() / (ref.abs() + 1.0)).max()))
            t = replay_seconds(fp4_ws, packed, scales_t, x_slots, slot_expert, config)
            print(f"  BM, decode warps, stages, parts {tuple(config)}: {t * 1e6:.1f} us, "
                  f"{nbytes / t / 1e9 / copy:.1%} of copy, {shipped / t:.2f}x shipped, "
                  f"largest error {worst:.1e} (of |ref| + 1)")  # fmt: skip


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    main()
