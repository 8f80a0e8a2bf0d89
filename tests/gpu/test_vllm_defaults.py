"""vLLM's defaults on a GPU machine: `LLM()` with no device runs on CUDA with CUDA graphs
(graph_mode auto -> full_decode_only), `enforce_eager=True` runs eagerly, and both give the
tokens of the CPU engine (float32, greedy). Data-parallel replicas take one GPU each: on one GPU
`data_parallel_size=2` is refused before any rank starts; on two they give one engine's tokens."""

from __future__ import annotations

import pytest
import torch

from afdserve import LLM, SamplingParams

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello, my name is", "The capital of France", "1 2 3 4", "MoE"]


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def on_cpu() -> list[list[int]]:
    with LLM(device="cpu", dtype="float32") as llm:
        return greedy(llm)


def test_auto_is_cuda_with_graphs_and_gives_the_cpu_tokens(on_cpu) -> None:
    with LLM(dtype="float32", gpu_memory_utilization=0.3) as llm:
        assert llm.engine_config.device == "cuda"
        assert llm.graph_config.mode == "full_decode_only"
        assert greedy(llm) == on_cpu


def test_enforce_eager_runs_without_graphs(on_cpu) -> None:
    with LLM(dtype="float32", gpu_memory_utilization=0.3, enforce_eager=True) as llm:
        assert llm.graph_config.mode == "none"
        assert greedy(llm) == on_cpu


def test_replicas_take_one_gpu_each(on_cpu) -> None:
    gpus = torch.cuda.device_count()
    if gpus < 2:
        with pytest.raises(ValueError, match=f"data_parallel_size=2 needs 2 GPUs.*sees {gpus}"):
            LLM(data_parallel_size=2)
        return
    with LLM(data_parallel_size=2, dtype="float32", gpu_memory_utilization=0.3) as llm:
        devices = {r.memory.rank for r in llm.rank_ready.values()}
        assert devices == {0, 1}
        assert greedy(llm) == on_cpu
