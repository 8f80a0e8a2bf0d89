"""DeepSeek-V3.2 and GLM-5 (DSA) against transformers' implementations of the same checkpoints:
prefill logits at every position (one shot, chunked, with pad rows, and one row a step through the
batched selection a GPU runs), greedy tokens teacher-forced to the full forward, chunked prefill
equal to one shot, prefix caching equal to none, the public FP8 layout. The tiny models keep 4
earlier tokens per query, so the selection drops tokens in every prompt past 4."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from afdserve import LLM, SamplingParams
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.kernels.reference.fp8 import FP8_DTYPE
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families import family_of, parse_model_config
from afdserve.model.families.dsa import indexer as indexer_module
from afdserve.model.families.dsa.cache import DSAPages
from afdserve.model.families.dsa.indexer import Indexer, select_batched, select_per_segment
from afdserve.model.families.dsa.tiny import build_tiny_dsa
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.layers.fp8 import Fp8Linear
from afdserve.model.parts import ModelParts

from .test_fp8 import dequantized_copy, teacher_forced_argmax
from .test_parity import PROMPTS, afdserve_prefill_logits, relative_close

FAMILIES = ("deepseek_v32", "glm_moe_dsa")
TOPK = 4  # the tiny models' index_topk (model/families/dsa/tiny.py)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def dsa_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-dsa")
    return {f: make_tiny_model(root / f, f, seed=0) for f in FAMILIES}


@pytest.fixture(scope="module")
def hf_dsa(dsa_models: dict[str, Path]) -> dict[str, torch.nn.Module]:
    return {
        f: AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        for f, path in dsa_models.items()
    }


@torch.inference_mode()
def _hf_logits(hf: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    return hf(torch.tensor([prompt])).logits[0].float()


def _check_logits(got: list[torch.Tensor], hf: torch.nn.Module) -> None:
    for prompt, logits in zip(PROMPTS, got, strict=True):
        ref = _hf_logits(hf, prompt)
        assert float(ref.std()) > 0.5
        relative_close(logits, ref)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunks, pad_rows", [(1, 0), (3, 5)])
def test_prefill_logits_match_transformers(family, chunks, pad_rows, dsa_models, hf_dsa):
    model = load_model(dsa_models[family], ModelParts.colocated(), "float32")[0]
    got = afdserve_prefill_logits(model, PROMPTS, chunks=chunks, pad_rows=pad_rows)
    _check_logits(got, hf_dsa[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_decode_rows_match_transformers(family, dsa_models, hf_dsa, monkeypatch):
    """One row per sequence a step with device segments (what every CUDA step carries), so the
    selection runs `select_batched`, the form a decode graph captures; pad rows ride along."""
    monkeypatch.setattr(DSAPages, "batched_segments", True)
    model = load_model(dsa_models[family], ModelParts.colocated(), "float32")[0]
    longest = max(len(p) for p in PROMPTS)
    _check_logits(afdserve_prefill_logits(model, PROMPTS, longest, pad_rows=3), hf_dsa[family])


def test_the_selection_drops_tokens(dsa_models):
    """With index_topk past every prompt's length the long prompts' logits change: the tiny
    model's top-4 really leaves tokens out."""
    prompt = PROMPTS[4]
    sparse = build_tiny_dsa("deepseek_v32", seed=0)
    dense = build_tiny_dsa("deepseek_v32", seed=0, index_topk=512)
    assert sparse.config.index_topk == TOPK < len(prompt)
    a, b = _hf_logits(sparse, prompt), _hf_logits(dense, prompt)
    assert torch.allclose(a[:TOPK], b[:TOPK], atol=1e-5)
    assert (a[TOPK:] - b[TOPK:]).abs().max() > 0.1


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_teacher_forced_and_chunked(family, dsa_models, hf_dsa):
    """Chunked prefill (a budget of 4 rows a step) gives one shot's tokens, and every token is
    transformers' argmax after the prompt and the tokens before it."""
    runs = []
    for budget in (64, 4):
        with LLM(
            str(dsa_models[family]), dtype="float32", block_size=4, max_num_batched_tokens=budget
        ) as llm:
            runs.append([o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
    assert runs[0] == runs[1]
    for prompt, tokens in zip(PROMPTS, runs[0], strict=True):
        assert teacher_forced_argmax(hf_dsa[family], prompt, tokens) == tokens, prompt
    assert len({tuple(t) for t in runs[0]}) == len(PROMPTS)


def test_prefix_caching_gives_the_uncached_tokens(dsa_models):
    """Latent and indexer-key pages of full blocks are reused by prefix hash."""
    shared = [(11 * i + 5) % 250 for i in range(24)]
    prompts = [shared + [1, 2, 3], shared + [9, 8]]
    outs = {}
    for caching in (False, True):
        with LLM(
            str(dsa_models["glm_moe_dsa"]),
            dtype="float32",
            block_size=4,
            enable_prefix_caching=caching,
        ) as llm:
            first = llm.generate(prompts[:1], GREEDY)
            second = llm.generate(prompts[1:], GREEDY)
        outs[caching] = [o.token_ids for o in first + second]
        if caching:
            assert second[0].num_cached_tokens >= 20
    assert outs[True] == outs[False]


@pytest.mark.parametrize("score_elements", [indexer_module.SCORE_ELEMENTS, 1])
def test_batched_selection_is_the_per_sequence_one(score_elements, monkeypatch):
    """`select_batched` (device segments, every row at once) keeps the slots the reference
    keeps: a prefill chunk begun mid-sequence, a decode row, a sequence shorter than top-k and
    pad rows, over scattered block tables; scored whole or one row at a time."""
    monkeypatch.setattr(indexer_module, "SCORE_ELEMENTS", score_elements)
    config = parse_model_config(json.loads(json.dumps(family_of("glm_moe_dsa").presets["glm-5"])))
    torch.manual_seed(0)
    indexer = Indexer(config)
    indexer.topk = 6
    block, dim, heads = 4, config.family_config.index_head_dim, indexer.heads
    cache = torch.randn(12, block, 1, dim)
    tables = [torch.tensor(t) for t in ([3, 7, 1, 9], [0, 5, 11, 2], [4, 6, 8, 10])]
    segments = (
        Segment(0, 3, tables[0], 13),
        Segment(3, 4, tables[1], 15),
        Segment(4, 5, tables[2], 3),
    )
    positions = torch.tensor([10, 11, 12, 14, 2, 0, 0])
    slots = torch.full((7,), -1)
    meta = AttentionMetadata(positions, slots, segments, batch_segments(segments, "cpu"))
    q, w = torch.randn(7, heads, dim), torch.randn(7, heads)
    want = select_per_segment(indexer, q, w, cache, meta)
    assert torch.equal(select_batched(indexer, q, w, cache, meta), want)
    assert (want[:4] >= 0).all() and (want[4, :3] >= 0).all() and (want[4, 3:] == -1).all()
    assert (want[5:] == -1).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_checkpoint_matches_its_dequantized_form(family, tmp_path):
    """The public block-scaled layout: the indexer's wq_b and wk FP8 with their scales, its head
    weights float32; greedy tokens teacher-forced to transformers over the dequantized copy."""
    path = make_tiny_model(tmp_path / family, family, seed=0, quantization="fp8")
    names = load_file(path / "model.safetensors")
    assert names["model.layers.0.self_attn.indexer.wk.weight"].dtype == FP8_DTYPE
    assert "model.layers.0.self_attn.indexer.wq_b.weight_scale_inv" in names
    assert names["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.float32
    model, report = load_model(path, ModelParts.colocated(), "float32")
    assert not report.unexpected
    indexer = model.model.layers[0].self_attn.indexer
    assert isinstance(indexer.wq_b, Fp8Linear) and isinstance(indexer.wk, Fp8Linear)
    oracle = AutoModelForCausalLM.from_pretrained(
        dequantized_copy(path, tmp_path / "plain"), dtype=torch.float32
    ).eval()
    with LLM(str(path), dtype="float32") as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert teacher_forced_argmax(oracle, prompt, tokens) == tokens, prompt


def test_mtp_layers_are_skipped_at_load(dsa_models, tmp_path):
    """A checkpoint with DeepSeek's multi-token-prediction layer (model.layers.{n}.*, as
    published) loads: transformers builds no MTP layer and neither does afdserve."""
    src = dsa_models["deepseek_v32"]
    dst = tmp_path / "mtp"
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    weights = load_file(dst / "model.safetensors")
    extra = "model.layers.4.self_attn.indexer.wk.weight"
    weights[extra] = weights["model.layers.0.self_attn.indexer.wk.weight"].clone()
    save_file(weights, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    model, report = load_model(dst, ModelParts.colocated(), "float32")
    assert report.unexpected == [extra] and model.config.num_layers == 4


def test_fp8_cache_holds_both_pages_and_stays_close(dsa_models, hf_dsa):
    """kv_cache_dtype="fp8": latents and indexer keys stored float8_e4m3fn, and the greedy
    tokens mostly transformers' argmax teacher-forced. Measured on these prompts: 0.68 (0.85
    with a top-512 selection, 0.82 for the tiny DeepSeek-V3's plain MLA): random tiny models have
    small logit gaps, and a key rounded to 3 mantissa bits moves tokens in and out of a top 4."""
    path = dsa_models["glm_moe_dsa"]
    with LLM(str(path), dtype="float32", kv_cache_dtype="fp8", kv_cache_blocks=64) as llm:
        cache = llm.engine.core_client.core.kv_cache
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]
    pages = [t for layer in cache.layers for t in layer if t is not None]
    assert {t.dtype for t in pages} == {FP8_DTYPE} and cache.layers[1][1] is None
    agree = sum(
        a == b
        for prompt, tokens in zip(PROMPTS, got, strict=True)
        for a, b in zip(teacher_forced_argmax(hf_dsa["glm_moe_dsa"], prompt, tokens), tokens)
    )
    assert agree >= 0.6 * sum(len(t) for t in got)
