"""Linear layers that read the same rows packed into one GEMM (model/layers/packed.py), as the
loader packs them: DeepSeek-V4's q_a with kv, CSA's q_b with its indexer's, each compressor's kv
and gate with its indexer's kv, gate and head weights, and the shared experts' gate and up; in
float32 and in V4-Flash's FP8 layout (at 128-row projections, so that the scale grids stack).
What cannot pack (kinds mixed, biases on some, FP8 rows off a scale block) is left as it was.
The oracle is each layer run alone: the packed outputs must equal them, and the layers'
parameters must be views of the packed matrix (what the checkpoint loaded)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from afdserve.kernels import ops
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families.deepseek_v4.attention import V4Attention
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.fixtures.deepseek_v4_quant import quantize_v4_checkpoint
from afdserve.model.layers.common import GatedMLP
from afdserve.model.layers.fp8 import Fp8Linear
from afdserve.model.layers.packed import PackedLinear
from afdserve.model.parts import ModelParts


def v4_layers(path: Path, kind: type = V4Attention) -> list[nn.Module]:
    model, _ = load_model(path, ModelParts.colocated(), "float32")
    layers = [m for m in model.modules() if isinstance(m, kind)]
    assert layers
    return layers


def check_gate_up(mlp: GatedMLP, x: torch.Tensor, tol: float) -> None:
    """The packed gate/up (swiglu over its column slices) as the two layers alone."""
    assert mlp.gate_up is not None
    shares_storage(mlp.up_proj, mlp.gate_up, 1)
    gate, up = mlp.gate_up.split(x)
    torch.testing.assert_close(gate, mlp.gate_proj(x), rtol=tol, atol=1e-6)
    torch.testing.assert_close(up, mlp.up_proj(x), rtol=tol, atol=1e-6)
    alone = mlp.down_proj(ops.swiglu(mlp.gate_proj(x), mlp.up_proj(x), mlp.limit))
    torch.testing.assert_close(mlp(x), alone, rtol=tol, atol=1e-6)


def shares_storage(layer: nn.Module, packed: PackedLinear, index: int) -> None:
    first = sum(packed.sizes[:index])
    assert layer.weight.data_ptr() == packed.weight[first:].data_ptr()


def test_v4_projections_pack_and_equal_each_layer_alone(tmp_path: Path) -> None:
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(0))
    for attn in v4_layers(make_tiny_v4(tmp_path / "v4", seed=1)):
        assert attn.q_a_kv is not None and attn.q_a_kv.sizes == (16, 16)
        shares_storage(attn.kv_proj, attn.q_a_kv, 1)
        q_a, kv = attn.q_a_kv.split(x)
        torch.testing.assert_close(q_a, attn.q_a_proj(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(kv, attn.kv_proj(x), rtol=1e-6, atol=1e-6)
        comp = attn.compressor
        if comp is None:
            assert attn.kind == "sliding_attention" and attn.q_b is None
            continue
        own, index = comp.project(x)
        alone = [comp.kv_proj, comp.gate_proj]
        got = list(own)
        if attn.kind == "compressed_sparse_attention":
            indexer = comp.indexer
            alone += [indexer.kv_proj, indexer.gate_proj, indexer.weights_proj]
            got += list(index)
            # q_b with the indexer's: both read the q residual.
            assert attn.q_b is not None and attn.q_b.sizes == (4 * 16, 8 * 8)
            shares_storage(indexer.q_b_proj, attn.q_b, 1)
            residual = torch.randn(7, 16, generator=torch.Generator().manual_seed(2))
            q, index_q = attn.q_b.split(residual)
            torch.testing.assert_close(q, attn.q_b_proj(residual), rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(index_q, indexer.q_b_proj(residual), rtol=1e-6, atol=1e-6)
        else:
            assert index is None and attn.q_b is None
    for mlp in v4_layers(tmp_path / "v4", GatedMLP):  # the shared experts
        check_gate_up(mlp, x, 1e-6)
        assert comp.packed is not None and len(comp.packed.sizes) == len(alone)
        for i, (layer, out) in enumerate(zip(alone, got, strict=True)):
            shares_storage(layer, comp.packed, i)
            assert not out.is_contiguous()  # a column slice of the packed output
            torch.testing.assert_close(out, layer(x), rtol=1e-6, atol=1e-6)


def test_v4_fp8_projections_pack_their_scale_grids(tmp_path: Path) -> None:
    """V4-Flash's layout (q_a and kv FP8 with ue8m0 block scales) at 128-row projections."""
    path = make_tiny_v4(
        tmp_path / "v4",
        seed=2,
        q_lora_rank=128,
        head_dim=128,
        index_head_dim=64,
        moe_intermediate_size=128,
    )
    quantize_v4_checkpoint(path, expert_dtype="fp8")
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    for attn in v4_layers(path):
        packed = attn.q_a_kv
        assert isinstance(attn.q_a_proj, Fp8Linear) and packed is not None
        assert packed.weight.shape == (256, 32) and packed.scale_inv.shape == (2, 1)
        shares_storage(attn.kv_proj, packed, 1)
        assert attn.kv_proj.weight_scale_inv.data_ptr() == packed.scale_inv[1:].data_ptr()
        q_a, kv = packed.split(x)
        torch.testing.assert_close(q_a, attn.q_a_proj(x), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(kv, attn.kv_proj(x), rtol=1e-5, atol=1e-6)
        if attn.kind == "compressed_sparse_attention":  # q_b (4 x 128) with the indexer's (8 x 64)
            q_b, indexer = attn.q_b, attn.compressor.indexer
            assert q_b is not None and q_b.sizes == (512, 512) and q_b.scale_inv.shape == (8, 1)
            residual = torch.randn(5, 128, generator=torch.Generator().manual_seed(3))
            q, index_q = q_b.split(residual)
            torch.testing.assert_close(q, attn.q_b_proj(residual), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(index_q, indexer.q_b_proj(residual), rtol=1e-5, atol=1e-6)
    for mlp in v4_layers(path, GatedMLP):  # the shared experts, FP8 (two 128-row blocks)
        assert isinstance(mlp.gate_proj, Fp8Linear) and mlp.gate_up.scale_inv.shape == (2, 1)
        check_gate_up(mlp, x, 1e-5)


@pytest.mark.parametrize(
    "layers",
    [
        lambda: [nn.Linear(8, 4, bias=True), nn.Linear(8, 4, bias=False)],
        lambda: [nn.Linear(8, 128, bias=False), Fp8Linear(8, 128, False, (128, 128))],
        lambda: [Fp8Linear(8, 128, False, (128, 128)), Fp8Linear(8, 64, False, (128, 128))],
    ],
    ids=["biases-on-some", "kinds-mixed", "fp8-rows-off-a-block"],
)
def test_what_cannot_share_a_matrix_stays_apart(layers) -> None:
    built = layers()
    before = [layer.weight.data_ptr() for layer in built]
    assert PackedLinear.of(built) is None
    assert [layer.weight.data_ptr() for layer in built] == before
