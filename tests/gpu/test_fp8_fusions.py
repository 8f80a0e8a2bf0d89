"""Launches the w8a8 FP8 path folds into others, on the GPU, against the launches they replace:
the norm that quantizes its rows for the GEMM after it (kernels/triton_norm.add_rms_norm_fp8
against add_rms_norm, then triton_fp8_w8a8.quantize_rows) and the GEMM whose last K split sums
the partials (triton_fp8_w8a8.REDUCE_IN_GEMM against the sum launch). Each must give the bits of
what it replaces, so that the model's tokens and log-probabilities do not change either."""

from __future__ import annotations

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.kernels.reference import fp8
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.gpu.sync import no_sync
from tests.gpu.test_fp8_kernels import fp8_linear_case
from tests.gpu.test_graphs import _prompts
from tests.model.test_fp8_qkv_pack import write_wide_heads

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

BLOCK = (128, 128)


@pytest.mark.parametrize(
    "rows,width", [(1, 2048), (64, 2048), (256, 4096), (40, 200), (17, 7168), (3, 96)]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_norm_quantizes_its_rows_as_the_quantize_launch_does(rows, width, dtype):
    """Values, scales (a partial last group included) and the residual sum, bit for bit."""
    from afdserve.kernels.triton import fp8_w8a8 as triton_fp8_w8a8
    from afdserve.kernels.triton import norm as triton_norm

    gen = torch.Generator(device="cuda").manual_seed(rows + width)
    h = (torch.randn(rows, width, generator=gen, device="cuda") * 3).to(dtype)
    delta = torch.randn(rows, width, generator=gen, device="cuda").to(dtype)
    weight = (torch.rand(width, generator=gen, device="cuda") + 0.5).to(dtype)
    normed, summed = triton_norm.add_rms_norm(h, delta, weight, 1e-6)
    values, scales = triton_fp8_w8a8.quantize_rows(normed)
    got, got_summed = no_sync(triton_norm.add_rms_norm_fp8, h, delta, weight, 1e-6)
    assert isinstance(got, fp8.Fp8Rows) and got.dtype == dtype and got.shape == (rows, width)
    assert torch.equal(got.values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(got.scales, scales) and torch.equal(got_summed, summed)


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_ops_norm_quantizes_the_rows_the_norm_outputs(weight_dtype):
    """ops.add_rms_norm(quantize=True): the quantized rows of what it returns unquantized; with
    a norm weight of another dtype (float32 output, which the GEMM takes weight-only) those
    rows as they are."""
    from afdserve.kernels import ops
    from afdserve.kernels.triton import fp8_w8a8 as triton_fp8_w8a8

    gen = torch.Generator(device="cuda").manual_seed(2)
    h, delta = (torch.randn(24, 2048, generator=gen, device="cuda").bfloat16() for _ in "hd")
    weight = (torch.rand(2048, generator=gen, device="cuda") + 0.5).to(weight_dtype)
    normed, summed = ops.add_rms_norm(h, delta, weight, 1e-6)
    got, got_summed = no_sync(ops.add_rms_norm, h, delta, weight, 1e-6, True)
    assert torch.equal(got_summed, summed)
    if weight_dtype != h.dtype:
        assert isinstance(got, torch.Tensor) and torch.equal(got, normed)
        return
    values, scales = triton_fp8_w8a8.quantize_rows(normed)
    assert got.dtype == normed.dtype
    assert torch.equal(got.values.view(torch.uint8), values.view(torch.uint8))
    assert torch.equal(got.scales, scales)


@pytest.mark.parametrize("m", [17, 64, 256])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (576, 1024), (200, 136)])
def test_gemm_of_rows_quantized_before_equals_the_gemm_of_x(m, n, k):
    from afdserve.kernels.triton import fp8_w8a8 as triton_fp8_w8a8

    x, q, scale, b = fp8_linear_case(m, n, k, torch.bfloat16, bias=n == 200, seed=m + n)
    rows = fp8.Fp8Rows(*triton_fp8_w8a8.quantize_rows(x), x.dtype)
    want = triton_fp8_w8a8.fp8_linear(x, q, scale, b)
    assert torch.equal(no_sync(triton_fp8_w8a8.fp8_linear, rows, q, scale, b), want)


@pytest.mark.parametrize(
    "tiles",
    [
        (16, 64, 128, 4, 4, 3),
        (64, 64, 256, 4, 4, 4),
        (16, 16, 512, 2, 4, 3),
        (32, 32, 128, 8, 4, 3),
    ],
)
@pytest.mark.parametrize("m", [1, 8, 40])
@pytest.mark.parametrize("n,k", [(5120, 2048), (2048, 4096), (576, 1024), (200, 136)])
def test_last_split_sums_the_partials_as_the_sum_launch_does(tiles, m, n, k, monkeypatch):
    """Every split count and tile, with and without a bias: the sum launch's bits, call after
    call (each launch leaves its tile counters at zero for the next)."""
    from afdserve.kernels.triton import fp8_w8a8 as w8a8
    from afdserve.kernels.triton.counters import tile_counters

    x, q, scale, b = fp8_linear_case(m, n, k, torch.bfloat16, bias=n == 200, seed=m + 5 * n)
    tiles = w8a8.Tiles(*tiles)
    monkeypatch.setattr(w8a8, "REDUCE_IN_GEMM", False)
    want = w8a8.fp8_linear(x, q, scale, b, tiles)
    monkeypatch.setattr(w8a8, "REDUCE_IN_GEMM", True)
    for _ in range(3):
        assert torch.equal(no_sync(w8a8.fp8_linear, x, q, scale, b, tiles), want)
    assert int(tile_counters(q, w8a8.MAX_SPLIT_TILES).count_nonzero()) == 0


def test_last_split_sum_replays_in_a_cuda_graph():
    """Captured with the default tiles of a batch of 1 (q/k/v's shape: 4 splits), replayed on
    new rows: the sum launch's bits each time."""
    from afdserve.kernels.triton import fp8_w8a8 as w8a8

    x, q, scale, _ = fp8_linear_case(1, 5120, 2048, torch.bfloat16, bias=False, seed=9)
    assert w8a8.tiles_for(1, 5120, 2048).splits > 1 and w8a8.REDUCE_IN_GEMM
    w8a8.fp8_linear(x, q, scale, None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = w8a8.fp8_linear(x, q, scale, None)
    for seed in (10, 11, 12):
        x.copy_(fp8_linear_case(1, 5120, 2048, torch.bfloat16, False, seed)[0])
        graph.replay()
        w8a8.REDUCE_IN_GEMM = False
        try:
            want = w8a8.fp8_linear(x, q, scale, None)
        finally:
            w8a8.REDUCE_IN_GEMM = True
        assert torch.equal(out, want)


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory):
    """A Qwen3-MoE whose FP8 q/k/v pack into one GEMM, and a DeepSeek-V3 (MLA: q_a_proj and
    kv_a_proj_with_mqa read the layer input), both FP8 checkpoints."""
    root = tmp_path_factory.mktemp("fp8-fusions")
    return {
        "gqa": write_wide_heads(root / "gqa", torch.bfloat16),
        "mla": make_tiny_model(
            root / "mla", "deepseek_v3", seed=5, dtype="bfloat16", quantization="fp8"
        ),
    }


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_model_with_the_fused_launches_serves_the_same_tokens_and_logprobs(
    fp8_models, kind, monkeypatch
):
    """FP8 models on CUDA, eager and under graphs, 24 sequences (more than the 16 rows up to
    which the GEMM quantizes its rows itself, so the norm quantizes them), with the fused
    launches and without: the same tokens and the same log-probabilities."""
    from afdserve.kernels.triton import fp8_w8a8 as triton_fp8_w8a8
    from afdserve.model.layers.attention import GQAAttention, MLAAttention

    attention = {"gqa": GQAAttention, "mla": MLAAttention}[kind]
    prompts = _prompts(24)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    common = dict(
        device="cuda", dtype="bfloat16", max_num_seqs=32, max_model_len=256, kv_cache_blocks=512
    )

    def serve(**kw) -> tuple[bool, list]:
        with LLM(str(fp8_models[kind]), **common, **kw) as llm:
            model = llm.engine.core_client.core.runner.model
            attn = next(m for m in model.modules() if isinstance(m, attention))
            rows = torch.empty(24, model.config.hidden_size, dtype=torch.bfloat16, device="cuda")
            fused = attn.takes_fp8_rows(rows)
            outs = llm.generate(prompts, params)
        return fused, [(o.token_ids, o.logprobs) for o in outs]

    for kw in ({}, dict(graph_mode="full_decode_only", cuda_graph_sizes=[8, 16, 32])):
        fused, got = serve(**kw)
        assert fused
        monkeypatch.setattr(attention, "takes_fp8_rows", lambda self, h: False)
        monkeypatch.setattr(triton_fp8_w8a8, "REDUCE_IN_GEMM", False)
        _, want = serve(**kw)
        monkeypatch.undo()
        assert got == want


@pytest.mark.parametrize("rows", [1, 16, 17, 64, 300])
@pytest.mark.parametrize("limit", [None, 10.0])
def test_gated_mlp_quantizes_its_rows_once_for_gate_and_up(rows, limit, monkeypatch):
    """An FP8 GatedMLP (shared experts, dense layers) past QUANTIZE_IN_GEMM_ROWS rows quantizes
    x once for its gate and up GEMMs: the bits of each GEMM quantizing them itself."""
    from afdserve.kernels import ops
    from afdserve.model.layers.common import GatedMLP
    from afdserve.model.layers.fp8 import Fp8Linear

    gen = torch.Generator().manual_seed(rows)
    mlp = GatedMLP(2048, 1024, limit)
    for name in ("gate_proj", "up_proj", "down_proj"):
        dense = getattr(mlp, name)
        linear = Fp8Linear(dense.in_features, dense.out_features, False, BLOCK, "cuda")
        w = torch.randn(dense.out_features, dense.in_features, generator=gen) * 0.03
        q, s = fp8.quantize_blockwise(w, BLOCK)
        linear.weight.data.copy_(q)
        linear.weight_scale_inv.data.copy_(s)
        setattr(mlp, name, linear)
    x = torch.randn(rows, 2048, generator=gen).bfloat16().cuda()
    calls = []
    quantize = ops.quantize_rows
    monkeypatch.setattr(ops, "quantize_rows", lambda t: calls.append(1) or quantize(t))
    got = no_sync(mlp, x)
    assert len(calls) == (1 if rows > 16 else 0)
    monkeypatch.setattr(ops, "quantizes_for_gemm", lambda *args: False)
    assert torch.equal(got, mlp(x))
