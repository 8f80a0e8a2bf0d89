"""DeepSeek-V4's fused compressor update of prefill chunks beside decodes
(kernels/triton/v4_compress.py's `chunk` form: the pooling with each slot at or past the chunk's
start from the chunk's own rows, then the first series and the open rows written in launches of
their own) under Triton's interpreter on CPU, against the torch path it replaces on CUDA
(`batched._compress`, the same projections) over real `LayerPages` filled with random rows: the
entries of the rows that close a window, and every page after the step (rings, CSA's prev rows,
entries; all but the scratch row). CSA's compressor, its indexer's and HCA's at rates 2/4 and 4/8;
chunks starting at 0, inside a window (CSA's first series then from the chunk's rows or the open
ring), past a block end, longer than a ring (its reads and writes of one ring row in separate
launches), beside decode rows and pad rows; block sizes a multiple of the rates (first series in
the pages at block ends) and not (in the slot); float32, float16 and an FP8 cache."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import tempfile

import torch

from afdserve.engine.kv_cache import make_kv_cache
from afdserve.model.families.deepseek_v4 import batched
from afdserve.model.families.deepseek_v4.rows import StepRows

from tests.kernels.v4_cases import CSA, HCA, SLIDING, models_of, projected


def chunk_rows(chunks, width, pad, gen):
    # chunks: (start, rows) per sequence, each its own state slot (in reverse), pad rows after.
    positions, tables, real, start, end, slots = [], [], [], [], [], []
    perm = torch.randperm(len(chunks) * width + 2, generator=gen)
    for i, (first, count) in enumerate(chunks):
        table = perm[i * width:(i + 1) * width]
        for q in range(first, first + count):
            positions.append(q); tables.append(table); real.append(True)
            start.append(first); end.append(first + count); slots.append(len(chunks) - 1 - i)
    for _ in range(pad):
        positions.append(0); tables.append(perm[:width]); real.append(False)
        start.append(0); end.append(0); slots.append(-1)
    return StepRows(torch.tensor(positions), torch.stack(tables), torch.tensor(real),
                    torch.tensor(start), torch.tensor(end), False, torch.tensor(slots))


def case(models, layer, prefix, chunks, pad, dtype, block_size, seed, fp8=False):
    model = models[dtype]
    gen = torch.Generator().manual_seed(seed)
    comp = model.model.layers[layer].self_attn.compressor
    comp = comp.indexer if prefix else comp
    width = -(-max(s + c for s, c in chunks) // block_size) + 1
    rows = chunk_rows(chunks, width, pad, gen)
    blocks = len(chunks) * width + 2
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    torch_pages, fused_pages = (
        make_kv_cache(model.config, blocks, block_size, cache_dtype, "cpu", len(chunks))
        .layers[layer]
        for _ in range(2)
    )
    torch_pages.scale = fused_pages.scale = 0.5 if fp8 else 1.0
    for name, flat in torch_pages.flat.items():
        flat.copy_(torch.randn(flat.shape, generator=gen))
        fused_pages.flat[name].copy_(flat)
    n = rows.positions.shape[0]
    x = torch.randn(n, model.config.hidden_size, generator=gen).to(dtype)
    rope = model.ropes("cpu")["compress"]
    kv, gate = projected(model, layer, prefix, x)
    want = batched._compress(comp, torch_pages, prefix, (kv, gate), rows, rope)
    got = batched._compress_fused(comp, fused_pages, prefix, kv, gate, rows, rope)
    closes = rows.real & ((rows.positions + 1) % comp.rate == 0)
    label = (prefix or "main", comp.rate, chunks, pad, dtype, block_size, fp8)
    tol = 1e-2 if fp8 else 1e-5 if dtype == torch.float32 else 2e-3
    assert bool(closes.any()), label
    diff = (got[closes].double() - want[closes].double()).norm()
    err = float(diff / want[closes].double().norm())
    assert got.dtype == want.dtype and err < tol, (label, err)
    for name, flat in torch_pages.flat.items():
        g, w = fused_pages.flat[name][:-1].double(), flat[:-1].double()
        if w.numel() == 0:
            continue
        page_err = float((g - w).norm() / w.norm())
        assert page_err < tol, (label, name, page_err)
    print("chunk", label, round(err, 8), "ok")


torch.set_grad_enabled(False)
with tempfile.TemporaryDirectory() as root:
    tiny = models_of(root, "tiny")
    wide = models_of(root, "wide", num_attention_heads=4, head_dim=80, index_head_dim=48,
                     compress_rates={CSA: 4, HCA: 8})
    # From 0 across several windows; inside a window; a decode row; a chunk past a block end
    # and longer than a CSA ring (2 m + 16 rows); a decode row closing a window.
    mixed = [(0, 11), (5, 6), (13, 1), (9, 40), (7, 1)]
    for models in (tiny, wide):
        for layer, prefix in ((1, ""), (1, "index_"), (2, "")):
            case(models, layer, prefix, mixed, 2, torch.float32, 8, layer)
            case(models, layer, prefix, mixed[:2], 0, torch.float32, 4, layer + 10)
            case(models, layer, prefix, mixed, 1, torch.float32, 6, layer + 20)  # not resumable
            case(models, layer, prefix, mixed, 1, torch.float16, 8, layer + 30)
            case(models, layer, prefix, mixed, 2, torch.float32, 8, layer + 40, fp8=True)
"""


def test_fused_v4_compressor_of_chunks_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 30, run.stdout
