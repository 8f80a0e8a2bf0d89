"""CUDA graphs on the GPU: graph replay gives the eager engine's tokens (bf16: up to reported
near-ties), colocated and in-process 1A1F, every captured size replays, and `full` replays a
decode step's graph apart from a mixed step's."""

from __future__ import annotations

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.engine.model_runner import ModelRunner
from afdserve.model.fixtures.tiny import make_tiny_model

pytestmark = pytest.mark.gpu

SIZES = [1, 2, 4, 8, 16]
NEAR_TIE = 0.15  # bf16 logit gap under which two kernels may legitimately pick different tokens


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu") / "m", "qwen3_moe", hash_layers=1, seed=5, dtype="bfloat16"
    )


def _prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * j + 1) % 250 for j in range(3 + i % 5)] for i in range(n)]


def _check(eager: LLM, prompts, got, want) -> list[float]:
    """Equal tokens, or a divergence at a near-tie of the eager engine (gap returned)."""
    gaps = []
    for p, g, w in zip(prompts, got, want, strict=True):
        if g == w:
            continue
        i = next(k for k in range(len(w)) if g[k] != w[k])
        out = eager.generate(
            [p + w[:i]], SamplingParams(max_tokens=1, temperature=0.0, logprobs=2, ignore_eos=True)
        )[0]
        top = sorted(out.logprobs[0].values(), reverse=True)
        gap = top[0] - top[1]
        assert gap < NEAR_TIE, f"prompt {p}: diverged at {i} with a logprob gap of {gap}"
        gaps.append(gap)
    return gaps


@pytest.fixture(scope="module")
def bf16_mla_model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu") / "mla",
        "deepseek_v3",
        hash_layers=1,
        seed=5,
        dtype="bfloat16",
    )


@pytest.mark.parametrize(
    ("topology", "family"),
    [
        ("colocated", "qwen3_moe"),
        ("1A1F", "qwen3_moe"),
        ("colocated", "deepseek_v3"),
        ("1A1F", "deepseek_v3"),
    ],
)
def test_graph_tokens_equal_eager(bf16_model, bf16_mla_model, topology, family):
    """GQA and MLA (latent-space attention) alike."""
    if family == "deepseek_v3":
        bf16_model = bf16_mla_model
    prompts = _prompts(12)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    # Two engines live at once here: give each a fixed cache instead of a share of free memory.
    common = dict(
        device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=256, kv_cache_blocks=512
    )
    with LLM(str(bf16_model), **common) as eager:
        want = [o.token_ids for o in eager.generate(prompts, params)]
        with LLM(
            str(bf16_model),
            topology=topology,
            connector="inprocess" if topology == "1A1F" else "auto",
            graph_mode="full_decode_only",
            cuda_graph_sizes=SIZES,
            log_step_plan=True,
            **common,
        ) as graphs:
            assert graphs.engine.core_client.driver.forward.graphs is not None
            got = [o.token_ids for o in graphs.generate(prompts, params)]
            modes = {r["mode"] for r in graphs.step_log()}
            assert not graphs.engine.core_client.driver.forward.graphs.eager_keys
        gaps = _check(eager, prompts, got, want)
    assert "replay" in modes and "capture" in modes
    print(f"{topology} {family}: {len(gaps)} near-tie divergences, gaps {gaps}")


@pytest.mark.parametrize(
    ("family", "ubatches", "mode"),
    [
        ("qwen3_moe", 2, "full_decode_only"),
        ("qwen3_moe", 3, "full"),
        ("deepseek_v3", 2, "full"),
    ],
)
def test_ubatch_graphs_equal_eager(bf16_model, bf16_mla_model, family, ubatches, mode):
    """In-process 1A1F with several ubatches: each ubatch's segments come from its own static
    buffers. In full mode, steps with prefill chunks (cut across ubatches) replay too."""
    model = bf16_mla_model if family == "deepseek_v3" else bf16_model
    prompts = _prompts(12)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    common = dict(
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=16,
        max_model_len=256,
        kv_cache_blocks=512,
        topology="1A1F",
        connector="inprocess",
        ubatches=ubatches,
    )
    with LLM(str(model), **common) as eager:
        want = [o.token_ids for o in eager.generate(prompts, params)]
        with LLM(
            str(model),
            graph_mode=mode,
            cuda_graph_sizes=SIZES,
            log_step_plan=True,
            max_num_batched_tokens=16,
            **common,
        ) as graphs:
            got = [o.token_ids for o in graphs.generate(prompts, params)]
            records = [r for r in graphs.step_log() if r["role"] == "attention"]
        gaps = _check(eager, prompts, got, want)
    replays = [r for r in records if r["mode"] == "replay"]
    assert replays and all(len(r["key"][2]) == ubatches for r in replays)  # key[2]: ubatch rows
    if mode == "full":  # 12 prompts decode at most 12 rows: more means a prefill chunk
        assert any(r["real_rows"] > len(prompts) for r in replays), records[:5]
    print(f"{family} ubatches={ubatches} {mode}: {len(gaps)} near-tie divergences, gaps {gaps}")


def _note_steps(llm: LLM) -> list[bool]:
    """Whether each scheduled step was a uniform decode, as the real scheduler gave it."""
    scheduler = llm.engine.core_client.core.scheduler
    schedule, uniform = scheduler.schedule, []

    def noted():
        out = schedule()
        if out.scheduled:
            uniform.append(out.uniform_decode)
        return out

    scheduler.schedule = noted
    return uniform


@pytest.mark.parametrize("topology", ["colocated", "1A1F"])
def test_full_replays_the_decode_graph_for_decode_steps(bf16_model, topology, caplog):
    """Under full a decode-only step replays the decode graph of its size (the graph
    full_decode_only captures: decode attention) and a step with prefill chunks the mixed graph;
    both kinds of every size are captured at warm-up, which logs them; tokens equal eager."""
    prompts = _prompts(12)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    common = dict(
        device="cuda", dtype="bfloat16", max_num_seqs=16, max_model_len=256, kv_cache_blocks=512
    )
    with LLM(str(bf16_model), **common) as eager:
        want = [o.token_ids for o in eager.generate(prompts, params)]
        with (
            caplog.at_level("INFO", logger="afdserve.engine.step_loop"),
            LLM(
                str(bf16_model),
                topology=topology,
                connector="inprocess" if topology == "1A1F" else "auto",
                graph_mode="full",
                cuda_graph_sizes=SIZES,
                max_num_batched_tokens=16,
                log_step_plan=True,
                **common,
            ) as graphs,
        ):
            runner = graphs.engine.core_client.driver.forward.graphs
            held = {(key[2][0], key[4]) for key in runner.graphs}
            uniform = _note_steps(graphs)
            got = [o.token_ids for o in graphs.generate(prompts, params)]
            records = [r for r in graphs.step_log() if r["role"] == "attention"]
            assert not runner.eager_keys
        gaps = _check(eager, prompts, got, want)
    assert held == {(size, kind) for size in SIZES for kind in ("decode", "mixed")}
    assert f"decode {len(SIZES)} (" in caplog.text and f"mixed {len(SIZES)} (" in caplog.text
    steps = list(zip(uniform, records[-len(uniform) :], strict=True))
    assert all(r["mode"] == "replay" for _, r in steps), steps
    assert all(r["key"][4] == ("decode" if u else "mixed") for u, r in steps), steps
    assert {u for u, _ in steps} == {True, False}
    captured = [r.getMessage() for r in caplog.records if "CUDA graphs" in r.getMessage()]
    print(f"{topology} full: {len(gaps)} near-tie divergences, gaps {gaps}; {captured}")


def test_every_captured_size_replays(bf16_model):
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with LLM(
        str(bf16_model),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=16,
        max_model_len=256,
        graph_mode="full_decode_only",
        cuda_graph_sizes=SIZES,
        log_step_plan=True,
    ) as llm:
        for n in SIZES:
            llm.generate(_prompts(n), params)
        replayed = {r["padded_rows"] for r in llm.step_log() if r["mode"] == "replay"}
        assert set(SIZES) <= replayed
        graphs = llm.engine.core_client.driver.forward.graphs.graphs
        captured = {key[2][0] for key in graphs}  # key[2]: ubatch rows
        assert captured == set(SIZES)


def test_batch_above_largest_capture_runs_eagerly(bf16_model):
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with LLM(
        str(bf16_model),
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=24,
        max_model_len=256,
        graph_mode="full_decode_only",
        cuda_graph_sizes=[1, 2, 4],
        log_step_plan=True,
    ) as llm:
        outs = llm.generate(_prompts(20), params)
        records = llm.step_log()
    assert all(len(o.token_ids) == 3 for o in outs)
    assert any(r["real_rows"] > 4 and r["mode"] == "eager" for r in records)
    torch.cuda.synchronize()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "deepseek_v3", "mixtral"])
def test_cuda_float32_matches_cpu(tmp_path, family):
    """device='cuda' runs every family (fast attention for GQA, reference MLA and MoE in float32)
    and gives the CPU engine's greedy tokens; 1A1F on the GPU too, over whatever connector "auto"
    picks (both halves in one process on one GPU, connector "ipc" on two)."""
    model = make_tiny_model(tmp_path / family, family, hash_layers=1, seed=2)
    prompts = _prompts(6)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    with LLM(str(model), dtype="float32") as cpu:
        want = [o.token_ids for o in cpu.generate(prompts, params)]
    for topology in ("colocated", "1A1F"):
        with LLM(
            str(model), device="cuda", dtype="float32", topology=topology, max_num_batched_tokens=16
        ) as gpu:
            got = [o.token_ids for o in gpu.generate(prompts, params)]
        assert got == want, topology


def test_failed_capture_runs_the_key_eagerly(bf16_model, caplog, monkeypatch):
    """A capture that fails (here: a host sync inside the forward, which CUDA forbids while
    capturing) is retried once, then its key runs eagerly with the reason logged: the tokens
    are the eager engine's and the engine goes on serving. The engine captures every key while
    it warms up, so the forward is made to fail before the engine is built."""
    prompts = _prompts(4)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # Two engines live at once: a fixed cache each, not a share of free memory (the eager one's
    # share leaves the second no room on an 80 GB card).
    common = dict(
        device="cuda", dtype="bfloat16", max_num_seqs=8, max_model_len=256, kv_cache_blocks=512
    )
    forward = ModelRunner.forward

    def syncing_forward(self, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # not allowed under capture: the capture fails
        return forward(self, *args, **kwargs)

    with LLM(str(bf16_model), **common) as eager:
        want = [o.token_ids for o in eager.generate(prompts, params)]
        monkeypatch.setattr(ModelRunner, "forward", syncing_forward)
        with caplog.at_level("WARNING", logger="afdserve.engine.cuda_graphs"):
            with LLM(
                str(bf16_model), graph_mode="full_decode_only", cuda_graph_sizes=SIZES, **common
            ) as llm:
                graphs = llm.engine.core_client.driver.forward.graphs
                got = [o.token_ids for o in llm.generate(prompts, params)]
                assert graphs.eager_keys and not graphs.graphs
                assert "failed twice, so that key runs eagerly" in caplog.text
        _check(eager, prompts, got, want)
