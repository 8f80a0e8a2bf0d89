"""DeepSeek-V4's compressor addresses in one launch (kernels/triton/v4_addresses.py) under
Triton's interpreter on CPU, against the torch form it replaces on CUDA
(`batched.compress_addresses`) over real `LayerPages`: every address column (the open rings,
CSA's first series in its pages or its slot, the open rows of the window before), the entry
rows and the chunk's keeps, exactly. CSA and HCA (and the indexer's entries) at rates 2/4 and
4/8; decode rows and prefill chunks from 0, inside a window, past block ends, beside pad rows
(slot -1); block sizes a multiple of every rate (first series at block ends in the pages, the
window pool's where the window reaches past a compressor window) and not (in the slot)."""

from __future__ import annotations

import pytest

from tests.kernels.interpret import run_interpreted

CASES = """
import tempfile

import torch

from afdserve.engine.kv_cache import make_kv_cache
from afdserve.model.families.deepseek_v4 import batched
from afdserve.model.families.deepseek_v4.rows import StepRows

from tests.kernels.v4_cases import CSA, HCA, models_of


def step_rows(chunks, width, pad, gen, decode, window_tables):
    positions, tables, wtables, real, start, end, slots = [], [], [], [], [], [], []
    perm = torch.randperm(len(chunks) * width + 2, generator=gen)
    wperm = torch.randperm(len(chunks) * width + 2, generator=gen)
    for i, (first, count) in enumerate(chunks):
        table, wtable = perm[i * width:(i + 1) * width], wperm[i * width:(i + 1) * width]
        for q in range(first, first + count):
            positions.append(q); tables.append(table); wtables.append(wtable); real.append(True)
            start.append(first); end.append(first + count); slots.append(len(chunks) - 1 - i)
    for _ in range(pad):
        positions.append(0); tables.append(perm[:width]); wtables.append(wperm[:width])
        real.append(False); start.append(0); end.append(0); slots.append(-1)
    return StepRows(torch.tensor(positions), torch.stack(tables), torch.tensor(real),
                    torch.tensor(start), torch.tensor(end), decode, torch.tensor(slots),
                    torch.stack(wtables) if window_tables else None)


def case(model, layer, prefix, chunks, pad, block_size, seed, window_tables=False):
    gen = torch.Generator().manual_seed(seed)
    comp = model.model.layers[layer].self_attn.compressor
    m, overlap = comp.rate, comp.overlap
    width = -(-max(s + c for s, c in chunks) // block_size) + 1
    decode = all(c == 1 for _, c in chunks)
    rows = step_rows(chunks, width, pad, gen, decode, window_tables)
    pages = make_kv_cache(model.config, len(chunks) * width + 2, block_size, torch.float32,
                          "cpu", len(chunks)).layers[layer]
    entries = prefix + "entries"
    want = batched.compress_addresses(pages, entries, m, overlap, rows)
    got = pages.fused_compress_addresses(entries, rows, m, overlap)
    label = (prefix or "main", layer, m, chunks, pad, block_size, window_tables)
    assert got is not None, label
    assert torch.equal(got[0], want[0]), (label, got[0], want[0])
    assert torch.equal(got[1], want[1]), (label, got[1], want[1])
    if decode:
        assert got[2] is None and want[2] is None, label
    else:
        assert torch.equal(got[2][0], want[2][1]) and torch.equal(got[2][1], want[2][2]), label
    print("addresses", label, "ok")


import afdserve.kernels.ops as ops
ops._triton_ready = lambda t: True  # the CUDA dispatch, run by the interpreter
torch.set_grad_enabled(False)
with tempfile.TemporaryDirectory() as root:
    tiny = models_of(root, "tiny")[torch.float32]
    wide = models_of(root, "wide", num_attention_heads=4, head_dim=80, index_head_dim=48,
                     compress_rates={CSA: 4, HCA: 8})[torch.float32]
    mixed = [(0, 11), (5, 6), (13, 1), (9, 40), (7, 1)]
    decodes = [(0, 1), (3, 1), (7, 1), (8, 1), (31, 1)]
    gen = torch.Generator().manual_seed(0)

    def drawn():  # chunks of every start and length: each end's keeps, each window's pages
        starts = torch.randint(0, 24, (6,), generator=gen).tolist()
        counts = torch.randint(1, 26, (6,), generator=gen).tolist()
        return list(zip(starts, counts))

    n = 0
    for model in (tiny, wide):
        for layer, prefix in ((1, ""), (1, "index_"), (2, "")):
            for chunks in (mixed, decodes, drawn(), drawn()):
                for block_size, pad in ((8, 2), (4, 0), (6, 1), (16, 1)):
                    case(model, layer, prefix, chunks, pad, block_size, n, n % 2 == 1)
                    n += 1
    print("cases", n)
"""


def test_fused_v4_compressor_addresses_equal_the_torch_form() -> None:
    run = run_interpreted(CASES, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 96, run.stdout


def test_addresses_kernel_compiles_for_sm90() -> None:
    """Compiled, where the interpreter's numpy integer division would hide C's: CSA's chunk form
    (every branch) and HCA's decode form, at V4-Flash's rates."""
    pytest.importorskip("triton")
    from afdserve.kernels.triton import v4_addresses as k
    from tests.kernels.test_fp8_moe_compile import compile_for_h200

    ints = ("t_stride", "w_stride", "out_stride", "open_base", "prev_base", "width", "prev_width")
    signature = {
        **{name: "*i64" for name in ("POS", "SLOT", "TABLE", "WTABLE", "END", "OUT", "ENTRY")},
        **{name: "*i1" for name in ("REAL", "KEEP_PREV", "KEEP_OPEN")},
        **{name: "i64" for name in ints},
    }
    for m, overlap, chunk, in_slot, pooled in (
        (4, True, True, False, True),
        (128, False, False, True, False),
    ):
        constants = {
            "M": m, "M_PAD": max(2, 1 << (2 * m - 1).bit_length()), "RING": 2 * m + 16,
            "BLOCK": 128, "ENTRY_SLOTS": 128 // m, "PREV_PAGE_ROWS": m, "OVERLAP": overlap,
            "CHUNK": chunk, "PREV_IN_SLOT": in_slot, "PREV_POOLED": pooled,
        }  # fmt: skip
        built = compile_for_h200(k._addresses_kernel, signature, constants, {"num_warps": 1})
        assert built.asm["cubin"] and ".local" not in built.asm["ptx"]
