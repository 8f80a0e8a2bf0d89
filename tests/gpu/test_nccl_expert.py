"""Expert-parallel FFN groups over NCCL, one rank per GPU: the FFN ranks' all-gather and
reduce-scatter run on their own NCCL group, inside the FFN step's CUDA graph when the plan says
capture or replay, and the tokens equal colocated ones in float32. Needs as many GPUs as ranks
(3 for 1A2F, 4 for 2A2F, 6 for 2A4F); written before such a machine was lent, so not run yet."""

from __future__ import annotations

import pytest
import torch

from afdserve import LLM
from afdserve.afd.dataplane.wire import mirror_errors, read_wire_log

from .test_nccl import GREEDY, SIZES, _prompts, colocated, models  # noqa: F401 (fixtures)

pytestmark = pytest.mark.gpu

CASES = [
    # topology, family, ubatches, gate on attention, graph mode
    ("1A2F", "qwen3_moe", 2, False, "full"),
    ("2A2F", "mixtral", 1, True, "full_decode_only"),
    ("2A2F", "deepseek_v2", 2, False, "none"),
    ("2A4F", "deepseek_v3", 2, True, "full"),
]


@pytest.mark.parametrize(("topology", "family", "ubatches", "gate", "graph_mode"), CASES)
def test_nccl_expert_parallel_matches_colocated(
    models,  # noqa: F811 (the fixture imported above)
    tmp_path,
    topology,
    family,
    ubatches,  # noqa: F811
    gate,
    graph_mode,
):
    a, f = (int(n) for n in topology.rstrip("F").split("A"))
    if torch.cuda.device_count() < a + f:
        pytest.skip(f"{topology} needs {a + f} GPUs (one rank per GPU)")
    model = models[family]
    with LLM(
        str(model),
        device="cuda",
        dtype="float32",
        topology=topology,
        ffn_expert_parallel=True,
        ubatches=ubatches,
        gate_on_attention=gate,
        graph_mode=graph_mode,
        cuda_graph_sizes=SIZES,
        max_num_batched_tokens=16,
        log_step_plan=True,
        log_data_plane=str(tmp_path),
    ) as llm:
        got = [o.token_ids for o in llm.generate(_prompts(), GREEDY)]
    records = llm.step_log()
    assert got == colocated(model)
    assert mirror_errors(read_wire_log(str(p) for p in tmp_path.glob("rank*.jsonl"))) == []
    modes = {r["mode"] for r in records}
    if graph_mode != "none":
        assert {"capture", "replay"} <= modes, modes
