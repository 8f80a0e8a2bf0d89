"""DeepSeek-V4's fused CUDA paths (kernels/triton/: mhc.py, v4_attention.py, v4_compress.py,
v4_indexer.py, v4_index_select.py, v4_norm_rope.py) against the torch path they replace: each
kernel on CUDA at the tiny shapes and at V4-Flash's (hc_mult 4, hidden 4096; 64 heads of 512,
window 128, CSA rate 4 with top-512 and an indexer of 64 heads of 128, HCA rate 128), rows 1,
odd and 64, float32 and bf16, eagerly and replayed from a CUDA graph (the model's logits:
test_v4_fused_model.py)."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path

import pytest
import torch

from afdserve.engine.kv_cache import make_kv_cache
from afdserve.kernels import ops
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families.deepseek_v4 import batched
from afdserve.model.families.deepseek_v4.attention import rope_tail
from afdserve.model.families.deepseek_v4.mhc import (
    HyperConnection,
    expand,
    unweighted_rms_norm,
    v4_rms_norm,
)
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.parts import ModelParts
from tests.kernels.v4_cases import CSA, HCA, SLIDING, projected

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# V4-Flash's attention shapes on a model of hidden 64 (dummy weights: only the attention's
# shapes, sinks and scale matter here).
FLASH_ATTENTION = dict(
    hidden_size=64,
    num_attention_heads=64,
    head_dim=512,
    partial_rotary_factor=0.125,
    q_lora_rank=16,
    o_groups=8,
    o_lora_rank=8,
    index_head_dim=128,
    index_n_heads=64,
    index_topk=512,
    sliding_window=128,
    compress_rates={CSA: 4, HCA: 128},
    max_position_embeddings=16384,
    layer_types=[SLIDING, CSA, HCA, CSA],
)


def triton_module(name: str):
    """A module of kernels/triton/, imported inside the tests (Triton is a GPU-only install)."""
    return importlib.import_module(f"afdserve.kernels.triton.{name}")


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def mhc_inputs(rows, n, hidden, dtype, update, seed):
    gen = torch.Generator().manual_seed(seed)
    hc = HyperConnection(hidden, n, 20, 1e-6, 1e-6)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=gen) * (n * hidden) ** -0.5)
        hc.base.copy_(torch.randn(hc.base.shape, generator=gen) * 0.5)
        hc.scale.copy_(torch.rand(3, generator=gen) + 0.5)
    weight = torch.rand(hidden, generator=gen) + 0.5
    h = torch.randn(rows, n, hidden, generator=gen).to(dtype)
    step = None
    if update:
        y = torch.randn(rows, hidden, generator=gen).to(dtype)
        step = (y, torch.rand(rows, n, generator=gen) * 2, torch.rand(rows, n, n, generator=gen))
    moved = None if step is None else tuple(t.cuda() for t in step)
    return hc.cuda(), weight.cuda(), h.cuda(), moved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "n", "hidden"), [(1, 4, 4096), (7, 4, 4096), (64, 4, 4096), (3, 2, 32), (5, 3, 200)]
)
@pytest.mark.parametrize("update", [False, True])
@torch.inference_mode()
def test_mhc_site_equals_the_torch_path(rows, n, hidden, dtype, update):
    triton_mhc = triton_module("mhc")
    hc, weight, h, step = mhc_inputs(rows, n, hidden, dtype, update, rows + n)
    eps = (hc.hc_eps, hc.norm_eps, 1e-6)
    got = ops.hyper_connection(h, step, hc.fn, hc.base, hc.scale, weight, hc.iters, eps)
    assert got is not None  # the fused path applies
    streams = h if step is None else expand(h, *step)
    collapsed, post, comb = hc(streams)
    want = (streams, v4_rms_norm(collapsed, weight, 1e-6), post, comb)
    for name, g, w in zip(("streams", "x", "post", "comb"), got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert relative(g, w) < TOL[dtype], (name, relative(g, w))
    # Replayed from a graph, with new inputs copied into the captured ones: the eager values.
    args = (hc.fn, hc.base, hc.scale, weight, hc.iters, *eps)
    y, p, c = step if step is not None else (None, None, None)
    triton_mhc.hyper_connection(h, y, p, c, *args)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_mhc.hyper_connection(h, y, p, c, *args)
    _, _, fresh_h, fresh_step = mhc_inputs(rows, n, hidden, dtype, update, rows + n + 1)
    h.copy_(fresh_h)
    for buffer, value in zip(step or (), fresh_step or (), strict=True):
        buffer.copy_(value)
    graph.replay()
    eager = triton_mhc.hyper_connection(h, y, p, c, *args)
    for g, w in zip(captured, eager, strict=True):
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "n", "hidden"),
    [(1, 4, 4096), (7, 4, 4096), (64, 4, 4096), (300, 4, 4096), (5, 3, 200)],
)
@torch.inference_mode()
def test_mhc_expand_equals_the_torch_path(rows, n, hidden, dtype):
    """The update alone (after the last layer): the torch form's streams, eager and replayed."""
    _, _, h, step = mhc_inputs(rows, n, hidden, dtype, True, rows + n)
    got = ops.mhc_expand(h, *step)
    assert got is not None  # the fused path applies
    want = expand(h, *step)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert relative(got, want) < TOL[dtype], relative(got, want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = ops.mhc_expand(h, *step)
    _, _, fresh_h, fresh_step = mhc_inputs(rows, n, hidden, dtype, True, rows + n + 1)
    h.copy_(fresh_h)
    for buffer, value in zip(step, fresh_step, strict=True):
        buffer.copy_(value)
    graph.replay()
    assert torch.equal(captured, ops.mhc_expand(h, *step))


@torch.inference_mode()
def test_mhc_past_2_31_stream_elements():
    """A prefill of 131136 rows at V4-Flash's 4 x 4096 streams (2^31 elements and 64 rows
    more, 4.3 GB of bf16): the last rows' update and site equal the torch path on those rows
    alone, where 32-bit offsets would wrap onto the first rows."""
    n, hidden = 4, 4096
    rows = 2**31 // (n * hidden) + 64
    hc, weight, tail_h, tail_step = mhc_inputs(64, n, hidden, torch.bfloat16, True, 7)
    h = torch.zeros(rows, n, hidden, dtype=torch.bfloat16, device="cuda")
    y = torch.zeros(rows, hidden, dtype=torch.bfloat16, device="cuda")
    post = torch.zeros(rows, n, device="cuda")
    comb = torch.zeros(rows, n, n, device="cuda")
    for whole, tail in zip((h, y, post, comb), (tail_h, *tail_step), strict=True):
        whole[-64:] = tail
    streams = ops.mhc_expand(h, y, post, comb)
    assert torch.equal(streams[-64:], ops.mhc_expand(tail_h, *tail_step))
    assert not streams[:-64].any()
    del streams
    eps = (hc.hc_eps, hc.norm_eps, 1e-6)
    args = (hc.fn, hc.base, hc.scale, weight, hc.iters, eps)
    got = ops.hyper_connection(h, (y, post, comb), *args)
    want = ops.hyper_connection(tail_h, tail_step, *args)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g[-64:], w)


def attention_model(root: Path, name: str, **overrides):
    path = make_tiny_v4(root / name, seed=3, **overrides)
    return load_model(path, ModelParts.colocated(), "float32", "cuda", load_format="dummy")[0]


@pytest.fixture(scope="module")
def attention_models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("v4-fused")
    return {
        "tiny": attention_model(root, "tiny", layer_types=[SLIDING, CSA, HCA, CSA]),
        "flash": attention_model(root, "flash", **FLASH_ATTENTION),
    }


def step_rows(chunks, width, pad, gen) -> batched.StepRows:
    """(start, rows) per sequence -> StepRows on CUDA, `pad` pad rows appended; sequence i in
    state slot i (pad rows -1)."""
    positions, tables, real, start, end, slots = [], [], [], [], [], []
    perm = torch.randperm(len(chunks) * width + 2, generator=gen)
    for i, (first, count) in enumerate(chunks):
        for q in range(first, first + count):
            positions.append(q)
            tables.append(perm[i * width : (i + 1) * width])
            real.append(True)
            start.append(first)
            end.append(first + count)
            slots.append(i)
    for _ in range(pad):
        positions.append(0)
        tables.append(perm[:width])
        real.append(False)
        start.append(0)
        end.append(0)
        slots.append(-1)
    values = (positions, torch.stack(tables), real, start, end)
    cuda = [torch.as_tensor(v).cuda() for v in values]
    return batched.StepRows(*cuda, slots=torch.as_tensor(slots).cuda())


@pytest.mark.parametrize("shape", ["tiny", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("chunks", "pad"),
    [([(8000, 1)], 0), ([(0, 1), (3, 1), (130, 1), (511, 1), (4095, 1), (8191, 1), (77, 1)], 1),
     ([(0, 40), (300, 1), (200, 150)], 2)],
)  # fmt: skip
@torch.inference_mode()
def test_sparse_attention_equals_the_torch_path(attention_models, shape, dtype, chunks, pad):
    triton_v4_attention = triton_module("v4_attention")
    model = attention_models[shape]
    gen = torch.Generator().manual_seed(len(chunks))
    fill = torch.Generator(device="cuda").manual_seed(len(chunks))
    block_size = 64
    width = -(-max(s + c for s, c in chunks) // block_size) + 1
    rows = step_rows(chunks, width, pad, gen)
    cache = make_kv_cache(
        model.config, len(chunks) * width + 2, block_size, dtype, "cuda", num_slots=len(chunks)
    )
    for layer in range(3):  # sliding, CSA, HCA
        attn, pages = model.model.layers[layer].self_attn, cache.layers[layer]
        for name in ("window", "entries"):
            if name in pages.flat:
                flat = pages.flat[name]
                flat.copy_(torch.randn(flat.shape, generator=fill, device="cuda"))
        n, heads, dim = rows.positions.shape[0], attn.heads, attn.dim
        q = torch.randn(n, heads, dim, generator=gen).to(dtype).cuda()
        kv = torch.randn(n, dim, generator=gen).to(dtype).cuda()
        back = rows.positions[:, None] - torch.arange(attn.window, device="cuda")
        window_rows = pages.batch_rows("window", rows.tables, back)
        entries, rate = None, 0
        if attn.compressor is not None:
            rate = attn.compressor.rate
            count = -(-width * block_size // rate)
            if attn.kind == HCA:
                read = torch.arange(count).expand(n, count)
            else:
                k = min(attn.compressor.indexer.topk, count)
                read = torch.stack([torch.randperm(count, generator=gen)[:k] for _ in range(n)])
            read = read.cuda()
            new = torch.randn(n, dim, generator=gen).to(dtype).cuda()
            entry_rows = pages.batch_entry_rows("entries", rows.tables, read)
            entries = (new, pages.flat["entries"], rows.tables, read)
        paging = (block_size, pages.pages["entries"].shape[1]) if entries else None
        call = (q, kv, pages.flat["window"], window_rows, entries, rate)
        call += (rows.positions, rows.start, rows.real, attn.sinks, attn.scale, paging)
        got = triton_v4_attention.sparse_attention(*call)
        # The torch form of `_attend` (ops.v4_sparse_attention would take the kernel on CUDA).
        keys = rows.chunk_or(kv, back, pages.take("window", window_rows))
        allowed = (back >= 0) & rows.real[:, None]
        if entries is not None:
            at = (read + 1) * rate - 1
            keys = torch.cat((keys, rows.chunk_or(new, at, pages.take("entries", entry_rows))), 1)
            closed = ((rows.positions + 1) // rate)[:, None]
            allowed = torch.cat((allowed, read < closed), dim=1)
        want = attn.attend_batched(q, keys, allowed)
        real = rows.real
        assert got.dtype == dtype and bool(torch.isfinite(got).all())
        assert bool((got[~real] == 0).all())
        assert relative(got[real], want[real]) < TOL[dtype], (attn.kind, relative(got, want))
        if attn.kind == HCA:  # every closed entry, walked through the tables in the kernel
            walked = (new, pages.flat["entries"], rows.tables, None)
            every = triton_v4_attention.sparse_attention(*call[:4], walked, *call[5:])
            assert bool((every[~real] == 0).all())
            assert relative(every[real], want[real]) < TOL[dtype], relative(every, want)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = triton_v4_attention.sparse_attention(*call)
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        graph.replay()
        assert torch.equal(captured, triton_v4_attention.sparse_attention(*call))


def torch_compress(comp, pages, prefix, projections, rows, rope) -> torch.Tensor:
    """`batched._compress`'s torch form on CUDA too (the fused kernels refused)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ops, "fuses_v4_compress", lambda *args: False)
        return batched._compress(comp, pages, prefix, projections, rows, rope)


def compressor_model(tmp_path, shape: str, dtype: torch.dtype):
    overrides = FLASH_ATTENTION if shape == "flash" else {"layer_types": [SLIDING, CSA, HCA, CSA]}
    path = make_tiny_v4(tmp_path / shape, seed=3, **overrides)
    return load_model(path, ModelParts.colocated(), str(dtype)[6:], "cuda", load_format="dummy")[0]


def check_compressors(model, rows, sequences, width, block_size, dtype, gen, must_close):
    """Each compressor (CSA's, its indexer's, HCA's) over `rows` (sequence i in slot i) from
    randomly filled pages: the entries of the closing rows (`must_close`: some row closes) and
    every page after the step but the scratch rows as `_compress`'s torch form, and the same
    replayed from a graph."""
    rope = model.ropes("cuda")["compress"]
    for layer, prefix in ((1, ""), (1, "index_"), (2, "")):
        comp = model.model.layers[layer].self_attn.compressor
        comp = comp.indexer if prefix else comp
        blocks = sequences * width + 2
        made = [
            make_kv_cache(model.config, blocks, block_size, dtype, "cuda", sequences)
            for _ in range(3)
        ]
        torch_pages, fused_pages, graph_pages = (cache.layers[layer] for cache in made)
        for name, flat in torch_pages.flat.items():
            flat.copy_(torch.randn(flat.shape, generator=gen).to(flat.dtype))
            fused_pages.flat[name].copy_(flat)
            graph_pages.flat[name].copy_(flat)
        x = torch.randn(rows.positions.shape[0], model.config.hidden_size, generator=gen)
        projections = projected(model, layer, prefix, x.to(dtype).cuda())
        want = torch_compress(comp, torch_pages, prefix, projections, rows, rope)
        got = batched._compress(comp, fused_pages, prefix, projections, rows, rope)
        closes = rows.real & ((rows.positions + 1) % comp.rate == 0)
        assert bool(closes.any()) or not must_close
        if bool(closes.any()):
            assert relative(got[closes], want[closes]) < TOL[dtype], (layer, prefix)
        for name, flat in torch_pages.flat.items():
            assert relative(fused_pages.flat[name][:-1], flat[:-1]) < TOL[dtype], (prefix, name)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # nothing runs: graph_pages keep the step's start
            captured = batched._compress(comp, graph_pages, prefix, projections, rows, rope)
        graph.replay()
        assert torch.equal(captured[closes], got[closes])
        for name, flat in fused_pages.flat.items():
            assert torch.equal(graph_pages.flat[name][:-1], flat[:-1]), name


@pytest.mark.parametrize("shape", ["tiny", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("chunks", "pad"),
    [([(0, 300), (130, 1), (61, 70), (4000, 200), (127, 1)], 2),
     ([(0, 1), (1, 600), (8191, 1)], 0)],
)  # fmt: skip
@torch.inference_mode()
def test_compressor_chunks_equal_the_torch_path(tmp_path, shape, dtype, chunks, pad):
    """Each compressor over prefill chunks beside decode rows (chunks from 0, inside a window,
    across block ends, longer than a ring) in the fused chunk form (three launches): the entries
    of the closing rows and every page after the step as `_compress`'s torch form; and replayed
    from a graph."""
    model = compressor_model(tmp_path, shape, dtype)
    gen = torch.Generator().manual_seed(len(chunks))
    block_size = 64
    width = -(-max(s + c for s, c in chunks) // block_size) + 1
    rows = step_rows(chunks, width, pad, gen)
    assert not rows.decode
    check_compressors(model, rows, len(chunks), width, block_size, dtype, gen, must_close=True)


@pytest.mark.parametrize("shape", ["tiny", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("count", [1, 7, 64])
@torch.inference_mode()
def test_compressor_decode_equals_the_torch_path(tmp_path, shape, dtype, count):
    """Each compressor (CSA's, its indexer's, HCA's) over a decode ubatch of `count` rows at
    positions that open, continue and close windows, two pad rows: the entries of the closing
    rows and every page after the step (the open rows in the slots too; but the scratch rows) as
    `_compress`'s torch form."""
    model = compressor_model(tmp_path, shape, dtype)
    gen = torch.Generator().manual_seed(count)
    block_size, width = 64, 40
    positions = torch.randint(0, width * block_size - 1, (count,), generator=gen)
    positions[: min(count, 3)] = torch.tensor([3, 0, 127])[: min(count, 3)]
    rows = step_rows([(int(p), 1) for p in positions], width, 2, gen)
    rows = dataclasses.replace(rows, decode=True)
    check_compressors(model, rows, count, width, block_size, dtype, gen, must_close=False)


@pytest.mark.parametrize("shape", ["tiny", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("chunks", "pad"),
    [([(8000, 1)], 0), ([(0, 1), (3, 1), (130, 1), (511, 1), (4095, 1), (8191, 1)], 1),
     ([(0, 40), (300, 1), (200, 150)], 2)],
)  # fmt: skip
@torch.inference_mode()
def test_index_scores_equal_the_torch_path(attention_models, shape, dtype, chunks, pad):
    """The CSA indexer's scores of every addressable entry (the same ones -inf, the others
    close; float32: the same top-k), eagerly and replayed from a graph."""
    triton_v4_indexer = triton_module("v4_indexer")
    model = attention_models[shape]
    indexer = model.model.layers[1].self_attn.compressor.indexer
    gen = torch.Generator().manual_seed(len(chunks))
    fill = torch.Generator(device="cuda").manual_seed(len(chunks))
    block_size = 64
    width = -(-max(s + c for s, c in chunks) // block_size) + 1
    rows = step_rows(chunks, width, pad, gen)
    cache = make_kv_cache(
        model.config, len(chunks) * width + 2, block_size, dtype, "cuda", num_slots=len(chunks)
    )
    pages = cache.layers[1]
    page = pages.flat["index_entries"]
    page.copy_(torch.randn(page.shape, generator=fill, device="cuda"))
    n = rows.positions.shape[0]
    x = torch.randn(n, model.config.hidden_size, generator=gen).to(dtype).cuda()
    q_residual = torch.randn(n, model.config.q_lora_rank, generator=gen).to(dtype).cuda()
    new = torch.randn(n, indexer.dim, generator=gen).to(dtype).cuda()
    rope = model.ropes("cuda")["compress"]
    # The queries of the float32 model, in the pages' dtype.
    q, weights = indexer.queries(x.float(), q_residual.float(), rope.at(rows.positions))
    q = q.to(dtype)
    count = -(-width * block_size // indexer.rate)
    every = torch.arange(count, device="cuda").expand(n, count)
    entry_rows = pages.batch_entry_rows("index_entries", rows.tables, every)
    call = (q, weights, new, page, entry_rows, indexer.rate, rows.positions, rows.start)
    call += (None, 1.0, indexer.weight_scale)  # bf16 pages; the heads' weight scale
    got = triton_v4_indexer.index_scores(*call)
    # The torch form of `_index_scores` (ops.v4_index_scores would take the kernel on CUDA).
    keys = rows.chunk_or(
        new, (every + 1) * indexer.rate - 1, pages.take("index_entries", entry_rows)
    )
    closed = ((rows.positions + 1) // indexer.rate)[:, None]
    want = indexer.score(q, weights, keys).masked_fill(every >= closed, float("-inf"))
    seen = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), seen)
    assert relative(got[seen], want[seen]) < 1e-5
    if dtype == torch.float32:
        assert torch.equal(indexer.ranked(got), indexer.ranked(want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_v4_indexer.index_scores(*call)
    q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
    graph.replay()
    assert torch.equal(captured, triton_v4_indexer.index_scores(*call))


@pytest.mark.parametrize("shape", ["tiny", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("chunks", "pad"),
    [([(8000, 1)], 0), ([(0, 1), (3, 1), (130, 1), (511, 1), (4095, 1), (8191, 1)], 1),
     ([(0, 40), (300, 1), (200, 150), (5000, 300)], 2)],
)  # fmt: skip
@torch.inference_mode()
def test_index_select_keeps_the_torch_top_k(attention_models, shape, dtype, chunks, pad):
    """The CSA indexer's top-k (v4_index_select.py: scored up to each row's position, radix
    select) against `Indexer.ranked` over the torch scores: float32 the same entries, bf16 the
    same count of visible entries whose scores reach the torch k-th best (up to rounding);
    the scores in row chunks of a small scratch give the same; replayed from a graph."""
    triton_select = triton_module("v4_index_select")
    model = attention_models[shape]
    indexer = model.model.layers[1].self_attn.compressor.indexer
    gen = torch.Generator().manual_seed(len(chunks))
    fill = torch.Generator(device="cuda").manual_seed(len(chunks))
    block_size = 64
    width = -(-max(s + c for s, c in chunks) // block_size) + 1
    rows = step_rows(chunks, width, pad, gen)
    cache = make_kv_cache(
        model.config, len(chunks) * width + 2, block_size, dtype, "cuda", num_slots=len(chunks)
    )
    pages = cache.layers[1]
    page = pages.flat["index_entries"]
    page.copy_(torch.randn(page.shape, generator=fill, device="cuda"))
    n = rows.positions.shape[0]
    x = torch.randn(n, model.config.hidden_size, generator=gen).to(dtype).cuda()
    q_residual = torch.randn(n, model.config.q_lora_rank, generator=gen).to(dtype).cuda()
    new = torch.randn(n, indexer.dim, generator=gen).to(dtype).cuda()
    rope = model.ropes("cuda")["compress"]
    q, weights = indexer.queries(x.float(), q_residual.float(), rope.at(rows.positions))
    q = q.to(dtype)
    count = -(-width * block_size // indexer.rate)
    every = torch.arange(count, device="cuda").expand(n, count)
    entry_rows = pages.batch_entry_rows("index_entries", rows.tables, every)
    keys = rows.chunk_or(
        new, (every + 1) * indexer.rate - 1, pages.take("index_entries", entry_rows)
    )
    closed = torch.where(rows.real, (rows.positions + 1) // indexer.rate, 0)
    scores = indexer.score(q, weights, keys).masked_fill(every >= closed[:, None], float("-inf"))
    tables = (rows.tables, block_size, pages.pages["index_entries"].shape[1])
    call = (q, weights, new, page, tables, indexer.rate)
    call += ((rows.positions, rows.start, rows.real), indexer.topk)
    call += (None, 1.0, indexer.weight_scale)  # bf16 pages; the heads' weight scale
    got = triton_select.index_select(*call)
    visible = got < closed[:, None]
    assert torch.equal(visible.sum(1), closed.clamp(max=indexer.topk))
    assert bool((got[~visible] == count).all())
    if dtype == torch.float32:
        want = indexer.ranked(scores)
        want = torch.where(want < closed[:, None], want, count).sort(dim=1).values
        assert torch.equal(got[:, : want.shape[1]], want)
    else:
        kth = scores.sort(dim=1, descending=True).values[:, : indexer.topk].amin(1)
        kept = scores.gather(1, got.clamp(max=count - 1)).masked_fill(~visible, float("inf"))
        low = kept.amin(1)
        slack = 1e-2 * scores.masked_fill(~torch.isfinite(scores), 0).abs().amax(1)
        assert bool((low >= kth - slack).all())
    old = triton_select.SCORE_ELEMENTS
    triton_select.SCORE_ELEMENTS = 3 * count  # three rows of scores at a time
    try:
        assert torch.equal(triton_select.index_select(*call), got)
    finally:
        triton_select.SCORE_ELEMENTS = old
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_select.index_select(*call)
    graph.replay()
    assert torch.equal(captured, got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 64])
@pytest.mark.parametrize(
    ("use", "heads", "dim"),
    [("q", 64, 512), ("kv", 1, 512), ("q_residual", 1, 1024), ("index_q", 64, 128),
     ("output", 64, 512), ("q", 4, 16)],
)  # fmt: skip
@torch.inference_mode()
def test_norm_rope_equals_the_torch_forms(use, heads, dim, rows, dtype):
    """Each use of V4's per-head norm and rotary at V4-Flash's shapes (64 rotated dims) and the
    tiny one's, eagerly and replayed from a graph."""
    triton_v4_norm_rope = triton_module("v4_norm_rope")
    gen = torch.Generator().manual_seed(rows + dim)
    x = (torch.randn(rows, heads, dim, generator=gen) * 3).to(dtype).cuda()
    weight = (torch.rand(dim, generator=gen) + 0.5).cuda()
    angle = torch.rand(rows, 32 if dim > 16 else 4, generator=gen).cuda() * 5000
    cos_sin = (angle.cos() * 1.2, angle.sin() * 1.2)
    norm = {"q": (None, 1e-6), "kv": (weight, 1e-6), "q_residual": (weight, 1e-6)}.get(use)
    rotated = None if use == "q_residual" else cos_sin
    back = use == "output"
    want = x
    if norm is not None:
        want = unweighted_rms_norm(x, 1e-6) if norm[0] is None else v4_rms_norm(x, weight, 1e-6)
    if rotated is not None:
        want = rope_tail(want, cos_sin[0], -cos_sin[1] if back else cos_sin[1])
    got = ops.v4_norm_rope(x, norm, rotated, back)
    assert got is not None and got.dtype == dtype
    assert relative(got, want) < (1e-6 if dtype == torch.float32 else 1e-2)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = triton_v4_norm_rope.norm_rope(x, norm, rotated, back)
    x.copy_(torch.randn(x.shape, generator=gen).to(dtype))
    graph.replay()
    assert torch.equal(captured, triton_v4_norm_rope.norm_rope(x, norm, rotated, back))


@torch.inference_mode()
def test_norm_rope_past_2_31_elements():
    """V4-Flash's q at 65600 rows (64 heads of 512: 2^31 elements and 64 rows more, 4.3 GB):
    the last rows' norm and rotary equal those rows' alone, where 32-bit offsets would wrap."""
    rows, heads, dim = 2**31 // (64 * 512) + 64, 64, 512
    gen = torch.Generator().manual_seed(5)
    tail = (torch.randn(64, heads, dim, generator=gen) * 3).bfloat16().cuda()
    angle = torch.rand(rows, 32, generator=gen).cuda() * 5000
    x = torch.zeros(rows, heads, dim, dtype=torch.bfloat16, device="cuda")
    x[-64:] = tail
    got = ops.v4_norm_rope(x, (None, 1e-6), (angle.cos(), angle.sin()))
    want = ops.v4_norm_rope(tail, (None, 1e-6), (angle[-64:].cos(), angle[-64:].sin()))
    assert torch.equal(got[-64:], want)
    assert not got[:-64].any()


FP8 = torch.float8_e4m3fn


def fp8_cache(model, blocks: int, block_size: int, slots: int, gen: torch.Generator):
    """An FP8 cache (e4m3 "kv" pages beside their bf16 rotated channels, bf16 state) at scale
    0.5 (the kernels must honour it), every page filled with random rows."""
    cache = make_kv_cache(model.config, blocks, block_size, FP8, "cuda", num_slots=slots)
    for pages in cache.layers:
        pages.scale = 0.5
        for flat in pages.flat.values():
            flat.copy_(torch.randn(flat.shape, generator=gen).to(flat.dtype))
    return cache


@pytest.mark.parametrize("shape", ["tiny", "flash"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("chunks", "pad"),
    [([(0, 1), (3, 1), (130, 1), (511, 1), (4095, 1), (8191, 1), (77, 1)], 1),
     ([(0, 40), (300, 1), (200, 150)], 2)],
)  # fmt: skip
@torch.inference_mode()
def test_fp8_pages_attention_equals_the_torch_path(attention_models, shape, dtype, chunks, pad):
    """batched._attend over an FP8 cache takes the fused kernel (the e4m3 pages widened in it)
    and gives the torch form's attention over the same pages (`LayerPages.take` widening them):
    the window, CSA's selected entries and HCA's every closed entry (walked through the tables);
    replayed from a graph."""
    triton_v4_attention = triton_module("v4_attention")
    model = attention_models[shape]
    gen = torch.Generator().manual_seed(len(chunks))
    block_size = 64
    width = -(-max(s + c for s, c in chunks) // block_size) + 1
    rows = step_rows(chunks, width, pad, gen)
    cache = fp8_cache(model, len(chunks) * width + 2, block_size, len(chunks), gen)
    for layer in range(3):  # sliding, CSA, HCA
        attn, pages = model.model.layers[layer].self_attn, cache.layers[layer]
        n, heads, dim = rows.positions.shape[0], attn.heads, attn.dim
        q = torch.randn(n, heads, dim, generator=gen).to(dtype).cuda()
        kv = pages.as_stored(torch.randn(n, dim, generator=gen).to(dtype).cuda())
        assert triton_v4_attention.supports(q, kv, pages.flat["window"], pages.flat["window_rope"])
        back = rows.positions[:, None] - torch.arange(attn.window, device="cuda")
        window_rows = pages.batch_rows("window", rows.tables, back)
        keys = rows.chunk_or(kv, back, pages.take("window", window_rows, dtype))
        allowed = (back >= 0) & rows.real[:, None]
        selected = None
        if attn.compressor is not None:
            rate = attn.compressor.rate
            count = -(-width * block_size // rate)
            if attn.kind == HCA:
                read = torch.arange(count).expand(n, count)
            else:
                k = min(attn.compressor.indexer.topk, count)
                read = torch.stack([torch.randperm(count, generator=gen)[:k] for _ in range(n)])
            read = read.cuda()
            new = pages.as_stored(torch.randn(n, dim, generator=gen).to(dtype).cuda())
            selected = (None if attn.kind == HCA else read, new)
            entry_rows = pages.batch_entry_rows("entries", rows.tables, read)
            at = (read + 1) * rate - 1
            stored = pages.take("entries", entry_rows, dtype)
            keys = torch.cat((keys, rows.chunk_or(new, at, stored)), 1)
            closed = ((rows.positions + 1) // rate)[:, None]
            allowed = torch.cat((allowed, read < closed), dim=1)
        want = attn.attend_batched(q, keys, allowed)
        call = (attn, pages, q, kv, rows, window_rows, selected)
        got = batched._attend(*call)
        real = rows.real
        assert got.dtype == dtype and bool(torch.isfinite(got).all())
        assert bool((got[~real] == 0).all())
        assert relative(got[real], want[real]) < TOL[dtype], (attn.kind, relative(got, want))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = batched._attend(*call)
        q.copy_(torch.randn(q.shape, generator=gen).to(dtype))
        graph.replay()
        assert torch.equal(captured, batched._attend(*call))


@pytest.mark.parametrize("shape", ["tiny", "flash"])
@pytest.mark.parametrize(
    ("chunks", "pad"),
    [([(0, 1), (3, 1), (130, 1), (511, 1), (4095, 1), (8191, 1)], 1),
     ([(0, 40), (300, 1), (200, 150), (5000, 300)], 2)],
)  # fmt: skip
@torch.inference_mode()
def test_fp8_pages_index_select_keeps_the_torch_top_k(attention_models, shape, chunks, pad):
    """batched._index_top over an FP8 cache takes the fused selection (the e4m3 index entries
    widened in the kernel) and keeps, in float32, the entries `Indexer.ranked` keeps over the
    torch scores of the same pages; so do the fused scores (batched._index_scores)."""
    triton_select = triton_module("v4_index_select")
    model = attention_models[shape]
    indexer = model.model.layers[1].self_attn.compressor.indexer
    gen = torch.Generator().manual_seed(len(chunks))
    block_size = 64
    width = -(-max(s + c for s, c in chunks) // block_size) + 1
    rows = step_rows(chunks, width, pad, gen)
    pages = fp8_cache(model, len(chunks) * width + 2, block_size, len(chunks), gen).layers[1]
    n = rows.positions.shape[0]
    x = torch.randn(n, model.config.hidden_size, generator=gen).cuda()
    q_residual = torch.randn(n, model.config.q_lora_rank, generator=gen).cuda()
    new = pages.as_stored(torch.randn(n, indexer.dim, generator=gen).cuda())
    rope = model.ropes("cuda")["compress"]
    q, weights = indexer.queries(x, q_residual, rope.at(rows.positions))
    page, rope_page = pages.flat["index_entries"], pages.flat["index_entries_rope"]
    assert triton_select.supports(q, new, page, indexer.topk, rope_page)
    count = -(-width * block_size // indexer.rate)
    every = torch.arange(count, device="cuda").expand(n, count)
    entry_rows = pages.batch_entry_rows("index_entries", rows.tables, every)
    stored = pages.take("index_entries", entry_rows, torch.float32)
    keys = rows.chunk_or(new, (every + 1) * indexer.rate - 1, stored)
    closed = torch.where(rows.real, (rows.positions + 1) // indexer.rate, 0)
    scores = indexer.score(q, weights, keys).masked_fill(every >= closed[:, None], float("-inf"))
    want = indexer.ranked(scores)
    want = torch.where(want < closed[:, None], want, count).sort(dim=1).values
    got = batched._index_top(indexer, pages, x, q_residual, rows, rope, new)
    assert torch.equal(got[:, : want.shape[1]], want)
    fused = batched._index_scores(indexer, pages, x, q_residual, rows, rope, new)
    assert torch.equal(torch.isfinite(fused), torch.isfinite(scores))
    seen = torch.isfinite(scores)
    assert relative(fused[seen], scores[seen]) < 1e-5


@pytest.mark.parametrize("shape", ["tiny", "flash"])
@pytest.mark.parametrize("count", [1, 7, 64])
@torch.inference_mode()
def test_fp8_pages_compressor_decode_equals_the_torch_path(tmp_path, shape, count):
    """A bf16 model's decode compressors over an FP8 cache take the fused update (the entries
    quantized to e4m3 in the kernel, their rotated channels bf16) and leave the pages the torch
    form leaves (an element may land one e4m3 step apart where the bf16 pooling rounds
    differently: a loose norm bound, which a misplaced channel or scale far exceeds); the pooled
    entries come back as the page gives them."""
    overrides = FLASH_ATTENTION if shape == "flash" else {"layer_types": [SLIDING, CSA, HCA, CSA]}
    path = make_tiny_v4(tmp_path / shape, seed=3, **overrides)
    model = load_model(path, ModelParts.colocated(), "bfloat16", "cuda", load_format="dummy")[0]
    gen = torch.Generator().manual_seed(count)
    block_size, width = 64, 40
    positions = torch.randint(0, width * block_size - 1, (count,), generator=gen)
    positions[: min(count, 3)] = torch.tensor([3, 0, 127])[: min(count, 3)]
    rows = step_rows([(int(p), 1) for p in positions], width, 2, gen)
    rows = dataclasses.replace(rows, decode=True)
    rope = model.ropes("cuda")["compress"]
    rope_dim = 2 * rope.inv_freq.shape[0]
    for layer, prefix in ((1, ""), (1, "index_"), (2, "")):
        comp = model.model.layers[layer].self_attn.compressor
        comp = comp.indexer if prefix else comp
        torch_pages = fp8_cache(model, count * width + 2, block_size, count, gen).layers[layer]
        fused_pages = make_kv_cache(model.config, count * width + 2, block_size, FP8, "cuda", count)
        fused_pages = fused_pages.layers[layer]
        fused_pages.scale = torch_pages.scale
        for name, flat in torch_pages.flat.items():
            fused_pages.flat[name].copy_(flat)
        x = torch.randn(rows.positions.shape[0], model.config.hidden_size, generator=gen)
        projections = projected(model, layer, prefix, x.to(torch.bfloat16).cuda())
        open_kv = fused_pages.flat[f"{prefix}open_kv"]
        assert ops.fuses_v4_compress(projections[0], open_kv, comp.dim, rope_dim)
        want = torch_compress(comp, torch_pages, prefix, projections, rows, rope)
        got = batched._compress(comp, fused_pages, prefix, projections, rows, rope)
        closes = rows.real & ((rows.positions + 1) % comp.rate == 0)
        if bool(closes.any()):
            assert relative(got[closes], want[closes]) < 3e-2, (layer, prefix)
            assert torch.equal(got[closes], fused_pages.as_stored(got[closes]))
        for name, flat in torch_pages.flat.items():
            if flat.numel():
                g, w = fused_pages.flat[name][:-1].float(), flat[:-1].float()
                assert relative(g, w) < 3e-2, (prefix, name, relative(g, w))
