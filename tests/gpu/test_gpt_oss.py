"""gpt-oss on one GPU: the Triton paged attention with sinks and sliding windows, the expert
kernels with gpt-oss's SwiGLU (bf16 decode kernels, MXFP4 FP4 kernels), each against the plain-torch
reference, without host syncs and replayed in a CUDA graph; and the tiny checkpoints (bf16 and
MXFP4) decoding under `full_decode_only` graphs the tokens of the eager run.

Shapes: gpt-oss-120b's heads (64 query, 8 KV, dim 64, window 128) and experts (hidden and
intermediate 2880, top-4, clamp 7, gain 1.702) on 8 experts."""

from __future__ import annotations

import math

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.kernels.reference import fp4
from afdserve.kernels.reference import layers as reference
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.gpu.sync import no_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

HEADS, KV_HEADS, DIM, WINDOW = 64, 8, 64, 128
HIDDEN, INTER, EXPERTS, TOP_K, LIMIT, ALPHA = 2880, 2880, 8, 4, 7.0, 1.702


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def attention_case(query_lens, context_lens, dtype, seed, block=16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    needs = [math.ceil(c / block) for c in context_lens]
    shape = (sum(needs) + 1, block, KV_HEADS, DIM)
    k = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    v = torch.randn(shape, device="cuda", generator=gen).to(dtype)
    perm = (torch.randperm(sum(needs), device="cuda", generator=gen) + 1).tolist()
    segments, row, used = [], 0, 0
    for q_len, ctx, n in zip(query_lens, context_lens, needs, strict=True):
        table = perm[used : used + n] + [0] * (max(needs) - n)
        used += n
        table = torch.tensor(table, dtype=torch.int32, device="cuda")
        segments.append(Segment(row, row + q_len, table, ctx))
        row += q_len
    meta = AttentionMetadata(
        positions=torch.zeros(row, dtype=torch.int64, device="cuda"),
        slot_mapping=torch.zeros(row, dtype=torch.int64, device="cuda"),
        segments=tuple(segments),
        batched=batch_segments(tuple(segments), torch.device("cuda")),
    )
    q = torch.randn(row, HEADS, DIM, device="cuda", generator=gen).to(dtype)
    sinks = (2 * torch.randn(HEADS, device="cuda", generator=gen)).to(dtype)
    return q, k, v, sinks, meta


CASES = {
    "decode": ([1] * 64, [1 + 37 * i for i in range(64)]),
    "prefill": ([300, 1], [300, 700]),
    "chunked": ([64, 17], [1000, 130]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("window", [None, WINDOW])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sinks_and_window_match_the_reference(case, window, dtype) -> None:
    q, k, v, sinks, meta = attention_case(*CASES[case], dtype, seed=len(case))
    scale = DIM**-0.5
    out = no_sync(ops.paged_attention, q, k, v, meta, scale, sinks=sinks, window=window)
    ref = reference.paged_attention(
        q.float(), k.float(), v.float(), meta, scale, sinks=sinks.float(), window=window
    )
    assert out.dtype == dtype and rel_err(out, ref) < 2e-2


def test_sliding_decode_replays_in_a_cuda_graph() -> None:
    q, k, v, sinks, meta = attention_case(
        [1] * 8, [5 + 300 * i for i in range(8)], torch.bfloat16, 3
    )
    ops.paged_attention(q, k, v, meta, DIM**-0.5, sinks=sinks, window=WINDOW)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.paged_attention(q, k, v, meta, DIM**-0.5, sinks=sinks, window=WINDOW)
    q.copy_(torch.randn_like(q))
    graph.replay()
    ref = reference.paged_attention(
        q.float(), k.float(), v.float(), meta, DIM**-0.5, sinks=sinks.float(), window=WINDOW
    )
    assert rel_err(out, ref) < 2e-2


def expert_case(rows: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", generator=gen) / INTER**0.5
    b13 = torch.randn(EXPERTS, 2 * INTER, device="cuda", generator=gen).bfloat16()
    b2 = torch.randn(EXPERTS, HIDDEN, device="cuda", generator=gen).bfloat16()
    x = (3 * torch.randn(rows, HIDDEN, device="cuda", generator=gen)).bfloat16()
    ids = torch.rand(rows, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=-1).indices
    weights = torch.rand(rows, TOP_K, device="cuda", generator=gen).softmax(-1)
    return x, ids, weights, w13, w2, ops.ExpertGLU(b13, b2, ALPHA)


def glu_float(glu: ops.ExpertGLU) -> ops.ExpertGLU:
    return ops.ExpertGLU(glu.gate_up_bias.float(), glu.down_bias.float(), glu.alpha)


@pytest.mark.parametrize("rows", [1, 8, 64, 200])  # 200: row chunks of the decode kernels
def test_bf16_experts_with_the_glu(rows) -> None:
    x, ids, weights, w13, w2, glu = expert_case(rows, seed=rows)
    out = no_sync(ops.moe_experts, x, ids, weights, w13.bfloat16(), w2.bfloat16(), LIMIT, glu)
    ref = reference.moe_experts(x.float(), ids, weights, w13, w2, LIMIT, glu_float(glu))
    assert rel_err(out, ref) < 2e-2


@pytest.mark.parametrize("rows", [1, 8, 64, 200])
def test_mxfp4_experts_with_the_glu(rows) -> None:
    x, ids, weights, w13, w2, glu = expert_case(rows, seed=rows)
    gate_up, down = fp4.quantize_fp4(w13), fp4.quantize_fp4(w2)
    out = no_sync(ops.moe_experts_fp4, x, ids, weights, gate_up, down, LIMIT, glu)
    dq13 = fp4.dequantize_fp4(*gate_up, torch.float32)
    dq2 = fp4.dequantize_fp4(*down, torch.float32)
    ref = reference.moe_experts(x.float(), ids, weights, dq13, dq2, LIMIT, glu_float(glu))
    assert rel_err(out, ref) < 2e-2


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt-oss-gpu")
    return {
        quant: make_tiny_model(
            root / str(quant), "gpt_oss", seed=0, dtype="bfloat16", quantization=quant
        )
        for quant in (None, "mxfp4")
    }


@pytest.mark.parametrize("quant", [None, "mxfp4"])
def test_full_decode_only_graphs_give_the_eager_tokens(tiny_dirs, quant) -> None:
    prompts = [[(7 * i + 3) % 250 for i in range(n)] for n in (3, 20, 45, 130)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    tokens = {}
    for mode in ("none", "full_decode_only"):
        with LLM(str(tiny_dirs[quant]), dtype="bfloat16", device="cuda", graph_mode=mode) as llm:
            tokens[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["full_decode_only"] == tokens["none"]


@pytest.mark.parametrize("mode, ubatches", [("full_decode_only", 1), ("full", 2)])
def test_graphs_read_the_window_pool(tiny_dirs, mode, ubatches) -> None:
    """The sliding layers' own pool, smaller than the longest sequence, through the graphs'
    second table and slot buffers (cuda_graphs.py), in one and two ubatches: the eager
    tokens, and every window block back in the pool at the end."""
    prompts = [[(5 * i + 1) % 250 for i in range(n)] for n in (3, 45, 130, 61)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    limits = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_blocks=48)
    tokens = {}
    for graph_mode in ("none", mode):
        with LLM(
            str(tiny_dirs[None]),
            dtype="bfloat16",
            device="cuda",
            graph_mode=graph_mode,
            ubatches=ubatches,
            **limits,
        ) as llm:
            tokens[graph_mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            manager = llm.engine.core_client.core.block_manager
            # 1 + 4 x (1 + 2) + 4 blocks: fewer than the 170-token sequence's 11.
            assert manager.num_free_window_blocks == 16
    assert tokens[mode] == tokens["none"]
