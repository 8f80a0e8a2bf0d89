"""DeepSeek-V4's fused attention of a ubatch (kernels/triton/v4_attention.py) under Triton's
interpreter (TRITON_INTERPRET=1, numpy) on CPU, against the torch path it replaces on CUDA
(`batched._attend`'s own form: gathered window and entries, `chunk_or`, `attend_batched`), over a
real `LayerPages` filled with random rows: sliding, CSA (random top-k) and HCA (every entry: as
indices, and as the kernel's own walk through the tables up to each row's last) layers; one decode
row (batch 1, the first token); decode rows at positions before, across and past the window and the
rates, with pad rows (which must give zero); prefill chunks beside decodes (keys and entries from
the chunk's own rows and from the pages). The tiny V4 shapes and a wide one (20 heads: two head
blocks, one partly masked; head_dim 80: padded; a window and a top-k over one key tile; and in one
block of 32, as prefill steps take them). float32 and float16 (the interpreter computes bf16
wrongly). FP8 caches (e4m3 pages with their bf16 rotated channels) read in the kernel, against the
torch path over the same pages. In a subprocess because the variable must be set before any
@triton.jit function is defined."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import tempfile
from pathlib import Path

import torch

from afdserve.engine.kv_cache import make_kv_cache
from afdserve.kernels.triton import v4_attention as triton_v4
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families.deepseek_v4 import batched
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.parts import ModelParts

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
SLIDING = "sliding_attention"


def model_of(root, name, **overrides):
    path = make_tiny_v4(Path(root) / name, seed=3, layer_types=[SLIDING, CSA, HCA, CSA],
                        **overrides)
    return load_model(path, ModelParts.colocated(), "float32", load_format="dummy")[0]


def step_rows(chunks, width, block_size, pad, gen):
    # chunks: (start, rows) per sequence -> StepRows, pad rows appended.
    positions, tables, real, start, end = [], [], [], [], []
    perm = torch.randperm(len(chunks) * width + 2, generator=gen)
    for i, (first, count) in enumerate(chunks):
        table = perm[i * width:(i + 1) * width]
        for q in range(first, first + count):
            positions.append(q); tables.append(table); real.append(True)
            start.append(first); end.append(first + count)
    for _ in range(pad):
        positions.append(0); tables.append(perm[:width]); real.append(False)
        start.append(0); end.append(0)
    return batched.StepRows(torch.tensor(positions), torch.stack(tables), torch.tensor(real),
                            torch.tensor(start), torch.tensor(end))


def case(model, layer, chunks, pad, dtype, block_size, seed, fp8=False):
    # The torch path's `_attend` against the kernel, on the arguments it would pass.
    gen = torch.Generator().manual_seed(seed)
    attn = model.model.layers[layer].self_attn  # its sinks stay float32, as loaded
    width = -(-max(s + c for s, c in chunks) // block_size) + 1
    rows = step_rows(chunks, width, block_size, pad, gen)
    blocks = len(chunks) * width + 2
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    cache = make_kv_cache(model.config, blocks, block_size, cache_dtype, "cpu", num_slots=1)
    pages = cache.layers[layer]
    assert pages.fp8 == fp8
    rope_pages = None
    if fp8:
        pages.scale = 0.5  # the kernels honour a scale other than 1.0
        rope_pages = (pages.flat["window_rope"], pages.flat.get("entries_rope"))
    for flat in pages.flat.values():
        flat.copy_(torch.randn(flat.shape, generator=gen))
    n, heads, dim = rows.positions.shape[0], attn.heads, attn.dim
    q = torch.randn(n, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(n, dim, generator=gen).to(dtype)
    back = rows.positions[:, None] - torch.arange(attn.window)
    window_rows = pages.batch_rows("window", rows.tables, back)
    selected, entries, rate = None, None, 0
    if attn.compressor is not None:
        rate = attn.compressor.rate
        count = -(-width * block_size // rate)
        if attn.kind == HCA:
            read = torch.arange(count).expand(n, count)
        else:
            k = min(attn.compressor.indexer.topk, count)
            read = torch.stack([torch.randperm(count, generator=gen)[:k] for _ in range(n)])
        new = torch.randn(n, dim, generator=gen).to(dtype)
        selected = (read, new)
        entries = (new, pages.flat["entries"], rows.tables, read)
    paging = (block_size, pages.pages["entries"].shape[1]) if entries else None
    want = batched._attend(attn, pages, q, kv, rows, window_rows, selected)
    got = triton_v4.sparse_attention(q, kv, pages.flat["window"], window_rows, entries, rate,
                                     rows.positions, rows.start, rows.real, attn.sinks, attn.scale,
                                     paging, rope_pages, pages.scale)
    real = rows.real
    label = (attn.kind, chunks, pad, dtype, heads, dim, fp8)
    # With `store` the kernel also writes each real row's key to its window row, as the torch
    # path's LayerPages.store after the attention (pad rows write nothing; its scratch row aside).
    before = {name: flat.clone() for name, flat in pages.flat.items()}
    stored = triton_v4.sparse_attention(q, kv, pages.flat["window"], window_rows, entries, rate,
                                        rows.positions, rows.start, rows.real, attn.sinks,
                                        attn.scale, paging, rope_pages, pages.scale, store=True)
    assert torch.equal(stored, got), label
    kernel_pages = {name: flat.clone() for name, flat in pages.flat.items()}
    for name, flat in pages.flat.items():
        flat.copy_(before[name])
    pages.store("window", window_rows[:, :1], kv[:, None], real[:, None])
    changed = 0
    for name, flat in pages.flat.items():
        if name.endswith("_rope"):  # the interpreter truncates to bf16 where a GPU rounds
            torch.testing.assert_close(kernel_pages[name][:-1].float(), flat[:-1].float(),
                                       rtol=2 ** -7, atol=0, msg=lambda m: f"{label} {name} {m}")
        else:
            assert torch.equal(kernel_pages[name][:-1], flat[:-1]), (label, name)
        changed += int((flat[:-1] != before[name][:-1]).any())
    assert changed >= (2 if fp8 else 1) or not bool(real.any()), label
    assert got.dtype == dtype and torch.isfinite(got).all(), label
    assert torch.equal(got[~real], torch.zeros_like(got[~real])), label
    err = float((got[real].double() - want[real].double()).norm() / want[real].double().norm())
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert err < tol, (label, err)
    print("attention", label, round(err, 8), "ok")
    if attn.kind == HCA:  # every closed entry, addressed through the tables in the kernel
        got = triton_v4.sparse_attention(q, kv, pages.flat["window"], window_rows,
                                         (new, pages.flat["entries"], rows.tables, None), rate,
                                         rows.positions, rows.start, rows.real, attn.sinks,
                                         attn.scale, paging, rope_pages, pages.scale)
        assert torch.equal(got[~real], torch.zeros_like(got[~real])), label
        err = float((got[real].double() - want[real].double()).norm()
                    / want[real].double().norm())
        assert err < tol, ("every", label, err)
        print("every", label, round(err, 8), "ok")


torch.set_grad_enabled(False)
with tempfile.TemporaryDirectory() as root:
    tiny = model_of(root, "tiny")
    wide = model_of(root, "wide", num_attention_heads=20, head_dim=80, sliding_window=40,
                    index_topk=40, index_head_dim=48, compress_rates={CSA: 2, HCA: 3})
    decode = [(0, 1), (1, 1), (4, 1), (6, 1), (13, 1), (30, 1)]
    mixed = [(0, 7), (9, 1), (5, 6), (44, 3)]
    for model in (tiny, wide):
        for layer in range(3):  # sliding, CSA, HCA
            case(model, layer, decode[:1], 0, torch.float32, 4, layer)  # batch 1, first token
            case(model, layer, decode, 3, torch.float32, 4, layer + 10)
            case(model, layer, mixed, 1, torch.float16, 8, layer + 20)
            case(model, layer, mixed, 1, torch.float16, 8, layer + 30, fp8=True)
    for layer in range(3):
        case(tiny, layer, decode, 3, torch.float32, 4, layer + 40, fp8=True)
    # The prefill head block (20 heads in one block of 32, 12 masked), by lowering its row count.
    triton_v4.PREFILL_ROWS = 1
    for layer in range(3):
        case(wide, layer, mixed, 1, torch.float16, 8, layer + 50)
"""


def test_fused_v4_attention_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 40, run.stdout
