"""DeepSeek-V4's fused compressor update of a decode ubatch (kernels/triton/v4_compress.py) under
Triton's interpreter (TRITON_INTERPRET=1, numpy) on CPU, against the torch path it replaces on
CUDA (`batched._compress`, from the same projections) over real `LayerPages` filled with random
rows: the entries of the rows that close a window, and every page after the step (the open rows
in each sequence's slot, CSA's prev rows, entries; all but the scratch row). CSA's compressor,
its indexer's and HCA's; rates 2, 4 and 8 (a block of 4 under a rate of 8: windows across
blocks); one row (batch 1) opening or closing a window; rows at the first window (no previous
series) and later ones with pad rows (which must write nothing). float32 and float16 (the
interpreter computes bf16 wrongly). FP8 caches (the kernel quantizes the entries to e4m3 beside
their bf16 rotated channels, scale 0.5; bf16 state rings): close to the torch path on the same
pages (its float32 rows rounded to the bf16 rings may round a value across an e4m3 step). In a
subprocess because the variable must be set before any
@triton.jit function is defined."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import tempfile

import torch

from afdserve.engine.kv_cache import make_kv_cache
from afdserve.model.families.deepseek_v4 import batched

from tests.kernels.v4_cases import CSA, HCA, SLIDING, models_of, projected


def decode_rows(positions, width, pad, gen):
    count = len(positions)
    perm = torch.randperm(count * width + 2, generator=gen)
    tables = [perm[i * width:(i + 1) * width] for i in range(count)] + [perm[:width]] * pad
    p = torch.tensor(list(positions) + [0] * pad)
    real = torch.tensor([True] * count + [False] * pad)
    # Each sequence its own state slot, in reverse (not the row order); pad rows -1.
    slots = torch.tensor(list(range(count - 1, -1, -1)) + [-1] * pad)
    return batched.StepRows(p, torch.stack(tables), real, p.clone(), p + 1, True, slots)


def case(models, layer, prefix, positions, pad, dtype, block_size, seed, fp8=False):
    model = models[dtype]
    gen = torch.Generator().manual_seed(seed)
    comp = model.model.layers[layer].self_attn.compressor
    comp = comp.indexer if prefix else comp
    width = -(-(max(positions) + 1) // block_size) + 1
    rows = decode_rows(positions, width, pad, gen)
    blocks = len(positions) * width + 2
    slots = len(positions)
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    torch_pages, fused_pages = (
        make_kv_cache(model.config, blocks, block_size, cache_dtype, "cpu", slots).layers[layer]
        for _ in range(2)
    )
    assert torch_pages.fp8 == fp8
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
    label = (prefix or "main", comp.rate, positions, pad, dtype, block_size, fp8)
    tol = 1e-2 if fp8 else 1e-5 if dtype == torch.float32 else 2e-3
    err = 0.0
    if bool(closes.any()):  # the entry is kept (and read) only where the row closes its window
        diff = (got[closes].double() - want[closes].double()).norm()
        err = float(diff / want[closes].double().norm())
    assert got.dtype == want.dtype and err < tol, (label, err)
    for name, flat in torch_pages.flat.items():
        # Every page but its scratch row (where the torch path sends the writes it drops).
        g, w = fused_pages.flat[name][:-1].double(), flat[:-1].double()
        if w.numel() == 0:  # the tiny indexer's entries are all rotated: no e4m3 channels
            continue
        page_err = float((g - w).norm() / w.norm())
        assert page_err < tol, (label, name, page_err)
    print("compress", label, round(err, 8), "ok")


def comp_rate(models, layer):
    return models[torch.float32].model.layers[layer].self_attn.compressor.rate


torch.set_grad_enabled(False)
with tempfile.TemporaryDirectory() as root:
    tiny = models_of(root, "tiny")
    wide = models_of(root, "wide", num_attention_heads=4, head_dim=80, index_head_dim=48,
                    compress_rates={CSA: 4, HCA: 8})
    positions = (0, 1, 2, 3, 5, 6, 7, 8, 11, 12, 15, 22, 23, 31)
    for model in (tiny, wide):
        for layer, prefix in ((1, ""), (1, "index_"), (2, "")):
            case(model, layer, prefix, positions[:1], 0, torch.float32, 4, layer)
            case(model, layer, prefix, (comp_rate(model, layer) - 1,), 0, torch.float32, 4, layer)
            case(model, layer, prefix, positions, 3, torch.float32, 4, layer + 10)
            case(model, layer, prefix, positions, 1, torch.float16, 8, layer + 20)
            case(model, layer, prefix, positions, 3, torch.float32, 4, layer + 30, fp8=True)
"""


def test_fused_v4_compressor_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 30, run.stdout
