"""Block-scaled FP8 checkpoints and online FP8, against transformers.

The oracle of an FP8 checkpoint is transformers' model loaded from the same checkpoint
dequantized by transformers' own `Fp8Dequantize` into float32 (`dequantized_copy`): its FP8
loading dequantizes on a CPU too, but needs accelerate, which afdserve does not depend on;
`test_transformers_fp8_loading_agrees` checks that both give the same weights where accelerate
is installed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize
from transformers.utils.quantization_config import FineGrainedFP8Config

from afdserve import LLM, SamplingParams
from afdserve.kernels.reference.fp8 import FP8_DTYPE, dequantize_blockwise, quantize_blockwise
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.fixtures.fp8_checkpoint import quantize_checkpoint
from afdserve.model.fixtures.tiny import FAMILIES, make_tiny_model
from afdserve.model.layers.fp8 import Fp8Linear
from afdserve.model.parts import ModelParts

BLOCK = (128, 128)
NEW_TOKENS = 16
PROMPTS = [
    [7],
    [72, 101, 108, 108, 111],
    list(range(30, 58)),
    [256, 40, 41, 42, 200, 3, 4],
    [(17 * i) % 256 for i in range(45)],
]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
SCALE = "_scale_inv"


def _dequantized(op: Fp8Dequantize, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """One weight through transformers' op. Its loader hands it one list per pattern and the
    output's key and wrapping differ between transformers releases (5.17 returns a list under
    the layer's name, 5.24 the tensor under "weight"): take the single value either way."""
    (out,) = op.convert({"weight": [weight], "weight_scale_inv": [scale]}).values()
    (out,) = out if isinstance(out, list) else [out]
    return out


def dequantized_copy(src: Path, dst: Path) -> Path:
    """`src` with every FP8 weight dequantized by transformers (float32) and no
    quantization_config: a plain checkpoint transformers' classes load as they are."""
    shutil.copytree(src, dst)
    weights = load_file(dst / "model.safetensors")
    op = Fp8Dequantize(None)
    plain = {}
    for name, tensor in weights.items():
        if name.endswith(SCALE):
            continue
        scale = weights.get(name + SCALE)
        plain[name] = tensor if scale is None else _dequantized(op, tensor, scale)
    save_file(plain, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-fp8")
    return {f: make_tiny_model(root / f, f, seed=0, quantization="fp8") for f in FAMILIES}


@pytest.fixture(scope="module")
def oracles(fp8_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("tiny-fp8-dequantized")
    return {f: dequantized_copy(path, root / f) for f, path in fp8_models.items()}


def hf_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def teacher_forced_argmax(hf: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy choice after the prompt and each prefix of `tokens`."""
    logits = hf(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def greedy(path: Path, **kwargs: object) -> list[list[int]]:
    with LLM(str(path), dtype="float32", **kwargs) as llm:
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def _transformers_quantizer() -> object:
    class Quantizer:  # what Fp8Quantize reads of transformers' quantizer
        quantization_config = FineGrainedFP8Config(weight_block_size=BLOCK)

    return Quantizer()


@pytest.mark.parametrize("shape", [(256, 384), (3, 128, 512)])
def test_whole_blocks_match_transformers(shape: tuple[int, ...]) -> None:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    weight[..., :128, 128:256] *= 50.0  # blocks of very different ranges
    q, scale = quantize_blockwise(weight, BLOCK)
    theirs = Fp8Quantize(_transformers_quantizer()).convert({"w.weight": weight})
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert scale.shape == (*shape[:-2], shape[-2] // 128, shape[-1] // 128)
    assert torch.equal(q.view(torch.uint8), theirs["w.weight"].view(torch.uint8))
    torch.testing.assert_close(scale, theirs["w.weight_scale_inv"], rtol=1e-6, atol=0)
    ref = Fp8Dequantize(None).convert({"weight": q, "weight_scale_inv": scale})["weight"]
    assert torch.equal(dequantize_blockwise(q, scale, torch.float32, BLOCK), ref)


def test_partial_blocks_are_whole_blocks_cropped() -> None:
    """A [200, 300] weight has a 2 x 3 grid whose last row and column of blocks are partial: its
    values and scales are those of the zero-padded [256, 384] weight, cropped (vLLM's and
    DeepSeek's rule; transformers' own ops take whole blocks only)."""
    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(2))
    q, scale = quantize_blockwise(weight, BLOCK)
    assert scale.shape == (2, 3)
    padded = torch.zeros(256, 384)
    padded[:200, :300] = weight
    theirs = Fp8Quantize(_transformers_quantizer()).convert({"w.weight": padded})
    assert torch.equal(q.view(torch.uint8), theirs["w.weight"][:200, :300].view(torch.uint8))
    torch.testing.assert_close(scale, theirs["w.weight_scale_inv"], rtol=1e-6, atol=0)
    q_padded = torch.zeros(256, 384, dtype=FP8_DTYPE)
    q_padded[:200, :300] = q
    ref = Fp8Dequantize(None).convert({"weight": q_padded, "weight_scale_inv": scale})["weight"]
    assert torch.equal(dequantize_blockwise(q, scale, torch.float32, BLOCK), ref[:200, :300])
    # Within 1/16 of each block's largest value: e4m3 keeps 3 mantissa bits.
    err = (dequantize_blockwise(q, scale, torch.float32, BLOCK) - weight).abs()
    assert float(err.max()) <= float(weight.abs().max()) / 16


def test_make_tiny_model_writes_the_public_layout(
    fp8_models: dict[str, Path], tmp_path: Path
) -> None:
    from afdserve.cli import main

    assert (
        main(
            ["make-tiny-model", str(tmp_path / "m"), "--family", "mixtral", "--quantization", "fp8"]
        )
        == 0
    )
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization_config"] == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }
    weights = load_file(tmp_path / "m" / "model.safetensors")
    assert weights.keys() == load_file(fp8_models["mixtral"] / "model.safetensors").keys()
    for name, tensor in weights.items():
        if name.endswith(SCALE):
            assert tensor.dtype == torch.float32 and tensor.shape == (1, 1), name
        elif name + SCALE in weights:
            assert tensor.dtype == FP8_DTYPE and ".gate." not in name, name
        else:  # embeddings, norms, routers, lm_head
            assert tensor.dtype == torch.float32, name
            assert any(k in name for k in ("embed", "norm", ".gate.", "lm_head")), name
    assert weights["model.layers.1.block_sparse_moe.experts.7.w2.weight"].dtype == FP8_DTYPE


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_on_the_dequantized_checkpoint(
    family: str, fp8_models: dict[str, Path], oracles: dict[str, Path]
) -> None:
    model, report = load_model(fp8_models[family], ModelParts.colocated(), "float32")
    assert not report.unexpected
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert linears and all(m.weight.dtype == FP8_DTYPE for m in linears)
    experts = model.model.layers[2].mlp.experts
    assert experts.gate_up_proj.dtype == experts.down_proj.dtype == FP8_DTYPE
    assert model.lm_head.weight.dtype == model.model.embed_tokens.weight.dtype == torch.float32
    hf = hf_model(oracles[family])
    got = greedy(fp8_models[family])
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert teacher_forced_argmax(hf, prompt, tokens) == tokens, prompt
    assert len({tuple(t) for t in got}) == len(PROMPTS)  # not a degenerate model


def test_transformers_fp8_loading_agrees(fp8_models: dict[str, Path], oracles: dict) -> None:
    """transformers' own FP8 loading (which dequantizes on a CPU) reads the checkpoint as the
    oracle does: same weights, bit for bit."""
    pytest.importorskip("accelerate")
    for family in ("deepseek_v3", "mixtral"):
        theirs = hf_model(fp8_models[family]).state_dict()
        for name, tensor in hf_model(oracles[family]).state_dict().items():
            assert torch.equal(theirs[name], tensor), name


def test_each_role_reads_only_its_half(fp8_models: dict[str, Path]) -> None:
    path = fp8_models["deepseek_v3"]
    full, _ = load_model(path, ModelParts.colocated(), "float32")
    want = full.state_dict()
    attention, report = load_model(path, ModelParts(attention=True, ffn=False), "float32")
    assert report.skipped_other_half > 0 and not report.unexpected
    assert not [n for n in report.loaded if ".mlp." in n]  # no expert weight, no expert scale
    ffn, report = load_model(path, ModelParts(attention=False, ffn=True), "float32")
    assert not [n for n in report.loaded if "self_attn" in n]
    shard, _ = load_model(path, ModelParts(attention=False, ffn=True, experts=(5, 2)), "float32")
    for half in (attention, ffn):
        for name, tensor in half.state_dict().items():
            assert torch.equal(tensor.view(torch.uint8), want[name].view(torch.uint8)), name
    for name in ("gate_up_proj", "gate_up_proj_scale_inv", "down_proj", "down_proj_scale_inv"):
        name = f"model.layers.1.mlp.experts.{name}"
        got = shard.state_dict()[name]
        assert torch.equal(got.view(torch.uint8), want[name][[5, 2]].view(torch.uint8)), name


@pytest.mark.parametrize("family", FAMILIES)
def test_online_fp8_is_the_fp8_checkpoint(
    family: str, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    """quantization="fp8" on a float32 checkpoint quantizes it at load into the layout of the
    FP8 checkpoint written from it: the same weights, so the same tokens."""
    src = tiny_models[family]
    fp8_dir = quantize_checkpoint(shutil.copytree(src, tmp_path / "fp8"))
    online, report = load_model(src, ModelParts.colocated(), "float32", quantization="fp8")
    stored, _ = load_model(fp8_dir, ModelParts.colocated(), "float32", quantization="fp8")
    _, plain = load_model(src, ModelParts.colocated(), "float32")
    want = stored.state_dict()
    assert online.config.quantization is not None and online.config.quantization.online
    # Held in FP8: one byte per quantized weight instead of four, plus a float32 per block.
    state = online.state_dict()
    fp8_numel = sum(t.numel() for t in state.values() if t.dtype == FP8_DTYPE)
    scales = sum(t.numel() for n, t in state.items() if n.endswith(SCALE))
    assert report.bytes == plain.bytes - 3 * fp8_numel + 4 * scales
    for name, tensor in online.state_dict().items():
        assert tensor.dtype == want[name].dtype, name
        assert torch.equal(tensor.view(torch.uint8), want[name].view(torch.uint8)), name
    assert greedy(src, quantization="fp8") == greedy(fp8_dir)


def test_dummy_fp8_weights_are_the_quantized_dummy_weights(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["qwen3_moe"]
    plain, _ = load_model(path, ModelParts.colocated(), "float32", load_format="dummy", seed=4)
    fp8, _ = load_model(
        path, ModelParts.colocated(), "float32", load_format="dummy", seed=4, quantization="fp8"
    )
    ffn, _ = load_model(
        path,
        ModelParts(attention=False, ffn=True),
        "float32",
        load_format="dummy",
        seed=4,
        quantization="fp8",
    )
    want, got = plain.state_dict(), fp8.state_dict()
    for name, tensor in got.items():
        if name.endswith(SCALE):
            continue
        if tensor.dtype != FP8_DTYPE:
            assert torch.equal(tensor, want[name]), name
        else:
            gate_up = name.endswith("gate_up_proj")
            halves = want[name].chunk(2, dim=-2) if gate_up else (want[name],)
            q = torch.cat([quantize_blockwise(h, BLOCK)[0] for h in halves], dim=-2)
            assert torch.equal(tensor.view(torch.uint8), q.view(torch.uint8)), name
    for name, tensor in ffn.state_dict().items():
        assert torch.equal(tensor.view(torch.uint8), got[name].view(torch.uint8)), name


def test_two_attention_ranks_match_colocated(
    fp8_models: dict[str, Path], tiny_models: dict[str, Path]
) -> None:
    """Rank processes over gloo, each loading its half: an FP8 checkpoint, and online FP8 (the
    option travels to every rank)."""
    path = fp8_models["deepseek_v3"]
    assert greedy(path, topology="2A1F", max_num_batched_tokens=16) == greedy(path)
    plain = tiny_models["qwen3_moe"]
    assert greedy(plain, topology="2A1F", quantization="fp8") == greedy(plain, quantization="fp8")


def test_expert_parallel_shards_match_colocated(fp8_models: dict[str, Path]) -> None:
    """Two FFN ranks, each holding half of the FP8 experts with their scales; the group
    exchanges activations in the model dtype (an FFN half's first weight may be float8)."""
    path = fp8_models["deepseek_v3"]
    assert greedy(path, topology="1A2F", ffn_expert_parallel=True) == greedy(path)


def test_modules_to_not_convert_stay_in_the_model_dtype(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    # A prefix up to a module boundary, the same for a stack of experts, and a suffix: the
    # three ways transformers reads these names.
    keep = ("model.layers.0.self_attn", "model.layers.3.mlp.experts", "shared_experts.up_proj")
    path = quantize_checkpoint(
        shutil.copytree(tiny_models["deepseek_v2"], tmp_path / "fp8"), modules_to_not_convert=keep
    )
    weights = load_file(path / "model.safetensors")
    assert weights["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float32
    assert weights["model.layers.3.mlp.experts.5.up_proj.weight"].dtype == torch.float32
    assert weights["model.layers.2.mlp.experts.5.up_proj.weight"].dtype == FP8_DTYPE
    model, report = load_model(path, ModelParts.colocated(), "float32")
    assert not report.unexpected
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.o_proj, torch.nn.Linear)
    assert isinstance(layers[1].self_attn.o_proj, Fp8Linear)
    assert layers[3].mlp.experts.fp8_block is None and layers[2].mlp.experts.fp8_block == BLOCK
    assert isinstance(layers[2].mlp.shared_experts.up_proj, torch.nn.Linear)
    assert isinstance(layers[2].mlp.shared_experts.down_proj, Fp8Linear)
    hf = hf_model(dequantized_copy(path, tmp_path / "oracle"))
    for prompt, tokens in zip(PROMPTS, greedy(path), strict=True):
        assert teacher_forced_argmax(hf, prompt, tokens) == tokens, prompt
