"""MiniMax-M2 (`minimax_m2`) against transformers' MiniMaxM2ForCausalLM on tiny checkpoints in the
public layout (float32, CPU): prefill logits at every position (batched, chunked, padded), greedy
tokens equal to transformers' full forward teacher-forced (every generated token is the argmax of
the full forward over the prompt and the tokens before it), chunked prefill equal to one shot; the
FP8 checkpoint (MiniMax-M2's spelling) against transformers on its dequantized copy; the MTP
module's tensors skipped by name; config fields refused by name."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import MiniMaxM2ForCausalLM

from afdserve import LLM, SamplingParams
from afdserve.model.checkpoint.loader import CheckpointError, load_model
from afdserve.model.families import parse_model_config
from afdserve.model.families.decoder.model import MoECausalLM
from afdserve.model.families.minimax_m2.presets import MINIMAX_M2
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.layers.fp8 import Fp8Linear
from afdserve.model.parts import ModelParts
from afdserve.model.presets import preset_config
from tests.model.test_fp8 import dequantized_copy, teacher_forced_argmax
from tests.model.test_parity import afdserve_prefill_logits, hf_logits, relative_close

PROMPTS = [
    [7],
    [72, 101, 108, 108, 111],
    list(range(30, 58)),
    [256, 40, 41, 42, 200, 201, 202, 3, 4],
    [(17 * i) % 256 for i in range(45)],
]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
MTP_TENSORS = ["model.layers.3.input_layernorm.weight", "model.layers.3.self_attn.q_proj.weight"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("minimax") / "m2", "minimax_m2", seed=0)


@pytest.fixture(scope="module")
def hf(tiny: Path) -> MiniMaxM2ForCausalLM:
    return MiniMaxM2ForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ours(tiny: Path) -> MoECausalLM:
    model, report = load_model(tiny, ModelParts.colocated(), "float32")
    # The MTP module (num_mtp_modules=1) is not built: its tensors are skipped, by name.
    assert sorted(report.unexpected) == MTP_TENSORS
    return model


def greedy(path: Path, **kwargs: object) -> list[list[int]]:
    with LLM(str(path), dtype="float32", block_size=4, **kwargs) as llm:
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def test_modules_read_the_config(ours: MoECausalLM) -> None:
    attn = ours.model.layers[0].self_attn
    # q/k norms as wide as the projections; rotary on 8 of each head's 16 channels.
    assert attn.q_norm.weight.shape == (4 * 16,) and attn.k_norm.weight.shape == (2 * 16,)
    assert attn.rotary_dim == 8
    gate = ours.model.layers[0].mlp.gate
    assert (gate.scoring, gate.method, gate.normalize, gate.scale) == (
        "sigmoid",
        "noaux_tc",
        True,
        1.0,
    )
    assert gate.e_score_correction_bias.abs().sum() > 0  # read from block_sparse_moe.*


@pytest.mark.parametrize("chunks, pad_rows", [(1, 0), (3, 5)])
def test_prefill_logits_match_transformers(
    ours: MoECausalLM, hf: MiniMaxM2ForCausalLM, chunks: int, pad_rows: int
) -> None:
    got = afdserve_prefill_logits(ours, PROMPTS, chunks=chunks, pad_rows=pad_rows)
    for prompt, logits in zip(PROMPTS, got, strict=True):
        ref = hf_logits(hf, prompt)
        assert float(ref.std()) > 0.5
        relative_close(logits, ref)


def test_greedy_tokens_match_transformers_teacher_forced(
    tiny: Path, hf: MiniMaxM2ForCausalLM
) -> None:
    outs = greedy(tiny)
    for prompt, tokens in zip(PROMPTS, outs, strict=True):
        assert teacher_forced_argmax(hf, prompt, tokens) == tokens, prompt
    assert len({tuple(t) for t in outs}) == len(PROMPTS)
    assert min(len(set(t)) for t in outs) > 3


def test_chunked_prefill_matches_one_shot(tiny: Path) -> None:
    assert greedy(tiny, max_num_batched_tokens=8) == greedy(tiny)


def test_fp8_checkpoint_matches_transformers(tmp_path: Path) -> None:
    """MiniMax-M2's FP8 layout (fmt float8_e4m3fn; gate, bias and lm_head unconverted), its
    experts one by one under block_sparse_moe: every projection loads as FP8, and the greedy
    tokens are transformers' on the dequantized checkpoint, teacher-forced."""
    path = make_tiny_model(tmp_path / "fp8", "minimax_m2", seed=1, quantization="fp8")
    model, report = load_model(path, ModelParts.colocated(), "float32")
    assert sorted(report.unexpected) == [*MTP_TENSORS, MTP_TENSORS[1] + "_scale_inv"]
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.o_proj, Fp8Linear)
    assert layer.mlp.experts.fp8_block == (128, 128)
    assert layer.mlp.gate.weight.dtype == torch.float32
    oracle = MiniMaxM2ForCausalLM.from_pretrained(
        dequantized_copy(path, tmp_path / "plain"), dtype=torch.float32
    ).eval()
    for prompt, tokens in zip(PROMPTS, greedy(path), strict=True):
        assert teacher_forced_argmax(oracle, prompt, tokens) == tokens, prompt


def test_missing_tensor_named_as_published(tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for item in tiny.iterdir():
        if item.suffix != ".safetensors":
            (broken / item.name).write_bytes(item.read_bytes())
    weights = load_file(tiny / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.e_score_correction_bias"]
    del weights["model.layers.2.block_sparse_moe.experts.5.w3.weight"]
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_model(broken, ModelParts.colocated(), "float32")
    assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in str(err.value)
    assert "model.layers.2.block_sparse_moe.experts.5.w3.weight" in str(err.value)


def test_preset_is_the_published_shape() -> None:
    config = preset_config("minimax-m2")
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (
        62,
        48,
        8,
        128,
    )
    assert len(config.rope_inv_freq) == 32  # rotary_dim 64 of 128
    assert (config.num_experts, config.top_k, config.moe_intermediate_size) == (256, 8, 1536)
    assert config.quantization is not None and config.family_config.mtp_modules == 3
    assert preset_config("minimax-m2.5:2").num_layers == 2


@pytest.mark.parametrize(
    "change, named",
    [
        ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
        ({"use_routing_bias": False}, "use_routing_bias=False"),
        ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head'"),
        ({"shared_intermediate_size": 512}, "shared_intermediate_size=512"),
        ({"layernorm_mlp_beta": 0.5}, "layernorm_mlp_beta=0.5"),
        ({"sliding_window": 4096}, "sliding_window=4096"),
        ({"attn_type_list": [0] + [1] * 61}, "attn_type_list"),
        ({"layer_types": ["linear_attention"] * 62}, "layer_types"),
        ({"mlp_beta_factor": 2}, "mlp_beta_factor=2"),
        ({"rotary_dim": 63}, "rotary_dim=63"),
        ({"partial_rotary_factor": 0.25}, "disagree"),
        ({"some_new_field": 1}, "'some_new_field' is not supported"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method='awq'"),
    ],
)
def test_config_fields_refused_by_name(change: dict, named: str) -> None:
    raw = copy.deepcopy(MINIMAX_M2) | change
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("(", r"\(")):
        parse_model_config(raw)


def test_make_tiny_model_cli_writes_the_public_fp8_layout(tmp_path: Path) -> None:
    import json

    from safetensors import safe_open

    from afdserve.cli import main

    out = tmp_path / "m2"
    args = ["make-tiny-model", str(out), "--family", "minimax_m2", "--quantization", "fp8"]
    assert main(args) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "minimax_m2" and raw["num_mtp_modules"] == 1
    quant = raw["quantization_config"]
    assert quant["fmt"] == "float8_e4m3fn"
    assert quant["modules_to_not_convert"] == ["gate", "e_score_correction_bias", "lm_head"]
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes["model.layers.0.block_sparse_moe.experts.3.w2.weight"] == "F8_E4M3"
    assert dtypes["model.layers.0.self_attn.q_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.0.block_sparse_moe.gate.weight"] == "F32"
    assert dtypes["model.layers.0.block_sparse_moe.e_score_correction_bias"] == "F32"
    with pytest.raises(ValueError, match="hash_layers=1"):
        make_tiny_model(tmp_path / "hash", "minimax_m2", hash_layers=1)


def test_prefix_caching_changes_no_token(tiny: Path) -> None:
    """The plain paged KV cache: a prompt's shared prefix is served from cached blocks, and the
    tokens are those of a run without caching."""
    prefix = [(11 * i + 5) % 256 for i in range(24)]
    prompts = [prefix + [1, 2, 3], prefix + [200, 7], prefix + [42]]
    got = {}
    for enable in (False, True):
        with LLM(str(tiny), dtype="float32", block_size=4, enable_prefix_caching=enable) as llm:
            llm.generate(prompts[:1], GREEDY)  # leaves the prefix's blocks cached
            outs = llm.generate(prompts, GREEDY)
        got[enable] = [o.token_ids for o in outs]
        cached = [o.num_cached_tokens for o in outs]
        assert all(c >= 24 for c in cached) if enable else not any(cached)
    assert got[True] == got[False]


def test_yarn_on_the_partial_rotary_matches_transformers(tiny: Path, tmp_path: Path) -> None:
    """A scaled rope over the partial width: frequencies from transformers' own yarn with its
    partial_rotary_factor, cos/sin scaled by its attention factor."""
    import json
    import shutil

    edited = tmp_path / "yarn"
    shutil.copytree(tiny, edited)
    raw = json.loads((edited / "config.json").read_text())
    raw["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "partial_rotary_factor": 0.5,
    }
    (edited / "config.json").write_text(json.dumps(raw))
    model, _ = load_model(edited, ModelParts.colocated(), "float32")
    assert model.rotary.scaling != 1.0 and len(model.config.rope_inv_freq) == 4
    hf = MiniMaxM2ForCausalLM.from_pretrained(edited, dtype=torch.float32).eval()
    for prompt, logits in zip(PROMPTS, afdserve_prefill_logits(model, PROMPTS), strict=True):
        relative_close(logits, hf_logits(hf, prompt))


def test_training_only_and_switched_off_fields_are_accepted() -> None:
    """The keys a published config.json carries beyond the preset's: training-only ones, and
    MiniMax-Text-01's at the values that switch them off."""
    raw = copy.deepcopy(MINIMAX_M2) | {
        "auto_map": {"AutoModelForCausalLM": "modeling_minimax_m2.MiniMaxM2ForCausalLM"},
        "transformers_version": "4.46.1",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "use_cache": True,
        "max_model_len": None,
        "layernorm_full_attention_beta": 1.0,
        "layernorm_linear_attention_beta": 1.0,
        "layernorm_mlp_beta": 1.0,
        "mlp_intermediate_size": 8192,
        "shared_moe_mode": "sigmoid",
        "sliding_window": None,
    }
    assert parse_model_config(raw) == parse_model_config(copy.deepcopy(MINIMAX_M2))
