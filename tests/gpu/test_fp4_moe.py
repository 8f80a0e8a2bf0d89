"""The FP4 routed-expert kernels (kernels/moe/fp4_decode.py) against the plain-torch reference
(kernels/reference/fp4.py's dequantization, then reference.moe_experts in float32), at
DeepSeek-V4-Flash's expert shape (hidden 4096, intermediate 2048, top-6, swiglu_limit 10) on 16
experts.

The weights the kernels decode are the reference's bit for bit (tests/kernels/
test_fp4_kernel_interpret.py checks the decode on CPU), so what the tolerance covers is bf16: h
stored in bf16 between the launches, and the output.

Runtime: one Triton compile per kernel and tile shape (`triton_fp4_moe.TILES`, and the variants
of `tile_shapes`; about 10-20 s each on first use, then the Triton cache); the weights are drawn
and quantized once, on the GPU; the whole file takes well under a minute once compiled."""

from __future__ import annotations

import pytest
import torch

from afdserve.kernels import ops
from afdserve.kernels.reference import fp4
from afdserve.kernels.reference import layers as reference
from tests.gpu.sync import no_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FLASH = (16, 4096, 2048, 6, 10.0)  # experts (of 256), hidden, intermediate, top_k, swiglu_limit
Stack = tuple[torch.Tensor, torch.Tensor]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def fp4_experts(experts: int, hidden: int, inter: int, seed: int) -> tuple[Stack, Stack]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter**0.5
    return fp4.quantize_fp4(w13), fp4.quantize_fp4(w2)


@pytest.fixture(scope="module")
def flash_experts() -> tuple[Stack, Stack]:
    experts, hidden, inter, _, _ = FLASH
    return fp4_experts(experts, hidden, inter, seed=0)


def routed_rows(
    rows: int, experts: int, hidden: int, top_k: int, seed: int, dtype: torch.dtype = torch.bfloat16
):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (2 * torch.randn(rows, hidden, device="cuda", generator=gen)).to(dtype)
    ids = torch.rand(rows, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(rows, top_k, device="cuda", generator=gen)
    return x, ids, weights


def plain_reference(x, ids, weights, gate_up: Stack, down: Stack, limit):
    """The reference dequantization of the touched experts, the experts in float32; pairs of id
    -1 stay -1 (no expert)."""
    hit, local = ids.clamp_min(0).unique(return_inverse=True)
    local = torch.where(ids >= 0, local, -1)
    w13 = fp4.dequantize_fp4(gate_up[0][hit], gate_up[1][hit], torch.float32)
    w2 = fp4.dequantize_fp4(down[0][hit], down[1][hit], torch.float32)
    return reference.moe_experts(x.float(), local, weights.float(), w13, w2, limit)


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fp4_experts_match_reference(flash_experts, rows):
    from afdserve.kernels.moe import fp4_decode as triton_fp4_moe

    experts, hidden, _, top_k, limit = FLASH
    gate_up, down = flash_experts
    x, ids, weights = routed_rows(rows, experts, hidden, top_k, seed=rows)
    assert triton_fp4_moe.supports(x, gate_up, down)
    out = no_sync(ops.moe_experts_fp4, x, ids, weights, gate_up, down, limit)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, plain_reference(x, ids, weights, gate_up, down, limit)) < 2e-2


def tile_shapes():
    """The table's shapes, and variants of its first: the weights as the dot's B operand, a
    narrower K step, 8 warps over twice the columns, K split in 2 and 8, one dot a K step."""
    try:  # called at collection, also where there is no Triton (nor CUDA: all skip then)
        from afdserve.kernels.moe import fp4_decode as k
    except ImportError:
        return []
    first = k.TILES[0][1]
    wide = first._replace(gate_up_columns=2 * first.gate_up_columns, warps=8)
    variants = (
        first._replace(weights_left=False),
        first._replace(k_block=128),
        wide,
        first._replace(splits=2),
        first._replace(splits=8),
        first._replace(one_dot=True),
        first._replace(one_dot=True, splits=4),
    )
    return list(dict.fromkeys([t for _, t in k.TILES] + list(variants)))


@pytest.mark.parametrize("tiles", tile_shapes(), ids=str)
def test_fp4_tile_shapes_match_reference(flash_experts, tiles):
    """Every shape the table may pick (and the sweep's kinds of variant) computes the same."""
    from afdserve.kernels.moe import fp4_decode as triton_fp4_moe

    experts, hidden, _, top_k, limit = FLASH
    gate_up, down = flash_experts
    x, ids, weights = routed_rows(8, experts, hidden, top_k, seed=8)
    out = no_sync(
        triton_fp4_moe.moe_experts, x, ids, weights, gate_up, down, limit, lambda pairs: tiles
    )
    assert rel_err(out, plain_reference(x, ids, weights, gate_up, down, limit)) < 2e-2


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_fp4_experts_replay_in_cuda_graph(flash_experts, rows):
    """Captured once per batch size, replayed on new rows and routing copied into the captured
    buffers; the expert weights stay FP4 (no bf16 copy is made: memory stays flat)."""
    experts, hidden, inter, top_k, limit = FLASH
    gate_up, down = flash_experts
    x, ids, weights = routed_rows(rows, experts, hidden, top_k, seed=100)
    ops.moe_experts_fp4(x, ids, weights, gate_up, down, limit)  # compile outside the capture
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe_experts_fp4(x, ids, weights, gate_up, down, limit)
    # One bf16 copy of one expert's gate_up alone would be 2 * 2I * H bytes.
    assert torch.cuda.memory_allocated() - before < 2 * 2 * inter * hidden
    for seed in (101, 102):
        new_x, new_ids, new_weights = routed_rows(rows, experts, hidden, top_k, seed)
        x.copy_(new_x), ids.copy_(new_ids), weights.copy_(new_weights)
        graph.replay()
        assert rel_err(out, plain_reference(x, ids, weights, gate_up, down, limit)) < 2e-2


@pytest.mark.parametrize("splits", [2, 4])
def test_fp4_split_k_replays_in_cuda_graph(flash_experts, splits):
    """A K-split launch (each tile's last split sums the partials) captured once and replayed on
    new rows: its counters are back at zero after every launch, so each replay sums anew."""
    from afdserve.kernels.moe import fp4_decode as k
    from afdserve.kernels.triton import counters

    experts, hidden, _, top_k, limit = FLASH
    gate_up, down = flash_experts
    tiles = k.TILES[0][1]._replace(splits=splits)
    x, ids, weights = routed_rows(2, experts, hidden, top_k, seed=200)

    def run():
        return k.moe_experts(x, ids, weights, gate_up, down, limit, lambda pairs: tiles)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    for seed in (201, 202, 203):
        new_x, new_ids, new_weights = routed_rows(2, experts, hidden, top_k, seed)
        x.copy_(new_x), ids.copy_(new_ids), weights.copy_(new_weights)
        graph.replay()
        assert rel_err(out, plain_reference(x, ids, weights, gate_up, down, limit)) < 2e-2
    torch.cuda.synchronize()
    assert all(not c.any() for c in counters._COUNTERS.values())


def test_fp4_experts_prefill_chunks_and_absent_experts():
    """More pairs than one launch takes (row chunks), fp16 rows, no clamp, and pairs with id -1
    (an expert-parallel shard's experts held elsewhere), which contribute nothing."""
    from afdserve.kernels.moe import fp4_decode as triton_fp4_moe

    rows = triton_fp4_moe.MAX_PAIRS // 4 + 5
    gate_up, down = fp4_experts(16, 512, 256, seed=7)
    x, ids, weights = routed_rows(rows, 16, 512, 4, seed=7, dtype=torch.float16)
    ids[::3, 1] = -1
    ref = fp4.moe_experts_fp4(x.float(), ids, weights, gate_up, down)
    # The decode kernels' own chunks, and the dispatch (past one launch: fp4_grouped's tiles).
    for run in (triton_fp4_moe.moe_experts, ops.moe_experts_fp4):
        out = no_sync(run, x, ids, weights, gate_up, down, None)
        assert out.dtype == torch.float16
        assert rel_err(out, ref) < 2e-2, run


@pytest.mark.parametrize("rows", [256, 1024])
def test_fp4_prefill_path_matches_reference(flash_experts, rows):
    """From `fp4_grouped.MIN_PAIRS` pairs (prefill) the prefill path, with the limit and with
    pairs of id -1: as the dispatch picks it, each way (weights decoded in registers per tile of
    pairs; a bf16 copy over groups of three experts); then captured and replayed on new rows."""
    from afdserve.kernels.moe import fp4_grouped

    experts, hidden, inter, top_k, limit = FLASH
    gate_up, down = flash_experts
    x, ids, weights = routed_rows(rows, experts, hidden, top_k, seed=rows)
    ids[::7, 2] = -1
    assert ids.numel() >= fp4_grouped.MIN_PAIRS and fp4_grouped.supports(x, gate_up, down)
    want = plain_reference(x, ids, weights, gate_up, down, limit)
    out = no_sync(ops.moe_experts_fp4, x, ids, weights, gate_up, down, limit)
    assert out.dtype == torch.bfloat16 and rel_err(out, want) < 2e-2
    three = 3 * 3 * hidden * inter * 2
    for direct in (True, False):
        out = no_sync(
            fp4_grouped.moe_experts,
            x,
            ids,
            weights,
            gate_up,
            down,
            limit,
            group_bytes=three,
            direct=direct,
        )
        assert rel_err(out, want) < 2e-2, direct
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.moe_experts_fp4(x, ids, weights, gate_up, down, limit)
    new_x, new_ids, new_weights = routed_rows(rows, experts, hidden, top_k, seed=rows + 1)
    x.copy_(new_x), ids.copy_(new_ids), weights.copy_(new_weights)
    graph.replay()
    assert rel_err(out, plain_reference(x, ids, weights, gate_up, down, limit)) < 2e-2


def test_gpt_oss_experts_at_prefill_sizes_match_reference():
    """gpt-oss's experts (biases, gain, clamp) past the decode kernels' pairs: MXFP4 through
    the FP4 prefill path, bf16 through the grouped GEMM, against the reference."""
    from afdserve.kernels.moe import fp4_grouped

    experts, hidden, inter, top_k, limit = 16, 512, 256, 4, 7.0
    gate_up, down = fp4_experts(experts, hidden, inter, seed=11)
    x, ids, weights = routed_rows(600, experts, hidden, top_k, seed=11)
    gen = torch.Generator(device="cuda").manual_seed(12)
    glu = reference.ExpertGLU(
        (0.5 * torch.randn(experts, 2 * inter, device="cuda", generator=gen)).bfloat16(),
        (0.5 * torch.randn(experts, hidden, device="cuda", generator=gen)).bfloat16(),
        1.702,
    )
    glu32 = reference.ExpertGLU(glu.gate_up_bias.float(), glu.down_bias.float(), glu.alpha)
    assert ids.numel() >= fp4_grouped.MIN_PAIRS
    want = fp4.moe_experts_fp4(x.float(), ids, weights, gate_up, down, limit, glu32)
    out = no_sync(ops.moe_experts_fp4, x, ids, weights, gate_up, down, limit, glu)
    assert rel_err(out, want) < 2e-2
    w13 = fp4.dequantize_fp4(*gate_up, torch.bfloat16)
    w2 = fp4.dequantize_fp4(*down, torch.bfloat16)
    out = no_sync(ops.moe_experts, x, ids, weights, w13, w2, limit, glu)
    assert rel_err(out, want) < 2e-2


@pytest.mark.parametrize("rows", [1, 8, 64])
def test_v4_ffn_half_from_fp4_checkpoint_in_cuda_graph(tmp_path_factory, rows):
    """DeepSeek-V4's FFN half (router, FP4 experts through these kernels, FP8 shared expert)
    loaded on the GPU from a tiny FP4 checkpoint, captured and replayed, against the same
    checkpoint's FFN half on the CPU in float32 (the reference dequantization)."""
    from afdserve.model.checkpoint.loader import load_model
    from afdserve.model.fixtures.tiny import make_tiny_model
    from afdserve.model.parts import ModelParts

    path = make_tiny_model(
        tmp_path_factory.mktemp("v4") / "fp4",
        "deepseek_v4",
        hash_layers=1,
        quantization="fp8",
        expert_dtype="fp4",
    )
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
        # The tiny model's dims (32) are below the kernels' K step (64): on CUDA they take the
        # reference dequantization to bf16, whose bf16 GEMMs round more than fp32 accumulation.
        assert rel_err(out, want) < 4e-2, layer


@pytest.mark.parametrize(
    ("dtype", "weights_left", "inputs", "one_dot"),
    [
        (torch.bfloat16, True, 576, False),
        (torch.float16, True, 576, False),
        (torch.bfloat16, False, 512, False),  # this order takes no K tail (`_launch` refuses it)
        (torch.float16, False, 512, False),
        (torch.bfloat16, True, 576, True),  # one dot a K step (`Tiles.one_dot`)
        (torch.float16, True, 576, True),
    ],
)
def test_decode_is_the_reference_bit_for_bit(dtype, weights_left, inputs, one_dot):
    """Every byte (every code in both nibbles) at every byte of a word, under every scale byte
    the dtype's path takes (bf16: `fp4_decode.SCALE_BYTES`, its weights taken 2^-16 small by a
    packed bf16 multiply, subnormal 0.5 codes included; fp16: scales fp16 holds), over 576
    inputs (K steps of 128 and a tail of 64) or 512: the decoded weights equal
    `fp4.dequantize_fp4`'s in that dtype bit for bit (zeros as +0: the read-back's sums lose a
    zero's sign; the CPU formula tests keep it)."""
    from afdserve.kernels.moe import fp4_decode as k

    low, high = k.SCALE_BYTES if dtype == torch.bfloat16 else (103, 140)
    scales = torch.arange(low, high + 1, dtype=torch.uint8)
    scales = torch.cat([scales, scales[: -len(scales) % 64]])  # whole tiles of 64 rows
    codes = torch.arange(256, dtype=torch.uint8)  # 512 inputs a row: every byte once
    packed = torch.stack([codes.roll(r) for r in range(len(scales))])  # every byte offset
    packed = torch.cat([packed, packed[:, :32]], dim=1)[:, : inputs // 2]
    scale = scales[:, None].expand(-1, inputs // 32).contiguous()
    from tests.gpu.fp4_read_back import decoded_weights

    got = decoded_weights((packed.cuda(), scale.cuda()), dtype, weights_left, one_dot).cpu()
    # A sum starting from +0 reads a -0 weight back as +0: zeros compare as +0.
    want = fp4.dequantize_fp4(packed, scale, dtype).float() + 0.0
    wrong = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
    assert not len(wrong), (
        f"{len(wrong)} of {got.numel()} weights differ, first (row, input, got, want): "
        f"{[(r, i, got[r, i].item(), want[r, i].item()) for r, i in wrong[:6].tolist()]}"
    )


def test_weights_as_b_operand_with_a_k_tail_are_refused():
    """The weights as the dot's B operand sum a narrower last K step twice when compiled (the
    read-back above showed it): a launch that would take one is refused by name."""
    from afdserve.kernels.moe import fp4_decode as triton_fp4_moe

    gate_up, down = fp4_experts(4, 576, 512, seed=3)
    x, ids, weights = routed_rows(2, 4, 576, 2, seed=3)
    tiles = triton_fp4_moe.TILES[0][1]._replace(weights_left=False)
    with pytest.raises(ValueError, match=r"B operand over dims \[576\].*allowed: weights_left"):
        triton_fp4_moe.moe_experts(x, ids, weights, gate_up, down, None, lambda pairs: tiles)
