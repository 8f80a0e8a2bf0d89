"""MTP drafts (DeepSeek-V3's next-token-prediction layer) on one GPU under CUDA graphs,
colocated and in-process 1A1F: the eager engine's greedy tokens without speculation (bf16: up to
reported near-ties). The main model's verification steps replay their graphs, and so do the MTP
layer's draft passes after each step (layout/plan.py, rules 9 and 10; engine/draft_passes.py):
the runner holds a graph of each kind of pass and every capture succeeded. The constructed
checkpoint whose drafts provably equal the main model's tokens (tests/engine/test_mtp.py)
accepts them."""

from __future__ import annotations

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.engine.draft_passes import DraftPasses
from afdserve.layout.plan import DRAFT_TAGS
from afdserve.model.fixtures.tiny import make_tiny_model

from ..engine.test_mtp import _predictable
from .test_graphs import _check

pytestmark = pytest.mark.gpu

COMMON = dict(
    device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=256, kv_cache_blocks=256
)


@pytest.fixture(scope="module")
def bf16_mtp_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpu") / "mtp"
    return make_tiny_model(path, "deepseek_v3", seed=5, dtype="bfloat16", mtp_layers=1)


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * j + 1) % 250 for j in range(5 + 3 * i)] for i in range(6)]


def _generate(model, prompts, params, speculative=None, **kwargs):
    """Tokens, speculation counters, and the run modes of the main steps and (as "draft
    MODE") of their draft passes when the step plan is logged."""
    with LLM(str(model), speculative_config=speculative, **COMMON, **kwargs) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats().spec_decode.get(0)
        modes = set()
        if kwargs.get("log_step_plan"):
            log = llm.step_log()
            modes = {r["mode"] for r in log}
            modes |= {f"draft {m}" for r in log for m in r.get("draft_modes", ())}
            _check_draft_graphs(llm, speculative["num_speculative_tokens"], modes)
    return got, stats, modes


def _check_draft_graphs(llm: LLM, k: int, modes: set[str]) -> None:
    """The draft passes replayed CUDA graphs: the runner captured a graph of each kind of pass
    (chained passes only with k > 1), none fell back to eager, and the log shows replays."""
    passes = llm.engine.core_client.core.mtp.passes
    assert passes.settings is not None and passes.settings.capture
    assert not passes.eager_keys, passes.eager_keys
    assert {key[-1] for key in passes.graphs} == set(DRAFT_TAGS[: min(k, 2)]), list(passes.graphs)
    assert {"draft capture", "draft replay"} <= modes, modes


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("graph_mode", ["full_decode_only", "full"])
def test_mtp_graphs_equal_eager(bf16_mtp_model, graph_mode, k):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _prompts()
    with LLM(str(bf16_mtp_model), graph_mode="none", **COMMON) as eager:
        want = [o.token_ids for o in eager.generate(prompts, params)]
        got, stats, modes = _generate(
            bf16_mtp_model,
            prompts,
            params,
            {"method": "mtp", "num_speculative_tokens": k},
            graph_mode=graph_mode,
            cuda_graph_sizes=[1, 2, 4, 8, 16, 32],
            log_step_plan=True,
        )
        gaps = _check(eager, prompts, got, want)
    assert stats.num_drafts > 0
    assert "replay" in modes
    print(f"{graph_mode} k={k}: {len(gaps)} near-tie divergences, {stats}")


def test_constructed_mtp_drafts_are_accepted_under_graphs(bf16_mtp_model, tmp_path):
    """bf16 rounds the draft's and the main model's logits apart (their argmax agrees up to a
    positive factor): nearly every draft, not all, is accepted."""
    model = _predictable(bf16_mtp_model, tmp_path / "predictable")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _prompts()
    want, _, _ = _generate(model, prompts, params)
    got, stats, _ = _generate(
        model,
        prompts,
        params,
        {"method": "mtp", "num_speculative_tokens": 2},
        graph_mode="full_decode_only",
        cuda_graph_sizes=[1, 2, 4, 8, 16, 32],
        log_step_plan=True,
    )
    assert got == want
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0


@pytest.mark.parametrize("k", [1, 2])
def test_mtp_inprocess_1a1f_graphs_equal_eager(bf16_mtp_model, k):
    """1A1F in one process: the main step replays its graphs on both halves, the MTP layer's
    draft passes cross the in-process boundary as layer N inside their own graphs."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _prompts()
    with LLM(str(bf16_mtp_model), graph_mode="none", **COMMON) as eager:
        want = [o.token_ids for o in eager.generate(prompts, params)]
        got, stats, modes = _generate(
            bf16_mtp_model,
            prompts,
            params,
            {"method": "mtp", "num_speculative_tokens": k},
            topology="1A1F",
            connector="inprocess",
            graph_mode="full_decode_only",
            cuda_graph_sizes=[1, 2, 4, 8, 16, 32],
            log_step_plan=True,
        )
        gaps = _check(eager, prompts, got, want)
    assert stats.num_drafts > 0
    assert "replay" in modes
    print(f"1A1F inprocess k={k}: {len(gaps)} near-tie divergences, {stats}")


@pytest.mark.parametrize("topology", ["colocated", "1A1F"])
def test_failed_draft_capture_runs_the_pass_eagerly(bf16_mtp_model, topology, caplog, monkeypatch):
    """A draft pass whose capture fails (a host sync inside it, which CUDA forbids while
    capturing) runs its key eagerly from then on, the reason logged; the main step's graphs are
    untouched and the tokens are the eager engine's (bf16: up to near-ties). The engine captures
    every key while it warms up, so the pass is made to fail before the engine is built."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = _prompts()
    split = dict(topology="1A1F", connector="inprocess") if topology == "1A1F" else {}
    layer = DraftPasses._layer

    def syncing_layer(self, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed under capture: the capture fails
        return layer(self, *args, **kwargs)

    with LLM(str(bf16_mtp_model), graph_mode="none", **COMMON) as eager:
        want = [o.token_ids for o in eager.generate(prompts, params)]
        monkeypatch.setattr(DraftPasses, "_layer", syncing_layer)
        with caplog.at_level("WARNING", logger="afdserve.engine.cuda_graphs"):
            with LLM(
                str(bf16_mtp_model),
                speculative_config={"method": "mtp", "num_speculative_tokens": 1},
                graph_mode="full_decode_only",
                cuda_graph_sizes=[1, 2, 4, 8],
                **split,
                **COMMON,
            ) as llm:
                passes = llm.engine.core_client.core.mtp.passes
                got = [o.token_ids for o in llm.generate(prompts, params)]
                assert passes.eager_keys and not passes.graphs
                assert "failed twice, so that key runs eagerly" in caplog.text
                assert llm.engine.core_client.driver.forward.graphs.graphs  # the main step's
        _check(eager, prompts, got, want)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["1A1F", "1A2F-ep"])
def test_mtp_p2p_across_gpus_matches_colocated(tmp_path, expert_parallel):
    """Ranks on their own GPUs over NCCL, float32, graphs on the main step and the draft passes
    (the FFN ranks replay their side of each pass): colocated's tokens without speculation, and
    the provably-accepting checkpoint's drafts accepted."""
    gpus = 3 if expert_parallel else 2
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs (one rank per GPU)")
    model = make_tiny_model(tmp_path / "m", "deepseek_v3", seed=5, mtp_layers=1)
    model = _predictable(model, tmp_path / "predictable")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = _prompts()
    common = dict(device="cuda", dtype="float32", max_num_seqs=8, max_model_len=256)
    with LLM(str(model), graph_mode="none", **common) as eager:
        want = [o.token_ids for o in eager.generate(prompts, params)]
    topology = "1A2F" if expert_parallel else "1A1F"
    with LLM(
        str(model),
        topology=topology,
        connector="p2p",
        ffn_expert_parallel=expert_parallel,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
        graph_mode="full_decode_only",
        cuda_graph_sizes=[1, 2, 4, 8],
        log_step_plan=True,
        **common,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.stats().spec_decode[0]
        log = llm.step_log()
    assert got == want
    assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens > 0
    for role in ("attention", "ffn"):
        modes = {m for r in log if r["role"] == role for m in r.get("draft_modes", ())}
        assert {"capture", "replay"} <= modes, (role, modes)
