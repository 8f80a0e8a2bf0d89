"""The fp8 A2E payload (AFDConfig.a2e_dtype, kernels/a2e.py) over real gloo worlds: AFD
gives colocated's tokens exactly under the same setting, with the gate on either side, 1-2 ubatches
and a chunked prefill beside decodes; every A2E batch carries fp8 rows and their scales region in
the plan's sizes, and the FFN half received scales on exactly the real rows (pad rows: scale 0)."""

from __future__ import annotations

import json

import pytest
import torch

from afdserve import LLM
from afdserve.afd.dataplane.ffn import check_payload
from afdserve.afd.dataplane.payload import LayoutError
from afdserve.afd.dataplane.wire import read_wire_log
from afdserve.kernels.a2e import quantize_rows, scale_groups

from .conftest import GREEDY, colocated_tokens, mixed_prompts
from .wire_logs import assert_data_plane_matches_plan, received, warmup_steps

FP8 = {"a2e_dtype": "fp8"}

CASES = [
    # topology, family, ubatches, gate, graph mode, expert parallel
    ("2A1F", "qwen3_moe", 1, False, "none", False),
    ("2A1F", "mixtral", 2, True, "full_decode_only", False),
    ("3A2F", "deepseek_v2", 2, True, "full", False),
    ("1A2F", "deepseek_v3", 2, False, "none", True),
    ("1A2F", "qwen3_moe", 1, True, "none", True),
]


def _assert_scales_region(log_dir, step_log, hidden: int) -> None:
    """Every attention rank's A2E batch is [rows uint8 [tile, hidden], scales float32
    [tile, groups], ids, ...], and the FFN half saw a nonzero scale on every real row only."""
    plans = {(r["step"], r["rank"]): r for r in step_log if r["role"] == "attention"}
    batches = read_wire_log(str(p) for p in log_dir.glob("rank*.jsonl"))
    sends = 0
    for rank, records in batches.items():
        for record in records:
            ops = record["ops"]
            if rank in {r for _, r in plans} and ops[0][0] == "send":
                tile = plans[(record["step"], rank)]["tile_rows"][record["ubatch"]]
                assert ops[0][2:] == [[tile, hidden], "torch.uint8"], record
                assert ops[1][2:] == [[tile, scale_groups(hidden)], "torch.float32"], record
                sends += 1
    assert sends > 0
    for tile in received(log_dir):
        assert tile["scaled_rows"] == tile["real_rows"], tile


@pytest.mark.parametrize(("topology", "family", "ubatches", "gate", "graph_mode", "expert"), CASES)
def test_fp8_afd_equals_colocated_fp8(
    afd_models, tmp_path, topology, family, ubatches, gate, graph_mode, expert
):
    model = afd_models[family]
    prompts = mixed_prompts()  # a chunked prefill beside decodes
    with LLM(
        str(model),
        topology=topology,
        dtype="float32",
        ubatches=ubatches,
        gate_on_attention=gate,
        graph_mode=graph_mode,
        cuda_graph_sizes=[1, 2, 4, 8],
        max_num_batched_tokens=16,
        log_step_plan=True,
        log_data_plane=str(tmp_path),
        connector="p2p",
        ffn_expert_parallel=expert,
        **FP8,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    records = llm.step_log()
    assert got == colocated_tokens(model, prompts, max_num_batched_tokens=16, **FP8)
    warmup = warmup_steps(graph_mode, [1, 2, 4, 8])
    assert assert_data_plane_matches_plan(tmp_path, records, warmup) > 0
    hidden = json.loads((model / "config.json").read_text())["hidden_size"]
    _assert_scales_region(tmp_path, records, hidden)


@pytest.mark.parametrize("gate", [False, True])
def test_fp8_in_process_equals_colocated_fp8(afd_models, gate):
    model = afd_models["mixtral"]
    prompts = mixed_prompts()
    with LLM(
        str(model),
        topology="1A1F",
        connector="inprocess",
        dtype="float32",
        ubatches=2,
        gate_on_attention=gate,
        max_num_batched_tokens=16,
        **FP8,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == colocated_tokens(model, prompts, max_num_batched_tokens=16, **FP8)


def test_bad_a2e_dtype_is_refused_naming_the_field(afd_models):
    with pytest.raises(ValueError, match=r"AFDConfig.a2e_dtype='fp4' is not allowed"):
        LLM(str(afd_models["mixtral"]), topology="2A1F", a2e_dtype="fp4")
    with pytest.raises(ValueError, match=r"a2e_dtype='fp8' is not carried by connector='ipc'"):
        LLM(str(afd_models["mixtral"]), topology="1A1F", connector="ipc", a2e_dtype="fp8")


def _ids(tokens):
    return torch.tensor([7, 3, 1, len(tokens), *tokens], dtype=torch.int32)


def test_check_payload_reads_the_scales_region():
    x = torch.randn(4, 200)
    x[2:] = 0  # pad rows
    q, scales = quantize_rows(x)
    where = dict(rank=2, peer=1, step=7, layer=3, ubatch=1, tile_rows=4, vocab_size=100)
    check_payload(**where, hidden=q, ids=_ids([1, 2, -1, -1]), scales=scales)
    bad = scales.clone()
    bad[3, 1] = 0.5
    with pytest.raises(LayoutError, match="row 3 .*pad rows must have scale 0"):
        check_payload(**where, hidden=q, ids=_ids([1, 2, -1, -1]), scales=bad)
    with pytest.raises(LayoutError, match=r"expected scales \(4, 2\) float32"):
        check_payload(**where, hidden=q, ids=_ids([1, 2, -1, -1]), scales=scales[:, :1])
    with pytest.raises(LayoutError, match="row 0"):
        check_payload(**where, hidden=q, ids=_ids([1, 2, -1, -1]), scales=-scales)


def test_bfloat16_wire_of_a_float32_model(afd_models, tmp_path):
    """a2e_dtype=bfloat16 over a float32 model: the rows travel as bfloat16, no scales."""
    model = afd_models["qwen3_moe"]
    prompts = mixed_prompts()
    with LLM(
        str(model),
        topology="2A1F",
        dtype="float32",
        gate_on_attention=True,
        max_num_batched_tokens=16,
        log_data_plane=str(tmp_path),
        connector="p2p",
        a2e_dtype="bfloat16",
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    want = colocated_tokens(model, prompts, max_num_batched_tokens=16, a2e_dtype="bfloat16")
    assert got == want
    batches = read_wire_log(str(p) for p in tmp_path.glob("rank*.jsonl"))
    first = batches[0][0]["ops"]
    assert first[0][3] == "torch.bfloat16" and first[1][3] == "torch.int32", first
