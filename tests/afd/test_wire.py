"""The data-plane contract (afd/dataplane/wire.py) over real gloo worlds: every batch a rank posts
with a peer mirrors one batch the peer posts with it, as NCCL requires, and every FFN half receives
the rows the plan says, under mixed loads, ubatches, gate placement and graph warm-up."""

from __future__ import annotations

import pytest

from afdserve import LLM
from afdserve.afd.dataplane.wire import mirror_errors

from .conftest import GREEDY, colocated_tokens, mixed_prompts
from .wire_logs import assert_data_plane_matches_plan, warmup_steps


def _batch(rank, step, ops):
    ops = [[kind, peer, list(shape), "torch.float32"] for kind, peer, shape in ops]
    return {"rank": rank, "step": step, "ops": ops}


def test_mirror_check_rejects_the_batching_nccl_refuses():
    """The measured failure on two H200s: [send, send, recv] against [recv, recv] + [send]."""
    attention = [_batch(0, 0, [("send", 1, [4, 8]), ("send", 1, [8]), ("recv", 1, [4, 8])])]
    ffn = [
        _batch(1, 0, [("recv", 0, [4, 8]), ("recv", 0, [8])]),
        _batch(1, 0, [("send", 0, [4, 8])]),
    ]
    errors = mirror_errors({0: attention, 1: ffn})
    assert errors and "rank 0 posted 1 batches with 1, rank 1 posted 2 with 0" in errors[0]


def test_mirror_check_rejects_other_sizes_and_accepts_mirrors():
    sent = [_batch(0, 0, [("send", 1, [4, 8])]), _batch(0, 0, [("recv", 1, [4, 8])])]
    wrong = [_batch(1, 0, [("recv", 0, [6, 8])]), _batch(1, 0, [("send", 0, [4, 8])])]
    assert "a mirror is [('recv', (4, 8)" in mirror_errors({0: sent, 1: wrong})[0]
    # A batch with two peers mirrors each peer's own batch.
    ffn = [
        _batch(2, 0, [("recv", 0, [4, 8]), ("recv", 1, [4, 8])]),
        _batch(2, 0, [("send", 0, [4, 8]), ("send", 1, [4, 8])]),
    ]
    peer = [_batch(r, 0, [("send", 2, [4, 8])]) for r in (0, 1)]
    back = [_batch(r, 0, [("recv", 2, [4, 8])]) for r in (0, 1)]
    assert mirror_errors({0: [peer[0], back[0]], 1: [peer[1], back[1]], 2: ffn}) == []


CASES = [
    # topology, family, ubatches, gate, graph mode
    ("1A1F", "mixtral", 1, True, "none"),
    ("2A1F", "qwen3_moe", 3, False, "full_decode_only"),
    ("3A2F", "deepseek_v2", 2, True, "full"),
    ("3A1F", "deepseek_v3", 2, False, "none"),
    ("2A2F", "qwen3_moe", 2, True, "full_decode_only"),
]


@pytest.mark.parametrize(("topology", "family", "ubatches", "gate", "graph_mode"), CASES)
def test_data_plane_contract(afd_models, tmp_path, topology, family, ubatches, gate, graph_mode):
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
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    records = llm.step_log()  # after shutdown: every rank has written its last step
    assert got == colocated_tokens(model, prompts)
    warmup = warmup_steps(graph_mode, [1, 2, 4, 8])
    assert assert_data_plane_matches_plan(tmp_path, records, warmup) > 0
