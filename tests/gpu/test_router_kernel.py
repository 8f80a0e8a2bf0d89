"""The Triton greedy router against the torch form of `Router.forward`, computed in float32."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.sync import no_sync

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
if not torch.cuda.is_available():  # Triton ships with CUDA builds of torch only
    pytest.skip("needs a CUDA device", allow_module_level=True)

from afdserve.kernels.moe import router as triton_router  # noqa: E402

DEVICE = "cuda"
TIE = 1e-5  # rows whose k-th and (k+1)-th reference scores are closer may pick either expert


@pytest.fixture(autouse=True)
def no_tf32():
    """The reference must be a true float32 GEMM, whatever another test left set."""
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


def router_case(
    rows: int, experts: int, hidden: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """x and a router weight scaled so logits have std ~2: softmax scores spread over decades."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * 2).to(dtype).to(DEVICE)
    weight = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype).to(DEVICE)
    return x, weight


def reference_scores(x: torch.Tensor, weight: torch.Tensor, scoring: str) -> torch.Tensor:
    logits = x.float() @ weight.float().T
    if scoring == "sqrtsoftplus":  # DeepSeek-V4
        return torch.nn.functional.softplus(logits).sqrt()
    return logits.sigmoid() if scoring == "sigmoid" else logits.softmax(dim=-1)


def assert_routing_matches(
    ids: torch.Tensor,
    weights: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    scoring: str,
    normalize: bool,
    scale: float,
) -> None:
    rows, experts = x.shape[0], weight.shape[0]
    assert ids.shape == weights.shape == (rows, top_k)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    if rows == 0:
        return
    scores = reference_scores(x, weight, scoring)
    ref_weights, ref_ids = scores.topk(top_k, dim=-1)
    if normalize:
        ref_weights = ref_weights / ref_weights.sum(-1, keepdim=True)
    ref_weights = ref_weights * scale

    ids_sorted, order = ids.sort(-1)
    ref_sorted, ref_order = ref_ids.sort(-1)
    assert ((ids >= 0) & (ids < experts)).all()
    assert (ids_sorted[:, 1:] != ids_sorted[:, :-1]).all(), "an expert picked twice in a row"
    assert (weights[:, :-1] >= weights[:, 1:]).all(), "weights must come out descending"

    # A near-tie at the k-th place may legitimately resolve either way: skip those rows only.
    tie = torch.zeros(rows, dtype=torch.bool, device=ids.device)
    if top_k < experts:
        ranked = scores.sort(-1, descending=True).values
        tie = (ranked[:, top_k - 1] - ranked[:, top_k]).abs() < TIE
    assert int(tie.sum()) <= max(2, rows // 8), f"{int(tie.sum())} of {rows} rows near a tie"
    keep = ~tie
    assert torch.equal(ids_sorted[keep], ref_sorted[keep])
    torch.testing.assert_close(
        weights.gather(1, order)[keep], ref_weights.gather(1, ref_order)[keep], rtol=1e-5, atol=1e-7
    )


# Each combination compiles its own kernels on the GPU: the grid is kept to the cases that differ.
@pytest.mark.parametrize(
    "scoring,normalize",
    [("softmax", True), ("softmax", False), ("sigmoid", False), ("sqrtsoftplus", True)],
)
@pytest.mark.parametrize("rows", [0, 1, 17, 64])
@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("experts", [8, 60, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_router_matches_reference(dtype, experts, top_k, rows, scoring, normalize):
    hidden, scale = 512, 2.5
    x, weight = router_case(rows, experts, hidden, dtype, seed=experts * 100 + top_k * 10 + rows)
    ids, weights = triton_router.route(x, weight, top_k, scoring, normalize, scale)
    assert_routing_matches(ids, weights, x, weight, top_k, scoring, normalize, scale)


# (experts, hidden, top_k, normalize) of Mixtral-8x7B, DeepSeek-V2-Lite and Qwen3-30B-A3B.
MODEL_SHAPES = [(8, 4096, 2, True), (64, 2048, 6, False), (128, 2048, 8, True)]


@pytest.mark.parametrize("rows", [1, 8, 64, 300])
@pytest.mark.parametrize("experts,hidden,top_k,normalize", MODEL_SHAPES)
def test_router_model_shapes(experts, hidden, top_k, normalize, rows):
    """Full-width H (many splits at one row) and a prefill-sized batch (the wider tiles)."""
    x, weight = router_case(rows, experts, hidden, torch.bfloat16, seed=experts + rows)
    ids, weights = triton_router.route(x, weight, top_k, "softmax", normalize, 1.0)
    assert_routing_matches(ids, weights, x, weight, top_k, "softmax", normalize, 1.0)


def test_router_strided_rows_and_odd_hidden():
    """A row-strided view of x, and an H that is no multiple of the K step (masked tail)."""
    x, weight = router_case(5, 60, 200, torch.float16, seed=5)
    wide = torch.cat([x, x, x], dim=1)[:, 200:400]
    assert triton_router.supports(wide, weight, 4)
    ids, weights = triton_router.route(wide, weight, 4, "sigmoid", True, 1.0)
    assert_routing_matches(ids, weights, x, weight, 4, "sigmoid", True, 1.0)


def test_router_without_host_sync():
    x, weight = router_case(16, 128, 2048, torch.bfloat16, seed=41)
    assert triton_router.supports(x, weight, 8)
    ids, weights = no_sync(triton_router.route, x, weight, 8, "softmax", True, 1.0)
    assert_routing_matches(ids, weights, x, weight, 8, "softmax", True, 1.0)


def test_router_replays_in_cuda_graph():
    """Captured once, replayed on new inputs copied into the captured input buffer."""
    args = (8, "softmax", True, 1.0)
    x, weight = router_case(8, 128, 2048, torch.bfloat16, seed=51)
    triton_router.route(x, weight, *args)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = triton_router.route(x, weight, *args)
    for seed in (52, 53):
        new_x, _ = router_case(8, 128, 2048, torch.bfloat16, seed=seed)
        x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        assert_routing_matches(ids, weights, x, weight, *args)


def test_router_supports():
    x, weight = router_case(4, 128, 256, torch.bfloat16, seed=61)
    assert triton_router.supports(x, weight, 8)
    assert not triton_router.supports(x.float(), weight.float(), 8)  # float32 keeps torch
    assert not triton_router.supports(x, weight.half(), 8)  # mixed dtypes
    assert not triton_router.supports(x.cpu(), weight.cpu(), 8)
    assert not triton_router.supports(x, weight, 129)  # top_k > E
    assert not triton_router.supports(x, weight.T.contiguous().T, 8)  # non-contiguous weight
    big_x, big = router_case(4, 513, 256, torch.bfloat16, seed=62)
    assert not triton_router.supports(big_x, big, 8)  # E > 512


@pytest.mark.parametrize("rows", [1, 17, 64, 300])
@pytest.mark.parametrize("experts,hidden,top_k", [(256, 3072, 8), (60, 512, 4)])
def test_router_with_selection_bias(experts, hidden, top_k, rows):
    """MiniMax-M2's routing (noaux_tc of one group): sigmoid scores, the float32 bias added for
    the choice only, the picked scores renormalised; against `Router.forward`'s torch form."""
    x, weight = router_case(rows, experts, hidden, torch.bfloat16, seed=experts + rows + 7)
    gen = torch.Generator().manual_seed(rows)
    bias = (torch.randn(experts, generator=gen) * 0.05).to(DEVICE)
    assert triton_router.supports(x, weight, top_k)
    ids, weights = triton_router.route(x, weight, top_k, "sigmoid", True, 1.0, bias)
    scores = reference_scores(x, weight, "sigmoid")
    choice = scores + bias
    ref_ids = choice.topk(top_k, dim=-1).indices
    ranked = choice.sort(-1, descending=True).values
    keep = (ranked[:, top_k - 1] - ranked[:, top_k]).abs() >= TIE
    assert int((~keep).sum()) <= max(2, rows // 8)
    assert torch.equal(ids.sort(-1).values[keep], ref_ids.sort(-1).values[keep])
    ref = scores.gather(1, ids)
    ref = ref / ref.sum(-1, keepdim=True)
    torch.testing.assert_close(weights[keep], ref[keep], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("rows", [1, 17, 300])
def test_router_hash_layer_matches_the_torch_form_and_replays(rows):
    """DeepSeek-V4's hash layers at V4-Flash's shape (256 experts, top-6, H 4096): each row's
    experts are tid2eid[token id] in the table's order (a pad row's -1 reads row 0), weighed by
    their sqrt(softplus) scores renormalised; against `Router.forward`'s torch form, eager and
    replayed from a CUDA graph on new token ids."""
    from types import SimpleNamespace

    from afdserve.model.layers.moe import Router

    experts, hidden, top_k, vocab, scale = 256, 4096, 6, 1000, 1.5
    x, weight = router_case(rows, experts, hidden, torch.bfloat16, seed=rows + 91)
    gen = torch.Generator().manual_seed(rows)
    table = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(vocab)])
    table = table.to(DEVICE)
    tokens = torch.randint(0, vocab, (rows,), generator=gen).to(DEVICE)
    tokens[-1] = -1
    router = SimpleNamespace(
        weight=weight.float(), scoring="sqrtsoftplus", hash=True, tid2eid=table, layer=0,
        method="noaux_tc", n_group=1, top_k=top_k, scale=scale,
    )  # fmt: skip
    router._scores = lambda rows_in: Router._scores(router, rows_in)

    def torch_form():
        # Router.forward on float32 weights keeps its torch form (the kernel takes bf16 only).
        return Router.forward(router, x, tokens)

    hashed = (table, tokens)
    ids, weights = triton_router.route(x, weight, top_k, "sqrtsoftplus", False, scale, None, hashed)
    ref_ids, ref = torch_form()
    assert torch.equal(ids, ref_ids) and torch.equal(ids, table[tokens.clamp(min=0)])
    torch.testing.assert_close(weights, ref, rtol=1e-5, atol=1e-7)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ids, weights = triton_router.route(
            x, weight, top_k, "sqrtsoftplus", False, scale, None, hashed
        )
    tokens.copy_(torch.randint(0, vocab, (rows,), generator=gen).to(DEVICE))
    graph.replay()
    torch.cuda.synchronize()
    ref_ids, ref = torch_form()
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref, rtol=1e-5, atol=1e-7)


BAD_TOKEN_IN_A_GRAPH = """
import torch
from afdserve.kernels.moe import router
x = torch.randn(4, 512, device="cuda").bfloat16()
weight = torch.randn(64, 512, device="cuda").bfloat16()
table = torch.randint(0, 64, (100, 6), device="cuda")
tokens = torch.tensor([3, 99, -1, 0], device="cuda")
router.route(x, weight, 6, "sqrtsoftplus", False, 1.0, None, (table, tokens))  # compiled
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    router.route(x, weight, 6, "sqrtsoftplus", False, 1.0, None, (table, tokens))
graph.replay()
torch.cuda.synchronize()
print("valid ids replayed")
tokens[1] = 100  # one past the table
graph.replay()
torch.cuda.synchronize()
print("a bad id replayed")
"""


def test_hash_layer_kernel_stops_a_graph_on_a_token_id_outside_the_table():
    """Under a graph `Router.forward` leaves the token check to the hash kernel's device assert
    (no `check_token_ids` launches): a replay over an id past the table must fail, not read
    past it. In a subprocess: a device-side assert ends the CUDA context."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", BAD_TOKEN_IN_A_GRAPH], capture_output=True, text=True, timeout=300
    )
    assert "valid ids replayed" in run.stdout, run.stderr[-3000:]
    assert run.returncode != 0 and "a bad id replayed" not in run.stdout
    assert "token id outside the hash table" in run.stderr or "device-side assert" in run.stderr
