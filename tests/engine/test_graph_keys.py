"""A graph runner asked to replay a key it never captured raises (both roles use this check),
instead of capturing behind a step log that says replay; the key's kind sets the attention
launch of the graph's static buffers."""

from __future__ import annotations

import pytest
import torch

from afdserve.engine.cuda_graphs import CudaGraphRunner, GraphKeyError, check_replayable
from afdserve.engine.kv_cache import make_kv_cache
from afdserve.engine.model_runner import ModelRunner
from afdserve.layout.plan import GraphTable, RankStep, plan_step
from afdserve.layout.topology import Topology
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts


def test_replay_of_an_uncaptured_key_raises():
    graphs = {("ffn", 2, ((4,),), (4,)): object()}
    check_replayable(2, "replay", ("ffn", 2, ((4,),), (4,)), graphs)
    check_replayable(2, "capture", ("ffn", 2, ((8,),), (8,)), graphs)
    with pytest.raises(GraphKeyError, match=r"rank 2: the plan replays .*never captured"):
        check_replayable(2, "replay", ("ffn", 2, ((8,),), (8,)), graphs)


def test_the_key_kind_picks_the_attention_launch(tmp_path):
    """A decode graph's static buffers launch the attention for 1 + k query rows (the decode
    kernels), a mixed graph's for the whole ubatch (the varlen path): the plan's kind, not the
    graph mode, decides, so `full` holds both."""
    model_dir = make_tiny_model(tmp_path / "m", "qwen3_moe")
    model, _ = load_model(model_dir, ModelParts.colocated(), "float32")
    cache = make_kv_cache(model.config, 8, 16, torch.float32, "cpu")
    graphs = CudaGraphRunner(
        ModelRunner(model, cache, torch.device("cpu")), 8, 64, ubatches=2, decode_query_len=2
    )
    table = GraphTable("full", (4, 8))
    colocated = Topology.parse("colocated")
    for report, kind, query in (
        (RankStep(6, 3, True), "decode", 2),
        (RankStep(6, 2, False), "mixed", 4),
    ):
        (plan,) = plan_step([report], colocated, table, ubatches=2).attention
        assert plan.graph_kind == kind and plan.ubatch_rows == (4, 4)
        metas = graphs._static_inputs(plan).ubatch_metas
        assert [meta.batched.max_query_len for meta in metas] == [query, query]
