"""DeepSeek-V4's pages as prefix caching and the FP8 cache use them (model/families/deepseek_v4/
cache.py). Boundary writes: after one long chunk, every full block holds the state a chunk
starting at its end reads, the state a prefill stopping there leaves, on the batched path and the
per-sequence one. FP8: the KV pages are float8_e4m3fn (the compressor's state bf16, its biased
gates float32), the batched path equals the per-sequence one over them, and a block's bytes are
what the pages hold."""

from __future__ import annotations

import pytest
import torch

from afdserve.bench.capacity import sequences_by_bytes
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families import cache_layout, load_model_config
from afdserve.model.families.deepseek_v4.attention import CompressorState, LayerState
from afdserve.model.families.deepseek_v4.cache import V4Window
from afdserve.model.families.deepseek_v4.model import V4CausalLM
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.parts import ModelParts
from afdserve.model.presets import preset_config
from tests.model.test_deepseek_v4_batched import forward, step_meta, tables_for, v4_cache

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
    read at each block end equals the one a prefill of exactly that many rows leaves, read
    without the sequence's slot (a block boundary leaves no open compressor row)."""
    length, table = 27, tables_for((0,), block_size, -(-27 // block_size))[0]
    blocks = int(table.max()) + 1
    ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(4))
    cache = v4_cache(model, blocks, block_size)
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
        alone = v4_cache(model, blocks, block_size)
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
    caches = [v4_cache(model, blocks, block_size, FP8) for _ in range(2)]
    held = caches[0].layers[1]
    dtypes = {name: t.dtype for name, t in (*held.pages.items(), *held.slots.items())}
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
        # Keys one FP8 ulp apart (below) move a few logits by about 1e-4 of the largest: seen
        # on one CPU at 1.24e-4 (2 of 3900 logits), where another's GEMMs rounded both paths
        # alike. A wrong row or position moves them by the order of the largest itself.
        torch.testing.assert_close(got, want, atol=1e-3 * float(want.abs().max()), rtol=0.0)
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
    rotated ones and the compressor's first series at bf16's two, its biased gates at four; per
    sequence slot the open rows at bf16's two."""
    config = load_model_config(make_tiny_v4(tmp_path / "v4"))
    rope = config.qk_rope_head_dim
    size = {"state": 2, "float32": 4}
    specs = cache_layout(config).specs
    windows = [spec for spec in specs if isinstance(spec, V4Window)]
    # Per attention type its pages and its window-pool pages, over the same layers.
    assert [w.layers for w in windows] == [s.layers for s in specs if s not in windows]
    assert {w.window for w in windows} == {config.family_config.sliding_window}
    for spec in specs:
        geometry = spec.geometry(8)
        assert geometry.pages[0] == ("window", 8, config.head_dim, "kv")  # a row per position
        want = sum(
            rows * (width + rope if kind == "kv" else width * size[kind])
            for name, rows, width, kind in geometry.pages
            if geometry.pooled(name) == (spec in windows)
        )
        assert spec.bytes_per_block(8, FP8) == want
        ring = sum(rows * width * size[kind] for _, rows, width, kind in geometry.open)
        assert spec.bytes_per_slot(FP8) == (0 if spec in windows else ring)
        assert (ring > 0) == (geometry.rate > 0)


def test_flash_blocks_hold_what_grows_and_fp8_holds_more_sequences() -> None:
    """deepseek-v4-flash, counted by hand. At block_size 128 a block holds the window's rows (a
    row per position), the entries (CSA 32 and its indexer's 32, HCA 1) and the first series of
    the CSA window ending the block (4 rows: what a prefix hit there reads); at 16 (no prefix
    caching: not a multiple of HCA's 128) 16 window rows, 4 + 4 CSA entries, 1 HCA entry slot.
    The window's rows and the first series sit in the window pool's blocks. A sequence slot
    holds the open rows (kv and gate, CSA's two series) and CSA's first series, rings of m + 16
    rows (CSA 2 m + 16: room for a speculative step's drafts). FP8 holds 1.70x the bf16 cache's
    bytes a block at 128 and 1.76x at 16. At context 65536 in 120 GiB, the slots of the
    scheduler's sequences taken first, then the window pool at its bound (engine/factory.py):
    268 bf16 and 455 FP8 sequences (270 and 459 with rings of m rows, 36 and 62 while every
    block kept its window rows and first series), 1.70x."""
    flash = preset_config("deepseek-v4-flash")
    v4, layout = flash.family_config, cache_layout(flash)
    d, rope, di = flash.head_dim, flash.qk_rope_head_dim, v4.index_head_dim
    assert (d, rope, di, v4.sliding_window, v4.csa_rate, v4.hca_rate) == (512, 64, 128, 128, 4, 128)
    count = {t: v4.attention_types.count(t) for t in (SLIDING, CSA, HCA)}
    assert count == {SLIDING: 2, CSA: 21, HCA: 20}

    def key(width: int, fp8: bool) -> int:  # a window row or an entry
        return (width - rope) + 2 * rope if fp8 else 2 * width

    prev = 4 * (d + di) * (2 + 4)  # CSA's and its indexer's first series: kv bf16, gates float32
    blocks = {}
    for block_size, window, entries, prev_rows in ((128, 128, 32, prev), (16, 16, 4, 0)):
        for fp8, dtype in ((False, torch.bfloat16), (True, FP8)):
            csa = entries * (key(d, fp8) + key(di, fp8)) + prev_rows
            want = 43 * window * key(d, fp8) + 21 * csa + 20 * key(d, fp8)
            blocks[block_size, dtype] = layout.bytes_per_block(block_size, dtype)
            assert blocks[block_size, dtype] == want, (block_size, dtype)
            opened = 20 * 2 * (128 + 16) * d * 2 + 21 * 2 * (8 + 16) * 2 * (d + di) * 2
            assert layout.bytes_per_slot(dtype) == opened + 21 * prev * (8 + 16) // 4
            # The window's rows and the first series sit in the window pool's blocks, the
            # entries in the main ones.
            pooled = 43 * window * key(d, fp8) + 21 * prev_rows
            assert layout.bytes_per_window_block(block_size, dtype) == pooled
    ratios = [round(blocks[b, torch.bfloat16] / blocks[b, FP8], 2) for b in (128, 16)]
    assert ratios == [1.70, 1.76]
    budget, seqs = 120 * 2**30, 256
    fit = {
        dtype: sequences_by_bytes(flash, budget, 65536, 128, dtype, seqs)
        for dtype in (torch.bfloat16, FP8)
    }
    print(f"deepseek-v4-flash, 120 GiB at 65536: {fit}")
    # By hand: the slots first, then the window pool at its bound (1 null block, 256 sequences
    # x (1 block of past window + 2), 16384 / 128 a step's), then the main blocks, 512 a sequence.
    for fp8, dtype in ((False, torch.bfloat16), (True, FP8)):
        main = 21 * 32 * (key(d, fp8) + key(di, fp8)) + 20 * key(d, fp8)
        pool = (1 + 256 * 3 + 128) * (43 * 128 * key(d, fp8) + 21 * prev)
        assert fit[dtype] == (budget - seqs * layout.bytes_per_slot(dtype) - pool) // main // 512
    assert (fit[torch.bfloat16], fit[FP8]) == (268, 455)
