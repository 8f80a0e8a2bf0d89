"""DeepSeek-V4's fused lightning-indexer scores (kernels/triton/v4_indexer.py) under Triton's
interpreter (TRITON_INTERPRET=1, numpy) on CPU, against the torch path it replaces on CUDA
(`batched._index_scores`' own form: gathered keys, `chunk_or`, `Indexer.score`, the mask) over a
real `LayerPages` filled with random rows: the same entries -inf, the others close, and in
float32 the same top-k (`Indexer.ranked`). One decode row (batch 1); decode rows before and past
the rate, over several blocks of entries, with pad rows; prefill chunks beside decodes (keys from
the chunk's own pooled rows and from the page); the tiny indexer (8 heads of 8) and a wide one
(20 heads: padded; dim 48: padded); float32 and float16 (the interpreter computes bf16 wrongly);
FP8 caches (e4m3 entries beside their bf16 rotated channels, scale 0.5) read in the kernel.
In a subprocess because the variable must be set before any @triton.jit function is defined."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import tempfile

import torch

from afdserve.engine.kv_cache import make_kv_cache
from afdserve.kernels.triton import v4_indexer as triton_v4_indexer
from afdserve.model.families.deepseek_v4 import batched

from tests.kernels.v4_cases import CSA, HCA, SLIDING, models_of


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


def case(models, chunks, pad, dtype, block_size, seed, fp8=False):
    # The torch path's `_index_scores` against the kernel, on the arguments it would pass.
    gen = torch.Generator().manual_seed(seed)
    model = models[dtype]
    indexer = model.model.layers[1].self_attn.compressor.indexer
    width = -(-max(s + c for s, c in chunks) // block_size) + 1
    rows = step_rows(chunks, width, pad, gen)
    blocks = len(chunks) * width + 2
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    pages = make_kv_cache(model.config, blocks, block_size, cache_dtype, "cpu",
                          num_slots=1).layers[1]
    assert pages.fp8 == fp8
    for flat in pages.flat.values():
        flat.copy_(torch.randn(flat.shape, generator=gen))
    if fp8:
        pages.scale = 0.5  # the kernel honours a scale other than 1.0
    n = rows.positions.shape[0]
    x = torch.randn(n, model.config.hidden_size, generator=gen).to(dtype)
    q_residual = torch.randn(n, model.config.q_lora_rank, generator=gen).to(dtype)
    new = torch.randn(n, indexer.dim, generator=gen).to(dtype)
    rope = model.ropes("cpu")["compress"]
    want = batched._index_scores(indexer, pages, x, q_residual, rows, rope, new)
    q, weights = indexer.queries(x, q_residual, rope.at(rows.positions))
    # As the packed GEMM gives them: a column slice (rows apart), scaled in the kernel.
    weights = torch.cat((weights, torch.zeros_like(weights)), dim=1)[:, : indexer.heads]
    count = want.shape[1]
    every = torch.arange(count).expand(n, count)
    entry_rows = pages.batch_entry_rows("index_entries", rows.tables, every)
    got = triton_v4_indexer.index_scores(q, weights, new, pages.flat["index_entries"],
                                         entry_rows, indexer.rate, rows.positions, rows.start,
                                         pages.flat.get("index_entries_rope"), pages.scale,
                                         indexer.weight_scale)
    label = (indexer.heads, indexer.dim, indexer.rate, chunks, pad, dtype, block_size, fp8)
    seen = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), seen), label
    err = float((got[seen].double() - want[seen].double()).norm() / want[seen].double().norm())
    assert err < 1e-5, (label, err)
    if dtype == torch.float32:  # the same entries chosen
        assert torch.equal(indexer.ranked(got), indexer.ranked(want)), label
    print("index", label, round(err, 9), "ok")


torch.set_grad_enabled(False)
with tempfile.TemporaryDirectory() as root:
    tiny = models_of(root, "tiny")
    wide = models_of(root, "wide", num_attention_heads=4, head_dim=80, index_head_dim=48,
                     index_n_heads=20, index_topk=40, compress_rates={CSA: 4, HCA: 8})
    decode = [(0, 1), (1, 1), (4, 1), (6, 1), (13, 1), (30, 1), (263, 1)]
    mixed = [(0, 7), (9, 1), (5, 6), (44, 3)]
    for models in (tiny, wide):
        case(models, [(8, 1)], 0, torch.float32, 4, 1)  # batch 1
        case(models, decode, 3, torch.float32, 4, 2)
        case(models, mixed, 1, torch.float32, 8, 3)
        case(models, decode, 1, torch.float16, 16, 4)
        case(models, mixed, 1, torch.float32, 8, 5, fp8=True)
"""


def test_fused_v4_index_scores_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 10, run.stdout
