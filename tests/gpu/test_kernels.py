"""GPU fast paths against the plain-torch reference, on fresh random inputs each time."""

from __future__ import annotations

import math

import pytest
import torch

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.kernels.reference import layers as reference
from tests.gpu.sync import no_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def paged_case(
    query_lens: list[int],
    context_lens: list[int],
    pad_rows: int,
    heads: int,
    kv_heads: int,
    dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: str,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step batch of segments over a randomly filled cache with shuffled block tables."""
    gen = torch.Generator().manual_seed(seed)
    needs = [math.ceil(c / block_size) for c in context_lens]
    num_blocks = sum(needs) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(needs)
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(device)
    segments, positions, slots, row, used = [], [], [], 0, 0
    for q_len, ctx in zip(query_lens, context_lens):
        blocks = perm[used : used + math.ceil(ctx / block_size)]
        used += len(blocks)
        table = torch.tensor(blocks + [0] * (width - len(blocks)), dtype=torch.int32, device=device)
        segments.append(Segment(row, row + q_len, table, ctx))
        for p in range(ctx - q_len, ctx):
            positions.append(p)
            slots.append(blocks[p // block_size] * block_size + p % block_size)
        row += q_len
    positions += [0] * pad_rows
    slots += [-1] * pad_rows
    segments = tuple(segments)
    meta = AttentionMetadata(
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        segments=segments,
        batched=batch_segments(segments, torch.device(device)),
    )
    q = torch.randn(row + pad_rows, heads, dim, generator=gen).to(dtype).to(device)
    return q, k_cache, v_cache, meta


CASES = {
    "decode": ([1] * 7, [1, 15, 16, 17, 100, 333, 1024], 3),
    "prefill": ([37, 1, 64], [37, 50, 200], 0),
    "chunked": ([5, 130], [261, 130], 2),
    # Enough programs that the context is not split: the kernel writes the output directly.
    "wide": ([1] * 160, [1 + (7 * i) % 300 for i in range(160)], 1),
    # A chunk beside decodes: the flat grid of query blocks (triton_attention.FLAT_RATIO).
    "mixed": ([100] + [1] * 20, [300] + [1 + 13 * i for i in range(20)], 2),
}
# Qwen3-MoE's heads at every case and dtype; other GQA groups and head sizes on a few. Each shape
# compiles its own kernels, which is most of this file's run time.
SHAPES = [(32, 4, 128, case, dtype) for case in CASES for dtype in ("bf16", "fp32")] + [
    (8, 8, 64, "decode", "bf16"),
    (8, 8, 64, "chunked", "fp32"),
    (12, 2, 96, "prefill", "bf16"),
    (12, 2, 96, "wide", "bf16"),
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads,kv_heads,dim,case,dtype_name", SHAPES)
def test_paged_attention_matches_reference(heads, kv_heads, dim, case, dtype_name, block_size):
    dtype = DTYPES[dtype_name]
    query_lens, context_lens, pad = CASES[case]
    q, k_cache, v_cache, meta = paged_case(
        query_lens,
        context_lens,
        pad,
        heads,
        kv_heads,
        dim,
        block_size,
        dtype,
        "cuda",
        seed=hash((case, block_size, heads)) % 1000,
    )
    scale = dim**-0.5
    out = ops.paged_attention(q, k_cache, v_cache, meta, scale)
    ref = reference.paged_attention(q.double(), k_cache.double(), v_cache.double(), meta, scale)
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert rel_err(out, ref) < tol
    if pad:
        assert (out[-pad:] == 0).all(), "pad rows must come out zero"


def test_write_kv_skips_pad_rows_without_sync():
    gen = torch.Generator().manual_seed(7)
    cache = torch.randn(9, 16, 4, 128, generator=gen).to(torch.bfloat16).cuda()
    expected = cache.clone()
    values = torch.randn(6, 4, 128, generator=gen).cuda()  # float32 in, cast on write
    slots = torch.tensor([5, 140, -1, 17, -1, 0], device="cuda")
    reference.write_kv(expected, values, slots)
    no_sync(ops.write_kv, cache, values, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_moe_experts_matches_reference(rows):
    gen = torch.Generator().manual_seed(rows)
    experts, hidden, inter, top_k = 16, 256, 96, 4
    x = torch.randn(rows, hidden, generator=gen).bfloat16().cuda()
    gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.05).bfloat16().cuda()
    down = (torch.randn(experts, hidden, inter, generator=gen) * 0.05).bfloat16().cuda()
    logits = torch.randn(rows, experts, generator=gen).cuda()
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    out = no_sync(ops.moe_experts, x, ids, weights, gate_up, down)
    ref = reference.moe_experts(x.double(), ids, weights.double(), gate_up.double(), down.double())
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 2e-2


QWEN3_MOE = (128, 2048, 768, 8)  # experts, hidden, inter, top_k of Qwen3-30B-A3B


def moe_case(
    rows: int,
    experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    seed: int,
    shared: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, ...]:
    """Random x, routing and weights on the GPU. `shared`: every row picks the same experts, so
    each of those experts gets every row (more rows than one tile holds)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    x = randn(rows, hidden)
    gate_up = randn(experts, 2 * inter, hidden, scale=hidden**-0.5)
    down = randn(experts, hidden, inter, scale=inter**-0.5)
    logits = torch.randn(rows, experts, generator=gen, device="cuda")
    if shared:
        logits = logits[:1].expand(rows, experts)
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return x, ids, weights, gate_up, down


def moe_reference(x, ids, weights, gate_up, down) -> torch.Tensor:
    """The reference in float64, on the touched experts only (the full Qwen3 stack in float64
    would be 7 GB). Pairs of id -1 stay -1 (no expert)."""
    hit = ids[ids >= 0].unique()
    local = torch.searchsorted(hit, ids.clamp_min(0)).masked_fill(ids < 0, -1)
    return reference.moe_experts(
        x.double(), local, weights.double(), gate_up[hit].double(), down[hit].double()
    )


TRITON_MOE_CASES = [
    *((*QWEN3_MOE, rows, False) for rows in (1, 2, 3, 8, 16, 33, 64)),
    (*QWEN3_MOE, 64, True),  # 64 rows on each of the same 8 experts: four tiles per expert
    (16, 256, 96, 4, 7, False),
    (8, 144, 80, 2, 5, False),  # hidden not a multiple of the down tile: masked columns
    (8, 144, 80, 2, 40, True),
    (4, 128, 64, 2, 64, False),  # many pairs per expert: taller tiles
]


@pytest.mark.parametrize("experts,hidden,inter,top_k,rows,shared", TRITON_MOE_CASES)
def test_triton_moe_matches_reference(experts, hidden, inter, top_k, rows, shared):
    from afdserve.kernels.moe import decode as triton_moe

    seed = hash((experts, hidden, rows, shared)) % 1000
    case = moe_case(rows, experts, hidden, inter, top_k, seed, shared)
    assert triton_moe.supports(case[0], case[3], case[4])
    out = no_sync(triton_moe.moe_experts, *case)
    ref = moe_reference(*case)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-2


def test_triton_moe_fp16_and_strided_input():
    from afdserve.kernels.moe import decode as triton_moe

    x, ids, weights, gate_up, down = moe_case(6, 16, 256, 96, 4, 11, dtype=torch.float16)
    wide = torch.cat([x, x], dim=1)[:, :256]  # a non-contiguous view of the same rows
    out = no_sync(triton_moe.moe_experts, wide, ids, weights, gate_up, down)
    assert out.dtype == torch.float16
    assert rel_err(out, moe_reference(x, ids, weights, gate_up, down)) < 2e-2


def test_triton_moe_replays_in_cuda_graph():
    """Captured once, replayed on new inputs copied into the captured buffers."""
    from afdserve.kernels.moe import decode as triton_moe

    x, ids, weights, gate_up, down = moe_case(8, 32, 256, 128, 4, 21)
    triton_moe.moe_experts(x, ids, weights, gate_up, down)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_moe.moe_experts(x, ids, weights, gate_up, down)
    for seed in (22, 23):
        new_x, new_ids, new_weights, _, _ = moe_case(8, 32, 256, 128, 4, seed)
        x.copy_(new_x), ids.copy_(new_ids), weights.copy_(new_weights)
        graph.replay()
        assert rel_err(out, moe_reference(x, ids, weights, gate_up, down)) < 2e-2


def test_moe_dispatch_uses_triton_for_few_pairs():
    from afdserve.kernels.moe import decode as triton_moe
    from afdserve.kernels.moe import torch_grouped as moe_gpu

    small = moe_case(triton_moe.MAX_PAIRS // 8, *QWEN3_MOE, seed=31)
    assert torch.equal(no_sync(ops.moe_experts, *small), triton_moe.moe_experts(*small))
    # The two grouped paths sum a row's pairs in different orders: equal up to bf16 rounding.
    large = moe_case(triton_moe.MAX_PAIRS // 8 + 1, *QWEN3_MOE, seed=32)
    assert rel_err(no_sync(ops.moe_experts, *large), moe_gpu.moe_experts(*large)) < 1e-2


@pytest.mark.parametrize("rows,shared", [(1100, False), (1030, True), (2048, False)])
def test_prefill_experts_match_reference(rows, shared):
    """ops' bf16 path past the Triton grouped GEMM (prefill chunks): torch's grouped GEMM with
    the activation and the weighted sum as Triton launches. Against the float64 reference with
    pairs of no expert in every position (a row's first pair, a whole row: exactly zero), the
    same bits every run, no host sync, and replayed in a CUDA graph on new inputs."""
    from afdserve.kernels.moe import grouped as triton_grouped_moe
    from afdserve.kernels.moe import torch_grouped

    case = list(moe_case(rows, *QWEN3_MOE, seed=rows, shared=shared))
    assert case[1].numel() > triton_grouped_moe.GROUPED_MAX_PAIRS
    ids = case[1]
    ids[::3, 0] = -1
    ids[7] = -1
    out = no_sync(ops.moe_experts, *case)
    assert torch.equal(out, torch_grouped.moe_experts(*case))  # what ops dispatched to, again
    assert torch.equal(out[7], torch.zeros_like(out[7]))
    assert rel_err(out, moe_reference(*case)) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.moe_experts(*case)
    for seed in (rows + 1, rows + 2):
        new = moe_case(rows, *QWEN3_MOE, seed=seed, shared=shared)
        for buffer, value in zip(case[:3], new[:3]):
            buffer.copy_(value)
        ids[1::4, 2] = -1
        graph.replay()
        assert rel_err(captured, moe_reference(*case)) < 2e-2


def test_moe_fp32_falls_back_to_reference():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=gen).cuda()
    gate_up = torch.randn(4, 64, 64, generator=gen).cuda() * 0.1
    down = torch.randn(4, 64, 32, generator=gen).cuda() * 0.1
    ids = torch.randint(0, 4, (5, 2), generator=gen).cuda()
    weights = torch.rand(5, 2, generator=gen).cuda()
    out = ops.moe_experts(x, ids, weights, gate_up, down)
    assert torch.allclose(out, reference.moe_experts(x, ids, weights, gate_up, down))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 2048), (64, 2048), (37, 4, 128), (5, 40), (0, 64)])
def test_rms_norm_matches_reference(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(dtype).cuda()
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(dtype).cuda()
    want = reference.rms_norm(x, weight, 1e-6)
    got = no_sync(ops.rms_norm, x, weight, 1e-6)
    assert got.dtype == want.dtype and got.shape == want.shape
    # One rounding of the same float32 value: equal up to the last bit of the output dtype.
    tol = 0 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=1e-5 if tol == 0 else tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows,width", [(1, 2048), (64, 2048), (7, 40), (0, 64)])
def test_add_rms_norm_matches_reference(dtype, rows, width):
    """The residual add fused into the norm: the sum bit-equal to `h + delta`, the norm to one
    rounding of the same value."""
    gen = torch.Generator().manual_seed(rows + width)
    h = (torch.randn(rows, width, generator=gen) * 3).to(dtype).cuda()
    delta = torch.randn(rows, width, generator=gen).to(dtype).cuda()
    weight = (1 + 0.1 * torch.randn(width, generator=gen)).to(dtype).cuda()
    want_x, want_h = reference.add_rms_norm(h, delta, weight, 1e-6)
    got_x, got_h = no_sync(ops.add_rms_norm, h, delta, weight, 1e-6)
    assert torch.equal(got_h, want_h)
    tol = 0 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_x, want_x, rtol=tol, atol=1e-5 if tol == 0 else tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("rows", "heads", "width"), [(1, 16, 256), (64, 32, 128), (7, 1, 2048)])
def test_hybrid_norms_match_reference(dtype, rows, heads, width):
    """The Gated DeltaNet hybrids' norms in one launch: zero-centred over a strided view of
    heads and after the residual add (the sum bit-equal to `h + delta`), and gated by silu(z)."""
    gen = torch.Generator().manual_seed(rows + width)
    both = (torch.randn(rows, heads, 2 * width, generator=gen) * 3).to(dtype).cuda()
    x, z = both[..., :width], both[..., width:]
    weight = (0.1 * torch.randn(width, generator=gen)).to(dtype).cuda()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    got = no_sync(ops.zero_centred_rms_norm, x, weight, 1e-6)
    torch.testing.assert_close(got[0], reference.zero_centred_rms_norm(x, weight, 1e-6), **tol)
    h = x.reshape(rows, heads * width).contiguous()
    delta = torch.randn(h.shape, generator=gen).to(dtype).cuda()
    wide = (0.1 * torch.randn(heads * width, generator=gen)).to(dtype).cuda()
    got_x, got_h = no_sync(ops.zero_centred_rms_norm, h, wide, 1e-6, delta)
    assert torch.equal(got_h, h + delta)
    torch.testing.assert_close(got_x, reference.zero_centred_rms_norm(h + delta, wide, 1e-6), **tol)
    got = no_sync(ops.gated_rms_norm, x, z, weight + 1, 1e-6)
    torch.testing.assert_close(got, reference.gated_rms_norm(x, z, weight + 1, 1e-6), **tol)


def test_rms_norm_strided_rows():
    x = torch.randn(8, 3, 256, device="cuda", dtype=torch.bfloat16)[:, 1]  # row stride 768
    weight = torch.rand(256, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(
        ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), rtol=1e-2, atol=1e-2
    )


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    ("rows", "heads", "dim"), [(1, 32, 128), (64, 4, 128), (9, 16, 64), (5, 1, 8)]
)
def test_rotary_matches_reference(interleave, dtype, rows, heads, dim):
    gen = torch.Generator().manual_seed(rows * heads + dim)
    base = torch.randn(rows, heads, dim + 8, generator=gen).to(dtype).cuda()
    x = base[..., 8:]  # a strided view, as q_pe is after split
    angles = torch.rand(rows, dim // 2, generator=gen).cuda() * 50
    cos, sin = angles.cos(), angles.sin()
    want = reference.rotate(x.double(), cos.double(), sin.double(), interleave)
    got = no_sync(ops.rotate, x, cos, sin, interleave)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("rows,width", [(1, 2048), (64, 2048), (300, 18432)])
@pytest.mark.parametrize("limit", [None, 10.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_swiglu_equals_torch_on_cuda(rows, width, limit, dtype):
    """The shared experts' activation in one launch (ops.swiglu on CUDA, without and with
    DeepSeek-V4's clamps) equals torch's kernels on the same device within one rounding of the
    rows' dtype; graph capturable."""
    gen = torch.Generator().manual_seed(rows + width)
    gate = (torch.randn(rows, width, generator=gen) * 6).to(dtype).cuda()
    up = (torch.randn(rows, width, generator=gen) * 6).to(dtype).cuda()
    got = no_sync(ops.swiglu, gate, up, limit)
    want = reference.swiglu(gate, up, limit)
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(got, want, rtol=ulp, atol=ulp)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.swiglu(gate, up, limit)
    graph.replay()
    assert torch.equal(captured, got)
