"""The Triton decode step of the gated delta rule (kernels/triton/delta_rule.py) under Triton's
interpreter against the torch reference (kernels/reference/delta_rule.py): a decay per head and
per key channel, grouped key heads, value dims past one block, fresh rows, pad rows sent to a
scratch slot or of the pad marker (slot -1, skipped), every other slot untouched; and the slots
at a stride past their size (slots in the paged groups' pages, model/cache.py's SlotPlan), the
bytes between them untouched."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

CASES = r"""
import torch
from afdserve.kernels.reference import delta_rule as ref
from afdserve.kernels.triton import delta_rule as tri

gen = torch.Generator().manual_seed(0)


def strided(t):
    # t's slots 37 floats apart, the gaps -9 (returns the view and its buffer).
    size = t[0].numel()
    buf = torch.full((t.shape[0], size + 37), -9.0)
    buf[:, :size] = t.flatten(1)
    return buf[:, :size].view(t.shape), buf


SHAPES = [(2, 4, 8, 8, False), (2, 2, 16, 40, True), (1, 3, 8, 24, False)]
for hk, hv, dk, dv, per_channel in SHAPES:
    b, slots_total = 5, 6
    q, k = torch.randn(b, hk, dk, generator=gen), torch.randn(b, hk, dk, generator=gen)
    v = torch.randn(b, hv, dv, generator=gen)
    shape = (b, hv, dk) if per_channel else (b, hv)
    g, beta = -torch.rand(shape, generator=gen), torch.rand(b, hv, generator=gen)
    states = torch.randn(slots_total, hv, dk, dv, generator=gen)
    # Then pad rows in the scratch slot, and one of the pad marker (slot -1): skipped.
    slots = torch.tensor([3, 0, 5, 5, -1])
    fresh = torch.tensor([False, True, False, False, False])
    want_states, got_states = states.clone(), states.clone()
    real = slice(0, 2)
    want = ref.step_slots(
        q[real], k[real], v[real], g[real], beta[real], want_states, slots[real], fresh[real]
    )
    got = tri.step_slots(q, k, v, g, beta, got_states, slots, fresh)
    torch.testing.assert_close(got[:2], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states[:5], want_states[:5], atol=1e-5, rtol=1e-5)
    assert (got[4] == 0).all()
    # The torch step sends slot -1 to states[-1] (the scratch row), its output zero too.
    ref_states = states.clone()
    ref_all = ref.step_slots(q, k, v, g, beta, ref_states, slots, fresh)
    torch.testing.assert_close(got[:2], ref_all[:2], atol=1e-5, rtol=1e-5)
    assert (ref_all[4] == 0).all()
    torch.testing.assert_close(ref_states[:5], want_states[:5], atol=1e-5, rtol=1e-5)
    view, buf = strided(states)
    assert not view.is_contiguous() and view[0].is_contiguous()
    got_strided = tri.step_slots(q, k, v, g, beta, view, slots, fresh)
    torch.testing.assert_close(got_strided, got, atol=0, rtol=0)
    torch.testing.assert_close(view[:5], got_states[:5], atol=0, rtol=0)
    assert (buf[:, view[0].numel():] == -9.0).all()
print("ok")
"""


def test_decode_step_kernel_equals_the_reference() -> None:
    done = run_interpreted(CASES, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
