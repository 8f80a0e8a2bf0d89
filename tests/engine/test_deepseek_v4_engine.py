"""DeepSeek-V4 in the colocated engine, over its paged cache (model/families/deepseek_v4/cache.py):
greedy tokens equal transformers' full-sequence forward teacher-forced (the definition: every
generated token is the argmax of the full forward over the prompt and the tokens before it), on
several tiny shapes (hc_mult 2-4, windows and compression rates that short prompts cross, the rate
above and below the block size, mixed layer types, hash layers), batched; chunked prefill in chunks
of a few tokens and preemption by recompute give the same tokens, so do decode steps on the
per-sequence path instead of the batched one; and the cache's size is what its pages hold, per
layer type."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import DeepseekV4ForCausalLM

from afdserve import LLM, SamplingParams
from afdserve.engine.cuda_graphs import check_capturable
from afdserve.engine.kv_cache import bytes_per_block, make_kv_cache
from afdserve.kernels import ops
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families import cache_layout, load_model_config
from afdserve.model.families.deepseek_v4 import batched
from afdserve.model.families.deepseek_v4 import model as model_module
from afdserve.model.families.deepseek_v4.cache import V4Window
from afdserve.model.families.deepseek_v4.geometry import MAX_DRAFT_ROWS
from afdserve.model.families.deepseek_v4.rows import StepRows
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.parts import ModelParts
from tests.engine.test_llm import run
from tests.model.deepseek_v4_helpers import boundary_ties

CSA, HCA, SLIDING = (
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "sliding_attention",
)
# name -> (make_tiny_v4 overrides, block_size)
SHAPES = {
    "hc2-w4-r2r4": ({}, 16),
    "hc3-w3-r3r6": (
        dict(
            hc_mult=3,
            sliding_window=3,
            index_topk=3,
            compress_rates={CSA: 3, HCA: 6},
            layer_types=[CSA, HCA, SLIDING, HCA],
            mlp_layer_types=["moe", "hash_moe", "moe", "hash_moe"],
        ),
        4,
    ),
    "hc4-w6-r4r8": (
        dict(
            hc_mult=4,
            sliding_window=6,
            num_hidden_layers=3,
            compress_rates={CSA: 4, HCA: 8},
            layer_types=[HCA, CSA, CSA],
            mlp_layer_types=["hash_moe", "moe", "moe"],
        ),
        4,
    ),
}
NEW_TOKENS = 14
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 3, 7, 13, 29)]


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, Path, int]:
    overrides, block_size = SHAPES[request.param]
    path = make_tiny_v4(tmp_path_factory.mktemp("v4e") / request.param, seed=4, **overrides)
    return request.param, path, block_size


@pytest.fixture(scope="module")
def one_shot(shape: tuple[str, Path, int]) -> list[list[int]]:
    """Every prompt in one generate call, each prompt's prefill in one step."""
    _, path, block_size = shape
    with LLM(str(path), dtype="float32", block_size=block_size) as llm:
        return [o.token_ids for o in llm.generate(prompts(1), GREEDY)]


@torch.inference_mode()
def test_greedy_tokens_are_the_full_forward_argmax(shape, one_shot) -> None:
    _, path, _ = shape
    hf = DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ours = load_model(path, ModelParts.colocated(), "float32")[0]
    for prompt, got in zip(prompts(1), one_shot, strict=True):
        assert len(got) == NEW_TOKENS
        seq = torch.tensor(prompt + got)
        # Where the indexer's k-th and (k+1)-th entries tie, the model does not define the
        # token: the comparison means something only without such ties.
        assert boundary_ties(ours, seq) == []
        logits = hf(seq[None, :-1], use_cache=False).logits[0]
        want = logits[len(prompt) - 1 :].argmax(dim=-1).tolist()
        assert got == want


@pytest.mark.parametrize("budget", [3, 5])
def test_chunked_prefill_gives_the_one_shot_tokens(shape, one_shot, budget: int) -> None:
    _, path, block_size = shape
    with LLM(
        str(path), dtype="float32", block_size=block_size, max_num_batched_tokens=budget
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts(1), GREEDY)] == one_shot


def test_preemption_by_recompute_keeps_the_tokens(shape, one_shot) -> None:
    _, path, block_size = shape
    blocks = -(-(29 + NEW_TOKENS) // block_size) + 1  # the longest sequence and one block more
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=block_size,
        kv_cache_blocks=blocks,
        max_num_batched_tokens=7,
    )
    outs, preempted = run(llm, prompts(1), GREEDY, late={3: 4})
    assert preempted > 0
    assert [o.token_ids for o in outs] == one_shot
    assert llm.engine.core_client.core.block_manager.num_free_blocks == blocks


def test_cache_bytes_are_its_pages_per_layer_type(shape, caplog) -> None:
    """The start-up numbers (bytes per block and per sequence slot, how many blocks fit, the
    per-type breakdown) are the bytes the pages and the slots' open rings really allocate."""
    _, path, block_size = shape
    config = load_model_config(path)
    layout, f32 = cache_layout(config), torch.float32
    cache = make_kv_cache(config, 3, block_size, f32, "cpu", num_slots=2)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in layer.pages.values())
    assert held == 3 * bytes_per_block(config, block_size, f32)
    rings = sum(
        t.numel() * t.element_size() for layer in cache.layers for t in layer.slots.values()
    )
    assert rings == 2 * layout.bytes_per_slot(f32) > 0
    assert cache.bytes == held + rings
    # Per attention type its pages, then (after them all) its window-pool pages.
    windows = [spec for spec in layout.specs if isinstance(spec, V4Window)]
    types = [spec for spec in layout.specs if spec not in windows]
    assert [w.attention_type for w in windows] == [t.attention_type for t in types]
    for spec, window in zip(types, windows, strict=True):
        per_block = spec.bytes_per_block(block_size, f32) + window.bytes_per_block(block_size, f32)
        layers = [pages for pages in cache.layers if pages.geometry.kind == spec.attention_type]
        assert [cache.layers.index(pages) for pages in layers] == list(spec.layers)
        assert all(pages.bytes == 3 * per_block + 2 * spec.bytes_per_slot(f32) for pages in layers)
    # A sliding layer's pages are its window alone; a compressed layer's grow by its entries,
    # and its open rows sit in the slots (rings of m + 16 rows, CSA 2 m + 16: room for drafts),
    # whatever the block size.
    kinds = {pages.geometry.kind: pages for pages in cache.layers}
    if SLIDING in kinds:
        assert list(kinds[SLIDING].pages) == ["window"] and not kinds[SLIDING].slots
    for kind, rate in ((CSA, config.family_config.csa_rate), (HCA, config.family_config.hca_rate)):
        if kind in kinds:
            assert kinds[kind].pages["entries"].shape[1] == -(-block_size // rate)
            ring = (2 * rate if kind == CSA else rate) + MAX_DRAFT_ROWS
            assert kinds[kind].slots["open_kv"].shape[:2] == (2, ring)
            assert "open_kv" not in kinds[kind].pages
    with caplog.at_level(logging.INFO, logger="afdserve.engine.factory"):
        llm = LLM(
            str(path), dtype="float32", block_size=block_size, kv_cache_blocks=5, max_num_seqs=3
        )
    (ready,) = llm.engine.core_client.ready.values()
    slot_bytes = 3 * layout.bytes_per_slot(f32)
    # The window's pages in a pool of their own: at most one block more than the main pool.
    main = bytes_per_block(config, block_size, f32) - layout.bytes_per_window_block(block_size, f32)
    want = 5 * main + 6 * layout.bytes_per_window_block(block_size, f32) + slot_bytes
    assert ready.memory.cache_bytes == want
    assert ready.memory.cache_blocks == 5
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache"))
    for window in windows:
        per_window = window.bytes_per_block(block_size, f32)
        assert f"{len(window.layers)} {window.kind} x {per_window} B" in line
    for spec in types:
        short = {CSA: "CSA", HCA: "HCA", SLIDING: "sliding"}[spec.attention_type]
        per_block = spec.bytes_per_block(block_size, f32)
        assert f"{len(spec.layers)} {short} x {per_block} B" in line
        if spec.bytes_per_slot(f32):
            assert f"{len(spec.layers)} {short} x {spec.bytes_per_slot(f32)} B" in line


def test_decode_steps_take_the_batched_path_and_equal_the_per_sequence_one(
    shape, one_shot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's decode ubatches run all their sequences at once (model/deepseek_v4/
    batched.py) on every device, eagerly as in a graph; forced back to the per-sequence path
    (no device segments) they give the same tokens, and so does the CPU form of
    full_decode_only (eager, every decode step padded to a capture size)."""
    _, path, block_size = shape
    ran = []

    def counted(attn, pages, x, rows, *ropes):
        if bool((rows.end - rows.start <= 1).all()):  # a decode ubatch: one row per sequence
            ran.append(1)
        return batched.step_attention(attn, pages, x, rows, *ropes)

    monkeypatch.setattr(model_module, "step_attention", counted)
    with LLM(
        str(path),
        dtype="float32",
        block_size=block_size,
        graph_mode="full_decode_only",
        cuda_graph_sizes=[3, 8],
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts(1), GREEDY)] == one_shot
    assert ran
    with LLM(str(path), dtype="float32", block_size=block_size) as llm:
        llm.engine.core_client.core.runner.batched_metadata = False
        ran.clear()
        assert [o.token_ids for o in llm.generate(prompts(1), GREEDY)] == one_shot
    assert not ran


def test_a_ubatch_builds_its_rows_once_for_every_layer(
    shape, one_shot, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine builds a ubatch's rows (StepRows: positions, tables, chunk bounds) once, as
    the cache spec's step metadata, and every layer of every attention type reads that one
    object (with the page addresses it memoizes), prefill and decode steps alike, rather than
    rebuilding them per layer; the tokens stay the full forward's."""
    _, path, block_size = shape
    of, built, seen = StepRows.of.__func__, [], []

    def building(cls, meta, window=None):
        rows = of(cls, meta, window)
        built.append(rows)
        return rows

    def counted(attn, pages, x, rows, *ropes):
        seen.append(rows)
        return batched.step_attention(attn, pages, x, rows, *ropes)

    monkeypatch.setattr(StepRows, "of", classmethod(building))
    monkeypatch.setattr(model_module, "step_attention", counted)
    with LLM(str(path), dtype="float32", block_size=block_size) as llm:
        assert [o.token_ids for o in llm.generate(prompts(1), GREEDY)] == one_shot
        layers = llm.engine.core_client.core.runner.model.config.num_layers
    assert built and len(seen) == layers * len(built)
    for i, rows in enumerate(built):
        assert all(r is rows for r in seen[i * layers : (i + 1) * layers])
        assert rows.memo  # the layers' shared addresses and rotary tables


def test_full_graphs_are_refused_by_name_on_cuda_only_without_triton(
    shape, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`full` captures V4's mixed steps where the fused kernels read each row's compressed
    entries up to its position (tests/gpu/test_deepseek_v4.py); without Triton the torch form
    would gather every row's out to max_model_len, so CUDA refuses it by name, before any rank
    starts. full_decode_only is always allowed; on CPU every graph mode runs eagerly with the
    graph layout, as for every family (tests/afd/test_deepseek_v4_afd.py)."""
    _, path, _ = shape
    config = load_model_config(path)
    monkeypatch.setattr(ops, "triton_available", lambda: False)
    with pytest.raises(
        ValueError,
        match=r"graph_mode='full' is not supported for family 'deepseek_v4' on CUDA yet: "
        r"without Triton",
    ) as err:
        check_capturable(config, "cuda:0", "full")
    assert "\n" not in str(err.value)
    for mode in ("full_decode_only", "full"):
        check_capturable(config, "cpu", mode)
    for mode in ("none", "full_decode_only"):
        check_capturable(config, "cuda", mode)
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    for mode in ("none", "full_decode_only", "full"):
        check_capturable(config, "cuda:0", mode)
