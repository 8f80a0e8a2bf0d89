"""A ubatch's rows in one launch (kernels/triton/step_rows.py) against `StepRows.of`'s torch form
(`rows._rows_torch`), field by field, under Triton's interpreter on CPU: a decode ubatch with
graph pad rows, a mixed one, pad rows alone (no segment), state slots and window tables or
neither, a table that is a column slice of a wider one, more segments than one block of segment
ends and more table columns than one column block. And the rows' window addresses
(`window_rows`) against `LayerPages.batch_rows`' torch arithmetic, positions near 0 (clamped
below) and past the tables' span (clamped above) among them; and the rows' rotary tables
(`rotary.cos_sin`) against `RopeTable.at`'s torch form, positions up to 2**20 among them."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

CASES = """
import torch
from afdserve.kernels.metadata import BatchedSegments
from afdserve.kernels.triton import step_rows as k
from afdserve.model.families.deepseek_v4.rows import _rows_torch

gen = torch.Generator().manual_seed(3)

def case(counts, pad, width, slots, window, wide=False):
    n = len(counts)
    starts = torch.tensor([0] + list(counts)).cumsum(0).to(torch.int32)
    context = torch.randint(0, 500, (n,), generator=gen).to(torch.int32)
    tables = torch.randint(0, 10**6, (n, width + (7 if wide else 0)), generator=gen)
    tables = tables.to(torch.int32)[:, 3 : 3 + width] if wide else tables.to(torch.int32)
    batched = BatchedSegments(starts, context, tables, max(counts, default=0), 500)
    rows = int(starts[-1]) + pad
    slot_ids = torch.randperm(n + 5, generator=gen)[:n].to(torch.int32) if slots else None
    if slots and n == 0:
        slot_ids = context  # the pad-only ubatch's (StepRows.of)
    wtables = None
    if window:
        wtables = torch.randint(0, 999, (n, width // 2 + 1), generator=gen).to(torch.int32)
    got = k.step_rows(starts, context, tables, rows, slot_ids, wtables)
    want = _rows_torch(batched, rows, slot_ids, wtables)
    for name, g, w in zip(("tables", "real", "start", "end", "slots", "window"), got, want):
        assert (g is None) == (w is None), name
        if g is not None:
            assert g.dtype == w.dtype and torch.equal(g, w), (name, counts, g, w)

case([1, 1, 1, 1], pad=4, width=8, slots=True, window=True)  # decode, graph pad rows
case([1, 5, 1, 9], pad=0, width=20, slots=True, window=False, wide=True)  # mixed
case([], pad=6, width=8, slots=True, window=False)  # pad rows alone
case([3, 1], pad=1, width=200, slots=False, window=True)  # past one column block
case([1] * 130 + [4], pad=3, width=5, slots=True, window=True)  # past one block of ends

# window_rows: LayerPages._rows_of over positions clamped into the tables' span (batch_rows).
for rows, width, window, block, page_rows in [(5, 4, 8, 4, 4), (3, 6, 128, 16, 16)]:
    tables = torch.randint(0, 1000, (rows, width + 2), generator=gen)[:, 1 : 1 + width]
    positions = torch.randint(0, width * block + 9, (rows,), generator=gen)
    positions[0] = 1  # most of its window before position 0
    positions[-1] = width * block + 5  # past what the table addresses
    back = positions[:, None] - torch.arange(window)
    q = back.clamp(0, width * block - 1)
    want = tables.gather(1, q // block) * page_rows + q % page_rows
    got = k.window_rows(positions, tables, window, block, page_rows)
    assert torch.equal(got, want), (got, want)

# cos_sin: RopeTable.at's torch form (the kernel's path is CUDA's only).
from afdserve.kernels.triton import rotary
from afdserve.model.families.deepseek_v4.attention import RopeTable

inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
table = RopeTable(inv_freq, 1.25)
for positions in (torch.tensor([0, 1, 7, 4095, 2**20 - 1]), torch.arange(37)):
    got = rotary.cos_sin(positions, inv_freq, 1.25)
    for g, w in zip(got, table.at(positions)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
print("ok")
"""


def test_step_rows_match_the_torch_form_under_the_interpreter() -> None:
    run = run_interpreted(CASES, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
