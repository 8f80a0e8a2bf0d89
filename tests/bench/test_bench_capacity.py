"""CPU runs of `afdserve bench capacity` with the tiny preset's config.json (dummy weights): the
capacity figures are the KV caches the engines really allocated, and the CUDA sizing arithmetic
gives a 1A1F attention rank the room of the experts it does not hold."""

from __future__ import annotations

import json

import pytest

from afdserve import LLM
from afdserve.bench.capacity import CapacityBench, open_llm, read_capacity, run_capacity_bench
from afdserve.cli import main
from afdserve.engine.factory import blocks_in_budget
from afdserve.model.presets import preset_config, write_preset_config

CPU = ["--device", "cpu", "--dtype", "float32"]


def _spec(model_dir, **overrides) -> CapacityBench:
    fields = dict(
        model_dir=str(model_dir),
        context_len=100,
        device="cpu",
        dtype="float32",
        load_format="dummy",
        max_num_seqs=5,
    )
    fields.update(overrides)
    return CapacityBench(**fields)


def _cache_bytes(kv_cache) -> int:
    return sum(
        t.numel() * t.element_size() for layer in kv_cache.layers for t in layer if t is not None
    )


def test_capacity_is_what_the_engines_allocated(tmp_path):
    model = write_preset_config("tiny", tmp_path / "tiny")
    config = preset_config("tiny")
    per_token = config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4  # K, V; f32
    spec = _spec(model)
    # Oracles: the KV tensors of a colocated engine, and of a 1A1F attention rank built in this
    # process (the in-process connector) the way a rank process builds it.
    engines = {
        "colocated": open_llm(spec, "colocated"),
        "1A1F": LLM(
            str(model),
            topology="1A1F",
            connector="inprocess",
            device="cpu",
            dtype="float32",
            max_num_seqs=5,
            max_num_batched_tokens=16384,
            max_model_len=100,
            load_format="dummy",
        ),
    }
    oracles = {}
    for topology, llm in engines.items():
        with llm:
            (capacity,) = read_capacity(llm, topology, spec)
            kv = llm.engine.core_client.core.kv_cache
            blocks, block_size = kv.layers[0][0].shape[:2]
            assert (capacity.num_blocks, capacity.block_size) == (blocks, block_size)
            assert capacity.cache_bytes == _cache_bytes(kv)
        assert capacity.cache_bytes == capacity.capacity_tokens * per_token
        assert capacity.sequences_that_fit == blocks // 7  # 100 tokens: 7 blocks of 16
        assert capacity.batch == min(capacity.sequences_that_fit, 5)
        oracles[topology] = capacity
    # A 1A1F world of rank processes reports, in its ready message, what its engine built.
    found = run_capacity_bench(_spec(model, topologies=("colocated", "1A1F")))
    assert [(c.topology, c.rank) for c in found] == [("1A1F", 0), ("colocated", 0)]
    for capacity in found:
        assert capacity == oracles[capacity.topology]
    attention, colocated = found
    assert attention.parameter_bytes < colocated.parameter_bytes


def test_attention_rank_gets_the_room_of_the_experts(tmp_path):
    """The CUDA sizing arithmetic (free memory after the weights, less the held-back share), fed
    the real parameter bytes of a colocated engine and of a 1A1F attention rank."""
    model = write_preset_config("tiny", tmp_path / "tiny")
    found = run_capacity_bench(_spec(model))
    attention = next(c for c in found if c.topology == "1A1F")
    colocated = next(c for c in found if c.topology == "colocated")
    per_block = colocated.cache_bytes // colocated.num_blocks
    total = 4 * colocated.parameter_bytes
    blocks = {
        c.topology: blocks_in_budget(total - c.parameter_bytes, total, 0.9, per_block)
        for c in (attention, colocated)
    }
    experts_and_router = colocated.parameter_bytes - attention.parameter_bytes
    assert blocks["colocated"] > 0
    assert blocks["1A1F"] - blocks["colocated"] in (
        experts_and_router // per_block,
        experts_and_router // per_block + 1,
    )


def test_capacity_cli_measures_decode(tmp_path):
    out = tmp_path / "capacity.json"
    code = main(
        [
            "bench",
            "capacity",
            "--preset",
            "tiny",
            "--load-format",
            "dummy",
            "--topologies",
            "colocated",
            "--context-len",
            "40",
            "--max-num-seqs",
            "4",
            "--measure",
            "--steps",
            "2",
            "--json",
            str(out),
            *CPU,
        ]
    )
    assert code == 0
    (rank,) = json.loads(out.read_text())["results"]
    assert rank["batch"] == 4 and rank["decode_tokens_per_s"] > 0
    with pytest.raises(ValueError, match="bench.device='cpu'.*'cuda' to --measure 1A1F"):
        CapacityBench(model_dir=".", device="cpu", measure=True)


def test_fp8_kv_cache_holds_a_byte_per_element(tmp_path):
    """--kv-cache-dtype fp8 reaches the engines, colocated and the 1A1F attention rank: their
    caches hold one byte per element, a quarter of float32's."""
    model = write_preset_config("tiny", tmp_path / "tiny")
    config = preset_config("tiny")
    elements = config.num_layers * 2 * config.num_kv_heads * config.head_dim  # per token
    found = run_capacity_bench(_spec(model, kv_cache_dtype="fp8"))
    assert sorted(c.topology for c in found) == ["1A1F", "colocated"]
    for capacity in found:
        assert capacity.cache_bytes == capacity.capacity_tokens * elements


def test_capacity_refuses_an_unknown_kv_cache_dtype(tmp_path):
    model = write_preset_config("tiny", tmp_path / "tiny")
    with pytest.raises(ValueError, match="bench.kv_cache_dtype"):
        _spec(model, kv_cache_dtype="int4")


def test_cache_gib_counts_sequences_by_bytes_without_an_engine(tmp_path):
    """--cache-gib: the blocks a cache of that size holds by the engine's arithmetic, for a
    preset too large to start here. deepseek-v4-flash keeps the compressors' open rows in a
    slot per sequence: max_num_seqs slots (10.4 MB each, counted by hand in
    tests/model/test_deepseek_v4_pages.py) come out of the budget before the blocks, then the
    window pool's blocks, and the FP8 cache holds more than 1.65x the bf16 cache's sequences of
    65536 tokens."""
    out = tmp_path / "capacity.json"
    flags = ["--preset", "deepseek-v4-flash", "--load-format", "dummy", "--context-len", "65536"]
    flags += ["--block-size", "128", "--max-num-seqs", "64", "--cache-gib", "100"]
    found = {}
    for kv in ("auto", "fp8"):
        assert main(["bench", "capacity", *flags, "--kv-cache-dtype", kv, "--json", str(out)]) == 0
        (row,) = json.loads(out.read_text())["results"]
        found[kv] = row
    budget, per_slot = 100 * 2**30, 10414080
    # Then the window pool at its bound (window_pool_bound: 1 + 64 x 3 + 16384 / 128 blocks of
    # 43 layers x 128 window rows x 1024 B and 21 CSA layers' first series, 4 x 640 x 6 B),
    # then the main blocks (their entries: 880640 B).
    window = 321 * (43 * 128 * 1024 + 21 * 4 * 640 * 6)
    bf16 = blocks_in_budget(budget - 64 * per_slot - window, budget, 1.0, 880640)
    assert found["auto"]["num_blocks"] == bf16 and found["auto"]["topology"] == "by bytes"
    assert found["auto"]["sequences_that_fit"] == bf16 // 512 == 232
    assert found["fp8"]["sequences_that_fit"] / found["auto"]["sequences_that_fit"] > 1.65
    with pytest.raises(ValueError, match="bench.cache_gib"):
        _spec(tmp_path, cache_gib=-1.0)
