"""DeepSeek-V3.2 and GLM-5 (DSA) on one GPU. On CUDA the DSA layers run their own Triton kernels
(kernels/triton/dsa_indexer.py: the indexer's scores over the paged keys and the top-k;
dsa_attention.py: MLA over the selected latent rows), the rest on the kernels every family uses.
The kernels at the real models' widths (64 or 32 indexer heads of 128, index_topk 2048, 128
heads over latent 512 + rope 64, contexts past 2048, bf16 and FP8) against the torch path on the
same GPU (tests/kernels/dsa_cases.py); the model with the kernels against the model with the torch
path (float32: the same tokens; bf16 and an FP8 cache: each kernel call against its oracle on
the same inputs, tests/kernels/dsa_cases.py `shadowed`); float32 tokens equal
the CPU engine's (which tests/model/test_dsa.py holds to transformers), colocated and in-process
1A1F alike; full_decode_only captures the decode (kernels inside the graph) and `full` mixed
steps too (prefill chunks beside decodes), each giving graph_mode none's tokens; `auto` captures
decode where Triton loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.kernels import ops
from afdserve.model.families.dsa import attention, indexer
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.gpu.test_graphs import _check
from tests.kernels.dsa_cases import FP8, check_attention, check_selection, dsa_layer, shadowed

pytestmark = pytest.mark.gpu

FAMILIES = ("deepseek_v32", "glm_moe_dsa")
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
PROMPTS = [[(7 * i + 3) % 250 for i in range(45)], [5, 6, 7], [42] * 9, [9], list(range(60, 80))]


@pytest.fixture(scope="module")
def dsa_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    root = tmp_path_factory.mktemp("dsa-gpu")
    return {
        (family, dtype): make_tiny_model(root / f"{family}-{dtype}", family, seed=2, dtype=dtype)
        for family in FAMILIES
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


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_on_cuda_equals_the_cpu_engine(dsa_dirs, family):
    model = dsa_dirs[(family, "float32")]
    colocated = tokens(model, "float32", "cuda")
    assert colocated == tokens(model, "float32", "cpu")
    split = tokens(
        model,
        "float32",
        "cuda",
        topology="1A1F",
        connector="inprocess",
        ubatches=2,
        gate_on_attention=True,
    )
    assert split == colocated


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_full_decode_only_graphs_give_the_eager_tokens(dsa_dirs, family, dtype):
    """Decode steps of 5 sequences replay the graph of 8 rows (3 pad rows selecting nothing),
    steps with prefill chunks run eagerly (float32: equal; bf16: equal up to a near-tie)."""
    model = dsa_dirs[(family, dtype)]
    want = tokens(model, dtype, "cuda")
    with LLM(
        str(model),
        dtype=dtype,
        device="cuda",
        max_num_batched_tokens=16,
        graph_mode="full_decode_only",
        cuda_graph_sizes=[1, 2, 4, 8],
        log_step_plan=True,
        use_tqdm_on_load=False,
    ) as llm:
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        records = [r for r in llm.step_log() if r["role"] == "attention"]
    assert {"capture", "replay", "eager"} <= {r["mode"] for r in records}
    assert any(r["mode"] == "replay" and r["padded_rows"] > r["real_rows"] for r in records)
    if dtype == "float32":
        assert got == want
    else:
        with LLM(str(model), dtype=dtype, device="cuda", graph_mode="none") as eager:
            _check(eager, PROMPTS, got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_kernels_give_the_torch_paths_tokens_in_float32(dsa_dirs, family, monkeypatch):
    """The model with the DSA kernels against the model with the torch path on the same GPU
    (the kernels switched off in-process), eager and with prefill chunks: the same tokens."""
    model = dsa_dirs[(family, "float32")]
    got = tokens(model, "float32", "cuda")
    monkeypatch.setattr(ops, "dsa_select", lambda *args: None)
    monkeypatch.setattr(ops, "dsa_sparse_mla", lambda *args: None)
    assert got == tokens(model, "float32", "cuda")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_kernels_match_the_torch_path_at_every_dsa_layer_in_bf16(
    dsa_dirs, family, cache, monkeypatch
):
    """bf16 (and an FP8 cache): every kernel call of a real generation, checked on its own
    inputs (`shadowed`): the selection is the torch path's up to ties, the attention within
    bf16 rounding of the exact result. Not the tokens: the tiny models turn rounding into
    different tokens within a few steps (their indexers keep 4 of many near-equal scores and
    their routers pick experts by small margins, so an attention rounded otherwise flips a
    later layer's choices), the torch path against itself with float32 attention scores too,
    at top-2 gaps up to 0.7 (issue 45)."""
    select, sparse_mla, seen = shadowed(indexer.select_fast, ops.dsa_sparse_mla)
    monkeypatch.setattr(attention, "select_fast", select)
    monkeypatch.setattr(ops, "dsa_sparse_mla", sparse_mla)
    tokens(dsa_dirs[(family, "bfloat16")], "bfloat16", "cuda", kv_cache_dtype=cache)
    assert seen["select"] and seen["attend"], seen


# Decode rows around index_topk and far past it, a prefill chunk begun mid-sequence, pad rows.
REAL_STEP = [(1, 1), (2047, 1), (2048, 1), (2049, 1), (5000, 1), (33000, 1), (3000, 300)]


@pytest.mark.parametrize("preset", ["deepseek-v3.2", "glm-5"])
@pytest.mark.parametrize("keys", ["bfloat16", "fp8"])
@torch.inference_mode()
def test_selection_kernels_at_real_widths(preset, keys):
    heads = 64 if preset == "deepseek-v3.2" else 32
    attn = dsa_layer(
        "cuda", index_n_heads=heads, index_head_dim=128, index_topk=2048, num_attention_heads=16
    )
    dtype = FP8 if keys == "fp8" else torch.bfloat16
    for seed, block_size in ((1, 64), (2, 16)):
        check_selection(
            attn, REAL_STEP, 5, dtype, block_size, seed, ops.dsa_select, "cuda", torch.bfloat16
        )
    # Under negative head weights the zero keys tie exactly at the top: past 2048 of them (one
    # slot in about nine), the earliest 2048 are the torch path's set.
    long_rows = [(33000, 1), (40000, 1)]
    check_selection(
        attn, long_rows, 1, dtype, 64, 3, ops.dsa_select, "cuda", torch.bfloat16, negative=True
    )


@pytest.mark.parametrize("cache", ["bfloat16", "fp8"])
@torch.inference_mode()
def test_sparse_mla_kernel_at_real_widths(cache):
    """128 heads (four head blocks, eight over FP8) over latent 512 + rope 64, 2048 selected
    rows a row."""
    attn = dsa_layer("cuda", num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64)
    dtype = FP8 if cache == "fp8" else torch.bfloat16
    # bf16: the torch path rounds its scores and probabilities to bf16, the kernel keeps float32.
    check_attention(attn, 9, 256, 64, dtype, 4, ops.dsa_sparse_mla, "cuda", torch.bfloat16, 2e-2)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "dtype, cache, topology, ubatches",
    [
        ("float32", "auto", "colocated", 1),
        ("float32", "auto", "1A1F", 2),
        ("bfloat16", "fp8", "colocated", 1),
    ],
)
def test_full_graphs_of_mixed_steps_give_the_eager_tokens(
    dsa_dirs, family, dtype, cache, topology, ubatches
):
    """`full` captures DSA's mixed steps (the kernels read each row's table up to its own
    position from the graph's static buffers, prefill rows as decode ones): with 16 tokens a
    step, prefill chunks beside decodes replay mixed graphs of at most 16 rows, decodes alone
    decode graphs; every capture succeeds and the tokens are graph_mode none's (float32:
    equal; bf16 over an FP8 cache: equal up to a near-tie)."""
    model = dsa_dirs[(family, dtype)]
    want = tokens(model, dtype, "cuda", kv_cache_dtype=cache)
    split = {}
    if topology == "1A1F":
        split = dict(topology=topology, connector="inprocess", ubatches=ubatches)
    with LLM(
        str(model),
        dtype=dtype,
        device="cuda",
        kv_cache_dtype=cache,
        max_num_batched_tokens=16,
        graph_mode="full",
        cuda_graph_sizes=[1, 2, 4, 8, 16],
        log_step_plan=True,
        use_tqdm_on_load=False,
        **split,
    ) as llm:
        graphs = llm.engine.core_client.driver.forward.graphs
        assert graphs is not None
        got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert not graphs.eager_keys  # every capture succeeded (no host sync inside)
        del graphs  # its captured pools must go with the engine, before the eager one starts
        records = [r for r in llm.step_log() if r["role"] == "attention"]
    modes = {r["mode"] for r in records}
    assert {"capture", "replay"} <= modes and "eager" not in modes, modes
    replays = [r for r in records if r["mode"] == "replay"]
    # 5 prompts decode at most 5 rows: more in a replay means prefill rows in the graph.
    assert any(r["real_rows"] > len(PROMPTS) for r in replays), records[:8]
    assert any(r["padded_rows"] > r["real_rows"] for r in replays)
    assert {r["key"][4] for r in replays} == {"decode", "mixed"}
    if dtype == "float32":
        assert got == want
        return
    with LLM(
        str(model), dtype=dtype, device="cuda", kv_cache_dtype=cache, graph_mode="none"
    ) as eager:
        _check(eager, PROMPTS, got, want)


def test_auto_captures_decode(dsa_dirs):
    """`auto` captures decode where Triton loads, as for every family: full_decode_only."""
    model = dsa_dirs[("deepseek_v32", "bfloat16")]
    with LLM(str(model), device="cuda") as llm:
        assert llm.graph_config.mode == "full_decode_only"
