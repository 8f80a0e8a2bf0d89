"""gpt-oss (model/families/gpt_oss/) against transformers' GptOssForCausalLM on a tiny float32
checkpoint: prefill logits at every position (paged, batched, chunked, with pad rows), greedy
tokens teacher-forced through transformers' full forward, chunked prefill equal to one shot;
the config's fields honoured or refused by name; the sliding layers' cache spec."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.model.cache import PagedKV
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families import cache_layout, parse_model_config
from afdserve.model.families.gpt_oss.cache import SlidingKV
from afdserve.model.families.gpt_oss.presets import PRESETS
from afdserve.model.families.gpt_oss.tiny import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from afdserve.model.fixtures import byte_tokenizer
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts
from afdserve.model.presets import preset_config

from .test_parity import PROMPTS, afdserve_prefill_logits, hf_logits, relative_close

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt-oss") / "m", "gpt_oss", seed=0)


@pytest.fixture(scope="module")
def hf_model(gpt_oss_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gpt_oss_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def test_tiny_vocabulary_is_the_byte_tokenizers() -> None:
    got = (VOCAB_SIZE, BOS_ID, EOS_ID, PAD_ID)
    tok = byte_tokenizer
    assert got == (tok.VOCAB_SIZE, tok.BOS_ID, tok.EOS_ID, tok.PAD_ID)


@pytest.mark.parametrize("chunks, pad_rows", [(1, 0), (3, 5)])
def test_prefill_logits_match_transformers(gpt_oss_dir, hf_model, chunks, pad_rows) -> None:
    ours = load_model(gpt_oss_dir, ModelParts.colocated(), "float32")[0]
    got = afdserve_prefill_logits(ours, PROMPTS, chunks=chunks, pad_rows=pad_rows)
    for prompt, logits in zip(PROMPTS, got, strict=True):
        ref = hf_logits(hf_model, prompt)
        assert float(ref.std()) > 0.5
        relative_close(logits, ref)


def teacher_forced(hf_model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' greedy choice at every generated position, fed our tokens before it."""
    logits = hf_logits(hf_model, prompt + tokens[:-1])
    return logits[len(prompt) - 1 :].argmax(-1).tolist()


def greedy(model_dir: Path, **kwargs) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(str(model_dir), dtype="float32", block_size=4, **kwargs) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, params)]


def test_greedy_tokens_match_transformers_and_chunked_prefill(gpt_oss_dir, hf_model) -> None:
    one_shot = greedy(gpt_oss_dir)
    for prompt, tokens in zip(PROMPTS, one_shot, strict=True):
        assert tokens == teacher_forced(hf_model, prompt, tokens), prompt
    # A degenerate model (one token repeated) would make equality meaningless.
    assert len({tuple(t) for t in one_shot}) == len(PROMPTS)
    # Prompts longer than the window (8) split into chunks of 5 rows: the same tokens.
    assert greedy(gpt_oss_dir, max_num_batched_tokens=5) == one_shot


def test_presets_parse() -> None:
    big, small = preset_config("gpt-oss-120b"), preset_config("gpt-oss-20b")
    assert (big.num_layers, big.num_experts, small.num_layers, small.num_experts) == (
        36,
        128,
        24,
        32,
    )
    assert big.quantization.expert_dtype == "fp4" and big.top_k == 4
    family = preset_config("gpt-oss-120b:3").family_config
    assert family.attention_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert family.sliding_window == 128 and family.swiglu_alpha == 1.702


def test_cache_layout_names_the_sliding_layers() -> None:
    layout = cache_layout(preset_config("gpt-oss-20b"))
    full, sliding = layout.specs
    assert type(full) is PagedKV and full.layers == tuple(range(1, 24, 2))
    assert isinstance(sliding, SlidingKV) and sliding.layers == tuple(range(0, 24, 2))
    assert sliding.window == 128 and sliding.kind == "sliding"
    per_layer = 2 * 16 * 8 * 64 * 2
    line = f"per block: 12 KV x {per_layer} B, 12 sliding x {per_layer} B"
    assert layout.describe(16, torch.bfloat16) == line


REFUSED = [
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 18}, "chunked_attention"),
    ({"experts_per_token": 2}, "experts_per_token"),
    ({"sliding_window": None}, "sliding_window"),
    ({"mlp_bias": True}, "'mlp_bias' is not supported"),
    ({"quantization_config": {"quant_method": "mxfp4", "bits": 4}}, "bits"),
    (
        {"quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model"]}},
        "keeps the routed experts unquantized",
    ),
    ({"quantization_config": {"quant_method": "awq"}}, "'awq' is not supported"),
]


@pytest.mark.parametrize("change, message", REFUSED)
def test_config_refusals_name_the_field(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_model_config({**PRESETS["gpt-oss-120b"], **change})


def test_online_fp8_is_refused(gpt_oss_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match="quantization='fp8' on a gpt_oss checkpoint"):
        load_model(gpt_oss_dir, ModelParts.colocated(), "float32", quantization="fp8")


def test_missing_sinks_are_named(gpt_oss_dir, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "m"
    shutil.copytree(gpt_oss_dir, copy)
    weights = load_file(copy / "model.safetensors")
    del weights["model.layers.1.self_attn.sinks"], weights["model.layers.2.mlp.router.bias"]
    save_file(weights, copy / "model.safetensors")
    with pytest.raises(ValueError, match="layers.1.self_attn.sinks.*layers.2.mlp.router.bias"):
        load_model(copy, ModelParts.colocated(), "float32")
    assert json.loads((copy / "config.json").read_text())["model_type"] == "gpt_oss"


def test_prefix_caching_and_fp8_cache_keep_the_windows(gpt_oss_dir) -> None:
    """A cached prefix longer than the window (the sliding layers read it from shared pages the
    hit keeps) gives the tokens of caching off; the FP8 cache runs the same attention (sinks,
    windows) over its float8 pages."""
    prefix = [(11 * i + 5) % 256 for i in range(21)]
    prompts = [prefix + [1, 2, 3], prefix + [9, 8]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def run(**kwargs) -> tuple[list[list[int]], list[int]]:
        with LLM(str(gpt_oss_dir), dtype="float32", block_size=4, **kwargs) as llm:
            outs = llm.generate(prompts, params) + llm.generate(prompts, params)
        return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]

    want, _ = run(enable_prefix_caching=False)
    got, cached = run(enable_prefix_caching=True)
    assert got == want and min(cached[2:]) >= 20
    fp8, _ = run(enable_prefix_caching=False, kv_cache_dtype="fp8")
    # e4m3's rounding of keys and values moves no token at this tiny model's margins.
    assert fp8 == want
