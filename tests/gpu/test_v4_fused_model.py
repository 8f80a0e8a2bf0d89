"""DeepSeek-V4's fused CUDA paths in the model (tests/gpu/test_v4_fused.py holds each kernel to
its torch form): the tiny V4's logits through the engine's layer loop (a prefill step, then
decode steps with pad rows) on CUDA, every fused launch counted, against the same loop on CPU (the
torch path), float32; and a decode step captured whole against the eager one."""

from __future__ import annotations

import copy

import pytest
import torch

from afdserve.engine.kv_cache import make_kv_cache
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.parts import ModelParts
from tests.gpu.test_v4_fused import triton_module
from tests.model.test_deepseek_v4_batched import forward

pytestmark = pytest.mark.gpu


def engine_steps(model, device: str) -> list[torch.Tensor]:
    """The engine's layer loop (tests/model/test_deepseek_v4_batched.forward) over a prefill step
    of four sequences, then three decode steps of them with two pad rows -> logits per step;
    the same ids whatever the device."""
    block_size, lengths = 4, (1, 5, 9, 14)
    gen = torch.Generator().manual_seed(4)
    tables = torch.randperm(4 * 8, generator=gen).view(4, 8).to(device)
    cache = make_kv_cache(model.config, 4 * 8, block_size, torch.float32, device, num_slots=4)
    logits, row, segments = [], 0, []
    for i, n in enumerate(lengths):
        segments.append(Segment(row, row + n, tables[i], n, i))  # sequence i in slot i
        row += n
    positions = torch.cat([torch.arange(n) for n in lengths])
    ids = torch.randint(0, 256, (row,), generator=gen)
    for step in range(4):
        meta = AttentionMetadata(
            positions.to(device),
            torch.zeros(positions.shape[0], dtype=torch.int64, device=device),
            tuple(segments),
            batch_segments(tuple(segments), torch.device(device)),
        )
        logits.append(forward(model, cache, ids.to(device), meta).cpu())
        context = [n + step + 1 for n in lengths]
        segments = [Segment(i, i + 1, tables[i], c + 1, i) for i, c in enumerate(context)]
        positions = torch.tensor(context + [0, 0])
        ids = torch.randint(0, 256, (6,), generator=gen)
    return logits


@torch.inference_mode()
def test_tiny_v4_logits_fused_on_cuda_equal_the_torch_path(tmp_path, monkeypatch):
    triton_mhc, triton_v4_attention = triton_module("mhc"), triton_module("v4_attention")
    triton_v4_compress, triton_v4_select = (
        triton_module("v4_compress"),
        triton_module("v4_index_select"),
    )
    triton_v4_norm_rope = triton_module("v4_norm_rope")
    triton_v4_addresses = triton_module("v4_addresses")
    path = make_tiny_v4(tmp_path / "tiny", seed=2)
    cpu = load_model(path, ModelParts.colocated(), "float32")[0]
    cuda = load_model(path, ModelParts.colocated(), "float32", "cuda")[0]
    calls = {"mhc": 0, "attention": 0, "compress": 0, "index": 0, "norm_rope": 0, "addresses": 0}

    def counted(name, fn):
        def wrapped(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(triton_mhc, "hyper_connection", counted("mhc", triton_mhc.hyper_connection))
    monkeypatch.setattr(
        triton_v4_attention,
        "sparse_attention",
        counted("attention", triton_v4_attention.sparse_attention),
    )
    monkeypatch.setattr(
        triton_v4_compress,
        "compress",
        counted("compress", triton_v4_compress.compress),
    )
    monkeypatch.setattr(
        triton_v4_select, "index_select", counted("index", triton_v4_select.index_select)
    )
    monkeypatch.setattr(
        triton_v4_norm_rope, "norm_rope", counted("norm_rope", triton_v4_norm_rope.norm_rope)
    )
    monkeypatch.setattr(
        triton_v4_addresses, "addresses", counted("addresses", triton_v4_addresses.addresses)
    )
    triton_step_rows, triton_rotary = triton_module("step_rows"), triton_module("rotary")
    shared = {"rows": 0, "window_rows": 0, "cos_sin": 0}  # what a ubatch builds for its layers

    def counted_shared(name, fn):
        def wrapped(*args, **kwargs):
            shared[name] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(
        triton_step_rows, "step_rows", counted_shared("rows", triton_step_rows.step_rows)
    )
    monkeypatch.setattr(
        triton_step_rows, "window_rows", counted_shared("window_rows", triton_step_rows.window_rows)
    )
    monkeypatch.setattr(triton_rotary, "cos_sin", counted_shared("cos_sin", triton_rotary.cos_sin))
    want, got = engine_steps(cpu, "cpu"), engine_steps(cuda, "cuda")
    assert all(shared.values()), shared  # none fell back to its torch form
    # The compressors' addresses: once per page layout and step (layers of one layout share).
    assert 0 < calls.pop("addresses") <= calls["compress"]
    layers = cuda.config.num_layers
    # Of 4 steps: every mHC site, attention and indexer (2 CSA layers), 4 norm-rotaries a layer
    # and the indexer's, the compressors (CSA 2, HCA 1; the prefill step's in chunk form).
    fused = {"mhc": 2 * layers * 4, "attention": layers * 4, "index": 2 * 4}
    fused |= {"compress": 5 * 4, "norm_rope": (4 * layers + 2) * 4}
    assert calls == fused
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4 * float(w.abs().max()), rtol=0.0, msg=str(step))
        real = slice(0, 4) if step else slice(None)
        assert g[real].argmax(-1).tolist() == w[real].argmax(-1).tolist()


@torch.inference_mode()
def test_tiny_v4_decode_step_replays_from_a_graph(tmp_path):
    """A decode step captured whole (both mHC sites and the attention of every layer, the pages
    written inside) replays to the eager step's logits from the same cache state."""
    path = make_tiny_v4(tmp_path / "tiny", seed=2)
    model = load_model(path, ModelParts.colocated(), "float32", "cuda")[0]
    gen = torch.Generator().manual_seed(5)
    tables = torch.randperm(4 * 8, generator=gen).view(4, 8).cuda()
    cache = make_kv_cache(model.config, 4 * 8, 4, torch.float32, "cuda", num_slots=4)
    lengths = (3, 6, 11, 17)
    for i, n in enumerate(lengths):  # each prompt alone
        meta = AttentionMetadata(
            torch.arange(n).cuda(),
            torch.zeros(n, dtype=torch.int64).cuda(),
            (Segment(0, n, tables[i], n, i),),
            batch_segments((Segment(0, n, tables[i], n, i),), torch.device("cuda")),
        )
        forward(model, cache, torch.randint(0, 256, (n,), generator=gen).cuda(), meta)
    segments = tuple(Segment(i, i + 1, tables[i], n + 1, i) for i, n in enumerate(lengths))
    meta = AttentionMetadata(
        torch.tensor(lengths + (0,)).cuda(),
        torch.zeros(5, dtype=torch.int64).cuda(),
        segments,
        batch_segments(segments, torch.device("cuda")),
    )
    ids = torch.randint(0, 256, (5,), generator=gen).cuda()
    warm, graph_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    forward(model, warm, ids, meta)  # compiles every kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = forward(model, graph_cache, ids, meta)
    want = forward(model, cache, ids, meta)
    graph.replay()
    torch.testing.assert_close(captured[:4], want[:4], atol=1e-5, rtol=0.0)
