"""DeepSeek-V4 in its published precision (FP8 projections with ue8m0 block scales, routed experts
in FP4 or FP8), against transformers' `DeepseekV4ForCausalLM` loading the same checkpoint: on a
CPU its FP8 quantizer dequantizes every weight that has a scale (`Fp8Dequantize`, int8-packed
FP4 included), so its model is the dequantized checkpoint, teacher-forced over whole sequences.
The tiny checkpoints are written by `afdserve make-tiny-model --quantization fp8
[--expert-dtype fp4]` in DeepSeek-V4-Flash's spelling and dtypes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV4ForCausalLM

from afdserve import LLM, SamplingParams
from afdserve.cli import main
from afdserve.kernels.reference.fp4 import dequantize_fp4
from afdserve.kernels.reference.fp8 import dequantize_blockwise
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families.deepseek_v4.quant import Fp4Experts
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.layers.fp8 import Fp8Linear
from afdserve.model.parts import ModelParts
from afdserve.model.quantization import check_quantization
from tests.model.deepseek_v4_helpers import boundary_ties

pytest.importorskip("accelerate")  # transformers' FP8 loading needs it
EXPERT_DTYPES = ("fp4", "fp8")
LENGTHS = (3, 9, 29)
KINDS = ["hash_moe", "moe", "moe", "moe"]


def make(root: Path, expert_dtype: str) -> Path:
    out = root / expert_dtype
    assert (
        main(
            [
                "make-tiny-model",
                str(out),
                "--family",
                "deepseek_v4",
                "--quantization",
                "fp8",
                "--expert-dtype",
                expert_dtype,
            ]
        )
        == 0
    )
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4-quant")
    return {e: make(root, e) for e in EXPERT_DTYPES}


@pytest.fixture(scope="module")
def theirs(checkpoints: dict[str, Path]) -> dict[str, DeepseekV4ForCausalLM]:
    return {
        e: DeepseekV4ForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        for e, path in checkpoints.items()
    }


@pytest.fixture(scope="module")
def ours(checkpoints: dict[str, Path]) -> dict:
    models = {}
    for e, path in checkpoints.items():
        model, report = load_model(path, ModelParts.colocated(), "float32")
        assert report.unexpected == []
        models[e] = model
    return models


def prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed))


def close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-5) -> None:
    torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=0.0)


def test_make_tiny_model_writes_flash_layout(checkpoints: dict[str, Path]) -> None:
    config = json.loads((checkpoints["fp4"] / "config.json").read_text())
    assert config["expert_dtype"] == "fp4"
    assert config["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    assert "expert_dtype" not in json.loads((checkpoints["fp8"] / "config.json").read_text())
    for path in checkpoints.values():
        check_quantization(path, None)  # what the frontend checks before any rank starts
    with safe_open(str(checkpoints["fp4"] / "model.safetensors"), "pt") as f:
        meta = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in f.keys()}
    assert not [k for k in meta if k.startswith("model.")] and "embed.weight" in meta
    assert meta["layers.1.ffn.experts.2.w1.weight"] == ("I8", [32, 16])  # [I, H / 2]
    assert meta["layers.1.ffn.experts.2.w1.scale"] == ("F8_E8M0", [32, 1])  # [I, H / 32]
    assert meta["layers.1.ffn.experts.2.w2.weight"] == ("I8", [32, 16])  # [H, I / 2]
    assert meta["layers.1.attn.wq_a.weight"] == ("F8_E4M3", [16, 32])
    assert meta["layers.1.attn.wq_a.scale"] == ("F8_E8M0", [1, 1])
    assert meta["layers.1.attn.indexer.wq_b.scale"] == ("F8_E8M0", [1, 1])
    assert meta["layers.1.ffn.shared_experts.w2.weight"][0] == "F8_E4M3"
    for bf16 in (
        "layers.1.attn.compressor.wkv.weight",
        "layers.1.attn.indexer.weights_proj.weight",
        "layers.1.ffn.gate.weight",
        "head.weight",
    ):
        assert meta[bf16][0] == "F32" and bf16.replace(".weight", ".scale") not in meta


def test_modules_hold_the_checkpoint_precision(ours: dict) -> None:
    fp4, fp8 = ours["fp4"], ours["fp8"]
    layer = fp4.model.layers[1]
    assert isinstance(layer.self_attn.q_a_proj, Fp8Linear)
    assert isinstance(layer.self_attn.compressor.indexer.q_b_proj, Fp8Linear)
    assert isinstance(layer.mlp.shared_experts.down_proj, Fp8Linear)
    assert not isinstance(layer.self_attn.compressor.kv_proj, Fp8Linear)
    assert not isinstance(layer.self_attn.compressor.indexer.weights_proj, Fp8Linear)
    experts = layer.mlp.experts
    assert isinstance(experts, Fp4Experts) and experts.gate_up_proj.dtype == torch.uint8
    assert tuple(experts.gate_up_proj.shape) == (4, 64, 16)  # [E, 2I, H / 2]
    assert tuple(experts.down_proj_scale_inv.shape) == (4, 32, 1)  # [E, H, I / 32]
    assert fp8.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.float8_e4m3fn


@torch.inference_mode()
def test_weights_equal_transformers_dequantized(theirs: dict, ours: dict) -> None:
    """Bit for bit: the ue8m0 scales, the nibble order and the scale groups read alike."""
    for e in EXPERT_DTYPES:
        hf, model = theirs[e].model.layers[3], ours[e].model.layers[3]
        assert torch.equal(
            model.self_attn.o_a_proj.dequantized(torch.float32), hf.self_attn.o_a_proj.weight
        )
        experts = model.mlp.experts
        if e == "fp4":
            got = dequantize_fp4(experts.down_proj, experts.down_proj_scale_inv, torch.float32)
        else:
            got = dequantize_blockwise(
                experts.down_proj, experts.down_proj_scale_inv, torch.float32, experts.fp8_block
            )
        assert torch.equal(got, hf.mlp.experts.down_proj)


@pytest.mark.parametrize("expert_dtype", EXPERT_DTYPES)
@pytest.mark.parametrize("length", LENGTHS)
@torch.inference_mode()
def test_teacher_forced_logits_match_transformers(
    theirs: dict, ours: dict, expert_dtype: str, length: int
) -> None:
    ids = prompt(length, seed=200 + length)
    model = ours[expert_dtype]
    assert boundary_ties(model, ids) == []
    want = theirs[expert_dtype](ids[None], use_cache=False).logits[0]
    got = model.forward_full(ids)
    close(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@torch.inference_mode()
def test_quantization_is_not_a_no_op(ours: dict, tmp_path: Path) -> None:
    """The same tiny model unquantized gives other logits: the comparison above sees the FP4
    values (by far more than its tolerance)."""
    plain = make_tiny_v4(
        tmp_path / "plain", 0, "float32", mlp_layer_types=KINDS, moe_intermediate_size=32
    )
    model, _ = load_model(plain, ModelParts.colocated(), "float32")
    ids = prompt(13, seed=5)
    want = ours["fp4"].forward_full(ids)
    gap = float((model.forward_full(ids) - want).abs().max()) / float(want.abs().max())
    assert gap > 1e-3


@pytest.mark.parametrize("expert_dtype", EXPERT_DTYPES)
@torch.inference_mode()
def test_each_role_reads_only_its_half(
    checkpoints: dict[str, Path], ours: dict, expert_dtype: str
) -> None:
    path, full = checkpoints[expert_dtype], ours[expert_dtype]
    attention, report = load_model(path, ModelParts(attention=True, ffn=False), "float32")
    assert report.skipped_other_half > 0 and not report.unexpected
    assert not [n for n in report.loaded if ".ffn.experts." in n or ".shared_experts." in n]
    ffn, report = load_model(path, ModelParts(attention=False, ffn=True), "float32")
    assert not [n for n in report.loaded if ".attn." in n]
    ids = prompt(9, seed=7)
    assert torch.equal(attention.forward_full(ids, ffn=ffn.ffn_half), full.forward_full(ids))
    shard, report = load_model(
        path, ModelParts(attention=False, ffn=True, experts=(3, 1)), "float32"
    )
    assert not [n for n in report.loaded if ".experts.0." in n or ".experts.2." in n]
    want = full.state_dict()
    for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
        name = f"model.layers.2.mlp.experts.{name}"
        got = shard.state_dict()[name]
        assert torch.equal(got.view(torch.uint8), want[name][[3, 1]].view(torch.uint8)), name


@torch.inference_mode()
def test_dummy_fp4_weights_agree_across_halves(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["fp4"]
    full, _ = load_model(path, ModelParts.colocated(), "float32", load_format="dummy")
    attention, _ = load_model(path, ModelParts(True, False), "float32", load_format="dummy")
    shard, _ = load_model(
        path, ModelParts(False, True, experts=(2,)), "float32", load_format="dummy"
    )
    experts = full.model.layers[1].mlp.experts
    assert isinstance(experts, Fp4Experts) and int(experts.gate_up_proj_scale_inv.max()) > 0
    got = shard.model.layers[1].mlp.experts.gate_up_proj
    assert torch.equal(got[0], experts.gate_up_proj[2])
    ids = prompt(20, seed=6)
    want = full.forward_full(ids)
    assert torch.isfinite(want).all()
    ffn, _ = load_model(path, ModelParts(False, True), "float32", load_format="dummy")
    assert torch.equal(attention.forward_full(ids, ffn=ffn.ffn_half), want)


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[7], [72, 101, 108, 108, 111], list(range(30, 43))]


@pytest.fixture(scope="module")
def engine_tokens(checkpoints: dict[str, Path]) -> list[list[int]]:
    with LLM(str(checkpoints["fp4"]), dtype="float32") as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@torch.inference_mode()
def test_engine_greedy_tokens_are_transformers_argmax(
    theirs: dict, ours: dict, engine_tokens: list[list[int]]
) -> None:
    """The engine over its paged cache, from the FP4 checkpoint: every token is the argmax of
    transformers' full forward over the prompt and the tokens before it."""
    for prompt, got in zip(PROMPTS, engine_tokens, strict=True):
        seq = torch.tensor(prompt + got)
        assert boundary_ties(ours["fp4"], seq) == []
        logits = theirs["fp4"](seq[None, :-1], use_cache=False).logits[0]
        assert got == logits[len(prompt) - 1 :].argmax(-1).tolist()


@pytest.mark.parametrize(
    ("topology", "extra"),
    [
        ("1A1F", {"connector": "inprocess", "gate_on_attention": True}),
        ("1A2F", {"ffn_expert_parallel": True}),  # rank processes, each FFN rank its experts' bytes
    ],
)
def test_afd_from_fp4_checkpoint_matches_colocated(
    checkpoints: dict[str, Path], engine_tokens: list[list[int]], topology: str, extra: dict
) -> None:
    with LLM(str(checkpoints["fp4"]), topology=topology, dtype="float32", **extra) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == engine_tokens
