"""DSA kernel cases shared by the interpreter test (tests/kernels/test_dsa_interpret.py) and the
GPU test (tests/gpu/test_dsa.py): real DSA layers of chosen sizes, steps over shuffled block
tables, and the checks of a selection and a sparse attention against the torch path
(`select_per_segment`, `DSAAttention._attend_reference`). The kernels come in as callables with
`ops.dsa_select` / `ops.dsa_sparse_mla`'s signatures, so nothing here imports Triton."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.kernels.ops import dequantize_kv
from afdserve.model.families import family_of, parse_model_config
from afdserve.model.families.deepseek_v4.batched import StepRows
from afdserve.model.families.dsa.attention import DSAAttention
from afdserve.model.families.dsa.indexer import Indexer, select_batched, select_per_segment, take

FP8 = torch.float8_e4m3fn
Select = Callable[..., torch.Tensor]


def dsa_layer(device: str = "cpu", **sizes: int) -> DSAAttention:
    """A DeepSeek-V3.2 attention layer with its indexer, random weights, of `sizes`."""
    raw = json.loads(json.dumps(family_of("deepseek_v32").presets["deepseek-v3.2"]))
    raw.update(hidden_size=64, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, **sizes)
    raw["num_key_value_heads"] = raw["num_attention_heads"]
    return DSAAttention(parse_model_config(raw), 0).to(device)


def step_metadata(
    chunks: list[tuple[int, int]], pad: int, block_size: int, blocks: int, gen, device: str
) -> AttentionMetadata:
    """chunks: (context, rows) per sequence; its block table a slice of a shuffled order."""
    order = torch.randperm(blocks, generator=gen).to(device)
    width = max(-(-c // block_size) for c, _ in chunks)
    segments, positions, row = [], [], 0
    for i, (context, count) in enumerate(chunks):
        segments.append(Segment(row, row + count, order[i * width : (i + 1) * width], context))
        positions += list(range(context - count, context))
        row += count
    positions_t = torch.tensor(positions + [0] * pad, device=device)
    segments_t = tuple(segments)
    slots = torch.full_like(positions_t, -1)
    return AttentionMetadata(positions_t, slots, segments_t, batch_segments(segments_t, device))


def _keys(shape: tuple[int, ...], dtype: torch.dtype, gen) -> torch.Tensor:
    keys = torch.randn(shape, generator=gen)
    flat = keys.view(-1, shape[-1])
    flat[1::7] = 0.0  # zero keys: every head's dot 0: exact ties at score 0 in any order
    flat[::5] = flat[3]  # every fifth slot a copy of slot 3: equal scores up to summation order
    return keys.to(dtype)


def check_selection(
    attn: DSAAttention,
    chunks: list[tuple[int, int]],
    pad: int,
    dtype: torch.dtype,
    block_size: int,
    seed: int,
    select: Select,
    device: str = "cpu",
    q_dtype: torch.dtype = torch.float16,
    negative: bool = False,
) -> tuple:
    """The kernel keeps as many slots as the torch path per row, distinct, and every slot only
    one of them keeps ties (up to rounding) the lowest the torch path keeps; with `negative`
    head weights the zero keys tie exactly at the top, the earliest must win: the sets equal."""
    gen = torch.Generator().manual_seed(seed)
    indexer = attn.indexer
    blocks = len(chunks) * -(-max(c for c, _ in chunks) // block_size) + 3
    keys = _keys((blocks, block_size, 1, indexer.dim), dtype, gen).to(device)
    meta = step_metadata(chunks, pad, block_size, blocks, gen, device)
    rows = meta.num_rows
    q_dtype = torch.float32 if dtype == torch.float32 else q_dtype
    q = torch.randn(rows, indexer.heads, indexer.dim, generator=gen).to(device, q_dtype)
    w = torch.randn(rows, indexer.heads, generator=gen).to(device)
    w = -w.abs() if negative else w
    want = select_per_segment(indexer, q, w, keys, meta)
    r = StepRows.of(meta)
    got = select(q, w, keys, (r.tables, r.positions, r.real), indexer.topk, indexer.scale)
    label = (indexer.heads, indexer.dim, indexer.topk, chunks, pad, dtype, block_size, negative)
    tol = 1e-5 if dtype == torch.float32 else 1e-3
    assert_same_selection(indexer, q, w, keys, got, want, tol, label, exact=negative)
    return label


def assert_same_selection(
    indexer: Indexer,
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    got: torch.Tensor,
    want: torch.Tensor,
    tol: float,
    label: object,
    exact: bool = False,
) -> None:
    """got (the kernel's) and want (the torch path's) slots [rows, topk] of the same q, w over
    the key pages `keys`: as many per row, distinct, and every slot only one of them keeps
    scores (up to `tol`) the lowest the torch path keeps; `exact`: the sets equal."""
    assert torch.equal((got >= 0).sum(1), (want >= 0).sum(1)), label
    flat = keys.view(-1, indexer.dim)
    same = torch.equal(got.sort(1).values, want.sort(1).values)
    for i in [] if same else range(got.shape[0]):
        kept, wanted = got[i][got[i] >= 0], want[i][want[i] >= 0]
        assert kept.unique().numel() == kept.numel(), label
        if not kept.numel():
            continue
        both = torch.cat((kept, wanted))
        cached = dequantize_kv(take(flat, both), 1.0, torch.float32).float()
        scores = indexer.scores(q[i : i + 1], w[i : i + 1], cached[None])[0].tolist()
        score_of = dict(zip(both.tolist(), scores, strict=True))
        lowest = min(score_of[s] for s in wanted.tolist())
        differ = set(kept.tolist()) ^ set(wanted.tolist())
        assert not (exact and differ), (label, i)
        assert all(abs(score_of[s] - lowest) <= tol * (1 + abs(lowest)) for s in differ), label


def exact_sparse_mla(
    q: torch.Tensor,
    cache: torch.Tensor,
    selected: torch.Tensor,
    latent: int,
    scale: float,
    k_scale: float,
) -> torch.Tensor:
    """`ops.dsa_sparse_mla`'s result in float64 from the same query and cached values (an FP8
    cache's dequantized): what both the kernel and the torch path round. -> [rows, heads,
    latent] float64, zeros for a row of none."""
    flat = cache.view(-1, cache.shape[-1])
    kv = dequantize_kv(take(flat, selected.clamp(min=0)), k_scale, torch.float32).double()
    scores = torch.einsum("rhd,rkd->rhk", q.double(), kv) * scale
    valid = (selected >= 0)[:, None, :]
    probs = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1)
    probs = probs.masked_fill(~valid, 0.0)
    return torch.einsum("rhk,rkl->rhl", probs, kv[..., :latent])


def check_attention(
    attn: DSAAttention,
    rows: int,
    blocks: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    attend: Select,
    device: str = "cpu",
    q_dtype: torch.dtype = torch.float16,
    tol: float = 2e-3,
) -> tuple:
    """The kernel's output against `_attend_reference`'s over random selections with -1
    anywhere, the last row selecting nothing (a pad row: zeros)."""
    gen = torch.Generator().manual_seed(seed)
    width = attn.kv_lora_rank + attn.rope
    q_dtype = torch.float32 if dtype == torch.float32 else q_dtype
    cache = torch.randn(blocks, block_size, 1, width, generator=gen).to(device, dtype)
    q = torch.randn(rows, attn.heads, width, generator=gen).to(device, q_dtype)
    topk = attn.indexer.topk
    selected = torch.randint(0, blocks * block_size, (rows, topk), generator=gen)
    selected[torch.rand(rows, topk, generator=gen) < 0.3] = -1
    selected[-1] = -1
    selected = selected.to(device)
    want = attn._attend_reference(q, cache, selected)
    got = attend(q, cache, selected, attn.kv_lora_rank, attn.scale, 1.0)
    label = (attn.heads, attn.kv_lora_rank, attn.rope, topk, rows, dtype)
    assert got.dtype == q.dtype and not bool(got[-1].any()), label
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err < (1e-5 if dtype == torch.float32 else tol), (label, err)
    return label


def shadowed(
    select_fast: Callable[..., torch.Tensor | None], attend: Select, attend_tol: float = 1e-2
) -> tuple[Callable[..., torch.Tensor | None], Select, dict[str, list[float]]]:
    """Wrappers of the model's kernel calls (indexer.py's `select_fast` as attention.py calls
    it, `ops.dsa_sparse_mla`) that check each call against its oracle on the very same
    inputs: the selection against the torch path's (`select_batched`: as many slots, differing
    only among ties up to rounding), the attention against `exact_sparse_mla` (relative error
    under `attend_tol`; the torch path itself rounds its scores to bf16). The model runs on the
    kernels' results; the dict collects each check (the attention's errors)."""
    seen: dict[str, list[float]] = {"select": [], "attend": []}

    def select(indexer, q, w, keys_cache, meta):
        got = select_fast(indexer, q, w, keys_cache, meta)
        assert got is not None, "the selection kernel did not run"
        want = select_batched(indexer, q, w, keys_cache, meta)
        assert_same_selection(indexer, q, w, keys_cache, got, want, 1e-3, "model step")
        seen["select"].append(0.0)
        return got

    def sparse_mla(q, cache, selected, latent, scale, k_scale):
        got = attend(q, cache, selected, latent, scale, k_scale)
        assert got is not None, "the attention kernel did not run"
        want = exact_sparse_mla(q, cache, selected, latent, scale, k_scale)
        err = float((got.double() - want).norm() / want.norm().clamp(min=1e-30))
        assert err < attend_tol, ("model step", err)
        seen["attend"].append(err)
        return got

    return select, sparse_mla, seen
