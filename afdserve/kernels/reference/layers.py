"""Plain-torch reference kernels: the CPU path and the oracle every GPU fast path is tested against.

KV caches are paged: `cache[num_blocks, block_size, heads, dim]`; a sequence's token at position p
lives in slot `block_table[p // block_size] * block_size + p % block_size`. Slot -1 (pad rows)
writes nothing. An FP8 cache (`float8_e4m3fn`, kv_cache_dtype="fp8") holds x / scale, clamped to
the e4m3 range; reads give back fp8 * scale in the reader's dtype (`quantize_kv`, `dequantize_kv`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from afdserve.kernels.metadata import AttentionMetadata, QKVLayout

FP8_KV = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value: a cast past it gives NaN, so clamp first


@dataclass(frozen=True)
class ExpertGLU:
    """What gpt-oss's experts add to the SiLU-gated pair: biases of gate_up [experts, 2 * inter]
    (gate half first) and of down [experts, hidden], and the gate's sigmoid gain `alpha`
    (`swiglu`). The default adds nothing."""

    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    alpha: float | None = None

    def biases(self, expert: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        b13, b2 = self.gate_up_bias, self.down_bias
        return (None if b13 is None else b13[expert], None if b2 is None else b2[expert])

    @property
    def plain(self) -> bool:
        return self.gate_up_bias is None and self.down_bias is None and self.alpha is None


def quantize_kv(values: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """`values` as a cache of `dtype` stores them: a plain cast, or for FP8 x / scale in float32,
    clamped to +-448, cast (round to nearest even)."""
    if dtype != FP8_KV:
        return values.to(dtype)
    return (values.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_KV)


def dequantize_kv(cached: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached rows as the attention reads them: FP8 upcast to float32, times scale, in `dtype`
    (e4m3 values are exact in bf16, so with scale 1.0 nothing rounds); any other cache as is."""
    if cached.dtype != FP8_KV:
        return cached
    return (cached.float() * scale).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotary embedding. x [rows, heads, dim]; cos/sin [rows, dim / 2]. Pairs (x[i], x[i + dim/2]),
    or (x[2i], x[2i+1]) when interleaved (DeepSeek), whose output comes back de-interleaved: q and
    k get the same permutation, so their dot products are unchanged."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    # The half-rotation's own rounding: cos/sin laid out as cat(freqs, freqs), as in transformers.
    return x * torch.cat((cos, cos), -1) + torch.cat((-x2, x1), -1) * torch.cat((sin, sin), -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Statistics in float32; the normalised row is rounded to x's dtype before the weight."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the norm after it: (rms_norm(h + delta), h + delta)."""
    h = h + delta
    return rms_norm(h, weight, eps), h


def zero_centred_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * (1 + weight), in float32, rounded once to x's dtype (the Gated DeltaNet
    hybrids' norm: the weight is stored as gain - 1)."""
    f = x.float()
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return (f * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """rms_norm(x) (rounded to x's dtype, times the weight in its dtype), then times silu(z) in
    float32, rounded once to x's dtype (transformers' RMSNormGated)."""
    return (rms_norm(x, weight, eps) * torch.nn.functional.silu(z.float())).to(x.dtype)


def prepare_qkv(
    qkv: torch.Tensor,
    layout: QKVLayout,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """GQA's prologue on the packed projection: q/k norms (when given; per head, or over each
    row's whole q and k), rotary on q and k (on each head's first `rotary_width` channels), k and
    v into the cache (quantized with k_scale / v_scale when it is FP8). Returns q
    [rows, heads, head_dim]."""
    rows, d, lay = qkv.shape[0], layout.head_dim, layout
    q, k, v = qkv.split([lay.heads * d, lay.kv_heads * d, lay.kv_heads * d], dim=-1)
    if lay.q_norm is not None and lay.k_norm is not None and lay.norm_over_heads:
        q, k = rms_norm(q, lay.q_norm, lay.eps), rms_norm(k, lay.k_norm, lay.eps)
    q, k = q.reshape(rows, lay.heads, d), k.reshape(rows, lay.kv_heads, d)
    v = v.view(rows, lay.kv_heads, d)
    if lay.q_norm is not None and lay.k_norm is not None and not lay.norm_over_heads:
        q, k = rms_norm(q, lay.q_norm, lay.eps), rms_norm(k, lay.k_norm, lay.eps)
    q, k = _rotate_part(q, cos, sin, lay), _rotate_part(k, cos, sin, lay)
    write_kv(k_cache, k, slot_mapping, k_scale)
    write_kv(v_cache, v, slot_mapping, v_scale)
    return q


def _rotate_part(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: QKVLayout
) -> torch.Tensor:
    """`rotate` on each head's first rotary_width channels; the others pass through."""
    rot = layout.rotary_width
    if rot == x.shape[-1]:
        return rotate(x, cos, sin, layout.interleave)
    return torch.cat((rotate(x[..., :rot], cos, sin, layout.interleave), x[..., rot:]), dim=-1)


def write_kv(
    cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0
) -> None:
    """cache [blocks, block_size, *shape]; values [rows, *shape]; rows with slot -1 are skipped.
    `scale`: the FP8 cache's per-tensor scale (unused by any other cache)."""
    flat = cache.view(-1, *cache.shape[2:])
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        slot_mapping, values = slot_mapping[keep], values[keep]
    stored = quantize_kv(values, cache.dtype, scale)
    if cache.dtype == FP8_KV:  # torch's CPU index_copy_ has no float8 kernel: copy the bytes
        flat, stored = flat.view(torch.uint8), stored.view(torch.uint8)
    flat.index_copy_(0, slot_mapping, stored)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, length: int, first: int = 0
) -> torch.Tensor:
    """One sequence's cached tokens at positions [first, length): [length - first, *shape]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    skipped = first // block_size
    blocks = cache[block_table[skipped:num_blocks].long()].flatten(0, 1)
    return blocks[first - skipped * block_size : length - skipped * block_size]


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """q [rows, heads, dk] are the last `rows` positions of k/v [ctx, kv_heads, d].
    Returns [rows, heads, dv]. `sinks` [heads]: a learned logit per head in the softmax's
    denominator (gpt-oss), whose share of the mass goes to no value. `window`: a query at
    position p sees keys p - window < j <= p only (a sliding-window layer)."""
    rows, heads, ctx = q.shape[0], q.shape[1], k.shape[0]
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, dk]
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, ctx, dv]
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # [heads, rows, ctx]
    query_pos = torch.arange(ctx - rows, ctx, device=q.device)[:, None]
    key_pos = torch.arange(ctx, device=q.device)[None, :]
    mask = key_pos > query_pos
    if window is not None:
        mask = mask | (key_pos <= query_pos - window)
    scores = scores.masked_fill(mask, float("-inf"))
    if sinks is None:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v).transpose(0, 1)  # [rows, heads, dv]
    sink = sinks.to(scores.dtype)[:, None, None].expand(-1, rows, 1)
    probs = F.softmax(torch.cat((scores, sink), dim=-1), dim=-1, dtype=torch.float32)
    return torch.matmul(probs[..., :-1].to(q.dtype), v).transpose(0, 1)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    sinks: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of every segment's rows over its cached context (prefill, chunked prefill and
    decode alike). q [rows, heads, dk]; the new rows' KV must already be written. Pad rows come
    out zero. An FP8 cache is read dequantized (`dequantize_kv`) with k_scale / v_scale.
    `sinks`, `window`: as `causal_attention`'s; with a window only the keys the segment's first
    row can see are read."""
    out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    for seg in meta.segments:
        first = 0
        if window is not None:
            first = max(0, seg.context_len - seg.num_rows - window + 1)
        k = gather_kv(k_cache, seg.block_table, seg.context_len, first)
        v = gather_kv(v_cache, seg.block_table, seg.context_len, first)
        k, v = dequantize_kv(k, k_scale, q.dtype), dequantize_kv(v, v_scale, q.dtype)
        out[seg.row_start : seg.row_end] = causal_attention(
            q[seg.row_start : seg.row_end], k, v, scale, sinks, window
        )
    return out


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None = None, alpha: float | None = None
) -> torch.Tensor:
    """silu(gate) * up; with `limit` (DeepSeek-V4's swiglu_limit) gate is clamped from above and
    up on both sides first. With `alpha` (gpt-oss) the gate's sigmoid has that gain and up is
    offset by one: gate * sigmoid(alpha * gate) * (up + 1), after the same clamps."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    if alpha is not None:
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return F.silu(gate) * up


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float | None = None,
    glu: ExpertGLU | None = None,
) -> torch.Tensor:
    """Routed experts, SiLU-gated (clamped at `limit` when given). x [rows, hidden];
    topk_ids/weights [rows, k]; gate_up [experts, 2 * inter, hidden]; down [experts, hidden,
    inter]. -> [rows, hidden]. A pair with id -1 goes to no expert (pad rows, experts another
    rank holds). `glu`: gpt-oss's biases and sigmoid gain."""
    return routed_experts(
        x,
        topk_ids,
        topk_weights,
        gate_up.shape[0],
        lambda expert: (gate_up[expert], down[expert]),
        limit,
        glu=glu,
    )


def routed_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    weights_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    limit: float | None = None,
    operand: Callable[[torch.Tensor], torch.Tensor] | None = None,
    glu: ExpertGLU | None = None,
) -> torch.Tensor:
    """`moe_experts` with each expert's (gate_up, down) from `weights_of(expert)`, asked only for
    the experts some row is routed to (the FP8 path dequantizes them there, one at a time).
    `operand`: applied to the left operand of both GEMMs (w8a8's activation quantization)."""
    glu = glu or ExpertGLU()
    operand = operand or (lambda t: t)
    out = torch.zeros_like(x)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    # Shifted by one so that id -1 counts (and sorts) first; its pairs are skipped.
    counts = torch.bincount(flat_ids + 1, minlength=num_experts + 1).tolist()
    token_of = order // topk_ids.shape[1]
    start = counts[0]
    for expert, count in enumerate(counts[1:]):
        if count == 0:
            continue
        picks = order[start : start + count]
        tokens = token_of[start : start + count]
        start += count
        w13, w2 = weights_of(expert)
        b13, b2 = glu.biases(expert)
        gate, up = F.linear(operand(x[tokens]), w13, b13).chunk(2, dim=-1)
        y = F.linear(operand(swiglu(gate, up, limit, glu.alpha)), w2, b2)
        weight = topk_weights.reshape(-1)[picks].unsqueeze(-1)
        out.index_add_(0, tokens, (y * weight).to(out.dtype))
    return out


def moe_experts_dense(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float | None = None,
    glu: ExpertGLU | None = None,
) -> torch.Tensor:
    """`moe_experts` with no host sync (CUDA-graph capturable in any dtype): every expert runs
    over every row and rows it does not serve get weight 0. Accumulates per row in expert order,
    like `moe_experts`. Costs experts x rows: for graphs of small float32 models only."""
    glu = glu or ExpertGLU()
    rows, experts = x.shape[0], gate_up.shape[0]
    weights = torch.zeros(rows, experts + 1, dtype=topk_weights.dtype, device=x.device)
    weights.scatter_(1, topk_ids + 1, topk_weights)  # [rows, 1 + experts]; column 0: id -1
    weights = weights[:, 1:]
    out = torch.zeros_like(x)
    for expert in range(experts):
        b13, b2 = glu.biases(expert)
        gate, up = F.linear(x, gate_up[expert], b13).chunk(2, dim=-1)
        y = F.linear(swiglu(gate, up, limit, glu.alpha), down[expert], b2)
        out += (y * weights[:, expert : expert + 1]).to(out.dtype)
    return out
