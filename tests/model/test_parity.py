"""Every family's colocated forward matches transformers' implementation of the same checkpoint:
prefill logits close at every position (paged, batched, chunked), greedy tokens identical."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.engine.block_manager import BlockManager
from afdserve.engine.kv_cache import make_kv_cache
from afdserve.engine.model_runner import LocalFFN, ModelRunner
from afdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from afdserve.engine.sequence import Sequence
from afdserve.layout.plan import AttentionRankPlan
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families.decoder.model import MoECausalLM
from afdserve.model.fixtures.byte_tokenizer import PAD_ID, build_byte_tokenizer
from afdserve.model.fixtures.tiny import FAMILIES, tiny_config
from afdserve.model.parts import ModelParts

BLOCK_SIZE = 4
NEW_TOKENS = 24
# Prompts of different lengths (1 to 45 tokens), batched together in one engine.
PROMPTS = [
    [7],
    [72, 101, 108, 108, 111],
    list(range(30, 58)),
    [256, 40, 41, 42, 200, 201, 202, 3, 4],
    [(17 * i) % 256 for i in range(45)],
    [97, 98, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109],
    [255, 0, 255, 0],
]


def relative_close(ours: torch.Tensor, ref: torch.Tensor, tol: float = 1e-4) -> None:
    """|ours - ref| <= tol * (largest |ref|): float32 with the sums taken in another order."""
    scale = float(ref.abs().max())
    torch.testing.assert_close(ours, ref, atol=tol * scale, rtol=0.0)


@torch.inference_mode()
def afdserve_prefill_logits(
    model: MoECausalLM, prompts: list[list[int]], chunks: int = 1, pad_rows: int = 0
) -> list[torch.Tensor]:
    """Logits [len(prompt), vocab] for every position of every prompt, the prompts batched in one
    step per chunk. Blocks are handed out round-robin, so every table is scattered over the cache;
    `pad_rows` extra rows (slot -1, route id -1) ride along as a padded graph batch would."""
    need = [-(-len(p) // BLOCK_SIZE) for p in prompts]
    cache = make_kv_cache(model.config, sum(need), BLOCK_SIZE, torch.float32, "cpu")
    manager = BlockManager(cache.num_blocks, BLOCK_SIZE)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    seqs = [Sequence(f"seq-{i}", p, params, None) for i, p in enumerate(prompts)]
    for blocks in range(1, max(need) + 1):
        for seq in seqs:
            manager.allocate(seq, min(blocks * BLOCK_SIZE, seq.num_tokens))
    runner = ModelRunner(model, cache, torch.device("cpu"))
    per_seq: list[list[torch.Tensor]] = [[] for _ in seqs]
    for chunk in range(chunks):
        scheduled = []
        for seq in seqs:
            end = len(seq.token_ids) * (chunk + 1) // chunks
            if end > seq.num_computed_tokens:
                scheduled.append(ScheduledSeq(seq, end - seq.num_computed_tokens))
        out = SchedulerOutput(scheduled, [])
        inputs = runner.prepare(out, out.num_tokens + pad_rows)
        real, rows = out.num_tokens, inputs.rows
        # One ubatch holding the step's real rows and `pad_rows` pad rows after them.
        plan = AttentionRankPlan(
            0, None, real, rows, (real,), (rows,), (0,), "eager", ("attention", 0, (rows,), (0,))
        )
        hidden = runner.forward(inputs, plan, LocalFFN(model))
        logits = model.logits(hidden)  # [rows, vocab]
        row = 0
        for entry in scheduled:
            index = seqs.index(entry.seq)
            per_seq[index].append(logits[row : row + entry.num_new_tokens])
            row += entry.num_new_tokens
            entry.seq.num_computed_tokens += entry.num_new_tokens
        assert not logits[row:].isnan().any()
    return [torch.cat(parts) for parts in per_seq]


@torch.inference_mode()
def hf_logits(hf_model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([prompt])).logits[0].float()


@pytest.fixture(scope="module")
def ours(tiny_models: dict[str, Path]) -> dict[str, MoECausalLM]:
    return {
        family: load_model(path, ModelParts.colocated(), "float32")[0]
        for family, path in tiny_models.items()
    }


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunks, pad_rows", [(1, 0), (3, 5)])
def test_prefill_logits_match_transformers(
    family: str, chunks: int, pad_rows: int, ours: dict, hf_models: dict
) -> None:
    got = afdserve_prefill_logits(ours[family], PROMPTS, chunks=chunks, pad_rows=pad_rows)
    for prompt, logits in zip(PROMPTS, got, strict=True):
        ref = hf_logits(hf_models[family], prompt)
        assert logits.shape == ref.shape
        # A tiny random model still spreads its logits by several units: the tolerance is tight.
        assert float(ref.std()) > 0.5
        relative_close(logits, ref)


@torch.inference_mode()
def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], new_tokens: int) -> list[int]:
    # eos_token_id=None: run the full length, as ignore_eos does on our side. No min_new_tokens:
    # it masks eos out of the logits, which changes the argmax.
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )
    tokens = out[0, len(prompt) :].tolist()
    assert len(tokens) == new_tokens
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(
    family: str, tiny_models: dict[str, Path], hf_models: dict
) -> None:
    llm = LLM(str(tiny_models[family]), dtype="float32", block_size=BLOCK_SIZE)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(hf_models[family], prompt, NEW_TOKENS), prompt
        assert out.finish_reason == "length"
    # A degenerate model (one token repeated) would make equality meaningless.
    assert len({tuple(out.token_ids) for out in outs}) == len(PROMPTS)
    assert min(len(set(out.token_ids)) for out in outs) > 3


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_sampled_logprobs_match_transformers(
    family: str, tiny_models: dict[str, Path], hf_models: dict
) -> None:
    llm = LLM(str(tiny_models[family]), dtype="float32")
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        ref = torch.log_softmax(hf_logits(hf_models[family], prompt)[-1], dim=-1)
        top = ref.topk(5)
        (entry,) = out.logprobs
        assert out.token_ids == [int(top.indices[0])]
        assert set(entry) == set(top.indices.tolist())
        for token, value in entry.items():
            assert value == pytest.approx(float(ref[token]), abs=1e-4)


# Architecture knobs the four tiny checkpoints leave at one value. EDITED: config.json of a copy
# changed, same weights. REBUILT: other module shapes, so new random weights, and no
# mlp_layer_types in config.json (real checkpoints have none: the family's rule applies).
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
YARN |= {"original_max_position_embeddings": 128}
EDITED = {
    # Two experts per group and top-2 of 2 groups equals plain top-2: only one group matters.
    "deepseek_v2-one-group": ("deepseek_v2", {"topk_group": 1}),
    "deepseek_v3-one-group": ("deepseek_v3", {"topk_group": 1}),
    "deepseek_v3-yarn": ("deepseek_v3", {"rope_parameters": YARN | {"mscale_all_dim": 1.0}}),
    "qwen3_moe-yarn": ("qwen3_moe", {"rope_parameters": YARN}),
    "qwen3_moe-unnormalised": ("qwen3_moe", {"norm_topk_prob": False}),
}
REBUILT = {
    "deepseek_v2-no-q-lora": ("deepseek_v2", {"q_lora_rank": None}),
    "deepseek_v3-all-moe": (
        "deepseek_v3",
        {"q_lora_rank": None, "first_k_dense_replace": 0, "n_shared_experts": 2},
    ),
    "qwen3_moe-tied": ("qwen3_moe", {"tie_word_embeddings": True}),
    "mixtral-top-3": ("mixtral", {"num_experts_per_tok": 3}),
}


@torch.no_grad()
def rebuild(path: Path, family: str, changes: dict) -> Path:
    """A fresh checkpoint from the family's tiny config with `changes`; weights drawn so that
    activations stay near unit scale and logits spread (transformers' default init ties them)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    for key, value in changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(3)
    for name, param in sorted(model.named_parameters()):
        if param.ndim == 1:
            param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
        elif name.endswith("embed_tokens.weight"):
            param.copy_(torch.randn(param.shape, generator=gen))
        else:
            gain = 3.0 if name == "lm_head.weight" else 2.0 if name.endswith("gate.weight") else 1
            std = gain / math.sqrt(param.shape[-1])
            param.copy_(std * torch.randn(param.shape, generator=gen))
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.05 * torch.randn(buffer.shape, generator=gen))
    model.save_pretrained(path)
    build_byte_tokenizer(path)
    return path


@pytest.fixture(scope="module", params=sorted(EDITED) + sorted(REBUILT))
def variant(
    request: pytest.FixtureRequest, tiny_models: dict, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp("variant") / request.param
    if request.param in REBUILT:
        family, changes = REBUILT[request.param]
        return family, rebuild(path, family, changes)
    family, changes = EDITED[request.param]
    shutil.copytree(tiny_models[family], path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | changes))
    return family, path


def test_variant_matches_transformers(variant: tuple[str, Path], hf_models: dict) -> None:
    from transformers import AutoModelForCausalLM

    family, path = variant
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model, report = load_model(path, ModelParts.colocated(), "float32")
    assert not report.unexpected
    prompts = PROMPTS[2:5]
    for prompt, logits in zip(prompts, afdserve_prefill_logits(model, prompts, 2, 3)):
        ref = hf_logits(hf_model, prompt)
        relative_close(logits, ref)
        # The knob changes the model: the base checkpoint's logits are far off.
        assert (ref - hf_logits(hf_models[family], prompt)).abs().max() > 0.1
    llm = LLM(str(path), dtype="float32", block_size=BLOCK_SIZE)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        assert out.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS)
