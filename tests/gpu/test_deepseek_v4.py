"""DeepSeek-V4 on one GPU (its fused mHC, attention, indexer and decode compressor kernels, each
held to the torch path in tests/gpu/test_v4_fused*.py; the clamped bf16 experts in torch): the
colocated engine and in-process 1A1F (the attention half keeping the mHC streams, the FFN half
behind an InProcessConnector) give the same greedy tokens, float32 ones equal to the CPU engine's,
over a batch with chunked prefill beside decodes; full_decode_only captures the batched decode
path and gives graph_mode none's tokens, and so does `full`, which captures the mixed steps
beside the decode ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from tests.gpu.test_graphs import _check

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3) % 250 for i in range(45)], [5, 6, 7], [42] * 9, [9], list(range(60, 80))]


@pytest.fixture(scope="module")
def v4_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4-gpu")
    return {
        dtype: make_tiny_v4(root / dtype, seed=2, dtype=dtype) for dtype in ("float32", "bfloat16")
    }


def tokens(model: Path, dtype: str, device: str, **kwargs) -> list[list[int]]:
    with LLM(
        str(model),
        dtype=dtype,
        device=device,
        max_num_batched_tokens=16,
        graph_mode="none",
        use_tqdm_on_load=False,
        **kwargs,
    ) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ubatches", [1, 2])
def test_in_process_1a1f_equals_colocated_on_cuda(v4_dirs, dtype, ubatches):
    model = v4_dirs[dtype]
    colocated = tokens(model, dtype, "cuda")
    split = tokens(
        model,
        dtype,
        "cuda",
        topology="1A1F",
        connector="inprocess",
        ubatches=ubatches,
        gate_on_attention=ubatches == 2,
    )
    assert split == colocated
    if dtype == "float32":  # the CPU engine equals transformers' full forward (tests/engine)
        assert colocated == tokens(model, dtype, "cpu")


@pytest.mark.parametrize(
    ("dtype", "topology", "ubatches"),
    [("float32", "colocated", 1), ("float32", "1A1F", 2), ("bfloat16", "colocated", 1)],
)
def test_full_decode_only_graphs_give_the_eager_tokens(v4_dirs, dtype, topology, ubatches):
    """full_decode_only captures V4's batched decode path (model/families/deepseek_v4/batched.py):
    decode steps of 5 sequences replay the graph of 8 rows (3 pad rows over stale block tables),
    steps with prefill chunks run eagerly; the tokens are graph_mode none's (float32: equal; bf16:
    equal up to a near-tie, as tests/gpu/test_graphs.py allows)."""
    model = v4_dirs[dtype]
    want = tokens(model, dtype, "cuda")
    split = {}
    if topology == "1A1F":
        split = dict(topology=topology, connector="inprocess", ubatches=ubatches)
    with LLM(
        str(model),
        dtype=dtype,
        device="cuda",
        max_num_batched_tokens=16,
        graph_mode="full_decode_only",
        cuda_graph_sizes=[1, 2, 4, 8],
        log_step_plan=True,
        use_tqdm_on_load=False,
        **split,
    ) as llm:
        assert llm.engine.core_client.driver.forward.graphs is not None
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        records = [r for r in llm.step_log() if r["role"] == "attention"]
    modes = {r["mode"] for r in records}
    assert {"capture", "replay", "eager"} <= modes, modes
    assert any(r["mode"] == "replay" and r["padded_rows"] > r["real_rows"] for r in records)
    if dtype == "float32":
        assert got == want
    else:
        with LLM(str(model), dtype=dtype, device="cuda", graph_mode="none") as eager:
            _check(eager, PROMPTS, got, want)


@pytest.mark.parametrize(
    ("dtype", "topology", "ubatches"),
    [("float32", "colocated", 1), ("float32", "1A1F", 2), ("bfloat16", "colocated", 1)],
)
def test_full_graphs_of_mixed_steps_give_the_eager_tokens(v4_dirs, dtype, topology, ubatches):
    """`full` captures V4's mixed steps too (batched.py from the graph's static buffers, the
    fused kernels reading each row's entries up to its position): with 16 tokens a step every
    step, prefill chunks beside decodes included, replays a graph of at most 16 rows; the
    tokens are graph_mode none's (float32: equal; bf16: equal up to a near-tie)."""
    model = v4_dirs[dtype]
    want = tokens(model, dtype, "cuda")
    split = {}
    if topology == "1A1F":
        split = dict(topology=topology, connector="inprocess", ubatches=ubatches)
    with LLM(
        str(model),
        dtype=dtype,
        device="cuda",
        max_num_batched_tokens=16,
        graph_mode="full",
        cuda_graph_sizes=[1, 2, 4, 8, 16],
        log_step_plan=True,
        use_tqdm_on_load=False,
        **split,
    ) as llm:
        assert llm.engine.core_client.driver.forward.graphs is not None
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        records = [r for r in llm.step_log() if r["role"] == "attention"]
    modes = {r["mode"] for r in records}
    assert {"capture", "replay"} <= modes and "eager" not in modes, modes
    # More rows than sequences: a prefill chunk in the replayed step.
    assert any(r["mode"] == "replay" and r["real_rows"] > len(PROMPTS) for r in records)
    assert any(r["mode"] == "replay" and r["padded_rows"] > r["real_rows"] for r in records)
    # Decode-only steps replay the decode graphs (the fused decode compressor), the others the
    # mixed ones (layout/plan.py, rule 5).
    assert {r["key"][4] for r in records if r["mode"] == "replay"} == {"decode", "mixed"}
    if dtype == "float32":
        assert got == want
    else:
        with LLM(str(model), dtype=dtype, device="cuda", graph_mode="none") as eager:
            _check(eager, PROMPTS, got, want)


def test_graph_mode_auto_captures_v4_decode(v4_dirs):
    """auto captures V4's decode up to max_model_len 65536 (cache.GRAPH_CONTEXT_LIMIT; the tiny
    model's is 512), as for every family: full_decode_only."""
    with LLM(str(v4_dirs["float32"]), dtype="float32", device="cuda") as llm:
        assert llm.graph_config.mode == "full_decode_only"
        assert llm.engine.core_client.driver.forward.graphs is not None
