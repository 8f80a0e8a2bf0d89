"""`afdserve bench decode` on DeepSeek-V4 (a tiny checkpoint of transformers' own model, CPU): the
bench fills every page of the V4 paged cache, colocated and in-process 1A1F decode the same greedy
tokens from it (its decode steps on the batched path, model/families/deepseek_v4/batched.py), the KV
bytes it reports are a count made by hand, and the graph mode V4 cannot be captured in on CUDA
(`full`) is refused before anything is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from afdserve.afd.dataplane.connector import InProcessConnector
from afdserve.bench.bytes import v4_layer_kv_bytes
from afdserve.bench.decode import DecodeBench, run_decode_bench
from afdserve.bench.decode_steps import DecodeSteps, bench_batch, build_halves
from afdserve.engine.kv_cache import make_kv_cache
from afdserve.engine.model_runner import LocalFFN
from afdserve.model.cache import PagedCache
from afdserve.model.families import load_model_config
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.presets import hf_config_of, preset_hf_config

# The tiny V4 (model/fixtures/deepseek_v4.py): layers sliding, CSA, HCA, CSA; window 4, CSA rate 2,
# HCA rate 4, head_dim 16, indexer keys 8 wide, index_topk 2.
CONTEXT, STEPS, BATCH, BLOCK = 10, 3, 3, 4


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_v4(tmp_path_factory.mktemp("v4bench") / "tiny", seed=4)


def spec(v4_dir: Path, **overrides) -> DecodeBench:
    fields = dict(
        model_dir=str(v4_dir),
        preset=None,
        random_weights=False,
        batch_sizes=(1, BATCH),
        context_len=CONTEXT,
        steps=STEPS,
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
    )
    fields.update(overrides)
    return DecodeBench(**fields)


def test_kv_bytes_of_each_layer_type_by_hand(v4_dir: Path) -> None:
    """bf16 pages (2 bytes) and float32 prev_gate (4), at positions before the window fills, with
    fewer closed entries than index_topk, and past several windows."""
    c = load_model_config(v4_dir)
    assert c.family_config.attention_types == (
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    )
    e = 2
    want = {
        0: (0, 0, 0),  # nothing cached yet
        # p=3: window 3 rows; CSA closed 1 (< topk), open 1; HCA closed 0, open 3.
        3: (
            3 * 16 * e,
            3 * 16 * e
            + 1 * 16 * e
            + 2 * 1 * 32 * e
            + 2 * 16 * (e + 4)  # entry, open kv+gate, prev
            + 1 * 8 * e
            + 2 * 1 * 16 * e
            + 2 * 8 * (e + 4),  # the indexer's
            3 * 16 * e + 0 + 2 * 3 * 16 * e,
        ),
        # p=13: window 3 rows (of 13); CSA closed 6, topk 2 selected, open 1; HCA closed 3, open 1.
        13: (
            3 * 16 * e,
            3 * 16 * e
            + 2 * 16 * e
            + 2 * 1 * 32 * e
            + 2 * 16 * (e + 4)
            + 6 * 8 * e
            + 2 * 1 * 16 * e
            + 2 * 8 * (e + 4),
            3 * 16 * e + 3 * 16 * e + 2 * 1 * 16 * e,
        ),
    }
    for position, (sliding, csa, hca) in want.items():
        got = [v4_layer_kv_bytes(c, layer, position, e) for layer in range(4)]
        assert got == [sliding, csa, hca, csa], position
    assert want[13] == (96, 736, 256)  # the sums written out once


def test_kv_bytes_are_what_the_cache_hands_the_attention(v4_dir: Path) -> None:
    """At every position up to a few windows, the bytes of the state `LayerPages.read` returns
    are the count, except CSA's entries: the attention keeps only the indexer's top-k of them."""
    c = load_model_config(v4_dir)
    cache = make_kv_cache(c, 8, BLOCK, torch.bfloat16, "cpu", num_slots=1)
    table = torch.arange(8)
    for position in range(1, 8 * BLOCK):
        for layer, pages in enumerate(cache.layers):
            state = pages.read(table, position, slot=0)
            parts = [state.window_kv]
            for comp in (state.compressor, state.indexer):
                if comp is not None:
                    parts += [comp.entries, comp.pending_kv, comp.pending_gate]
                    parts += [t for t in (comp.prev_kv, comp.prev_gate) if t is not None]
            read = sum(t.numel() * t.element_size() for t in parts)
            if state.indexer is not None:  # CSA: unselected entries are not read
                closed = state.compressor.entries.shape[0]
                read -= (closed - min(c.family_config.index_topk, closed)) * c.head_dim * 2
            assert v4_layer_kv_bytes(c, layer, position, 2) == read, (position, layer)
            # The FP8 cache: the unrotated channels of window rows and entries at one byte.
            keys = [(state.window_kv.shape[0], c.head_dim)]
            if state.compressor is not None:
                closed = state.compressor.entries.shape[0]
                selected = min(c.family_config.index_topk, closed) if state.indexer else closed
                keys.append((selected, c.head_dim))
            if state.indexer is not None:
                keys.append((state.indexer.entries.shape[0], c.family_config.index_head_dim))
            fp8 = read - sum(rows * (width - c.qk_rope_head_dim) for rows, width in keys)
            assert v4_layer_kv_bytes(c, layer, position, 1) == fp8, (position, layer)


def tokens(steps: DecodeSteps) -> list[list[int]]:
    return [steps.step()[0].tolist() for _ in range(STEPS)]


def test_in_process_decodes_the_colocated_tokens_over_a_full_cache(v4_dir: Path) -> None:
    raw = hf_config_of(None, str(v4_dir))
    got = {}
    for topology in ("colocated", "in-process"):
        s = spec(v4_dir, topology=topology)
        attn, ffn = build_halves(s, raw)
        steps = DecodeSteps(attn, ffn, s, BATCH)
        assert isinstance(steps.kv, PagedCache)
        boundary = InProcessConnector if topology == "in-process" else LocalFFN
        assert isinstance(steps.driver.forward.boundary, boundary)
        # Device segments on CPU too: the decode steps take the batched path a graph captures.
        assert steps._inputs().meta.batched is not None
        held = [(*layer.pages.values(), *layer.slots.values()) for layer in steps.kv.layers]
        assert all(bool((t != 0).all()) for ts in held for t in ts)  # all random state
        assert steps.kv.layers[1].pages["index_prev_gate"].dtype == torch.float32
        # The first step (position CONTEXT) reads a full window and every closed entry.
        state = steps.kv.layers[2].read(steps.tables[0], CONTEXT, slot=0)
        assert state.window_kv.shape[0] == 3 and state.compressor.entries.shape[0] == CONTEXT // 4
        got[topology] = tokens(steps)
    assert got["in-process"] == got["colocated"]
    assert len({t for row in got["colocated"] for t in row}) > 1  # not one token everywhere


@pytest.mark.parametrize("topology", ["colocated", "in-process"])
def test_decode_bench_reports_the_hand_count(v4_dir: Path, topology: str) -> None:
    results, _ = run_decode_bench(spec(v4_dir, topology=topology))
    assert [r.batch for r in results] == [1, BATCH]
    assert all(r.step_ms > 0 and r.weight_bytes > 0 for r in results)
    # Timed positions 13, 14, 15 (a step for the experts' count and 2 warm-ups first), float32:
    # per layer (sliding, CSA, HCA, CSA) as in the test above with e = 4.
    per_step = {
        13: 192 + (192 + 128 + 256 + 256 + 192 + 128 + 128) + (192 + 192 + 128) + 1280,
        14: 192 + (192 + 128 + 0 + 256 + 224 + 0 + 128) + (192 + 192 + 256) + 928,  # CSA open 0
        15: 192 + (192 + 128 + 256 + 256 + 224 + 128 + 128) + (192 + 192 + 384) + 1312,
    }
    assert per_step == {13: 3264, 14: 2688, 15: 3584}
    mean = sum(per_step.values()) / 3
    assert [r.kv_bytes for r in results] == [int(mean), int(BATCH * mean)]


def test_graph_modes_v4_cannot_capture_are_refused_on_cuda(v4_dir: Path) -> None:
    s = spec(v4_dir, device="cuda", graph_mode="full")
    with pytest.raises(
        ValueError, match="graph_mode='full' is not supported for family 'deepseek_v4' on CUDA yet"
    ):
        build_halves(s, hf_config_of(None, str(v4_dir)))


# DeepSeek-V4-Flash's preset shrunk to CPU size, everything else as published (FP8 projections,
# FP4 experts, window 128, CSA rate 4, HCA rate 128, index_topk 512, hash layers): the bench's
# `--preset deepseek-v4-flash:4` path in bf16, over a context that crosses two HCA windows.
SHRUNK = dict(
    hidden_size=256,
    head_dim=128,
    num_attention_heads=4,
    q_lora_rank=128,
    o_lora_rank=128,
    o_groups=2,
    index_n_heads=4,
    index_head_dim=128,
    n_routed_experts=8,
    moe_intermediate_size=256,
    vocab_size=512,
)


def test_shrunk_flash_in_bf16_decodes_alike_and_counts_by_hand(tmp_path: Path) -> None:
    raw = {**preset_hf_config("deepseek-v4-flash:4"), **SHRUNK}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    got = {}
    for topology in ("colocated", "in-process"):
        s = spec(
            tmp_path,
            random_weights=True,
            dtype="bfloat16",
            context_len=300,
            steps=2,
            block_size=16,
            topology=topology,
        )
        attn, ffn = build_halves(s, raw)
        assert bench_batch(attn, ffn, s, 2, None).kv_bytes == 2 * (205312 + 200192) // 2
        got[topology] = tokens(DecodeSteps(attn, ffn, s, 2))[:2]
    assert got["in-process"] == got["colocated"]
    # By hand, e = 2 (bf16), d = 128, timed positions 303 and 304; every layer reads its window's
    # last 127 rows: 127 * 128 * 2 = 32512 bytes.
    w = 32512
    # 303: CSA closed 75 (all selected, < 512), open 3; HCA closed 2, open 47.
    csa = 75 * 128 * 2 + 2 * 3 * 256 * 2 + 4 * 128 * 6  # entries, open kv+gate, prev kv+gate
    hca = 2 * 128 * 2 + 2 * 47 * 128 * 2
    assert 2 * w + (w + 2 * csa) + (w + hca) == 205312  # the indexer's sizes are the main ones
    # 304: CSA closed 76, open 0; HCA closed 2, open 48.
    csa = 76 * 128 * 2 + 0 + 4 * 128 * 6
    hca = 2 * 128 * 2 + 2 * 48 * 128 * 2
    assert 2 * w + (w + 2 * csa) + (w + hca) == 200192
