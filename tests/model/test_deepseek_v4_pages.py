"""DeepSeek-V4's pages as prefix caching and the FP8 cache use them (model/families/deepseek_v4/
cache.py). Boundary writes: after one long chunk, every full block holds the state a chunk
starting at its end reads, the state a prefill stopping there leaves, on the batched path and the
per-sequence one. FP8: the KV pages are float8_e4m3fn (the compressor's state bf16, its biased
gates float32), the batched path equals the per-sequence one over them, and a block's bytes are
what the pages hold."""

from __future__ import annotations

import pytest
import torch

from afdserve.engine.kv_cache import bytes_per_block, make_kv_cache
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families import cache_layout, load_model_config
from afdserve.model.families.deepseek_v4.attention import CompressorState, LayerState
from afdserve.model.families.deepseek_v4.model import V4CausalLM
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.parts import ModelParts
from afdserve.model.presets import preset_config
from tests.model.test_deepseek_v4_batched import forward, step_meta, tables_for

FP8 = torch.float8_e4m3fn
CSA, HCA, SLIDING = (
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "sliding_attention",
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> V4CausalLM:
    """Window 6 (5 ring rows: fewer than a block of 8, more than a block of 4), rates 2 and 4."""
    path = make_tiny_v4(tmp_path_factory.mktemp("v4pages") / "tiny", seed=2, sliding_window=6)
    return load_model(path, ModelParts.colocated(), "float32")[0]


def states_close(got: LayerState, want: LayerState) -> None:
    assert got.window_pos.tolist() == want.window_pos.tolist()
    torch.testing.assert_close(got.window_kv, want.window_kv, atol=1e-5, rtol=1e-5)
    for g, w in ((got.compressor, want.compressor), (got.indexer, want.indexer)):
        assert (g is None) == (w is None)
        if w is None:
            continue
        for name in CompressorState.__dataclass_fields__:
            a, b = getattr(g, name), getattr(w, name)
            assert (a is None) == (b is None), name
            if b is not None:
                torch.testing.assert_close(
                    a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
                )


@pytest.mark.parametrize("block_size", [4, 8])
@pytest.mark.parametrize("device_meta", [True, False], ids=["batched", "per-sequence"])
@torch.inference_mode()
def test_every_full_block_holds_its_end_state(model, block_size, device_meta) -> None:
    """A prefill of 27 rows in chunks of 11, 3 and 13 (ending mid-block, mid-window): the state
    read at each block end equals the one a prefill of exactly that many rows leaves."""
    length, table = 27, tables_for((0,), block_size, -(-27 // block_size))[0]
    blocks = int(table.max()) + 1
    ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(4))
    cache = make_kv_cache(model.config, blocks, block_size, torch.float32, "cpu")
    start = 0
    for n in (11, 3, 13):
        forward(
            model,
            cache,
            ids[start : start + n],
            step_meta([(table, start, n)], 0, device_meta, True),
        )
        start += n
    for boundary in range(block_size, length, block_size):
        alone = make_kv_cache(model.config, blocks, block_size, torch.float32, "cpu")
        forward(model, alone, ids[:boundary], step_meta([(table, 0, boundary)], 0, True, True))
        for got, want in zip(cache.layers, alone.layers, strict=True):
            states_close(
                got.read(table, boundary, torch.float32), want.read(table, boundary, torch.float32)
            )


@pytest.mark.parametrize("block_size", [2, 4])
@torch.inference_mode()
def test_fp8_pages_batched_equals_per_sequence(model, block_size) -> None:
    """Several sequences' chunks, step after step, over FP8 caches on both paths: logits close,
    tokens equal, pages equal (a chunk's own keys are rounded as the pages store them)."""
    sequences, lengths = 4, [5, 1, 9, 3, 2, 7]
    tables = tables_for((0,) * sequences, block_size, -(-4 * max(lengths) // block_size))
    blocks = int(tables.max()) + 1
    caches = [make_kv_cache(model.config, blocks, block_size, FP8, "cpu") for _ in range(2)]
    dtypes = {name: t.dtype for name, t in caches[0].layers[1].pages.items()}
    assert dtypes["window"] == dtypes["entries"] == dtypes["index_entries"] == FP8
    assert dtypes["window_rope"] == dtypes["entries_rope"] == dtypes["index_entries_rope"]
    assert dtypes["open_kv"] == dtypes["prev_kv"] == dtypes["window_rope"] == torch.bfloat16
    assert dtypes["prev_gate"] == torch.float32
    gen, done = torch.Generator().manual_seed(9), [0] * sequences
    for step in range(4):
        chunks = [
            (tables[i], done[i], lengths[(i + step) % len(lengths)]) for i in range(sequences)
        ]
        ids = torch.randint(0, 256, (sum(n for _, _, n in chunks),), generator=gen)
        want = forward(model, caches[0], ids, step_meta(chunks, 0, False, True))
        got = forward(model, caches[1], ids, step_meta(chunks, 0, True, True))
        torch.testing.assert_close(got, want, atol=1e-4 * float(want.abs().max()), rtol=0.0)
        assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
        for i, (_, start, n) in enumerate(chunks):
            done[i] = start + n
    # Float32 values that differ by GEMM rounding may round one storage ulp apart.
    ulp = {FP8: 2**-3, torch.bfloat16: 2**-7, torch.float32: 1e-5}
    for g, w in zip(caches[1].layers, caches[0].layers, strict=True):
        for name, page in w.pages.items():
            got, rtol = g.pages[name].float(), ulp[page.dtype]
            torch.testing.assert_close(
                got, page.float(), atol=1e-5, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}"
            )
    assert any(bool(layer.pages["window"].float().abs().sum() > 0) for layer in caches[1].layers)


def test_fp8_block_bytes_are_what_the_pages_hold(tmp_path) -> None:
    """Per layer and block: the KV pages' unrotated channels at one byte an element, their
    rotated ones and the compressor's state at bf16's two, its biased gates at four; for
    deepseek-v4-flash at block_size 128 (CSA rate 4, HCA 128) the FP8 cache holds the bf16
    cache's blocks times the printed ratio (1.29: HCA's open rows stay bf16)."""
    config = load_model_config(make_tiny_v4(tmp_path / "v4"))
    rope = config.qk_rope_head_dim
    for spec in cache_layout(config).specs:
        geometry = spec.geometry(8)
        size = {"state": 2, "float32": 4}
        want = sum(
            rows * (width + rope if kind == "kv" else width * size[kind])
            for _, rows, width, kind in geometry.pages
        )
        assert spec.bytes_per_block(8, FP8) == want
    flash = preset_config("deepseek-v4-flash")
    bf16, fp8 = (bytes_per_block(flash, 128, dtype) for dtype in (torch.bfloat16, FP8))
    print(f"deepseek-v4-flash, block 128: bf16 {bf16} B, fp8 {fp8} B, x{bf16 / fp8:.2f}")
    kinds = {spec.kind: spec.bytes_per_block(128, FP8) for spec in cache_layout(flash).specs}
    assert bf16 / fp8 > 1.25 and set(kinds) <= {"sliding", "CSA", "HCA"}
