"""Qwen3-Next, Qwen3.5-MoE and Kimi-Linear on one GPU (the delta rule's prefill, its decode step
and the short convolution on their Triton paths, as attention, rotary and the experts): float32
greedy tokens equal the CPU engine's (which tests/model/test_gated_deltanet.py holds equal to
transformers), colocated and in-process 1A1F alike, over a batch with chunked prefill beside
decodes, and with prefill chunks of several kernel chunks; full_decode_only captures the batched
decode step (pad segments skipped) and gives graph_mode none's tokens, as `full` does for mixed
steps; `auto` captures decode steps. The kernels against the torch ones at real sizes, pad
entries (slot -1) among the spans."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.kernels import ops
from afdserve.kernels.reference import delta_chunked as reference_chunked
from afdserve.kernels.reference import delta_rule as reference
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.gpu.test_graphs import _check

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3) % 250 for i in range(45)], [5, 6, 7], [42] * 9, [9], list(range(60, 80))]


@pytest.fixture(scope="module")
def gdn_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("gdn-gpu")
    return {
        (t, dtype): make_tiny_model(root / f"{t}-{dtype}", t, seed=2, dtype=dtype)
        for t in ("qwen3_next", "qwen3_5_moe", "kimi_linear")
        for dtype in ("float32", "bfloat16")
    }


def tokens(model: Path, dtype: str, device: str, **kwargs) -> list[list[int]]:
    kwargs.setdefault("graph_mode", "none")
    with LLM(
        str(model),
        dtype=dtype,
        device=device,
        max_num_batched_tokens=16,
        use_tqdm_on_load=False,
        **kwargs,
    ) as llm:
        return [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5_moe", "kimi_linear"])
@pytest.mark.parametrize("ubatches", [1, 2])
def test_cuda_equals_cpu_colocated_and_in_process(gdn_dirs, model_type, ubatches):
    model = gdn_dirs[(model_type, "float32")]
    colocated = tokens(model, "float32", "cuda")
    split = tokens(
        model, "float32", "cuda", topology="1A1F", connector="inprocess", ubatches=ubatches
    )
    assert split == colocated == tokens(model, "float32", "cpu")


@pytest.mark.parametrize("model_type", ["qwen3_next", "kimi_linear"])
def test_long_prefill_chunks_equal_cpu(gdn_dirs, model_type):
    """Prefill chunks of up to 96 rows: several of the Triton kernel's 32-row chunks per span."""
    model = gdn_dirs[(model_type, "float32")]
    prompts = [[(11 * i + 5) % 250 for i in range(150)], list(range(40, 110)), [3, 1, 4]]

    def run(device: str) -> list[list[int]]:
        with LLM(
            str(model),
            dtype="float32",
            device=device,
            max_num_batched_tokens=96,
            graph_mode="none",
            use_tqdm_on_load=False,
        ) as llm:
            return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]

    assert run("cuda") == run("cpu")


@pytest.mark.parametrize(
    ("model_type", "dtype", "topology"),
    [
        ("qwen3_next", "float32", "colocated"),
        ("qwen3_5_moe", "float32", "1A1F"),
        ("qwen3_next", "bfloat16", "colocated"),
        ("kimi_linear", "float32", "1A1F"),
        ("kimi_linear", "bfloat16", "colocated"),
    ],
)
def test_full_decode_only_graphs_give_the_eager_tokens(gdn_dirs, model_type, dtype, topology):
    model = gdn_dirs[(model_type, dtype)]
    want = tokens(model, dtype, "cuda")
    split = {} if topology == "colocated" else dict(topology=topology, connector="inprocess")
    with LLM(
        str(model),
        dtype=dtype,
        device="cuda",
        max_num_batched_tokens=16,
        graph_mode="full_decode_only",
        cuda_graph_sizes=[1, 2, 4, 8],
        log_step_plan=True,
        use_tqdm_on_load=False,
        **split,
    ) as llm:
        assert llm.engine.core_client.driver.forward.graphs is not None
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        records = [r for r in llm.step_log() if r["role"] == "attention"]
    modes = {r["mode"] for r in records}
    assert {"capture", "replay", "eager"} <= modes, modes
    assert any(r["mode"] == "replay" and r["padded_rows"] > r["real_rows"] for r in records)
    if dtype == "float32":
        assert got == want
    else:
        with LLM(str(model), dtype=dtype, device="cuda", graph_mode="none") as eager:
            _check(eager, PROMPTS, got, want)


@pytest.mark.parametrize(
    ("model_type", "dtype", "topology", "ubatches"),
    [
        ("qwen3_next", "float32", "colocated", 1),
        ("qwen3_5_moe", "float32", "1A1F", 1),
        ("qwen3_next", "float32", "1A1F", 2),
        ("kimi_linear", "float32", "colocated", 1),
        ("kimi_linear", "float32", "1A1F", 2),
        ("qwen3_next", "bfloat16", "colocated", 1),
        ("kimi_linear", "bfloat16", "1A1F", 1),
    ],
)
def test_full_graphs_replay_mixed_steps_with_the_eager_tokens(
    gdn_dirs, model_type, dtype, topology, ubatches
):
    """graph_mode full: steps with prefill chunks beside decode rows replay graphs captured
    over blank buffers (every segment a pad), the delta-rule layers running from the step's
    device spans (pad entries skipped by the kernels); the tokens are graph_mode none's."""
    model = gdn_dirs[(model_type, dtype)]
    split = {} if topology == "colocated" else dict(topology=topology, connector="inprocess")
    want = tokens(model, dtype, "cuda", ubatches=ubatches, **split)
    with LLM(
        str(model),
        dtype=dtype,
        device="cuda",
        max_num_batched_tokens=16,
        graph_mode="full",
        cuda_graph_sizes=[1, 2, 4, 8, 16],
        log_step_plan=True,
        use_tqdm_on_load=False,
        ubatches=ubatches,
        **split,
    ) as llm:
        # Not kept past the engine: the runner holds the cache and the graphs' pool, which the
        # eager engine below (and the next test) must get back.
        assert llm.engine.core_client.driver.forward.graphs is not None
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert not llm.engine.core_client.driver.forward.graphs.eager_keys  # all captured
        records = [r for r in llm.step_log() if r["role"] == "attention"]
    replays = [r for r in records if r["mode"] == "replay"]
    # 5 prompts decode at most 5 rows: more means a prefill chunk (beside decodes, or alone).
    assert any(r["real_rows"] > len(PROMPTS) for r in replays), records[:8]
    assert any(r["padded_rows"] > r["real_rows"] for r in replays)
    if dtype == "float32":
        assert got == want
    else:
        with LLM(str(model), dtype=dtype, device="cuda", graph_mode="none") as eager:
            _check(eager, PROMPTS, got, want)


def test_auto_captures_decode_steps(gdn_dirs):
    with LLM(str(gdn_dirs[("qwen3_next", "bfloat16")]), dtype="bfloat16", device="cuda") as llm:
        assert llm.graph_config.mode == "full_decode_only"


@pytest.mark.parametrize("per_channel", [False, True])
def test_decode_step_kernel_equals_the_reference_at_real_sizes(per_channel):
    """Qwen3-Next's linear-layer shape (16 key heads, 32 value heads, 128 x 128) and Kimi's
    per-channel decay: the Triton step against the torch one, pad rows in the scratch slot
    and of the pad marker (slot -1: skipped, output zero)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, hk, hv, d = 64, 16, 32, 128
    q, k = (torch.randn(b, hk, d, device="cuda", generator=gen) for _ in range(2))
    v = torch.randn(b, hv, d, device="cuda", generator=gen)
    shape = (b, hv, d) if per_channel else (b, hv)
    g = -torch.rand(shape, device="cuda", generator=gen)
    beta = torch.rand(b, hv, device="cuda", generator=gen)
    states = torch.randn(b + 1, hv, d, d, device="cuda", generator=gen)
    slots = torch.randperm(b, device="cuda", generator=gen)
    slots[-4:-2] = b  # pad rows in the scratch slot
    slots[-2:] = -1  # pad entries of a table sized by capacity
    fresh = torch.rand(b, device="cuda", generator=gen) < 0.2
    want_states, got_states = states.clone(), states.clone()
    real = slice(0, b - 4)
    want = reference.step_slots(
        q[real], k[real], v[real], g[real], beta[real], want_states, slots[real], fresh[real]
    )
    got = ops.delta_rule_step(q, k, v, g, beta, got_states, slots, fresh)
    torch.testing.assert_close(got[real], want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_states[:b], want_states[:b], atol=1e-4, rtol=1e-4)
    assert not got[-2:].any()


def _spans(lengths: list[int], device: str) -> tuple[torch.Tensor, int]:
    """Spans of the given lengths with a one-row gap (another segment's row) before each, in
    slots 0, 1, ..., every other one fresh, then pad entries (slot -1, skipped): over a gap
    row, over a span's rows, and past the last -> (spans [n, 4] int32, rows)."""
    spans, row = [], 0
    for i, n in enumerate(lengths):
        spans.append((row + 1, row + 1 + n, i, i % 2))
        row += 1 + n
    spans += [(0, 1, -1, 0), (spans[-1][0], spans[-1][1], -1, 1), (row + 1, row + 1, -1, 0)]
    return torch.tensor(spans, dtype=torch.int32, device=device), row + 1


@pytest.mark.parametrize("per_channel", [False, True])
def test_prefill_kernels_equal_the_reference_at_real_sizes(per_channel):
    """Qwen3-Next's linear-layer shape (16 key heads, 32 value heads, 128 x 128; Kimi: 32 and
    per-channel decays, some steep), bfloat16 rows as the model feeds them, spans of 1, C - 1, C,
    C + 1 and many chunks: the Triton convolution and chunked delta rule against the torch ones."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hk, hv, d = (32, 32, 128) if per_channel else (16, 32, 128)
    spans, rows = _spans([1, 31, 32, 33, 200, 700], "cuda")
    slots = spans.shape[0] + 1
    conv_dim = 2 * hk * d + hv * d
    qkv = torch.randn(rows, conv_dim, device="cuda", generator=gen).bfloat16()
    weight = (0.5 * torch.randn(conv_dim, 4, device="cuda", generator=gen)).bfloat16()
    windows = torch.randn(slots, conv_dim, 3, device="cuda", generator=gen).bfloat16()
    want_w, got_w = windows.clone(), windows.clone()
    want = reference_chunked.conv_spans(qkv, weight, want_w, spans)
    got = ops.causal_conv_spans(qkv, weight, got_w, spans)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_w, want_w, atol=0, rtol=0)
    q, k, v = want.split([hk * d, hk * d, hv * d], dim=-1)
    q, k, v = q.view(rows, hk, d), k.view(rows, hk, d), v.view(rows, hv, d)
    shape = (rows, hv, d) if per_channel else (rows, hv)
    g = -torch.rand(shape, device="cuda", generator=gen) * (4.0 if per_channel else 1.0)
    beta = torch.rand(rows, hv, device="cuda", generator=gen)
    states = 0.1 * torch.randn(slots, hv, d, d, device="cuda", generator=gen)
    want_s, got_s = states.clone(), states.clone()
    want_o = torch.zeros(rows, hv, d, device="cuda")
    got_o = torch.zeros(rows, hv, d, device="cuda")
    reference_chunked.chunked_spans(q, k, v, g, beta, want_s, spans, want_o)
    ops.delta_rule_spans(q, k, v, g, beta, got_s, spans, got_o)
    torch.testing.assert_close(got_o, want_o, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got_s, want_s, atol=2e-3, rtol=2e-3)
