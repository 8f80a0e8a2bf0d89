"""DSA's Triton kernels (kernels/triton/dsa_indexer.py, dsa_attention.py) under Triton's
interpreter (TRITON_INTERPRET=1, numpy) on CPU, against the torch path they replace on CUDA
(tests/kernels/dsa_cases.py: `select_per_segment`, `DSAAttention._attend_reference`), on real
DSA layers of small configs over paged caches whose block tables are shuffled.

Selection: decode rows of several lengths (shorter than, equal to and past index_topk), a
prefill chunk begun mid-sequence, pad rows; zero keys, which tie exactly at the top under negative
head weights (the earliest must win: the torch path's set), and repeated keys (equal up to
summation order); keys in float32, float16 and FP8; the kernels' steps shrunk so scoring and
ranking loop over many blocks. Attention: selections with -1 anywhere and a row of none,
float32, float16 and an FP8 cache, the tiny shapes (4 heads, latent 32 + rope 8, padded) and
the real widths (latent 512 + rope 64, 20 heads: two head blocks). In a subprocess because the
variable must be set before any @triton.jit function is defined."""

from __future__ import annotations

import pytest

from tests.kernels.interpret import BF16_DOTS, run_interpreted

INTERPRETED_CASES = (
    BF16_DOTS
    + """
import torch

from afdserve.kernels.triton import dsa_attention, dsa_indexer
from tests.kernels.dsa_cases import FP8, check_attention, check_selection, dsa_layer


def select(q, w, keys, rows, topk, scale):
    return dsa_indexer.select(q, w, keys, *rows, topk, scale)


def selection(*args, **kwargs):
    print("select", check_selection(*args, select=select, **kwargs), "ok")


def attention(*args, **kwargs):
    print("attend", check_attention(*args, attend=dsa_attention.sparse_mla, **kwargs), "ok")


torch.set_grad_enabled(False)
tiny = dsa_layer(num_attention_heads=4, kv_lora_rank=32, qk_rope_head_dim=8, index_topk=4,
                 index_n_heads=16, index_head_dim=16)
wide = dsa_layer(num_attention_heads=20, kv_lora_rank=512, qk_rope_head_dim=64, index_topk=40,
                 index_n_heads=20, index_head_dim=80)
decode = [(1, 1), (3, 1), (4, 1), (5, 1), (9, 1), (37, 1), (300, 1)]
mixed = [(12, 5), (2, 1), (70, 9), (41, 1)]
for attn in (tiny, wide):
    selection(attn, [(8, 1)], 0, torch.float32, 4, 1)  # batch 1
    selection(attn, decode, 3, torch.float32, 4, 2)
    selection(attn, mixed, 1, torch.float32, 8, 3)
    selection(attn, mixed, 0, torch.float32, 16, 4, negative=True)
    selection(attn, decode, 2, torch.float16, 16, 5)
    selection(attn, mixed, 1, FP8, 4, 6)
    selection(attn, mixed, 2, torch.bfloat16, 8, 11, q_dtype=torch.bfloat16)
    selection(attn, decode, 1, FP8, 16, 12, q_dtype=torch.bfloat16)
# Small steps: many key blocks per scoring program, many score blocks per top-k pass (the kept
# and tied counts carried across them), one row per scores chunk.
dsa_indexer.BLOCK_KEYS, dsa_indexer.SPLITS, dsa_indexer.BLOCK_SCORES = 16, 2, 32
dsa_indexer.SCORE_ELEMENTS = 1
selection(tiny, decode, 2, torch.float32, 4, 9)
selection(wide, mixed, 0, torch.float32, 8, 10, negative=True)
for dtype in (torch.float32, torch.float16, FP8):
    attention(tiny, 6, 5, 4, dtype, 7)
    attention(wide, 3, 4, 16, dtype, 8)
for dtype in (torch.bfloat16, FP8):  # the torch path rounds its scores to bf16 (and see BF16_DOTS)
    attention(tiny, 6, 5, 4, dtype, 13, q_dtype=torch.bfloat16, tol=2e-2)
"""
)


def test_dsa_kernels_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 26, run.stdout


MODEL_CASES = (
    BF16_DOTS
    + """
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from afdserve import LLM, SamplingParams
from afdserve.kernels import ops
from afdserve.kernels.triton import dsa_attention, dsa_indexer
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families.dsa import attention, indexer
from afdserve.model.families.dsa.cache import DSAPages
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts
from tests.kernels.dsa_cases import shadowed
from tests.model.test_parity import PROMPTS, afdserve_prefill_logits, hf_logits, relative_close


def select(q, w, keys, rows, topk, scale):
    return dsa_indexer.select(q, w, keys, *rows, topk, scale)


torch.set_grad_enabled(False)
DSAPages.batched_segments = True  # the CPU steps carry device segments, as every CUDA step
dsa_indexer.SPLITS = 2  # the interpreter runs every program, those with nothing to score too
torch_path = (ops.dsa_select, ops.dsa_sparse_mla)
with tempfile.TemporaryDirectory() as root:
    for family in ("deepseek_v32", "glm_moe_dsa"):
        path = make_tiny_model(Path(root) / family, family, seed=0)
        model = load_model(path, ModelParts.colocated(), "float32")[0]
        want = afdserve_prefill_logits(model, PROMPTS, chunks=3, pad_rows=2)
        ops.dsa_select, ops.dsa_sparse_mla = select, dsa_attention.sparse_mla
        got = afdserve_prefill_logits(model, PROMPTS, chunks=3, pad_rows=2)
        ops.dsa_select, ops.dsa_sparse_mla = torch_path
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        for prompt, g, w in zip(PROMPTS, got, want, strict=True):
            assert (g - w).abs().max() < 1e-4, (family, prompt, float((g - w).abs().max()))
            relative_close(g, hf_logits(hf, prompt))
        print(family, "ok")
# bf16, its cache bf16 or FP8: every kernel call of a generation checked on its own inputs (not
# the tokens, which drift from the torch path's within a few steps: tests/gpu/test_dsa.py).
ops.dsa_select = select
select_checked, attend_checked, seen = shadowed(indexer.select_fast, dsa_attention.sparse_mla)
attention.select_fast, ops.dsa_sparse_mla = select_checked, attend_checked
greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
with tempfile.TemporaryDirectory() as root:
    for family in ("deepseek_v32", "glm_moe_dsa"):
        path = make_tiny_model(Path(root) / family, family, seed=2, dtype="bfloat16")
        for cache in ("auto", "fp8"):
            with LLM(str(path), dtype="bfloat16", device="cpu", max_num_batched_tokens=16,
                     kv_cache_dtype=cache, use_tqdm_on_load=False) as llm:
                llm.generate(PROMPTS, greedy, use_tqdm=False)
            print(family, cache, len(seen["select"]), max(seen["attend"]), "ok")
"""
)


@pytest.mark.slow  # two minutes of interpreted launches
def test_dsa_model_through_the_kernels_under_the_interpreter() -> None:
    """The tiny DeepSeek-V3.2 and GLM-5 (top-4 selection, GLM-5's shared layers reusing it)
    with their DSA layers on the kernels, prefill in three chunks beside pad rows: the logits of
    the torch path and transformers' at every position; in bf16 with a bf16 and an FP8 cache,
    every kernel call of a chunked generation against its oracle (dsa_cases.py `shadowed`)."""
    run = run_interpreted(MODEL_CASES, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 6, run.stdout


GRAPH_CASES = """
import tempfile
from pathlib import Path

from afdserve import LLM
from afdserve.kernels import ops
from afdserve.kernels.triton import dsa_attention, dsa_indexer
from afdserve.model.families.dsa.cache import DSAPages
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.engine.test_dsa_graphs import BLOCK, BUDGET, GREEDY, full_graph_tokens, prompts


def select(q, w, keys, rows, topk, scale):
    return dsa_indexer.select(q, w, keys, *rows, topk, scale)


dsa_indexer.SPLITS = 2  # the interpreter runs every program, those with nothing to score too
with tempfile.TemporaryDirectory() as root:
    path = make_tiny_model(Path(root) / "glm", "glm_moe_dsa", seed=1)
    with LLM(str(path), dtype="float32", block_size=BLOCK, max_num_batched_tokens=BUDGET) as llm:
        eager = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
    DSAPages.batched_segments = True  # device segments, as on CUDA
    ops.dsa_select, ops.dsa_sparse_mla = select, dsa_attention.sparse_mla
    for split in ({}, {"topology": "1A1F", "connector": "inprocess"}):
        got, replays = full_graph_tokens(path, split)
        assert got == eager, (split, got, eager)
        assert any(kind == "mixed" for (*_, kind), _ in replays), replays
        print(split.get("topology", "colocated"), "ok")
"""


@pytest.mark.slow  # interpreted launches for every layer of every step
def test_full_graph_steps_through_the_kernels_under_the_interpreter() -> None:
    """The tiny GLM-5 under graph_mode full, every step replayed from the graph's static
    buffers (tests/engine/test_dsa_graphs.py: capacity-sized segments, pad segments, tables as
    wide as max_model_len with stale columns) with its DSA layers on the kernels: the eager
    torch path's tokens, colocated and in-process 1A1F on two ubatches."""
    run = run_interpreted(GRAPH_CASES, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 2, run.stdout
