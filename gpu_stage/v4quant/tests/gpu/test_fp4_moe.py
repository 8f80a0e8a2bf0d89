"""The FP4 routed-expert kernels (kernels/triton_fp4_moe.py) against the CPU reference
(kernels/fp4.py's dequantization, then the experts in float64), at DeepSeek-V4-Flash's expert
shape (hidden 4096, intermediate 2048, top-6, swiglu_limit 10) on fewer experts."""

from __future__ import annotations

import pytest
import torch

from afdserve.kernels import fp4, ops, reference
from tests.gpu.sync import no_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FLASH = (32, 4096, 2048, 6, 10.0)  # experts (of 256), hidden, intermediate, top_k, swiglu_limit


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def fp4_case(
    rows: int,
    experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    seed: int,
    dtype: torch.dtype = torch.bfloat16,
):
    """Rows, routing and FP4 experts on the GPU; the weights quantized on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = fp4.quantize_fp4(torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5)
    down = fp4.quantize_fp4(torch.randn(experts, hidden, inter, generator=gen) / inter**0.5)
    x = (2 * torch.randn(rows, hidden, generator=gen)).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
    weights = torch.rand(rows, top_k, generator=gen)
    cuda = [t.cuda() for t in (x, ids, weights)]
    return (*cuda, tuple(t.cuda() for t in gate_up), tuple(t.cuda() for t in down))


def cpu_reference(x, ids, weights, gate_up, down, limit):
    """The experts in float64 on the CPU, from the reference dequantization of the touched ones."""
    hit, local = ids.cpu().unique(return_inverse=True)
    w13 = fp4.dequantize_fp4(gate_up[0].cpu()[hit], gate_up[1].cpu()[hit], torch.float64)
    w2 = fp4.dequantize_fp4(down[0].cpu()[hit], down[1].cpu()[hit], torch.float64)
    return reference.moe_experts(x.cpu().double(), local, weights.cpu().double(), w13, w2, limit)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fp4_experts_match_reference(rows):
    experts, hidden, inter, top_k, limit = FLASH
    case = fp4_case(rows, experts, hidden, inter, top_k, seed=rows)
    from afdserve.kernels import triton_fp4_moe

    assert triton_fp4_moe.supports(case[0], case[3], case[4])
    out = no_sync(ops.moe_experts_fp4, *case, limit)
    assert out.dtype == torch.bfloat16 and out.shape == case[0].shape
    assert torch.isfinite(out).all()
    assert rel_err(out, cpu_reference(*case, limit)) < 2e-2


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fp4_experts_replay_in_cuda_graph(rows):
    """Captured once per batch size, replayed on new rows and routing copied into the captured
    buffers; the expert weights stay FP4 (no bf16 copy is made: memory stays flat)."""
    experts, hidden, inter, top_k, limit = FLASH
    x, ids, weights, gate_up, down = fp4_case(rows, experts, hidden, inter, top_k, seed=100)
    ops.moe_experts_fp4(x, ids, weights, gate_up, down, limit)  # compile outside the capture
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe_experts_fp4(x, ids, weights, gate_up, down, limit)
    # One bf16 copy of one expert's gate_up alone would be 2 * 2I * H bytes.
    assert torch.cuda.memory_allocated() - before < 2 * 2 * inter * hidden
    for seed in (101, 102):
        new_x, new_ids, new_weights, _, _ = fp4_case(rows, experts, hidden, inter, top_k, seed)
        x.copy_(new_x), ids.copy_(new_ids), weights.copy_(new_weights)
        graph.replay()
        assert rel_err(out, cpu_reference(x, ids, weights, gate_up, down, limit)) < 2e-2


def test_fp4_experts_prefill_chunks_and_absent_experts():
    """More pairs than one launch takes (row chunks), fp16 rows, no clamp, and pairs with id -1
    (an expert-parallel shard's experts held elsewhere), which contribute nothing."""
    from afdserve.kernels import triton_fp4_moe

    rows = triton_fp4_moe.MAX_PAIRS // 4 + 5
    x, ids, weights, gate_up, down = fp4_case(rows, 16, 512, 256, 4, seed=7, dtype=torch.float16)
    ids[::3, 1] = -1
    out = no_sync(ops.moe_experts_fp4, x, ids, weights, gate_up, down, None)
    assert out.dtype == torch.float16
    ref = fp4.moe_experts_fp4(
        x.cpu().double(),
        ids.cpu(),
        weights.cpu().double(),
        tuple(t.cpu() for t in gate_up),
        tuple(t.cpu() for t in down),
    )
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_v4_ffn_half_from_fp4_checkpoint_in_cuda_graph(tmp_path_factory, rows):
    """DeepSeek-V4's FFN half (router, FP4 experts through these kernels, FP8 shared expert)
    loaded on the GPU from a tiny FP4 checkpoint, captured and replayed, against the same
    checkpoint's FFN half on the CPU in float32 (the reference dequantization)."""
    from afdserve.model.loader import load_model
    from afdserve.model.model import ModelParts
    from afdserve.model.tiny import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("v4") / "fp4", "deepseek_v4", hash_layers=1,
                           quantization="fp8", expert_dtype="fp4")  # fmt: skip
    ffn = ModelParts(attention=False, ffn=True)
    gpu, _ = load_model(path, ffn, "bfloat16", device="cuda")
    cpu, _ = load_model(path, ffn, "float32")
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 32, generator=gen).cuda().bfloat16()
    ids = torch.randint(0, 256, (rows,), generator=gen).cuda()
    for layer in (0, 1):  # a hash layer and a routed one
        gpu.ffn_half(layer, x, ids)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = gpu.ffn_half(layer, x, ids)
        graph.replay()
        # The CPU side takes the GPU router's choice: a bf16 near-tie must not flip an expert.
        chosen, weights = gpu.model.layers[layer].mlp.gate(x, ids)
        want = cpu.ffn_half(layer, x.cpu().float(), ids.cpu(), (chosen.cpu(), weights.cpu()))
        assert rel_err(out, want) < 3e-2, layer
