"""DeepSeek-V4 under AFD over real gloo worlds: the attention ranks keep the mHC streams (and the
FFN hyper-connection's post and comb) across the hand-over, only the collapsed, normed row (width
hidden_size) and its token id cross to the FFN rank, and its output is expanded back into the
streams on the attention side. Token for token equal to the colocated engine (float32), for
several topologies, the gate on either side, one or two ubatches, chunked prefill beside decodes,
expert-parallel FFN groups and the graph modes as they run on CPU (eager, with the graph layout);
the data plane mirrors pairwise and every tile carries the plan's rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve import LLM
from afdserve.afd.dataplane.wire import read_wire_log
from afdserve.model.families import load_model_config
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4

from .conftest import GREEDY, colocated_tokens, mixed_prompts
from .wire_logs import assert_data_plane_matches_plan, collectives, warmup_steps

CSA, HCA, SLIDING = (
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "sliding_attention",
)
SHAPES = {
    "hc2": {},  # the tiny V4: window 4, CSA rate 2, HCA rate 4, a hash layer first
    "hc3": dict(
        hc_mult=3,
        sliding_window=3,
        index_topk=3,
        compress_rates={CSA: 3, HCA: 6},
        layer_types=[CSA, HCA, SLIDING, HCA],
        mlp_layer_types=["moe", "hash_moe", "moe", "hash_moe"],
    ),
}
SLOW = pytest.mark.slow
CASES = [
    # topology, shape, ubatches, budget, gate_on_attention, graph mode, ffn_expert_parallel
    pytest.param("2A1F", "hc2", 2, 16, True, "none", False, id="2A1F-hc2-u2-gate"),
    pytest.param("2A1F", "hc3", 1, 16, False, "full_decode_only", False, marks=SLOW),
    pytest.param("3A2F", "hc3", 2, 16, False, "none", False, marks=SLOW),
    pytest.param("3A2F", "hc2", 1, 8, True, "full", False, marks=SLOW),
    pytest.param("4A2F", "hc2", 2, 16, False, "none", False, marks=SLOW),
    pytest.param("4A2F", "hc3", 1, 8, True, "full_decode_only", False, marks=SLOW),
    pytest.param("1A2F", "hc2", 2, 16, False, "none", True, marks=SLOW),
    pytest.param("2A4F", "hc3", 1, 16, True, "full", True, marks=SLOW),
]
GRAPH_SIZES = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def v4_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4-afd")
    return {name: make_tiny_v4(root / name, seed=3, **kw) for name, kw in SHAPES.items()}


def _hidden_sends(log_dir: Path, ranks: range) -> list[tuple]:
    """The shape of the rows every attention rank handed the FFN: the first send of each of its
    send batches ([hidden, ids (+ routing)])."""
    batches = read_wire_log(str(p) for p in log_dir.glob("rank*.jsonl"))
    firsts = [batch["ops"][0] for rank in ranks for batch in batches.get(rank, ())]
    return [tuple(shape) for kind, _, shape, _ in firsts if kind == "send"]


@pytest.mark.parametrize(
    ("topology", "shape", "ubatches", "budget", "gate", "graph_mode", "expert_parallel"), CASES
)
def test_v4_afd_matches_colocated(
    v4_models, tmp_path, topology, shape, ubatches, budget, gate, graph_mode, expert_parallel
):
    model = v4_models[shape]
    prompts = mixed_prompts()  # a 70-token prompt, chunked under the budget, beside decodes
    with LLM(
        str(model),
        topology=topology,
        dtype="float32",
        ubatches=ubatches,
        max_num_batched_tokens=budget,
        gate_on_attention=gate,
        graph_mode=graph_mode,
        cuda_graph_sizes=GRAPH_SIZES,
        ffn_expert_parallel=expert_parallel,
        log_step_plan=True,
        log_data_plane=str(tmp_path),
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    records = llm.step_log()
    assert got == colocated_tokens(model, prompts)
    attention = [r for r in records if r["role"] == "attention"]
    by_step: dict[int, list[dict]] = {}
    for r in attention:
        by_step.setdefault(r["step"], []).append(r)
    # A chunked prefill really ran beside decodes: a step holding a whole budget of rows while
    # another rank (or, with one attention rank, a later step) runs one-row decodes.
    assert any(r["real_rows"] == budget for r in attention)
    if llm.topology.attention_ranks > 1:
        assert any(
            len({r["real_rows"] for r in rs}) > 1 and max(r["real_rows"] for r in rs) >= 8
            for rs in by_step.values()
        )
    warmup = warmup_steps(graph_mode, GRAPH_SIZES)
    assert assert_data_plane_matches_plan(tmp_path, records, warmup) > 0
    # What crossed: rows of width hidden_size, never the hc_mult streams.
    config = load_model_config(model)
    sends = _hidden_sends(tmp_path, range(llm.topology.attention_ranks))
    assert sends and all(s[-1] == config.hidden_size and len(s) == 2 for s in sends), sends[:3]
    if expert_parallel:
        assert collectives(tmp_path)  # the group exchanged rows
    if graph_mode != "none":
        assert {"capture", "replay"} <= {r["mode"] for r in records}


def test_v4_in_process_1a1f_matches_colocated(v4_models):
    """In-process 1A1F (the FFN half behind an InProcessConnector in the caller's process)."""
    model = v4_models["hc3"]
    prompts = mixed_prompts()
    with LLM(
        str(model),
        topology="1A1F",
        connector="inprocess",
        dtype="float32",
        ubatches=2,
        max_num_batched_tokens=16,
        gate_on_attention=True,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == colocated_tokens(model, prompts)


PREFIX_WORLDS = [
    pytest.param("2A1F", {}, id="2A1F"),
    pytest.param(
        "3A2F",
        {"ubatches": 2, "graph_mode": "full_decode_only", "cuda_graph_sizes": GRAPH_SIZES},
        id="3A2F-u2-graphs",
        marks=SLOW,
    ),
    pytest.param("2A2F", {"ffn_expert_parallel": True}, id="2A2F-ep", marks=SLOW),
]


@pytest.mark.parametrize(("topology", "extra"), PREFIX_WORLDS)
def test_v4_prefix_caching_under_afd_gives_the_uncached_tokens(v4_models, topology, extra):
    """Prefixes of 13 and 19 tokens (ending mid-window and mid-compressor window) computed in a
    first round; in the second, prompts sharing them resume from their full blocks on the rank
    the router sends them to (the one that cached them), in chunks beside decodes."""
    model = v4_models["hc2"]  # rates 2 and 4: blocks of 4 resume
    prefixes = [[(11 * i + 5 * n) % 250 for i in range(n)] for n in (13, 19)]
    first = [p + [1, 2] for p in prefixes]
    second = [p + tail for p in prefixes for tail in ([3], [4, 5, 6, 7, 8, 9])]
    cache = dict(block_size=4, max_num_batched_tokens=8)
    with LLM(
        str(model), topology=topology, dtype="float32", enable_prefix_caching=True, **cache, **extra
    ) as llm:
        got = [o.token_ids for o in llm.generate(first, GREEDY)]
        outs = llm.generate(second, GREEDY)
        got += [o.token_ids for o in outs]
    assert [o.num_cached_tokens for o in outs] == [12, 12, 16, 16]
    assert got == colocated_tokens(model, first + second, enable_prefix_caching=False, **cache)
