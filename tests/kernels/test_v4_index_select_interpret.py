"""DeepSeek-V4's fused lightning-indexer selection (kernels/triton/v4_index_select.py) under
Triton's interpreter (TRITON_INTERPRET=1, numpy) on CPU, against the torch path it replaces on
CUDA (`batched._index_scores` then `Indexer.ranked`, the per-sequence path's stable sort) over a
real `LayerPages` filled with random rows, a third of the indexer's entry rows zeroed so that
scores tie at 0.0: each row keeps the same set of visible entries (ties to the earlier entry),
in index order, then the fill index no row sees. One decode row; decode rows before, across and
well past the rate (more closed entries than index_topk), with pad rows (which keep none);
prefill chunks beside decodes (keys from the chunk's own pooled rows and from the page); the
scores taken in several row chunks (a small scratch); the tiny indexer (topk 2) and a wide one
(20 heads, dim 48: padded; topk 40); FP8 caches (e4m3 entries beside their bf16 rotated
channels, scale 0.5) read in the kernel. float32 queries only (the sets must match exactly). In a
subprocess because the variable must be set before any @triton.jit function is defined."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import tempfile
from pathlib import Path

import torch

from afdserve.engine.kv_cache import make_kv_cache
from afdserve.kernels.triton import v4_index_select as triton_select
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families.deepseek_v4 import batched
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.parts import ModelParts

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
SLIDING = "sliding_attention"


def model_of(root, name, **overrides):
    path = make_tiny_v4(Path(root) / name, seed=3, layer_types=[SLIDING, CSA, HCA, CSA],
                        **overrides)
    return load_model(path, ModelParts.colocated(), "float32")[0]


def step_rows(chunks, width, pad, gen):
    # chunks: (start, rows) per sequence -> StepRows, pad rows appended.
    positions, tables, real, start, end = [], [], [], [], []
    perm = torch.randperm(len(chunks) * width + 2, generator=gen)
    for i, (first, count) in enumerate(chunks):
        for q in range(first, first + count):
            positions.append(q); tables.append(perm[i * width:(i + 1) * width]); real.append(True)
            start.append(first); end.append(first + count)
    for _ in range(pad):
        positions.append(0); tables.append(perm[:width]); real.append(False)
        start.append(0); end.append(0)
    return batched.StepRows(torch.tensor(positions), torch.stack(tables), torch.tensor(real),
                            torch.tensor(start), torch.tensor(end))


def case(model, chunks, pad, block_size, seed, scratch=None, fp8=False):
    gen = torch.Generator().manual_seed(seed)
    indexer = model.model.layers[1].self_attn.compressor.indexer
    width = -(-max(s + c for s, c in chunks) // block_size) + 1
    rows = step_rows(chunks, width, pad, gen)
    blocks = len(chunks) * width + 2
    cache_dtype = torch.float8_e4m3fn if fp8 else torch.float32
    cache = make_kv_cache(model.config, blocks, block_size, cache_dtype, "cpu", num_slots=1)
    pages = cache.layers[1]
    assert pages.fp8 == fp8
    for flat in pages.flat.values():
        flat.copy_(torch.randn(flat.shape, generator=gen))
    page, rope_page = pages.flat["index_entries"], pages.flat.get("index_entries_rope")
    tie = torch.rand(page.shape[0], generator=gen) < 0.33
    page.view(torch.uint8)[tie] = 0  # ties at score 0.0 (e4m3's zero is the zero byte)
    if fp8:
        rope_page[tie] = 0.0
        pages.scale = 0.5  # the kernel honours a scale other than 1.0
    n = rows.positions.shape[0]
    x = torch.randn(n, model.config.hidden_size, generator=gen)
    q_residual = torch.randn(n, model.config.q_lora_rank, generator=gen)
    new = torch.randn(n, indexer.dim, generator=gen)
    new[::3] = 0.0
    rope = model.ropes("cpu")["compress"]
    want = indexer.ranked(batched._index_scores(indexer, pages, x, q_residual, rows, rope, new))
    q, weights = indexer.queries(x, q_residual, rope.at(rows.positions))
    # As the packed GEMM gives them: a column slice (rows apart), scaled in the kernel.
    weights = torch.cat((weights, torch.zeros_like(weights)), dim=1)[:, : indexer.heads]
    if scratch is not None:
        triton_select.SCORE_ELEMENTS = scratch
    got = triton_select.index_select(
        q, weights, new, page, (rows.tables, block_size, pages.pages["index_entries"].shape[1]),
        indexer.rate, (rows.positions, rows.start, rows.real), indexer.topk, rope_page,
        pages.scale, indexer.weight_scale)
    triton_select.SCORE_ELEMENTS = 1 << 26
    count = -(-width * block_size // indexer.rate)
    closed = torch.where(rows.real, (rows.positions + 1) // indexer.rate, 0)
    label = (indexer.heads, indexer.dim, indexer.topk, chunks, pad, block_size, scratch, fp8)
    assert got.shape == (n, indexer.topk), label
    for r in range(n):
        kept = [e for e in want[r].tolist() if e < closed[r]]
        mine = got[r].tolist()
        visible = [e for e in mine if e < closed[r]]
        assert visible == sorted(kept), (label, r, visible, kept)
        assert all(e == count for e in mine[len(visible):]), (label, r, mine)
    print("select", label, "ok")


torch.set_grad_enabled(False)
with tempfile.TemporaryDirectory() as root:
    tiny = model_of(root, "tiny")
    wide = model_of(root, "wide", num_attention_heads=4, head_dim=80, index_head_dim=48,
                    index_n_heads=20, index_topk=40, compress_rates={CSA: 2, HCA: 8})
    decode = [(0, 1), (1, 1), (4, 1), (6, 1), (13, 1), (30, 1), (263, 1)]
    mixed = [(0, 7), (9, 1), (5, 6), (44, 3), (150, 5)]
    for model in (tiny, wide):
        case(model, [(8, 1)], 0, 4, 1)  # batch 1
        case(model, decode, 3, 4, 2)
        case(model, mixed, 1, 8, 3)
        case(model, mixed, 2, 16, 4, scratch=300)  # rows in chunks of a small scratch
        case(model, decode, 3, 4, 5, fp8=True)
        case(model, mixed, 1, 8, 6, fp8=True)
"""


def test_fused_v4_index_select_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 12, run.stdout
