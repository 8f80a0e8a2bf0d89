"""The fused GQA prologue (q/k norm, rotary, paged k/v write) against the reference composition it
replaces: q and both whole caches, so a stray write anywhere (a pad row's, say) shows up."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from afdserve.kernels.metadata import QKVLayout
from afdserve.kernels.reference import layers as reference
from tests.gpu.sync import no_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
EPS = 1e-6
BLOCK_SIZE = 16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def qkv_case(
    rows: int, heads: int, kv_heads: int, dim: int, dtype: torch.dtype, norm: bool, seed: int
) -> dict:
    """Random inputs of prepare_qkv: qkv a column slice of a wider tensor (strided rows), Qwen3's
    rotary frequencies at random positions, shuffled slots with every third row a pad row."""
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * dim
    wide = (torch.randn(rows, width + 48, generator=gen) * 2).to(dtype).to(DEVICE)
    weights = [(1 + 0.2 * torch.randn(dim, generator=gen)).to(dtype).to(DEVICE) for _ in "qk"]
    inv_freq = 1e6 ** (-torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.randint(0, 32768, (rows,), generator=gen).float()[:, None] * inv_freq
    num_blocks = rows // BLOCK_SIZE + 4
    cache_shape = (num_blocks, BLOCK_SIZE, kv_heads, dim)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:rows]
    slots[::3] = -1
    norms = (weights[0], weights[1]) if norm else (None, None)
    return dict(
        qkv=wide[:, 16 : 16 + width],
        layout=QKVLayout(heads, kv_heads, dim, *norms, EPS, interleave=False),
        cos=angles.cos().to(DEVICE),
        sin=angles.sin().to(DEVICE),
        k_cache=torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE),
        v_cache=torch.randn(cache_shape, generator=gen).to(dtype).to(DEVICE),
        slot_mapping=slots.to(DEVICE),
    )


def assert_same(got: torch.Tensor, want: torch.Tensor, exact: bool) -> None:
    """Bit-equal when exact. Otherwise (q/k norm on: the reference's mean and rsqrt may differ
    from the kernel's in the last float32 bits) within 8 ulps of each head's largest value, and in
    bf16 or fp16 only rare elements may differ at all: the rounding points themselves must match."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if exact or got.numel() == 0:
        assert torch.equal(got, want)
        return
    ulp = torch.finfo(got.dtype).eps
    scale = want.double().abs().amax(-1, keepdim=True).clamp_min(1e-30) * ulp
    assert float(((got.double() - want.double()).abs() / scale).max()) <= 8
    if got.dtype != torch.float32:
        assert float((got != want).double().mean()) < 0.01


def check_case(case: dict, got_q: torch.Tensor, k_before: torch.Tensor, v_before: torch.Tensor):
    """`case` holds the caches the kernel wrote; the reference redoes it on copies of `*_before`."""
    k_want, v_want = k_before.clone(), v_before.clone()
    want_q = reference.prepare_qkv(**{**case, "k_cache": k_want, "v_cache": v_want})
    exact = case["layout"].q_norm is None
    assert got_q.is_contiguous()
    assert_same(got_q, want_q, exact)
    assert_same(case["k_cache"], k_want, exact)
    assert torch.equal(case["v_cache"], v_want)
    # Only the real rows' slots change: compare every other slot bit for bit.
    kv_shape = case["k_cache"].shape[2:]
    untouched = torch.ones(k_before.shape[0] * BLOCK_SIZE, dtype=torch.bool, device=DEVICE)
    slots = case["slot_mapping"]
    untouched[slots[slots >= 0]] = False
    assert torch.equal(
        case["k_cache"].view(-1, *kv_shape)[untouched], k_before.view(-1, *kv_shape)[untouched]
    )


SHAPES = [
    (32, 4, 128),
    (32, 4, 64),
    (32, 4, 96),
    (8, 8, 128),
    (8, 8, 64),
    (8, 8, 96),
    (4, 1, 128),
    (4, 1, 64),
    (4, 1, 96),
]


@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
def test_prepare_qkv_matches_reference(heads, kv_heads, dim, dtype, norm, interleave):
    from afdserve.kernels.triton import qkv as triton_qkv

    for rows in (0, 1, 7, 64):
        seed = hash((heads, kv_heads, dim, list(DTYPES).index(dtype), norm, interleave, rows))
        case = qkv_case(rows, heads, kv_heads, dim, DTYPES[dtype], norm, seed)
        case["layout"] = dataclasses.replace(case["layout"], interleave=interleave)
        assert triton_qkv.supports(case["qkv"], case["k_cache"], case["v_cache"], dim)
        k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
        got = triton_qkv.prepare_qkv(**case)
        check_case(case, got, k_before, v_before)


@pytest.mark.parametrize("tile", [None, 2, 16])  # None: the shipped PREFILL_ROWS
@pytest.mark.parametrize("interleave", [False, True])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 4, 128), (8, 8, 96), (4, 1, 64)])
def test_prepare_qkv_prefill_tiles_match_reference(
    heads, kv_heads, dim, dtype, norm, interleave, tile, monkeypatch
):
    """Prefill's tiles of several rows a program (a launch of PREFILL_FROM rows or more), a
    partial last tile included: the same contract as one row a program."""
    from afdserve.kernels.triton import qkv as triton_qkv

    if tile is not None:
        monkeypatch.setattr(triton_qkv, "PREFILL_ROWS", tile)
    rows = triton_qkv.PREFILL_FROM + triton_qkv.PREFILL_ROWS // 2 + 1
    seed = hash((heads, kv_heads, dim, dtype, norm, interleave, tile))
    case = qkv_case(rows, heads, kv_heads, dim, DTYPES[dtype], norm, seed)
    case["layout"] = dataclasses.replace(case["layout"], interleave=interleave)
    k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
    got = triton_qkv.prepare_qkv(**case)
    check_case(case, got, k_before, v_before)


def test_prepare_qkv_float32_norm_weights():
    """Norm weights in float32 with bf16 activations: the reference's norm output is float32 then,
    and so is its rotary; the kernel follows and rounds q to bf16 once at the end."""
    from afdserve.kernels.triton import qkv as triton_qkv

    case = qkv_case(7, 8, 8, 128, torch.bfloat16, True, 5)
    lay = case["layout"]
    case["layout"] = dataclasses.replace(lay, q_norm=lay.q_norm.float(), k_norm=lay.k_norm.float())
    k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
    got = triton_qkv.prepare_qkv(**case)
    k_want, v_want = k_before.clone(), v_before.clone()
    want = reference.prepare_qkv(**{**case, "k_cache": k_want, "v_cache": v_want})
    assert want.dtype == torch.float32
    assert_same(got, want.to(torch.bfloat16), exact=False)
    assert_same(case["k_cache"], k_want, exact=False)
    assert torch.equal(case["v_cache"], v_want)


def test_prepare_qkv_does_not_sync():
    from afdserve.kernels.triton import qkv as triton_qkv

    case = qkv_case(9, 32, 4, 128, torch.bfloat16, True, 3)
    k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
    got = no_sync(triton_qkv.prepare_qkv, **case)
    check_case(case, got, k_before, v_before)


def test_prepare_qkv_replays_in_cuda_graph():
    """Captured once, replayed on new inputs (qkv, cos/sin, slots and cache contents) copied into
    the captured buffers."""
    from afdserve.kernels.triton import qkv as triton_qkv

    case = qkv_case(64, 32, 4, 128, torch.bfloat16, True, 40)
    triton_qkv.prepare_qkv(**case)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = triton_qkv.prepare_qkv(**case)
    for seed in (41, 42):
        new = qkv_case(64, 32, 4, 128, torch.bfloat16, True, seed)
        for name in ("qkv", "cos", "sin", "slot_mapping", "k_cache", "v_cache"):
            case[name].copy_(new[name])
        k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
        graph.replay()
        torch.cuda.synchronize()
        check_case(case, out, k_before, v_before)


def test_supports():
    from afdserve.kernels.triton import qkv as triton_qkv

    qkv = torch.zeros(2, 40 * 128, dtype=torch.bfloat16, device=DEVICE)
    cache = torch.zeros(4, BLOCK_SIZE, 4, 128, dtype=torch.bfloat16, device=DEVICE)
    assert triton_qkv.supports(qkv, cache, cache, 128)
    assert not triton_qkv.supports(qkv.cpu(), cache.cpu(), cache.cpu(), 128)
    assert not triton_qkv.supports(qkv, cache.float(), cache.float(), 128)
    assert not triton_qkv.supports(qkv.double(), cache.double(), cache.double(), 128)
    assert not triton_qkv.supports(qkv, cache.transpose(0, 1), cache, 128)
    assert not triton_qkv.supports(qkv, cache, cache, 127)
    assert not triton_qkv.supports(qkv, cache, cache, 514)


def norm_over_heads_case(
    rows: int, heads: int, kv_heads: int, dim: int, rot: int, dtype: torch.dtype, seed: int
) -> dict:
    """`qkv_case` in MiniMax-M2's layout: q/k norm weights over the whole row's q and k, rotary
    on each head's first `rot` channels (cos/sin [rows, rot / 2])."""
    case = qkv_case(rows, heads, kv_heads, dim, dtype, False, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    norms = [
        (1 + 0.2 * torch.randn(n * dim, generator=gen)).to(dtype).to(DEVICE)
        for n in (heads, kv_heads)
    ]
    case["layout"] = QKVLayout(heads, kv_heads, dim, *norms, EPS, False, True, rot)
    case["cos"], case["sin"] = case["cos"][:, : rot // 2], case["sin"][:, : rot // 2]
    return case


# MiniMax-M2's (48 query, 8 KV heads of 128, rotary 64), its per-GPU slices, a smaller one.
NORM_OVER_HEADS_SHAPES = [(48, 8, 128, 64), (6, 1, 128, 64), (12, 2, 128, 64), (4, 2, 64, 32)]


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "rot"), NORM_OVER_HEADS_SHAPES)
def test_prepare_qkv_norm_over_heads_partial_rotary(heads, kv_heads, dim, rot, dtype):
    from afdserve.kernels.triton import qkv as triton_qkv

    for rows in (0, 1, 7, 64):
        seed = hash((heads, kv_heads, dim, rot, list(DTYPES).index(dtype), rows))
        case = norm_over_heads_case(rows, heads, kv_heads, dim, rot, DTYPES[dtype], seed)
        qkv, layout = case["qkv"], case["layout"]
        assert triton_qkv.supports(qkv, case["k_cache"], case["v_cache"], dim, layout)
        k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
        got = triton_qkv.prepare_qkv(**case)
        check_case(case, got, k_before, v_before)


def test_prepare_qkv_norm_over_heads_fp8_cache():
    """MiniMax-M2's layout into an FP8 cache: v quantized bit for bit as the reference does; k
    from a norm a few ulps off may land on the neighbouring e4m3 value, no further."""
    from afdserve.kernels.triton import qkv as triton_qkv

    case = norm_over_heads_case(33, 48, 8, 128, 64, torch.bfloat16, 7)
    for name in ("k_cache", "v_cache"):
        case[name] = case[name].to(torch.float8_e4m3fn)
    theirs = {name: case[name].clone() for name in ("k_cache", "v_cache")}
    got = triton_qkv.prepare_qkv(**case, k_scale=0.5, v_scale=2.0)
    want = reference.prepare_qkv(**{**case, **theirs}, k_scale=0.5, v_scale=2.0)
    assert_same(got, want, exact=False)
    assert torch.equal(case["v_cache"].view(torch.uint8), theirs["v_cache"].view(torch.uint8))
    k, k_want = case["k_cache"].double(), theirs["k_cache"].double()
    assert bool(((k - k_want).abs() <= 0.125 * k_want.abs() + 2**-9).all())


def test_supports_norm_over_heads_up_to_its_tile():
    from afdserve.kernels.triton import qkv as triton_qkv

    case = norm_over_heads_case(2, 48, 8, 128, 64, torch.bfloat16, 1)
    args = (case["qkv"], case["k_cache"], case["v_cache"], 128)
    assert triton_qkv.supports(*args, case["layout"])
    wide = dataclasses.replace(case["layout"], heads=triton_qkv.MAX_NORM_WIDTH // 128 + 1)
    assert not triton_qkv.supports(*args, wide)
