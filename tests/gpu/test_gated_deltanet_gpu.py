"""Qwen3-Next, Qwen3.5-MoE and Kimi-Linear on one GPU (the delta rule in torch; attention,
rotary and the experts on their Triton paths): float32 greedy tokens equal the CPU engine's
(which tests/model/test_gated_deltanet.py holds equal to transformers), colocated and in-process
1A1F alike, over a batch with chunked prefill beside decodes; full_decode_only captures the
batched decode step (pad segments writing the scratch slot) and gives graph_mode none's tokens;
`full` is refused by name; `auto` captures decode steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.gpu.test_graphs import _check

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3) % 250 for i in range(45)], [5, 6, 7], [42] * 9, [9], list(range(60, 80))]


@pytest.fixture(scope="module")
def gdn_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("gdn-gpu")
    return {
        (t, dtype): make_tiny_model(root / f"{t}-{dtype}", t, seed=2, dtype=dtype)
        for t in ("qwen3_next", "qwen3_5_moe", "kimi_linear")
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


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe", "kimi_linear"])
@pytest.mark.parametrize("ubatches", [1, 2])
def test_cuda_equals_cpu_colocated_and_in_process(gdn_dirs, model_type, ubatches):
    model = gdn_dirs[(model_type, "float32")]
    colocated = tokens(model, "float32", "cuda")
    split = tokens(
        model, "float32", "cuda", topology="1A1F", connector="inprocess", ubatches=ubatches
    )
    assert split == colocated == tokens(model, "float32", "cpu")


@pytest.mark.parametrize(
    ("model_type", "dtype", "topology"),
    [
        ("qwen3_next", "float32", "colocated"),
        ("qwen3_5_moe", "float32", "1A1F"),
        ("qwen3_next", "bfloat16", "colocated"),
        ("kimi_linear", "float32", "1A1F"),
        ("kimi_linear", "bfloat16", "colocated"),
    ],
)
def test_full_decode_only_graphs_give_the_eager_tokens(gdn_dirs, model_type, dtype, topology):
    model = gdn_dirs[(model_type, dtype)]
    want = tokens(model, dtype, "cuda")
    split = {} if topology == "colocated" else dict(topology=topology, connector="inprocess")
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


def test_full_graph_mode_is_refused_on_cuda(gdn_dirs):
    with pytest.raises(ValueError, match=r"graph_mode='full' is not supported for family"):
        LLM(str(gdn_dirs[("qwen3_next", "bfloat16")]), device="cuda", graph_mode="full")


def test_auto_captures_decode_steps(gdn_dirs):
    with LLM(str(gdn_dirs[("qwen3_next", "bfloat16")]), dtype="bfloat16", device="cuda") as llm:
        assert llm.graph_config.mode == "full_decode_only"
