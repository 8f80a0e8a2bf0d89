"""The sort-free grouping of routed pairs by expert (kernels/moe/align.py) under Triton's
interpreter, on CPU, against a stable sort: pair counts on both sides of every chunk length
(one chunk of SUB pairs up to the count grid's cap), ids outside [0, experts) dropped, and each
group's padded end. The chunk length and counts are runtime arguments, so these sizes share one
compiled kernel on a GPU (tests/gpu/test_fp8_kernels.py runs it there)."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

CASES = """
import torch
from afdserve.kernels.moe.align import SUB, _chunking, assign

seen = set()
for experts, rows, pairs in [(8, 16, 1), (8, 16, 31), (8, 16, 33), (256, 16, 700),
                             (256, 64, 1024), (256, 16, 5000), (384, 32, 9000)]:
    gen = torch.Generator().manual_seed(pairs)
    ids = torch.randint(-1, experts + 1, (pairs,), generator=gen)  # -1 and `experts`: no slot
    a = assign(ids, experts, rows)
    e_pad = max(16, 1 << (experts - 1).bit_length())
    seen.add(_chunking(pairs, e_pad)[0])
    count = torch.bincount(ids[(ids >= 0) & (ids < experts)], minlength=experts)
    assert torch.equal(a.expert_count.long(), count), (experts, pairs)
    padded = (count + rows - 1) // rows * rows
    assert torch.equal(a.expert_end.long(), padded.cumsum(0)), (experts, pairs)
    for e in range(experts):
        start = int(a.expert_end[e] - padded[e])
        got = a.slots[start : start + int(count[e])].long()
        assert torch.equal(got, (ids == e).nonzero().flatten()), (experts, pairs, e)
assert len(seen) >= 3, seen  # several chunk lengths ran
print("ok")
"""


def test_assignment_matches_a_stable_sort_at_every_chunk_length() -> None:
    run = run_interpreted(CASES, timeout=600)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout + run.stderr
