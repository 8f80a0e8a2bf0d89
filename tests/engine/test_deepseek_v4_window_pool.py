"""DeepSeek-V4's sliding-window rows in the engine's window pool (deepseek_v4/cache.py's
`V4Window`, engine/block_manager.py): every layer's window blocks behind the window go back to
the pool while its compressed entries stay in the main pages, and a tiny V4 (window 4, CSA rate
2, HCA rate 4, blocks of 4) gives transformers' greedy tokens with chunked prefill, preemption,
prefix hits and 2A1F on a window pool smaller than one sequence, so that only freeing lets it
run."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from afdserve import LLM, SamplingParams
from afdserve.engine.kv_cache import window_pool_bound
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.parts import ModelParts
from tests.engine.test_llm import run
from tests.model.deepseek_v4_helpers import boundary_ties

BLOCK, WINDOW = 4, 4  # the tiny checkpoint's window
GREEDY = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
# Two sequences, 6 tokens a step: a window pool of 9 blocks (8 usable), where the longest
# sequence (45 + 14 tokens) spans 15 blocks.
LIMITS = dict(block_size=BLOCK, max_num_seqs=2, max_num_batched_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_v4(tmp_path_factory.mktemp("v4-window") / "m", seed=4)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (3, 29, 45, 11)]


@torch.inference_mode()
def teacher_forced(model_dir: Path, outputs: list[list[int]]) -> list[list[int]]:
    """transformers' greedy choice at every generated position, fed our tokens before it (where
    the indexer's top-k does not tie at its boundary, so that the token is defined)."""
    hf = DeepseekV4ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ours = load_model(model_dir, ModelParts.colocated(), "float32")[0]
    want = []
    for prompt, tokens in zip(prompts(), outputs, strict=True):
        seq = torch.tensor(prompt + tokens)
        assert boundary_ties(ours, seq) == []
        logits = hf(seq[None, :-1], use_cache=False).logits[0]
        want.append(logits[len(prompt) - 1 :].argmax(dim=-1).tolist())
    return want


def test_tokens_match_transformers_with_preemption_and_prefix_hits(model_dir) -> None:
    llm = LLM(
        str(model_dir), dtype="float32", kv_cache_blocks=20, enable_prefix_caching=True, **LIMITS
    )
    core = llm.engine.core_client.core
    manager = core.block_manager
    assert core.kv_cache.layout.window == WINDOW and not core.kv_cache.window_layers
    assert manager.num_free_window_blocks == window_pool_bound(WINDOW, BLOCK, 2, 6) - 1 == 8
    outs, preempted = run(llm, prompts(), GREEDY, late={3: 9})
    got = [o.token_ids for o in outs]
    assert preempted > 0 and len({tuple(t) for t in got}) == len(got)
    # The longest prompt alone, three times: the 20 main blocks hold its prefix again from the
    # third on, its hit taking the main blocks (entries, first series) and the window's last.
    longest = prompts()[2]
    again = [llm.generate([longest], GREEDY, use_tqdm=False)[0] for _ in range(3)]
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in again] == [got[2]] * 3
    assert again[2].num_cached_tokens == 44
    assert got == teacher_forced(model_dir, got)
    assert (manager.num_free_blocks, manager.num_free_window_blocks) == (20, 8)


# The same tokens through two attention ranks, each with its own window pool.
@pytest.mark.slow
def test_2a1f_matches_transformers(model_dir) -> None:
    with LLM(str(model_dir), topology="2A1F", dtype="float32", kv_cache_blocks=20, **LIMITS) as llm:
        got = [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]
    assert got == teacher_forced(model_dir, got)
