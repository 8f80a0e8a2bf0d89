"""DeepSeek-V4 on one GPU (plain torch: its paged attention and the clamped experts have no
kernels yet): the colocated engine and in-process 1A1F (the attention half keeping the mHC
streams, the FFN half behind an InProcessConnector) give the same greedy tokens, float32 ones
equal to the CPU engine's, over a batch with chunked prefill beside decodes; and CUDA graph modes
are refused by name until the attention side is capturable."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve import LLM, SamplingParams
from afdserve.model.deepseek_v4.tiny import make_tiny_v4

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


def test_graph_modes_are_refused_for_v4_on_cuda(v4_dirs):
    with pytest.raises(ValueError, match=r"graph_mode='full_decode_only' is not supported for "
                                         r"family 'deepseek_v4' on CUDA"):  # fmt: skip
        LLM(str(v4_dirs["bfloat16"]), device="cuda", graph_mode="full_decode_only")
