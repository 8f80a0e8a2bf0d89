"""DeepSeek-V4's pages on one GPU (model/families/deepseek_v4/cache.py; plain torch, as every V4
path on CUDA today): prefix caching gives the tokens of the engine without it (float32: equal, and
equal to the CPU engine's; bf16 under full_decode_only graphs: equal up to a near-tie), and the FP8
cache (e4m3 KV pages) gives the CPU FP8 cache's float32 tokens, stays close to the bf16 cache,
and replays in decode graphs and, through the fused kernels, in `full` graphs."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve import LLM, SamplingParams
from afdserve.model.families.deepseek_v4 import batched
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from tests.engine.test_kv_fp8 import _quality_tool
from tests.gpu.test_graphs import _check

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PREFIXES = [[(7 * i + 3) % 250 for i in range(n)] for n in (13, 22, 41)]
FIRST = [p + [1, 2] for p in PREFIXES]  # computes and caches each prefix
SECOND = [p + tail for p in PREFIXES for tail in ([3], [4, 5, 6, 7, 8, 9])]  # resumes from it
GRAPHS = dict(graph_mode="full_decode_only", cuda_graph_sizes=[1, 2, 4, 8])


@pytest.fixture(scope="module")
def v4_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4-cache-gpu")
    return {
        dtype: make_tiny_v4(root / dtype, seed=2, dtype=dtype) for dtype in ("float32", "bfloat16")
    }


def rounds(model: Path, dtype: str, device: str, **kwargs) -> tuple[list[list[int]], list[int]]:
    """FIRST then SECOND through one engine (blocks of 4: the tiny V4's rates are 2 and 4)."""
    with LLM(
        str(model),
        dtype=dtype,
        device=device,
        block_size=4,
        max_num_batched_tokens=8,
        use_tqdm_on_load=False,
        **{"graph_mode": "none", **kwargs},
    ) as llm:
        outs = llm.generate(FIRST, GREEDY, use_tqdm=False)
        outs += llm.generate(SECOND, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def test_prefix_caching_float32_equals_uncached_and_cpu(v4_dirs):
    model = v4_dirs["float32"]
    want, _ = rounds(model, "float32", "cuda", enable_prefix_caching=False)
    got, cached = rounds(model, "float32", "cuda", enable_prefix_caching=True)
    assert cached[len(FIRST) :] == [12, 12, 20, 20, 40, 40]
    assert got == want
    assert got == rounds(model, "float32", "cpu", enable_prefix_caching=True)[0]
    graphs, _ = rounds(model, "float32", "cuda", enable_prefix_caching=True, **GRAPHS)
    assert graphs == want


def test_prefix_caching_bf16_under_decode_graphs(v4_dirs):
    model = v4_dirs["bfloat16"]
    want, _ = rounds(model, "bfloat16", "cuda", enable_prefix_caching=False)
    got, cached = rounds(model, "bfloat16", "cuda", enable_prefix_caching=True, **GRAPHS)
    assert sum(cached) > 0
    with LLM(str(model), dtype="bfloat16", device="cuda", graph_mode="none") as eager:
        _check(eager, FIRST + SECOND, got, want)


def test_fp8_cache_float32_equals_the_cpu_fp8_cache(v4_dirs):
    """The same e4m3 rounding on both devices: the CPU FP8 cache's tokens, up to a near-tie
    (float32 GEMMs part by ~1e-6, which may cross an e4m3 rounding boundary)."""
    model = v4_dirs["float32"]
    fp8 = dict(kv_cache_dtype="fp8", enable_prefix_caching=False)
    cpu, _ = rounds(model, "float32", "cpu", **fp8)
    got, _ = rounds(model, "float32", "cuda", **fp8)
    with LLM(str(model), dtype="float32", device="cpu", kv_cache_dtype="fp8") as eager:
        _check(eager, FIRST + SECOND, got, cpu)


def test_fp8_cache_bf16_replays_and_stays_close(v4_dirs, tmp_path):
    """bf16 with the FP8 cache: decode graphs and prefix caching give its eager uncached tokens
    (up to a near-tie: the KV round trip makes every chunking read the same keys); teacher-forced
    along the bf16 cache's tokens it stays as close as on CPU (tests/engine/test_kv_fp8.py; CPU,
    6 x 8: agreement 0.92, mean |d logprob| 0.06)."""
    model = v4_dirs["bfloat16"]
    fp8 = dict(kv_cache_dtype="fp8")
    want, _ = rounds(model, "bfloat16", "cuda", enable_prefix_caching=False, **fp8)
    got, _ = rounds(model, "bfloat16", "cuda", enable_prefix_caching=True, **fp8, **GRAPHS)
    with LLM(str(model), dtype="bfloat16", device="cuda", graph_mode="none", **fp8) as eager:
        _check(eager, FIRST + SECOND, got, want)
    tool = _quality_tool()
    m = tool.measure(tool.tiny_models(tmp_path)["deepseek_v4"], "bfloat16", tool.PROMPTS[:6], 8)
    print(f"deepseek_v4 bf16 on cuda: agreement {m['agree']:.3f}, mean |dlp| {m['dlp']:.4f}")
    assert m["agree"] >= 0.85 and m["dlp"] < 0.2


def test_fp8_cache_bf16_under_full_graphs_gives_the_eager_tokens(v4_dirs, monkeypatch):
    """`full` captures V4's prefill and mixed steps beside decodes over the FP8 cache: the fused
    kernels read the e4m3 pages (the torch form, which gathers every row's entries out to the
    table's end, rows x context, is made to fail), and the tokens are the eager engine's, up
    to a near-tie."""
    model = v4_dirs["bfloat16"]
    fp8 = dict(kv_cache_dtype="fp8", enable_prefix_caching=False)
    want, _ = rounds(model, "bfloat16", "cuda", **fp8)

    def gathered(*args, **kwargs):
        raise AssertionError("the torch form ran on CUDA over the FP8 cache")

    monkeypatch.setattr(batched, "_every_entry", gathered)
    monkeypatch.setattr(batched, "_index_scores", gathered)
    got, _ = rounds(
        model, "bfloat16", "cuda", graph_mode="full", cuda_graph_sizes=[1, 2, 4, 8], **fp8
    )
    monkeypatch.undo()
    with LLM(str(model), dtype="bfloat16", device="cuda", graph_mode="none", **fp8) as eager:
        _check(eager, FIRST + SECOND, got, want)
