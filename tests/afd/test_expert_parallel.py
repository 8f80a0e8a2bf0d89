"""Expert-parallel FFN groups over real gloo worlds: FFN ranks hold disjoint expert shards, A < F
is allowed, and the greedy tokens equal colocated ones token for token (float32). Every world also
checks the data plane: the point-to-point batches mirror pairwise (what NCCL needs), every FFN rank
of the group ran the same collectives in the same order with the plan's sizes, and each FFN rank
loaded only its shard."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

import pytest
from safetensors import safe_open

from afdserve import LLM
from afdserve.cli import build_parser, llm_kwargs
from afdserve.config import AFDConfig

from .conftest import GREEDY, colocated_tokens, mixed_prompts
from .wire_logs import assert_data_plane_matches_plan, collectives, warmup_steps

CASES = [
    # topology, family, ubatches, gate_on_attention, graph mode, placement (None: contiguous)
    ("1A2F", "qwen3_moe", 2, False, "none", None),
    ("2A2F", "deepseek_v2", 1, True, "full_decode_only", None),
    ("3A2F", "mixtral", 2, True, "none", None),
    ("2A4F", "deepseek_v3", 2, False, "full", None),
    ("2A4F", "qwen3_moe", 1, True, "none", [[7, 0], [3, 4], [1, 6], [2, 5]]),
]


def _expert_bytes(model: Path) -> dict[int, int]:
    """Float32 bytes of each routed expert over all layers, from the checkpoint."""
    out: dict[int, int] = defaultdict(int)
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        for name in f.keys():
            match = re.search(r"\.experts\.(\d+)\.", name)
            if match:
                out[int(match[1])] += 4 * math.prod(f.get_slice(name).get_shape())
    return out


def _assert_group_collectives(log_dir: Path, records: list[dict], topology) -> int:
    """Every FFN rank ran the same collectives, in the same order, each over the group's rows
    of that step and ubatch (len(group) x group_rows); returns how many each rank ran."""
    by_rank = collectives(log_dir)
    group = list(topology.ffn_group)
    assert sorted(by_rank) == group
    sequences = {
        rank: [(c["collective"], c["step"], c["layer"], c["ubatch"], c["tensors"]) for c in cs]
        for rank, cs in by_rank.items()
    }
    first = sequences[group[0]]
    assert all(seq == first for seq in sequences.values())
    group_rows = {(r["step"], r["rank"]): r["group_rows"] for r in records if r["role"] == "ffn"}
    for rank, cs in by_rank.items():
        for c in cs:
            assert c["group"] == group
            rows = group_rows[(c["step"], rank)][c["ubatch"]]
            assert all(shape[0] == len(group) * rows for shape, _ in c["tensors"]), c
    return len(first)


@pytest.mark.parametrize(
    ("topology", "family", "ubatches", "gate", "graph_mode", "placement"), CASES
)
def test_expert_parallel_matches_colocated(
    afd_models, tmp_path, topology, family, ubatches, gate, graph_mode, placement
):
    model = afd_models[family]
    prompts = mixed_prompts()  # a chunked prefill beside decodes under a budget of 16
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
        ffn_expert_parallel=True,
        expert_placement=placement,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        memory = llm.memory_reports
    records = llm.step_log()  # after shutdown: every rank has written its last step
    assert got == colocated_tokens(model, prompts)

    topo = llm.topology
    # Each FFN rank holds its shard only: together every expert once, and fewer bytes each.
    shards = [m.experts for m in memory if m.role == "ffn"]
    held = sorted(e for shard in shards for e in shard)
    assert held == list(range(len(held))) and all(len(s) < len(held) for s in shards)
    if placement is not None:
        assert shards == [tuple(sorted(s)) for s in placement]
    # ... and its bytes are the replicated part (the same on every FFN rank) plus its experts'.
    per_expert = _expert_bytes(model)
    replicated = {
        m.parameter_bytes - sum(per_expert[e] for e in m.experts) for m in memory if m.role == "ffn"
    }
    assert len(replicated) == 1  # 0 when the router sits on the attention side, no dense layer

    warmup = warmup_steps(graph_mode, [1, 2, 4, 8])
    assert assert_data_plane_matches_plan(tmp_path, records, warmup) > 0
    assert _assert_group_collectives(tmp_path, records, topo) > 0
    ffn_records = [r for r in records if r["role"] == "ffn"]
    if topo.ffn_ranks > topo.attention_ranks:  # ranks without peers serve their experts
        assert any(r["peers"] == [] and any(r["group_rows"]) for r in ffn_records)
    if topo.attention_ranks > 1:  # an idle attention rank pads while another one works
        assert any(
            r["real_rows"] == 0 and any(r["tile_rows"]) for r in records if r["role"] == "attention"
        )
    # The group shares one mode with every attention rank, step by step.
    modes: dict[int, set[str]] = defaultdict(set)
    for r in records:
        if r["mode"] != "idle" or r["role"] == "ffn":
            modes[r["step"]].add(r["mode"])
    assert all(len(m) == 1 for m in modes.values()), modes
    if graph_mode != "none":
        seen = {m for ms in modes.values() for m in ms}
        assert {"capture", "replay", "eager"} <= seen


def test_expert_parallel_config_errors(afd_models):
    """Refused with the field, the value and what is allowed, before any process starts."""
    with pytest.raises(ValueError, match=r"ffn_ranks \(2\) must not exceed.*--ffn-expert-par"):
        AFDConfig(topology="1A2F")
    with pytest.raises(ValueError, match=r"expert_placement=.*None unless ffn_expert_parallel"):
        AFDConfig(topology="2A2F", expert_placement=((0,), (1,)))
    with pytest.raises(ValueError, match=r"connector='inprocess' needs topology 1A1F without"):
        AFDConfig(topology="1A1F", connector="inprocess", ffn_expert_parallel=True)
    with pytest.raises(ValueError, match=r"ffn_expert_parallel=1 is not allowed: True or False"):
        AFDConfig(topology="2A2F", ffn_expert_parallel=1)
    with pytest.raises(ValueError, match=r"more than once \(expert: FFN indices\): \{1: \[0, 1"):
        AFDConfig(topology="1A2F", ffn_expert_parallel=True, expert_placement=[[0, 1], [1]])
    args = build_parser().parse_args(
        [
            "generate",
            "--topology",
            "1A2F",
            "--ffn-expert-parallel",
            "--expert-placement",
            "0,1,2;3,4,5,6,7",
        ]
    )
    kwargs = llm_kwargs(args)
    assert kwargs["ffn_expert_parallel"] and kwargs["expert_placement"] == [
        [0, 1, 2],
        [3, 4, 5, 6, 7],
    ]
    # The model's expert count is checked by LLM before it starts a rank.
    with pytest.raises(ValueError, match=r"8 routed experts: experts held by no FFN rank: \[7\]"):
        LLM(
            str(afd_models["mixtral"]),
            topology="1A2F",
            ffn_expert_parallel=True,
            expert_placement=[[0, 1, 2], [3, 4, 5, 6]],
        )
