"""AFD runs over real rank processes (gloo) give the colocated greedy tokens, token for token."""

from __future__ import annotations

import os

import pytest

from afdserve import LLM

from .conftest import GREEDY, colocated_tokens, mixed_prompts
from .wire_logs import assert_data_plane_matches_plan, warmup_steps

CASES = [
    # topology, family, ubatches, budget, gate_on_attention
    ("1A1F", "qwen3_moe", 2, 2048, True),
    ("2A1F", "qwen3_moe", 1, 16, False),
    ("3A1F", "deepseek_v3", 2, 16, False),
    ("4A2F", "mixtral", 1, 8, False),
    ("3A2F", "deepseek_v2", 2, 16, True),
]


@pytest.mark.parametrize(("topology", "family", "ubatches", "budget", "gate"), CASES)
def test_afd_matches_colocated(afd_models, tmp_path, topology, family, ubatches, budget, gate):
    model = afd_models[family]
    prompts = mixed_prompts()
    want = colocated_tokens(model, prompts)
    with LLM(
        str(model),
        topology=topology,
        dtype="float32",
        ubatches=ubatches,
        max_num_batched_tokens=budget,
        gate_on_attention=gate,
        log_step_plan=True,
        log_data_plane=str(tmp_path),
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    records = llm.step_log()  # after shutdown: every rank has written its last step
    assert got == want
    attention = [r for r in records if r["role"] == "attention"]
    by_step: dict[int, list[dict]] = {}
    for r in attention:
        by_step.setdefault(r["step"], []).append(r)
    if llm.topology.attention_ranks > 1:
        # Mixed loads really happened: a rank idle while its group works, and a chunked
        # prefill step beside a one-token step.
        assert any(r["real_rows"] == 0 and any(r["tile_rows"]) for r in attention)
        # ... and uneven steps: one rank in a prefill chunk while another decodes.
        assert any(
            len({r["real_rows"] for r in rs}) > 1 and max(r["real_rows"] for r in rs) >= 8
            for rs in by_step.values()
        )
    # What each FFN rank really received: every peer's tile of every working step, with the
    # header of its step, layer and ubatch and exactly the real rows the plan gave that peer.
    assert assert_data_plane_matches_plan(tmp_path, records, warmup_steps=0) > 0


def test_afd_requests_added_while_running(afd_models):
    """Requests arriving mid-flight on an AFD world still match colocated outputs."""
    model = afd_models["qwen3_moe"]
    prompts = mixed_prompts()
    want = colocated_tokens(model, prompts)
    with LLM(str(model), topology="2A1F", dtype="float32", max_num_batched_tokens=16) as llm:
        engine = llm.engine
        done = {}
        engine.add_request("r0", prompts[0], GREEDY)
        pending = [(f"r{i}", p) for i, p in enumerate(prompts) if i]
        while len(done) < len(prompts):
            if pending:
                rid, p = pending.pop(0)
                engine.add_request(rid, p, GREEDY)
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
    assert [done[f"r{i}"] for i in range(len(prompts))] == want


def _control_boards(pid: int) -> set[str]:
    """The shared-memory control boards a process has mapped, as /proc names them (a name
    already unlinked ends in ' (deleted)')."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split(maxsplit=5)[5].strip() for line in f if "/afdserve-control-" in line}


@pytest.mark.parametrize("control_plane", ["auto", "gloo", "shm"])
def test_control_planes_match_colocated(afd_models, control_plane):
    """Either control plane, as chosen (auto: shm for a world the launcher spawns): the same
    tokens as colocated. With shm every rank maps the one board, already unlinked; with gloo
    none maps any."""
    model = afd_models["qwen3_moe"]
    prompts = mixed_prompts()
    want = colocated_tokens(model, prompts)
    with LLM(
        str(model),
        topology="2A1F",
        dtype="float32",
        max_num_batched_tokens=16,
        control_plane=control_plane,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        boards = [_control_boards(p.pid) for p in llm.engine.core_client.world.procs]
    assert got == want
    if control_plane in ("auto", "shm"):
        assert len(boards) == 3 and boards[0] == boards[1] == boards[2]
        (board,) = boards[0]
        assert board.startswith("/dev/shm/afdserve-control-") and board.endswith(" (deleted)")
        assert not os.path.exists(board.removesuffix(" (deleted)"))
    else:
        assert boards == [set(), set(), set()]


@pytest.mark.parametrize(
    ("ubatches", "gate", "graph_mode"),
    [
        (1, False, "none"),
        (2, True, "full_decode_only"),
        (3, False, "full"),
    ],
)
def test_in_process_1a1f_matches_colocated(afd_models, tmp_path, ubatches, gate, graph_mode):
    """Both halves in one process (the one-device AFD): same plan, same padding, same tokens."""
    model = afd_models["deepseek_v3"]
    prompts = mixed_prompts()
    want = colocated_tokens(model, prompts)
    with LLM(
        str(model),
        topology="1A1F",
        connector="inprocess",
        dtype="float32",
        ubatches=ubatches,
        gate_on_attention=gate,
        graph_mode=graph_mode,
        cuda_graph_sizes=[1, 2, 4, 8],
        max_num_batched_tokens=8,
        log_step_plan=True,
        log_data_plane=str(tmp_path),
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        records = llm.step_log()
    modes = {(r["role"], r["mode"]) for r in records}
    assert got == want
    # What the in-process FFN half ran: every tile, with the planned real rows.
    warmup = warmup_steps(graph_mode, [1, 2, 4, 8])
    assert assert_data_plane_matches_plan(tmp_path, records, warmup) > 0
    assert {role for role, _ in modes} == {"attention", "ffn"}
    if graph_mode != "none":
        assert ("ffn", "replay") in modes and ("ffn", "capture") in modes
