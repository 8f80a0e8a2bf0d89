"""The fp8 A2E payload on the GPU (kernels/a2e.py): in-process 1A1F with a2e_dtype=fp8
gives the tokens of colocated with a2e_dtype=fp8, in bf16 under CUDA graphs (the same round trip
runs at both boundaries, inside the captured graphs), and the format's device arithmetic equals the
CPU's bit for bit."""

from __future__ import annotations

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.kernels.a2e import A2EFormat, quantize_rows
from afdserve.model.fixtures.tiny import make_tiny_model

from .test_graphs import _check

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def bf16_model(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("gpu") / "m", "qwen3_moe", hash_layers=1, seed=5, dtype="bfloat16"
    )


def _prompts(n: int) -> list[list[int]]:
    return [[(13 * i + 7 * j + 1) % 250 for j in range(3 + i % 5)] for i in range(n)]


@pytest.mark.parametrize(("ubatches", "gate"), [(1, False), (2, True)])
def test_in_process_fp8_equals_colocated_fp8_under_graphs(bf16_model, ubatches, gate):
    """Equal tokens; in bf16 a divergence is allowed only at a near-tie of colocated (as in
    test_graphs.py): two ubatches run the attention kernels over other row counts."""
    prompts = _prompts(12)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    common = dict(
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=16,
        max_model_len=256,
        kv_cache_blocks=512,
        graph_mode="full_decode_only",
        cuda_graph_sizes=[1, 2, 4, 8, 16],
        a2e_dtype="fp8",
        log_step_plan=True,
    )
    with LLM(str(bf16_model), **common) as colocated:
        want = [o.token_ids for o in colocated.generate(prompts, params)]
        assert "replay" in {r["mode"] for r in colocated.step_log()}
        with LLM(
            str(bf16_model),
            topology="1A1F",
            connector="inprocess",
            ubatches=ubatches,
            gate_on_attention=gate,
            **common,
        ) as in_process:
            got = [o.token_ids for o in in_process.generate(prompts, params)]
            modes = {r["mode"] for r in in_process.step_log()}
        gaps = _check(colocated, prompts, got, want)
    assert {"capture", "replay"} <= modes
    if ubatches == 1 and not gate:  # the same shapes on both sides: the same tokens
        assert got == want
    print(f"fp8 wire, ubatches={ubatches}, gate={gate}: {len(gaps)} near-tie divergences {gaps}")


def test_fp8_rows_on_the_gpu_equal_the_cpu_bit_for_bit():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(33, 2048 + 64, generator=g) * 3).to(torch.bfloat16)
    x[5] = 0
    q_cpu, s_cpu = quantize_rows(x)
    q_gpu, s_gpu = quantize_rows(x.cuda())
    assert torch.equal(s_gpu.cpu(), s_cpu)
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q_cpu.view(torch.uint8))
    fp8 = A2EFormat("fp8", torch.bfloat16)
    assert torch.equal(fp8.decode(q_gpu, s_gpu).cpu(), fp8.decode(q_cpu, s_cpu))
