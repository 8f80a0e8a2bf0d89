"""DeepSeek-V4 speculating on one GPU under `full_decode_only` graphs, colocated: n-gram drafts
and its MTP layer (k = 1, 2) give the eager engine's greedy tokens without speculation (bf16: up
to reported near-ties). Verification steps (k + 1 rows a sequence) replay their graphs through
the fused attention and the torch compressor path (the fused decode compressor takes one row a
sequence); the MTP layer runs eagerly after each step. The constructed checkpoint whose MTP
drafts provably equal the main model's tokens (tests/engine/test_mtp_v4.py) has nearly all of
them accepted."""

from __future__ import annotations

import pytest

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.tiny import make_tiny_model

from ..engine.test_mtp_v4 import _predictable
from .test_graphs import _check

pytestmark = pytest.mark.gpu

COMMON = dict(
    device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=256, kv_cache_blocks=256
)
GRAPHS = dict(graph_mode="full_decode_only", cuda_graph_sizes=[1, 2, 4, 8, 16, 32])
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_max": 3,
    # A random model rarely repeats 2-grams of its own: one repeated token drafts.
    "prompt_lookup_min": 1,
}


@pytest.fixture(scope="module")
def bf16_v4_mtp(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "v4mtp"
    return make_tiny_model(path, "deepseek_v4", seed=5, dtype="bfloat16", mtp_layers=1)


def _prompts() -> list[list[int]]:
    """Prompts that repeat their own text (n-gram drafts find matches) and plain ones."""
    repeating = [[(3 * i + j % (2 + i)) % 250 for j in range(12 + 5 * i)] for i in range(3)]
    return repeating + [[(7 * i + 3 * j + 1) % 250 for j in range(5 + 3 * i)] for i in range(3)]


def _generate(model, prompts, params, speculative=None, **kwargs):
    with LLM(str(model), speculative_config=speculative, **COMMON, **kwargs) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats().spec_decode.get(0)
        modes = {r["mode"] for r in llm.step_log()} if kwargs.get("log_step_plan") else set()
    return got, stats, modes


@pytest.mark.parametrize(
    "speculative",
    [
        NGRAM,
        {"method": "mtp", "num_speculative_tokens": 1},
        {"method": "mtp", "num_speculative_tokens": 2},
    ],
    ids=["ngram-k3", "mtp-k1", "mtp-k2"],
)
def test_v4_speculation_under_graphs_equals_eager(bf16_v4_mtp, speculative):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _prompts()
    with LLM(str(bf16_v4_mtp), graph_mode="none", **COMMON) as eager:
        want = [o.token_ids for o in eager.generate(prompts, params)]
        got, stats, modes = _generate(
            bf16_v4_mtp, prompts, params, speculative, log_step_plan=True, **GRAPHS
        )
        gaps = _check(eager, prompts, got, want)
    assert stats.num_drafts > 0
    assert "replay" in modes
    print(f"{speculative}: {len(gaps)} near-tie divergences, {stats}")


def test_v4_constructed_mtp_drafts_are_accepted_under_graphs(bf16_v4_mtp, tmp_path):
    """bf16 rounds the draft's and the main model's logits apart: nearly every draft, not
    necessarily all, is accepted."""
    model = _predictable(str(bf16_v4_mtp), tmp_path / "predictable")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _prompts()
    want, _, _ = _generate(model, prompts, params)
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    got, stats, _ = _generate(model, prompts, params, spec, **GRAPHS)
    assert got == want
    assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens > 0
