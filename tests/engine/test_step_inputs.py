"""A step's inputs (`ModelRunner.prepare`), staged on the host and copied over together, against
the formulas they stand for: each row's KV slot `table[position // block] * block + position %
block`, pad rows writing nowhere and routing as -1, the segments' device tensors."""

from __future__ import annotations

from pathlib import Path

import torch

from afdserve.engine.block_manager import BlockManager
from afdserve.engine.kv_cache import make_kv_cache
from afdserve.engine.model_runner import ModelRunner
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from afdserve.engine.sequence import Sequence
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.parts import ModelParts

BLOCK = 4


def test_prepare_stages_every_input_as_its_formula_gives_it(tiny_models: dict[str, Path]) -> None:
    model = load_model(tiny_models["qwen3_moe"], ModelParts.colocated(), "float32")[0]
    cache = make_kv_cache(model.config, 32, BLOCK, torch.float32, "cpu")
    manager = BlockManager(cache.num_blocks, BLOCK)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    logprobs = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)
    chunked = Sequence("chunked", list(range(1, 18)), params, None)  # 17 prompt tokens
    decoding = Sequence("decoding", list(range(30, 40)), params, None)
    scored = Sequence("scored", list(range(50, 56)), logprobs, None)
    # Blocks handed out round-robin, so no table is contiguous in the cache.
    for blocks in range(1, 6):
        for seq in (chunked, decoding, scored):
            manager.allocate(seq, min(blocks * BLOCK, seq.num_tokens))
    chunked.num_computed_tokens = 3  # a chunk [3, 14): it crosses three block boundaries
    decoding.num_computed_tokens = 9  # the last prompt token, as a decode's row
    steps = [ScheduledSeq(chunked, 11), ScheduledSeq(decoding, 1), ScheduledSeq(scored, 6)]
    out = SchedulerOutput(steps, [])
    runner = ModelRunner(model, cache, torch.device("cpu"))
    runner.batched_metadata = True  # the GPU's view: the segments as device tensors too
    pad = 5
    inputs = runner.prepare(out, out.num_tokens + pad)

    rows = [(chunked, p) for p in range(3, 14)] + [(decoding, 9)]
    rows += [(scored, p) for p in range(6)]
    ids = [seq.token_ids[p] for seq, p in rows]
    slots = [seq.block_table[p // BLOCK] * BLOCK + p % BLOCK for seq, p in rows]
    assert inputs.input_ids.tolist() == ids + [0] * pad
    assert inputs.route_ids.tolist() == ids + [-1] * pad
    assert inputs.meta.positions.tolist() == [p for _, p in rows] + [0] * pad
    assert inputs.meta.slot_mapping.tolist() == slots + [-1] * pad
    # chunked's chunk ends inside its prompt: only the other two sample, from their last rows.
    assert inputs.sample_rows.tolist() == [11, 17]
    assert [s.request_id for s in inputs.sample_seqs] == ["decoding", "scored"]
    assert inputs.prompt_rows.tolist() == list(range(12, 17))  # positions 0..4 predict 1..5
    assert inputs.real_rows == len(rows)

    tables = [seq.block_table for seq in (chunked, decoding, scored)]
    width = max(map(len, tables))
    segments = inputs.meta.segments
    assert [(s.row_start, s.row_end, s.context_len) for s in segments] == [
        (0, 11, 14),
        (11, 12, 10),
        (12, 18, 6),
    ]
    for segment, table in zip(segments, tables, strict=True):
        assert segment.block_table.tolist() == table + [0] * (width - len(table))
    batched = inputs.meta.batched
    assert batched.query_start.tolist() == [0, 11, 12, 18]
    assert batched.context_lens.tolist() == [14, 10, 6]
    assert batched.block_tables.dtype == torch.int32
    assert batched.block_tables.tolist() == [t + [0] * (width - len(t)) for t in tables]
    assert (batched.max_query_len, batched.max_context_len) == (11, 14)
    assert batched.state_slots is None  # this cache keeps no per-sequence state
    # Every tensor starts where an allocation would: kernels see one pointer alignment.
    staged = [inputs.input_ids, inputs.route_ids, inputs.meta.slot_mapping, batched.query_start]
    staged += [batched.context_lens, batched.block_tables, inputs.sample_rows]
    assert all(t.data_ptr() % 16 == 0 for t in staged)


def test_a_step_of_pad_rows_alone_writes_no_kv(tiny_models: dict[str, Path]) -> None:
    """A warm-up step: no sequence, only the plan's pad rows."""
    model = load_model(tiny_models["qwen3_moe"], ModelParts.colocated(), "float32")[0]
    cache = make_kv_cache(model.config, 4, BLOCK, torch.float32, "cpu")
    runner = ModelRunner(model, cache, torch.device("cpu"))
    runner.batched_metadata = True
    inputs = runner.prepare(SchedulerOutput([], []), 3)
    assert inputs.meta.slot_mapping.tolist() == [-1, -1, -1]
    assert inputs.route_ids.tolist() == [-1, -1, -1]
    assert inputs.meta.segments == ()
    assert inputs.meta.batched.query_start.tolist() == [0]
    assert tuple(inputs.meta.batched.block_tables.shape) == (0, 1)
