"""The Triton router (kernels/moe/router.py) with a selection bias, as MiniMax-M2 routes (sigmoid
scores, `e_score_correction_bias` added for the choice only, weights renormalised, noaux_tc of one
group) and DeepSeek-V4 (the same over sqrt(softplus) scores, logits past softplus's threshold of 20
and far below 0 among them: `Router.forward`'s torch form itself; and its hash layers, whose
experts come from `tid2eid` by token id, a pad row's -1 among them), under Triton's interpreter
(TRITON_INTERPRET=1, numpy) on CPU: the experts and weights of `Router.forward`'s torch form.
float16 rows (the interpreter computes bf16 wrongly); tests/gpu/test_router_kernel.py runs it
compiled. Both kernels loop over a runtime bound, which Triton 3.6's interpreter cannot run on
numpy 2.4 (skipped there). In a subprocess: the variable must be set before any @triton.jit
function is defined."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import torch
from afdserve.kernels.moe import router as triton_router

for rows, experts, hidden, top_k, scale in [(1, 16, 64, 2, 1.0), (9, 60, 96, 4, 2.5)]:
    gen = torch.Generator().manual_seed(rows + experts)
    x = (torch.randn(rows, hidden, generator=gen) * 2).half()
    weight = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).half()
    bias = torch.randn(experts, generator=gen) * 0.3  # large enough to change choices
    scores = (x.float() @ weight.float().T).sigmoid()
    ref_ids = (scores + bias).topk(top_k, dim=-1).indices
    ref = scores.gather(1, ref_ids)
    ref = ref / ref.sum(-1, keepdim=True) * scale
    assert not torch.equal(ref_ids.sort(-1).values, scores.topk(top_k).indices.sort(-1).values)
    ids, weights = triton_router.route(x, weight, top_k, "sigmoid", True, scale, bias)
    assert torch.equal(ids, ref_ids), (ids, ref_ids)  # both in order of score + bias
    torch.testing.assert_close(weights, ref, rtol=1e-5, atol=1e-7)
    print("bias", rows, experts, "ok")

# DeepSeek-V4: Router.forward's torch form (float32 logits of the fp16 rows) against the kernel.
from types import SimpleNamespace

from afdserve.model.layers.moe import Router

for rows, experts, hidden, top_k in [(1, 16, 64, 2), (9, 64, 96, 6)]:
    gen = torch.Generator().manual_seed(7 * rows + experts)
    x = (torch.randn(rows, hidden, generator=gen) * 2).half()
    weight = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).half()
    x[0, :4] = 40.0  # logits past the threshold (softplus(x) = x) and far below 0
    weight[:2, :4] = torch.tensor([[1.0] * 4, [-1.0] * 4]).half()
    bias = torch.randn(experts, generator=gen) * 0.3
    router = SimpleNamespace(weight=weight.float(), scoring="sqrtsoftplus")
    scores = Router._scores(router, x.float())
    assert float(scores.max()) > 20 ** 0.5 and float(scores.min()) < 1e-3
    ref_ids = (scores + bias).topk(top_k, dim=-1).indices
    ref = scores.gather(1, ref_ids)
    ref = ref / (ref.sum(-1, keepdim=True) + 1e-20) * 1.5
    ids, weights = triton_router.route(x, weight, top_k, "sqrtsoftplus", True, 1.5, bias)
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    torch.testing.assert_close(weights, ref, rtol=1e-5, atol=1e-7)
    print("sqrtsoftplus", rows, experts, "ok")

# DeepSeek-V4's hash layers: each row's experts from tid2eid[token id] (pad rows -1 look up row
# 0), weighed by their sqrt(softplus) scores renormalised, against Router.forward's torch form
# (CPU tensors take it), the table's order kept.
for rows, experts, hidden, top_k, vocab in [(1, 16, 64, 2, 5), (9, 64, 96, 6, 40)]:
    gen = torch.Generator().manual_seed(11 * rows + experts)
    x = (torch.randn(rows, hidden, generator=gen) * 2).half()
    weight = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).half()
    table = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(vocab)])
    tokens = torch.randint(0, vocab, (rows,), generator=gen)
    tokens[-1] = -1  # a pad row
    if rows > 1:
        tokens[0] = vocab - 1
    router = SimpleNamespace(
        weight=weight.float(), scoring="sqrtsoftplus", hash=True, tid2eid=table, layer=0,
        method="noaux_tc", n_group=1, top_k=top_k, scale=1.5,
    )
    router._scores = lambda x, r=router: Router._scores(r, x)
    ref_ids, ref = Router.forward(router, x, tokens)
    assert torch.equal(ref_ids, table[tokens.clamp(min=0)])
    ids, weights = triton_router.route(
        x, weight, top_k, "sqrtsoftplus", False, 1.5, torch.zeros(experts), (table, tokens)
    )
    assert torch.equal(ids, ref_ids), (ids, ref_ids)
    torch.testing.assert_close(weights, ref, rtol=1e-5, atol=1e-7)
    print("hash", rows, experts, "ok")
print("ok")
"""


def test_router_with_selection_bias_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=600, min_triton=(3, 7))
    output = run.stdout + run.stderr[-3000:]
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), output
