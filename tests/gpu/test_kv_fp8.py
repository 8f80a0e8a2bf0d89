"""The FP8 KV cache on the GPU: Triton paged attention over a float8_e4m3fn cache against the
reference over the same cache (decode, prefill and chunked segments, GQA and one KV head as MLA
reads its latent), the KV writes (plain and the fused qkv prologue) against the reference write,
and a colocated bf16 engine with the FP8 cache under full_decode_only graphs against eager."""

from __future__ import annotations

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.kernels.reference import layers as reference
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.gpu.sync import no_sync
from tests.gpu.test_graphs import SIZES, _check, _prompts
from tests.gpu.test_kernels import CASES, paged_case, rel_err
from tests.gpu.test_qkv_kernel import assert_same, qkv_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FP8 = torch.float8_e4m3fn
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# GQA at Qwen3-MoE's heads and another group; one KV head of width 80 as MLA's latent reads.
SHAPES = [(32, 4, 128, case, "bf16") for case in CASES] + [
    (32, 4, 128, "decode", "fp32"),
    (32, 4, 128, "chunked", "fp32"),
    (12, 2, 96, "prefill", "bf16"),
    (16, 1, 80, "decode", "bf16"),
]
SCALES = [(1.0, 1.0), (0.05, 0.03)]  # 1.0: what the engine uses; others exercise the scale


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("heads,kv_heads,dim,case,dtype_name", SHAPES)
def test_fp8_paged_attention_matches_reference(heads, kv_heads, dim, case, dtype_name, scales):
    dtype = DTYPES[dtype_name]
    query_lens, context_lens, pad = CASES[case]
    q, k_cache, v_cache, meta = paged_case(
        query_lens,
        context_lens,
        pad,
        heads,
        kv_heads,
        dim,
        16,
        dtype,
        "cuda",
        seed=hash((case, heads, dim)) % 1000,
    )
    k8 = reference.quantize_kv(k_cache, FP8, scales[0])
    v8 = reference.quantize_kv(v_cache, FP8, scales[1])
    scale = dim**-0.5
    out = no_sync(ops.paged_attention, q, k8, v8, meta, scale, *scales)
    # The reference over the same FP8 cache: on CPU it equals attention over the dequantized
    # cache exactly (tests/engine/test_kv_fp8.py), here in float64.
    k, v = ((c.float() * s).double() for c, s in zip((k8, v8), scales, strict=True))
    ref = reference.paged_attention(q.double(), k, v, meta, scale)
    assert out.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert rel_err(out, ref) < tol
    if pad:
        assert (out[-pad:] == 0).all(), "pad rows must come out zero"


def poisoned(cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, tuple]:
    """The cache with a NaN-byte block 0 in front (the tables shifted past it, their padding
    still 0) and NaN bytes in every slot past a context: all a kernel reads beyond its
    context. -> (cache, segments)."""
    block = cache.shape[1]
    nan = torch.full_like(cache[:1].view(torch.uint8), 0x7F)
    out = torch.cat([nan, cache.view(torch.uint8)]).view(FP8)
    segments = []
    for seg in meta.segments:
        used = -(-seg.context_len // block)
        table = seg.block_table.clone()
        table[:used] += 1
        out.view(torch.uint8)[table[used - 1], seg.context_len - (used - 1) * block :] = 0x7F
        segments.append(Segment(seg.row_start, seg.row_end, table, seg.context_len))
    return out, tuple(segments)


@pytest.mark.parametrize(
    "heads,kv_heads,dim,case",
    [(32, 4, 128, "decode"), (32, 4, 128, "chunked"), (16, 1, 80, "decode")],
)
def test_fp8_attention_ignores_nan_in_uncovered_slots(heads, kv_heads, dim, case):
    """The FP8 path loads K tiles unmasked (where the head dim needs no padding): NaN in the
    slots past each context and in block 0 (which the tables' padding points at) must not
    reach the output. e4m3fn's 0x7F is NaN on the GPU (the interpreter reads it as 480)."""
    query_lens, context_lens, pad = CASES[case]
    q, k_cache, v_cache, meta = paged_case(
        query_lens, context_lens, pad, heads, kv_heads, dim, 16, torch.bfloat16, "cuda", seed=5
    )
    k8, segments = poisoned(reference.quantize_kv(k_cache, FP8, 0.05), meta)
    v8, _ = poisoned(reference.quantize_kv(v_cache, FP8, 0.03), meta)
    meta = AttentionMetadata(
        meta.positions, meta.slot_mapping, segments, batch_segments(segments, torch.device("cuda"))
    )
    out = no_sync(ops.paged_attention, q, k8, v8, meta, dim**-0.5, 0.05, 0.03)
    k, v = ((c.float() * s).double() for c, s in zip((k8, v8), (0.05, 0.03), strict=True))
    ref = reference.paged_attention(q.double(), k, v, meta, dim**-0.5)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("scale", [1.0, 0.5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp8_write_kv_matches_reference(dtype, scale):
    gen = torch.Generator().manual_seed(11)
    cache = torch.zeros(9, 16, 4, 128, dtype=FP8, device="cuda")
    expected = cache.clone()
    values = (torch.randn(6, 4, 128, generator=gen) * 50).to(dtype).cuda()
    values[0, 0, :4] = torch.tensor([1e4, -1e4, 448.0, 449.0])  # clamped, not NaN
    slots = torch.tensor([5, 140, -1, 17, -1, 0], device="cuda")
    reference.write_kv(expected, values, slots, scale)
    no_sync(ops.write_kv, cache, values, slots, scale)
    assert torch.equal(bits(cache), bits(expected))
    assert not cache.float().isnan().any()


def fp8_qkv_case(rows: int, norm: bool, seed: int) -> dict:
    case = qkv_case(rows, 32, 4, 128, torch.bfloat16, norm, seed)
    case["k_cache"] = reference.quantize_kv(case["k_cache"], FP8, 1.0)
    case["v_cache"] = reference.quantize_kv(case["v_cache"], FP8, 1.0)
    return case


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize("norm", [False, True])
def test_fp8_prepare_qkv_matches_reference(norm, scales):
    """The fused prologue's FP8 k/v writes equal the reference write: bit for bit without q/k
    norms; with them (the norm's last float32 bits may differ, see test_qkv_kernel) a k element
    may land on the neighbouring e4m3 value, rarely. v is copied, so always bit for bit."""
    from afdserve.kernels.triton import qkv as triton_qkv

    for rows in (1, 7, 64, triton_qkv.PREFILL_FROM + 3):  # the last: prefill's tiles of rows
        case = fp8_qkv_case(rows, norm, seed=rows + 100 * norm)
        assert triton_qkv.supports(case["qkv"], case["k_cache"], case["v_cache"], 128)
        k_want, v_want = case["k_cache"].clone(), case["v_cache"].clone()
        want_q = reference.prepare_qkv(
            **{**case, "k_cache": k_want, "v_cache": v_want}, k_scale=scales[0], v_scale=scales[1]
        )
        got_q = no_sync(triton_qkv.prepare_qkv, **case, k_scale=scales[0], v_scale=scales[1])
        assert_same(got_q, want_q, exact=not norm)
        assert torch.equal(bits(case["v_cache"]), bits(v_want))
        if not norm:
            assert torch.equal(bits(case["k_cache"]), bits(k_want))
            continue
        got, want = case["k_cache"].float(), k_want.float()
        differ = got != want
        assert float(differ.double().mean()) < 0.01
        # Neighbouring e4m3 values are at most 2^-3 of the larger apart (3 mantissa bits).
        gap = torch.maximum(got.abs(), want.abs()) * 0.125
        assert bool(((got - want).abs() <= gap)[differ].all())


def test_fp8_kernels_replay_in_cuda_graph():
    """The fused prologue's FP8 write and the attention over an FP8 cache, captured once with
    scales 0.5 / 0.25 (kernel constants) and replayed on new inputs, equal the eager calls."""
    from afdserve.kernels.triton import qkv as triton_qkv

    q, k, v, meta = paged_case(*CASES["decode"], 32, 4, 128, 16, torch.bfloat16, "cuda", seed=1)
    k8, v8 = k.to(FP8), v.to(FP8)
    case = fp8_qkv_case(64, True, seed=40)

    def step():
        written_q = triton_qkv.prepare_qkv(**case, k_scale=0.5, v_scale=0.25)
        return written_q, ops.paged_attention(q, k8, v8, meta, 0.088, 0.5, 0.25)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    k_before, v_before = case["k_cache"].clone(), case["v_cache"].clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    case["k_cache"].copy_(k_before)
    case["v_cache"].copy_(v_before)
    case["qkv"].copy_(fp8_qkv_case(64, True, seed=41)["qkv"])
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    got = [o.clone() for o in outs]
    got_k, got_v = case["k_cache"].clone(), case["v_cache"].clone()
    case["k_cache"].copy_(k_before)
    case["v_cache"].copy_(v_before)
    want = step()
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(bits(got_k), bits(case["k_cache"]))
    assert torch.equal(bits(got_v), bits(case["v_cache"]))
    assert not torch.equal(bits(got_k), bits(k_before))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvfp8")
    return {
        family: make_tiny_model(root / family, family, hash_layers=1, seed=5, dtype="bfloat16")
        for family in ("qwen3_moe", "deepseek_v3")
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_fp8_cache_graphs_equal_eager(models, family):
    """bf16 with the FP8 cache: replayed graphs (the scales are constants in them) give the eager
    FP8 engine's tokens up to near-ties; the share equal to the bf16 cache's is printed."""
    prompts = _prompts(12)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    common = dict(
        device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=256, kv_cache_blocks=512
    )
    with LLM(str(models[family]), **common) as plain:
        bf16_cache = [o.token_ids for o in plain.generate(prompts, params)]
    with LLM(str(models[family]), kv_cache_dtype="fp8", **common) as eager:
        assert eager.engine.core_client.core.kv_cache.dtype == FP8
        want = [o.token_ids for o in eager.generate(prompts, params)]
        with LLM(
            str(models[family]),
            kv_cache_dtype="fp8",
            graph_mode="full_decode_only",
            cuda_graph_sizes=SIZES,
            log_step_plan=True,
            **common,
        ) as graphs:
            assert graphs.engine.core_client.driver.forward.graphs is not None
            got = [o.token_ids for o in graphs.generate(prompts, params)]
            modes = {r["mode"] for r in graphs.step_log()}
        gaps = _check(eager, prompts, got, want)
    assert "replay" in modes and "capture" in modes
    assert all(len(g) == params.max_tokens for g in got)
    same = sum(a == b for w, b16 in zip(want, bf16_cache) for a, b in zip(w, b16))
    print(
        f"{family}: {len(gaps)} near-tie divergences (gaps {gaps}); FP8 eager equals the bf16 "
        f"cache at {same / sum(map(len, want)):.3f} of positions"
    )


def test_fp8_cache_block_size_and_bytes(models):
    """The same blocks take half the bytes of the bf16 cache on the device."""
    common = dict(device="cuda", dtype="bfloat16", max_model_len=256, kv_cache_blocks=64)
    sizes = {}
    for kv in ("auto", "fp8"):
        with LLM(str(models["qwen3_moe"]), kv_cache_dtype=kv, **common) as llm:
            cache = llm.engine.core_client.core.kv_cache
            sizes[kv] = (cache.bytes, cache.layers[0][0].dtype, cache.layers[0][0].is_cuda)
    assert sizes["fp8"] == (sizes["auto"][0] // 2, FP8, True)
