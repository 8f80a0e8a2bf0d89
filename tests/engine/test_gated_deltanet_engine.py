"""The delta-rule hybrids (Qwen3-Next, Qwen3.5-MoE, Kimi-Linear) in the colocated engine:
chunked prefill (chunks of a few tokens, so the state and the convolution window cross chunk
boundaries), preemption by recompute (a slot changes hands and a victim restarts from position
0), the decode-graph layout and two ubatches (a sequence's rows split between them) all give the
one-shot greedy tokens, which tests/model/test_gated_deltanet.py holds equal to transformers;
every slot and block is free at the end. So do full graphs' static buffers on CPU (mixed steps
replayed from capacity-sized segment tensors, no host segments)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.config import EngineConfig
from afdserve.engine.cuda_graphs import CudaGraphRunner
from afdserve.engine.factory import CPU_CACHE_BUDGET, cache_blocks_for
from afdserve.engine.model_runner import ModelRunner
from afdserve.model.families import cache_layout, load_model_config
from afdserve.model.families.gated_deltanet.spans import DeltaSpans
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.engine.test_llm import run

MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "kimi_linear")
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
BLOCK = 4


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 3, 7, 13, 29)]


@pytest.fixture(scope="module", params=MODEL_TYPES)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gdn-e") / request.param, request.param, seed=2)


@pytest.fixture(scope="module")
def one_shot(model: Path) -> list[list[int]]:
    with LLM(str(model), dtype="float32", block_size=BLOCK) as llm:
        return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.mark.parametrize("budget", [3, 5])
def test_chunked_prefill_gives_the_one_shot_tokens(model, one_shot, budget: int) -> None:
    with LLM(str(model), dtype="float32", block_size=BLOCK, max_num_batched_tokens=budget) as llm:
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == one_shot


def test_preemption_by_recompute_keeps_the_tokens(model, one_shot) -> None:
    # The longest sequence, one block more, and the pages of one state slot: the slots live in
    # the pool's pages (model/cache.py's SlotPlan), so they compete with the blocks.
    pages = cache_layout(load_model_config(model)).slot_pages(BLOCK, torch.float32)
    assert pages > 0
    blocks = -(-(29 + NEW_TOKENS) // BLOCK) + 1 + pages
    llm = LLM(
        str(model),
        dtype="float32",
        block_size=BLOCK,
        kv_cache_blocks=blocks,
        max_num_batched_tokens=7,
        max_num_seqs=3,
    )
    outs, preempted = run(llm, prompts(), GREEDY, late={3: 4})
    assert preempted > 0
    assert [o.token_ids for o in outs] == one_shot
    manager = llm.engine.core_client.core.block_manager
    assert manager.num_free_blocks == blocks
    slots = min(3, blocks // pages)
    assert manager.num_slots == slots and manager.num_free_slots == slots


def test_decode_graph_layout_keeps_the_tokens(model, one_shot) -> None:
    """graph_mode full_decode_only as it runs on CPU: decode steps padded to the capture sizes,
    pad segments (slot -1) writing the scratch slot, one batched step per layer."""
    with LLM(
        str(model),
        dtype="float32",
        block_size=BLOCK,
        graph_mode="full_decode_only",
        cuda_graph_sizes=[1, 2, 4, 8],
        log_step_plan=True,
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == one_shot
        modes = {r["mode"] for r in llm.step_log()}
    assert {"capture", "replay"} <= modes


def test_two_ubatches_split_sequences_and_keep_the_tokens(model, one_shot) -> None:
    """In-process 1A1F with two ubatches: a prefill's rows fall on both sides of the ubatch
    boundary, the second part resuming from the state the first left."""
    with LLM(
        str(model),
        topology="1A1F",
        connector="inprocess",
        dtype="float32",
        block_size=BLOCK,
        ubatches=2,
        max_num_batched_tokens=9,
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == one_shot


class _Replay:
    def __init__(self, run, out: torch.Tensor) -> None:
        self.run, self.out = run, out

    def replay(self) -> None:
        self.out.copy_(self.run())


class GraphBuffersOnCPU(CudaGraphRunner):
    """What a full graph runs, on CPU: the first step of a key (the engine's warm-up captured
    before this runner was put in) makes its "graph", whose replay runs the forward over the
    static inputs the buffers hold after `_load`: as many segments as rows, the ones past the
    step's of slot -1. The full-attention layers' CPU reference loops over host segments, so
    a replay hands them the step's; the delta-rule layers read the device spans alone.
    Records each replay's key and its segments' row counts."""

    replays: list

    def forward(self, inputs, plan, boundary) -> torch.Tensor:
        if plan.mode in ("capture", "replay") and plan.key not in self.graphs:
            config, dtype = self.runner.model.config, self.runner.model.dtype
            out = torch.empty(plan.padded_rows, config.hidden_size, dtype=dtype)
            self.graphs[plan.key] = (_Replay(lambda: self._run(plan, boundary), out), out)
        self.step = inputs
        return super().forward(inputs, plan, boundary)

    def _run(self, plan, boundary) -> torch.Tensor:
        static, meta = self._static_inputs(plan), self.step.meta
        host = [meta.rows(lo, hi).segments for lo, hi in plan.ubatch_bounds]
        metas = [replace(m, segments=s) for m, s in zip(static.ubatch_metas, host, strict=True)]
        whole = replace(static.meta, segments=meta.segments)
        static = replace(static, meta=whole, ubatch_metas=tuple(metas))
        return self.runner.forward(static, plan, boundary)

    def _capture(self, key, plan, boundary) -> bool:
        return True

    def _load(self, inputs, plan) -> None:
        self.replays.append((plan.key, tuple(seg.num_rows for seg in inputs.meta.segments)))
        super()._load(inputs, plan)


@pytest.mark.parametrize("split", [{}, {"topology": "1A1F", "connector": "inprocess"}])
def test_full_graph_buffers_keep_the_tokens(model, one_shot, split: dict) -> None:
    """graph_mode full: every step (prefill chunks beside decode rows) replayed from the static
    buffers; graphs of one key replay different mixes of prefill and decode rows."""
    ubatches = 2 if split else 1
    with LLM(
        str(model),
        dtype="float32",
        block_size=BLOCK,
        graph_mode="full",
        cuda_graph_sizes=[4, 8, 12],
        max_num_batched_tokens=11,
        ubatches=ubatches,
        **split,
    ) as llm:
        forward = llm.engine.core_client.driver.forward
        assert forward.graphs is None  # CPU: the graph steps would run eagerly
        forward.graphs = GraphBuffersOnCPU(
            forward.runner, 12, llm.engine.max_model_len, ubatches=ubatches
        )
        forward.graphs.replays = []
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == one_shot
        replays = forward.graphs.replays
    mixed = [key for key, rows in replays if 1 in rows and max(rows) > 1]
    assert mixed, replays
    mixes = {key: {rows for k, rows in replays if k == key} for key in mixed}
    assert any(len(seen) > 1 for seen in mixes.values()), replays


def test_spans_are_built_once_per_ubatch(model, one_shot, monkeypatch) -> None:
    """The span tables are step metadata: built once per ubatch of each forward (two ubatches
    here), never per linear layer."""
    calls = {"forward": 0, "spans": 0}

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(ModelRunner, "forward", counting("forward", ModelRunner.forward))
    monkeypatch.setattr(DeltaSpans, "of", classmethod(counting("spans", DeltaSpans.of.__func__)))
    with LLM(
        str(model),
        topology="1A1F",
        connector="inprocess",
        dtype="float32",
        block_size=BLOCK,
        ubatches=2,
        max_num_batched_tokens=9,
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == one_shot
    assert calls["forward"] > 0 and calls["spans"] == 2 * calls["forward"], calls


def test_slots_take_pages_of_the_pool_not_max_num_seqs_bytes(model: Path) -> None:
    """The slots live in the pool's pages: a max_num_seqs whose slots alone would overflow the
    budget (CPU: 1 GiB) reserves nothing up front; the pool is sized by the budget and holds
    as many slots as its pages could, each taking its pages only while held."""
    config = load_model_config(model)
    layout = cache_layout(config)
    pages = layout.slot_pages(16, torch.float32)
    per_slot = layout.bytes_per_slot(torch.float32)
    seqs = CPU_CACHE_BUDGET // per_slot + 1
    engine = EngineConfig(model=str(model), max_num_seqs=seqs, max_num_batched_tokens=64)
    pools = cache_blocks_for(engine, config, torch.float32, 64, torch.device("cpu"))
    per_block = layout.bytes_per_block(16, torch.float32)
    assert pools.slot_pages == pages
    want = seqs * (4 + pages)  # every sequence at max_model_len 64 with its slot
    assert pools.blocks == min(want, CPU_CACHE_BUDGET // per_block - pages)
    assert pools.slots == min(seqs, pools.blocks // pages) < seqs
    # A slot's bytes, spread over its pages' rows, never exceed the pages' (first-fit waste
    # only), and never beat the bytes themselves.
    assert per_slot <= pages * per_block < 2 * per_slot + per_block


def test_slots_and_blocks_trade_pages_and_keep_the_tokens(model: Path) -> None:
    """Short and long prompts arriving over time in a pool just larger than the longest
    sequence and two slots: the pages serve as slots for the short ones and as blocks for the
    long ones in turn, sequences are preempted and recomputed, and every output equals its
    one-shot tokens; every page is free at the end."""
    gen = torch.Generator().manual_seed(5)
    lengths = (2, 35, 3, 4, 30, 5, 6, 28, 7, 1)
    many = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]
    with LLM(str(model), dtype="float32", block_size=BLOCK) as alone:
        want = [o.token_ids for o in alone.generate(many, GREEDY)]
    pages = cache_layout(load_model_config(model)).slot_pages(BLOCK, torch.float32)
    blocks = -(-(35 + NEW_TOKENS) // BLOCK) + 2 * pages + 2
    llm = LLM(
        str(model),
        dtype="float32",
        block_size=BLOCK,
        kv_cache_blocks=blocks,
        max_num_batched_tokens=16,
        max_num_seqs=6,
    )
    outs, preempted = run(llm, many, GREEDY, late={i: 3 * i for i in range(len(many))})
    assert preempted > 0
    assert [o.token_ids for o in outs] == want
    manager = llm.engine.core_client.core.block_manager
    assert manager.num_free_blocks == blocks
    assert manager.num_free_slots == manager.num_slots == min(6, blocks // pages)
