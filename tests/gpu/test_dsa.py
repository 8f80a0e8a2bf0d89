"""DeepSeek-V3.2 and GLM-5 (DSA) on one GPU. The DSA layers run in plain torch on CUDA (the
indexer's scores, a stable sort for the top-k, a fixed-width gather of the selected latents; no
Triton kernel of their own yet), the rest on the kernels every family uses. Decode steps select
through the batched path (every row at once from the device segments), prefill chunks per
sequence. float32 tokens equal the CPU engine's (which tests/model/test_dsa.py holds to
transformers), colocated and in-process 1A1F alike; full_decode_only captures the batched decode
and gives graph_mode none's tokens; `full` is refused by name and `auto` stays eager."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.gpu.test_graphs import _check

pytestmark = pytest.mark.gpu

FAMILIES = ("deepseek_v32", "glm_moe_dsa")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3) % 250 for i in range(45)], [5, 6, 7], [42] * 9, [9], list(range(60, 80))]


@pytest.fixture(scope="module")
def dsa_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("dsa-gpu")
    return {
        (family, dtype): make_tiny_model(root / f"{family}-{dtype}", family, seed=2, dtype=dtype)
        for family in FAMILIES
        for dtype in ("float32", "bfloat16")
    }


def tokens(model: Path, dtype: str, device: str, **kwargs) -> list[list[int]]:
    kwargs.setdefault("graph_mode", "none")
    with LLM(
        str(model),
        dtype=dtype,
        device=device,
        max_num_batched_tokens=16,
        use_tqdm_on_load=False,
        **kwargs,
    ) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_on_cuda_equals_the_cpu_engine(dsa_dirs, family):
    model = dsa_dirs[(family, "float32")]
    colocated = tokens(model, "float32", "cuda")
    assert colocated == tokens(model, "float32", "cpu")
    split = tokens(
        model,
        "float32",
        "cuda",
        topology="1A1F",
        connector="inprocess",
        ubatches=2,
        gate_on_attention=True,
    )
    assert split == colocated


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_decode_only_graphs_give_the_eager_tokens(dsa_dirs, family, dtype):
    """Decode steps of 5 sequences replay the graph of 8 rows (3 pad rows selecting nothing),
    steps with prefill chunks run eagerly (float32: equal; bf16: equal up to a near-tie)."""
    model = dsa_dirs[(family, dtype)]
    want = tokens(model, dtype, "cuda")
    with LLM(
        str(model),
        dtype=dtype,
        device="cuda",
        max_num_batched_tokens=16,
        graph_mode="full_decode_only",
        cuda_graph_sizes=[1, 2, 4, 8],
        log_step_plan=True,
        use_tqdm_on_load=False,
    ) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        records = [r for r in llm.step_log() if r["role"] == "attention"]
    assert {"capture", "replay", "eager"} <= {r["mode"] for r in records}
    assert any(r["mode"] == "replay" and r["padded_rows"] > r["real_rows"] for r in records)
    if dtype == "float32":
        assert got == want
    else:
        with LLM(str(model), dtype=dtype, device="cuda", graph_mode="none") as eager:
            _check(eager, PROMPTS, got, want)


def test_fp8_cache_runs_on_cuda(dsa_dirs):
    """Latents and indexer keys as float8_e4m3fn through the Triton KV write."""
    got = tokens(dsa_dirs[("glm_moe_dsa", "bfloat16")], "bfloat16", "cuda", kv_cache_dtype="fp8")
    assert [len(t) for t in got] == [GREEDY.max_tokens] * len(PROMPTS)


def test_full_graph_mode_is_refused_and_auto_stays_eager(dsa_dirs):
    model = dsa_dirs[("deepseek_v32", "bfloat16")]
    with pytest.raises(ValueError, match=r"graph_mode='full' is not supported for family"):
        LLM(str(model), device="cuda", graph_mode="full")
    with LLM(str(model), device="cuda") as llm:
        assert llm.graph_config.mode == "none"
