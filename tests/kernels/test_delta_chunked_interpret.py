"""The Triton prefill kernels of the delta-rule layers (kernels/triton/delta_chunked.py and
short_conv.py) under Triton's interpreter against the torch reference
(kernels/reference/delta_chunked.py), float32: spans of 1, C - 1, C, C + 1 and several chunks
of C rows, fresh and from a non-zero state or window, with rows of other segments between them
left untouched, as is every other slot, and pad entries (slot -1) skipped; a decay per head
(grouped key heads, q, k and v as views of one convolved row, value dims past one block) and
per key channel (Kimi); and the slots at a stride past their size (slots in the paged groups'
pages, model/cache.py's SlotPlan), the bytes between them untouched."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

CASES = r"""
import torch
from afdserve.kernels.reference import delta_chunked as ref
from afdserve.kernels.triton import delta_chunked as tri
from afdserve.kernels.triton import short_conv

C = 16
gen = torch.Generator().manual_seed(0)


def strided(t):
    # t's slots 37 elements apart, the gaps -9 (returns the view and its buffer).
    size = t[0].numel()
    buf = torch.full((t.shape[0], size + 37), -9.0, dtype=t.dtype)
    buf[:, :size] = t.flatten(1)
    return buf[:, :size].view(t.shape), buf


# (rows, slot, fresh); a one-row gap (another segment's row) before each span.
LENGTHS = [(1, 0, 0), (C - 1, 2, 0), (C, 3, 1), (C + 1, 4, 0), (2 * C + 3, 5, 0), (2, 1, 0)]
spans, row = [], 0
for n, slot, fresh in LENGTHS:
    spans.append((row + 1, row + 1 + n, slot, fresh))
    row += 1 + n
rows, slots = row + 1, 7
# Pad entries (slot -1), as a table sized by capacity holds: over a gap row, and over a span's
# rows (a segment the other delta-rule launch runs): both skipped.
spans += [(0, 1, -1, 0), (spans[1][0], spans[1][1], -1, 1), (rows, rows, -1, 0)]
spans = torch.tensor(spans, dtype=torch.int32)
span_rows = torch.zeros(rows, dtype=torch.bool)
for r0, r1, slot, _ in spans.tolist():
    span_rows[r0:r1] |= slot >= 0
touched = sorted({s for _, _, s, _ in spans.tolist() if s >= 0})
untouched = [s for s in range(slots) if s not in touched]

# The short convolution: 20 channels (past one block of 16), 4 taps, spans shorter than the window.
channels, taps = 20, 4
x = torch.randn(rows, channels, generator=gen)
weight = torch.randn(channels, taps, generator=gen)
windows = torch.randn(slots, channels, taps - 1, generator=gen)
want_w, got_w = windows.clone(), windows.clone()
want = ref.conv_spans(x, weight, want_w, spans)
got = short_conv.conv_spans(x, weight, got_w, spans)
torch.testing.assert_close(got[span_rows], want[span_rows], atol=1e-5, rtol=1e-5)
assert (got[~span_rows] == 0).all() and (want[~span_rows] == 0).all()
torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)
torch.testing.assert_close(got_w[untouched], windows[untouched], atol=0, rtol=0)
view, buf = strided(windows)
assert not view.is_contiguous()
torch.testing.assert_close(short_conv.conv_spans(x, weight, view, spans), got, atol=0, rtol=0)
torch.testing.assert_close(view, got_w, atol=0, rtol=0)
assert (buf[:, view[0].numel():] == -9.0).all()

SHAPES = [(1, 2, 8, 40, False), (2, 2, 16, 8, True)]
for hk, hv, dk, dv, per_channel in SHAPES:
    mixed = torch.randn(rows, 2 * hk * dk + hv * dv, generator=gen)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(rows, hk, dk), k.view(rows, hk, dk), v.view(rows, hv, dv)
    shape = (rows, hv, dk) if per_channel else (rows, hv)
    g, beta = -torch.rand(shape, generator=gen), torch.rand(rows, hv, generator=gen)
    states = torch.randn(slots, hv, dk, dv, generator=gen) * 0.5
    want_s, got_s = states.clone(), states.clone()
    want_o = torch.full((rows, hv, dv), 7.0)
    got_o = want_o.clone()
    ref.chunked_spans(q, k, v, g, beta, want_s, spans, want_o)
    tri.chunked_spans(q, k, v, g, beta, got_s, spans, got_o, chunk=C)
    torch.testing.assert_close(got_o, want_o, atol=2e-5, rtol=1e-5)
    assert (got_o[~span_rows] == 7.0).all()
    torch.testing.assert_close(got_s, want_s, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_s[untouched], states[untouched], atol=0, rtol=0)
    view, buf = strided(states)
    again = torch.full((rows, hv, dv), 7.0)
    tri.chunked_spans(q, k, v, g, beta, view, spans, again, chunk=C)
    torch.testing.assert_close(again, got_o, atol=0, rtol=0)
    torch.testing.assert_close(view, got_s, atol=0, rtol=0)
    assert (buf[:, view[0].numel():] == -9.0).all()
print("ok")
"""


def test_prefill_kernels_equal_the_reference() -> None:
    done = run_interpreted(CASES, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
