"""The kernels the model calls. Each name resolves to the plain-torch reference; a GPU fast path
replaces it only for CUDA tensors, and each fast path is compared against the reference in
tests/gpu/test_kernels.py. The fast modules import Triton, so they load on first CUDA use only.
The model reaches the kernels through this module and metadata.py alone: the weight formats and
the plain-torch pieces it uses as they are (no fast path) are re-exported here.
"""

from __future__ import annotations

import torch

from afdserve.kernels.metadata import AttentionMetadata, BatchedSegments, QKVLayout
from afdserve.kernels.reference import delta_chunked as reference_delta_chunked
from afdserve.kernels.reference import delta_rule as reference_delta_rule
from afdserve.kernels.reference import fp4, fp8
from afdserve.kernels.reference import layers as reference
from afdserve.kernels.reference.delta_rule import l2_normalize as l2_normalize
from afdserve.kernels.reference.delta_rule import recurrent_step as recurrent_step
from afdserve.kernels.reference.fp4 import FP4_BLOCK as FP4_BLOCK
from afdserve.kernels.reference.fp4 import as_bytes as as_bytes
from afdserve.kernels.reference.fp4 import e8m0_to_float as e8m0_to_float
from afdserve.kernels.reference.fp4 import quantize_fp4 as quantize_fp4
from afdserve.kernels.reference.fp4 import scale_problem as scale_problem
from afdserve.kernels.reference.fp8 import FP8_DTYPE as FP8_DTYPE
from afdserve.kernels.reference.fp8 import FP8_MAX as FP8_MAX
from afdserve.kernels.reference.fp8 import Fp8Rows as Fp8Rows
from afdserve.kernels.reference.fp8 import quantize_blockwise as quantize_blockwise
from afdserve.kernels.reference.fp8 import scale_grid as scale_grid
from afdserve.kernels.reference.layers import ExpertGLU as ExpertGLU
from afdserve.kernels.reference.layers import causal_attention as causal_attention
from afdserve.kernels.reference.layers import dequantize_kv as dequantize_kv
from afdserve.kernels.reference.layers import gather_kv as gather_kv
from afdserve.kernels.reference.layers import quantize_kv as quantize_kv


def _triton_ready(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    if _triton_ready(x):
        from afdserve.kernels.triton import rotary as triton_rotary

        return triton_rotary.rotate(x, cos, sin, interleave)
    return reference.rotate(x, cos, sin, interleave)


def swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float | None = None, alpha: float | None = None
) -> torch.Tensor:
    """silu(gate) * up (`reference.swiglu`: `limit` clamps first, `alpha` is gpt-oss's gain),
    on CUDA one launch (kernels/triton/swiglu.py) where there is no gain."""
    if alpha is None and _triton_ready(gate):
        from afdserve.kernels.triton import swiglu as triton_swiglu

        if triton_swiglu.supports(gate, up):
            return triton_swiglu.swiglu(gate, up, limit)
    return reference.swiglu(gate, up, limit, alpha)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if _triton_ready(x) and x.shape[-1] <= 16384:
        from afdserve.kernels.triton import norm as triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(
    h: torch.Tensor,
    delta: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    quantize: bool = False,
) -> tuple[torch.Tensor | fp8.Fp8Rows, torch.Tensor]:
    """(rms_norm(h + delta), h + delta): the residual add fused into the norm after it.
    `quantize` (where `quantizes_for_gemm(h, q, scale_inv, block)` holds): the normalised rows
    may come back as the w8a8 GEMM they feed takes them (fp8.Fp8Rows), from the same launch;
    they do where the norm's output has h's dtype (its weight's), else they come back as they
    are, for the GEMM to take as it would."""
    fits = h.dim() == 2 and h.shape == delta.shape and h.dtype == delta.dtype
    if fits and _triton_ready(h) and h.shape[-1] <= 16384:
        from afdserve.kernels.triton import norm as triton_norm

        if quantize and weight.dtype == h.dtype:
            return triton_norm.add_rms_norm_fp8(h, delta, weight, eps)
        return triton_norm.add_rms_norm(h, delta, weight, eps)
    return reference.add_rms_norm(h, delta, weight, eps)


def zero_centred_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x / rms(x) * (1 + weight), None); given `delta`, the residual add first: (the norm of
    x + delta, x + delta). One launch on CUDA."""
    if _triton_ready(x) and x.shape[-1] <= 16384 and (delta is None or delta.shape == x.shape):
        from afdserve.kernels.triton import norm as triton_norm

        return triton_norm.hybrid_norm(x, weight, eps, delta=delta)
    if delta is not None:
        x = x + delta
    return reference.zero_centred_rms_norm(x, weight, eps), None if delta is None else x


def gated_rms_norm(
    x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """rms_norm(x, weight) * silu(z), z shaped as x. One launch on CUDA."""
    if _triton_ready(x) and x.shape[-1] <= 16384 and z.shape == x.shape:
        from afdserve.kernels.triton import norm as triton_norm

        return triton_norm.hybrid_norm(x, weight, eps, z=z)[0]
    return reference.gated_rms_norm(x, z, weight, eps)


def quantizes_for_gemm(
    h: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> bool:
    """Whether `add_rms_norm(h, ..., quantize=True)` may feed the FP8 weight (q, scale_inv):
    the w8a8 GEMM takes h's rows from a quantize launch of their own there (past
    triton_fp8_w8a8.QUANTIZE_IN_GEMM_ROWS rows), which the norm then does instead."""
    if not (_triton_ready(h) and h.dim() == 2 and h.shape[-1] <= 16384):
        return False
    from afdserve.kernels.triton import fp8_w8a8 as triton_fp8_w8a8
    from afdserve.kernels.triton import fp8_weight_only as triton_fp8

    if not (triton_fp8.supports(h, q, scale_inv, block) and triton_fp8.w8a8(h.dtype)):
        return False
    return h.shape[0] > triton_fp8_w8a8.QUANTIZE_IN_GEMM_ROWS


def quantize_rows(x: torch.Tensor) -> fp8.Fp8Rows:
    """x's rows quantized for the w8a8 GEMM once, for several GEMMs of the same rows (where
    `quantizes_for_gemm` holds: each GEMM would quantize them again in a launch of its own)."""
    from afdserve.kernels.triton import fp8_w8a8 as triton_fp8_w8a8

    return fp8.Fp8Rows(*triton_fp8_w8a8.quantize_rows(x), x.dtype)


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
    """Norms + rotary + KV write of GQA's packed projection (see `reference.prepare_qkv`); the
    scales are an FP8 cache's (Python floats, so a captured graph holds them as constants)."""
    args = (qkv, layout, cos, sin, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    if _triton_ready(qkv):
        from afdserve.kernels.triton import qkv as triton_qkv

        if triton_qkv.supports(qkv, k_cache, v_cache, layout.head_dim, layout):
            return triton_qkv.prepare_qkv(*args)
    return reference.prepare_qkv(*args)


def write_kv(
    cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor, scale: float = 1.0
) -> None:
    if cache.is_contiguous() and _triton_ready(cache):
        from afdserve.kernels.triton import attention as triton_attention

        triton_attention.write_kv(cache, values, slot_mapping, scale)
        return
    reference.write_kv(cache, values, slot_mapping, scale)


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
    """`k_scale`/`v_scale`: an FP8 cache's per-tensor scales (ignored for other caches);
    `sinks` [heads] (a learned logit per head in the softmax's denominator) and `window` (a
    sliding-window layer's width): gpt-oss's (`reference.causal_attention`)."""
    args = (q, k_cache, v_cache, meta, scale, k_scale, v_scale)
    if (
        meta.batched is not None
        and q.shape[-1] == k_cache.shape[-1] == v_cache.shape[-1]
        and _triton_ready(q)
    ):
        from afdserve.kernels.triton import attention as triton_attention

        return triton_attention.paged_attention(*args, sinks=sinks, window=window)
    return reference.paged_attention(*args, sinks, window)


def hyper_connection(
    h: torch.Tensor,
    update: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    norm_weight: torch.Tensor,
    iters: int,
    eps: tuple[float, float, float],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """DeepSeek-V4's mHC site (update (y, post, comb): the streams' update after the previous
    block first; eps: mHC's, its norm's, the block norm's) as two fused launches on CUDA ->
    (streams, normalised collapse, post, comb), or None where the fast path does not apply and
    the caller keeps its torch form (model/families/deepseek_v4/mhc.py, the reference)."""
    if not _triton_ready(h):
        return None
    from afdserve.kernels.triton import mhc as triton_mhc

    y, post, comb = update if update is not None else (None, None, None)
    if not triton_mhc.supports(h, y, post, comb, fn):
        return None
    return triton_mhc.hyper_connection(h, y, post, comb, fn, base, scale, norm_weight, iters, *eps)


def mhc_expand(
    h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor | None:
    """DeepSeek-V4's streams after a block with no mHC site after it (the last layer's FFN):
    post * y + comb^T h in one launch on CUDA, or None where the caller keeps its torch form
    (model/families/deepseek_v4/mhc.py's `expand`)."""
    if not _triton_ready(h):
        return None
    from afdserve.kernels.triton import mhc as triton_mhc

    if not triton_mhc.supports_update(h, y, post, comb):
        return None
    return triton_mhc.expand(h, y, post, comb)


def v4_sparse_attention(
    q: torch.Tensor,
    own: torch.Tensor,
    window: tuple[torch.Tensor, torch.Tensor],
    entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None,
    rate: int,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    sinks: torch.Tensor,
    scale: float,
    paging: tuple[int, int] | None = None,
    fp8: tuple[torch.Tensor, torch.Tensor | None, float] | None = None,
    store: bool = False,
) -> torch.Tensor | None:
    """DeepSeek-V4's attention of a ubatch over each row's window and compressed entries, with
    the sinks, read from its pages in one launch on CUDA (kernels/triton/v4_attention.py says what
    each row sees) -> [rows, heads, dim], or None where the fast path does not apply and the
    caller keeps its torch form (model/families/deepseek_v4/batched.py, the reference).
    window: (page, flat rows [rows, window]); entries: (new, page, the rows' block tables, the
    entry indices, or None: every closed entry of each row (HCA)) or None; rows: (positions,
    chunk starts, real); paging (with entries): (block size, entry rows per block); fp8: an FP8
    cache's (window's rotated page, entries' or None, scale), its pages then e4m3; store: the
    kernel also writes each real row's own key to its window row (the first of its rows)."""
    if not _triton_ready(q):
        return None
    from afdserve.kernels.triton import v4_attention as triton_v4_attention

    window_rope, entry_rope, kv_scale = fp8 if fp8 is not None else (None, None, 1.0)
    if not triton_v4_attention.supports(q, own, window[0], window_rope):
        return None
    if entries is not None and not triton_v4_attention.supports(
        q, entries[0], entries[1], entry_rope
    ):
        return None
    rope_pages = None if fp8 is None else (window_rope, entry_rope)
    return triton_v4_attention.sparse_attention(
        q, own, *window, entries, rate, *rows, sinks, scale, paging, rope_pages, kv_scale, store
    )


def triton_available() -> bool:
    """Whether the Triton fast paths can load here (a cache spec's graph policy asks, before any
    tensor exists: model/families/dsa/cache.py)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def dsa_select(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk: int,
    scale: float,
) -> torch.Tensor | None:
    """DSA's lightning indexer on CUDA (kernels/triton/dsa_indexer.py): each row's scores over
    its sequence's paged keys [blocks, B, 1, dim] (model dtype or FP8, `scale` times the FP8
    cache's), then its `topk` best, ties to the earlier position -> cache slots [rows, topk],
    in position order, -1 after; rows: (block tables [rows, W], positions, real). None where the
    fast path does not apply and the caller keeps its torch form (model/families/dsa/indexer.py)."""
    if not _triton_ready(q):
        return None
    from afdserve.kernels.triton import dsa_indexer as triton_dsa_indexer

    if not triton_dsa_indexer.supports(q, keys):
        return None
    return triton_dsa_indexer.select(q, weights, keys, *rows, topk, scale)


def dsa_sparse_mla(
    q: torch.Tensor,
    cache: torch.Tensor,
    selected: torch.Tensor,
    latent: int,
    scale: float,
    k_scale: float,
) -> torch.Tensor | None:
    """DSA's absorbed MLA over each row's selected slots on CUDA (kernels/triton/
    dsa_attention.py): q [rows, heads, latent + rope] over the latent pages -> [rows, heads,
    latent], zeros for a row of none; None where the fast path does not apply and the caller
    keeps its torch form (model/families/dsa/attention.py)."""
    if not _triton_ready(q):
        return None
    from afdserve.kernels.triton import dsa_attention as triton_dsa_attention

    if not triton_dsa_attention.supports(q, cache):
        return None
    return triton_dsa_attention.sparse_mla(q, cache, selected, latent, scale, k_scale)


def fuses_v4_compress(kv: torch.Tensor, open_kv: torch.Tensor, dim: int, rope_dim: int) -> bool:
    """Whether `v4_compress` runs for these projections and pages."""
    if not _triton_ready(kv):
        return False
    from afdserve.kernels.triton import v4_compress as triton_v4_compress

    return triton_v4_compress.supports(kv, open_kv, dim, rope_dim)


def v4_compress_addresses(
    positions: torch.Tensor,
    slots: torch.Tensor,
    tables: torch.Tensor,
    windows: torch.Tensor,
    end: torch.Tensor,
    real: torch.Tensor,
    geometry: tuple[int, int, int, int, int],
    bases: tuple[int, int],
    overlap: bool,
    chunk: bool,
    prev: tuple[bool, bool],
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None:
    """DeepSeek-V4's compressor addresses of a ubatch in one launch on CUDA
    (kernels/triton/v4_addresses.py), or None where the caller keeps its torch form
    (model/families/deepseek_v4/batched.py's `_compress_addresses`)."""
    if not _triton_ready(positions):
        return None
    from afdserve.kernels.triton import v4_addresses as triton_v4_addresses

    return triton_v4_addresses.addresses(
        positions, slots, tables, windows, end, real, geometry, bases, overlap, chunk, prev
    )


def v4_compress(
    kv: torch.Tensor,
    gate: torch.Tensor,
    pages: dict[str, torch.Tensor],
    addresses: torch.Tensor,
    entry_rows: torch.Tensor,
    position_bias: torch.Tensor,
    norm: tuple[torch.Tensor, float],
    rope: tuple[torch.Tensor, float],
    positions: torch.Tensor,
    real: torch.Tensor,
    rate: int,
    dim: int,
    kv_scale: float = 1.0,
    chunk: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """DeepSeek-V4's compressor update of a ubatch, one launch for decode rows, where
    `fuses_v4_compress` holds (kernels/triton/v4_compress.py): the pooled entries [rows, dim],
    the pages written; rope: (inv_freq, scaling) of the entries' rotary; an FP8 cache's entries
    (`pages` with `entries_rope`) quantized at `kv_scale`; `chunk`: rows of prefill chunks
    (their starts, the rows keeping a first series, the rows keeping open rows), in three
    launches. The torch form is model/families/deepseek_v4/batched.py's `_compress`."""
    from afdserve.kernels.triton import v4_compress as triton_v4_compress

    return triton_v4_compress.compress(
        kv,
        gate,
        pages,
        addresses,
        entry_rows,
        position_bias,
        norm,
        rope,
        positions,
        real,
        rate,
        dim,
        kv_scale,
        chunk,
    )


def v4_index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    new: torch.Tensor,
    page: torch.Tensor,
    entry_rows: torch.Tensor,
    rate: int,
    positions: torch.Tensor,
    start: torch.Tensor,
    fp8: tuple[torch.Tensor, float] | None = None,
    weight_scale: float = 1.0,
) -> torch.Tensor | None:
    """DeepSeek-V4's lightning indexer scores of a ubatch [rows, count] float32, its keys read
    from the page in one launch on CUDA (kernels/triton/v4_indexer.py says which), or None where
    the fast path does not apply and the caller keeps its torch form (batched.py's); fp8: an FP8
    cache's (rotated page, scale), `page` then its e4m3 channels; the heads' weights are
    `weights` (any float dtype) times `weight_scale`, in float32."""
    if not _triton_ready(q):
        return None
    from afdserve.kernels.triton import v4_indexer as triton_v4_indexer

    rope_page, kv_scale = fp8 if fp8 is not None else (None, 1.0)
    if not triton_v4_indexer.supports(q, new, page, rope_page):
        return None
    return triton_v4_indexer.index_scores(
        q, weights, new, page, entry_rows, rate, positions, start, rope_page, kv_scale, weight_scale
    )


def v4_index_select(
    q: torch.Tensor,
    weights: torch.Tensor,
    new: torch.Tensor,
    page: torch.Tensor,
    tables: tuple[torch.Tensor, int, int],
    rate: int,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk: int,
    fp8: tuple[torch.Tensor, float] | None = None,
    weight_scale: float = 1.0,
) -> torch.Tensor | None:
    """DeepSeek-V4's lightning indexer top-k of a ubatch on CUDA (kernels/triton/
    v4_index_select.py): each row's kept entries [rows, topk] int64 (index order, then an index
    no row sees), scored only up to the row's position, no [rows, entries] tensor beyond a
    bounded scratch; tables: (block tables [rows, W], block size, entry rows per block); rows:
    (positions, chunk starts, real); fp8, weight_scale: as v4_index_scores'. None where the fast
    path does not apply and the caller keeps its torch form (batched.py's scores and
    `Indexer.ranked`)."""
    if not _triton_ready(q):
        return None
    from afdserve.kernels.triton import v4_index_select as triton_v4_index_select

    rope_page, kv_scale = fp8 if fp8 is not None else (None, 1.0)
    if not triton_v4_index_select.supports(q, new, page, topk, rope_page):
        return None
    return triton_v4_index_select.index_select(
        q, weights, new, page, tables, rate, rows, topk, rope_page, kv_scale, weight_scale
    )


def v4_norm_rope(
    x: torch.Tensor,
    norm: tuple[torch.Tensor | None, float] | None,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    negate: bool = False,
) -> torch.Tensor | None:
    """DeepSeek-V4's per-head RMS norm and partial interleaved rotary of x [rows, heads, dim] in
    one launch on CUDA (kernels/triton/v4_norm_rope.py), or None where the fast path does not
    apply and the caller keeps its torch form (model/families/deepseek_v4/attention.py's)."""
    if not _triton_ready(x):
        return None
    from afdserve.kernels.triton import v4_norm_rope as triton_v4_norm_rope

    if not triton_v4_norm_rope.supports(x):
        return None
    return triton_v4_norm_rope.norm_rope(x, norm, cos_sin, negate)


def step_rows(
    batched: BatchedSegments,
    rows: int,
    slots: torch.Tensor | None,
    window_tables: torch.Tensor | None,
) -> tuple[torch.Tensor, ...] | None:
    """A ubatch's per-row fields from its device segments (`StepRows.of`) in one launch on
    CUDA; None elsewhere (the caller keeps its torch form)."""
    if _triton_ready(batched.query_start):
        from afdserve.kernels.triton import step_rows as triton_step_rows

        starts, context, tables = batched.query_start, batched.context_lens, batched.block_tables
        return triton_step_rows.step_rows(starts, context, tables, rows, slots, window_tables)
    return None


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos/sin [rows, half] of positions times float32 inverse frequencies, scaled, in one
    launch on CUDA (`rotary.cos_sin`); None elsewhere."""
    if _triton_ready(positions) and inv_freq.dtype == torch.float32:
        from afdserve.kernels.triton import rotary as triton_rotary

        return triton_rotary.cos_sin(positions, inv_freq, scaling)
    return None


def window_rows(
    positions: torch.Tensor, tables: torch.Tensor, window: int, block: int, page_rows: int
) -> torch.Tensor | None:
    """DeepSeek-V4's window addresses of a ubatch's rows (`step_rows.window_rows`) in one launch
    on CUDA; None elsewhere."""
    if _triton_ready(positions):
        from afdserve.kernels.triton import step_rows as triton_step_rows

        return triton_step_rows.window_rows(positions, tables, window, block, page_rows)
    return None


def route_greedy(
    x: torch.Tensor,
    weight: torch.Tensor,
    top_k: int,
    scoring: str,
    normalize: bool,
    scale: float,
    bias: torch.Tensor | None = None,
    hashed: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The router's plain top-k (softmax, sigmoid or sqrt(softplus) scores; with `bias` added
    for the choice only, noaux_tc of one group) or, with `hashed` = (tid2eid, token ids), a hash
    layer's table lookup (an id outside the table stops the kernel with a device-side assert), as
    fused launches on CUDA; None where the fast path does not apply and the caller keeps its
    torch form."""
    if _triton_ready(x):
        from afdserve.kernels.moe import router as triton_router

        if scoring in triton_router.SCORINGS and triton_router.supports(x, weight, top_k):
            return triton_router.route(x, weight, top_k, scoring, normalize, scale, bias, hashed)
    return None


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float | None = None,
    glu: ExpertGLU | None = None,
) -> torch.Tensor:
    """`glu`: gpt-oss's expert biases and sigmoid gain (`reference.ExpertGLU`)."""
    if glu is not None and not glu.plain:
        return _gpt_oss_experts(x, topk_ids, topk_weights, gate_up, down, limit, glu)
    if limit is not None:
        # The GPU kernels take a clamp only with gpt-oss's biases and gain so far (DeepSeek-V4's
        # swiglu_limit alone): the reference, graph capturable in its dense form.
        return _reference_experts(x, topk_ids, topk_weights, gate_up, down, limit)
    if _triton_ready(x):
        from afdserve.kernels.moe import decode as triton_moe
        from afdserve.kernels.moe import grouped as triton_grouped_moe
        from afdserve.kernels.moe import torch_grouped

        if gate_up.shape[0] == 0:  # a shard without experts (more FFN ranks than experts)
            return torch.zeros_like(x)
        # Few pairs (decode): the fused Triton kernels, which route in registers and read each
        # touched expert once. More: the Triton grouped GEMM over a sort-free assignment (no
        # torch sort / scatter / gather around it); past GROUPED_MAX_PAIRS (prefill chunks,
        # compute-bound) torch's grouped GEMM. The first crossover was measured. Every path
        # skips pairs with id -1 (no expert here) itself.
        pairs = topk_ids.numel()
        if pairs <= triton_moe.MAX_PAIRS and triton_moe.supports(x, gate_up, down):
            return triton_moe.moe_experts(x, topk_ids, topk_weights, gate_up, down)
        grouped = pairs <= triton_grouped_moe.GROUPED_MAX_PAIRS
        if grouped and triton_grouped_moe.supports(x, gate_up, down):
            return triton_grouped_moe.moe_experts(x, topk_ids, topk_weights, gate_up, down)
        if torch_grouped.supports(x, gate_up, down):
            return torch_grouped.moe_experts(x, topk_ids, topk_weights, gate_up, down)
    return _reference_experts(x, topk_ids, topk_weights, gate_up, down)


def _gpt_oss_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float | None,
    glu: ExpertGLU,
) -> torch.Tensor:
    """Experts with gpt-oss's biases and gain. On CUDA the decode kernels up to
    `decode.MAX_PAIRS` pairs, the grouped GEMM past them (which reads each expert once per tile
    of its rows, where the decode kernels' row chunks would read it once per chunk); no host
    sync and graph capturable at any batch."""
    if x.is_cuda and (gate_up.shape[0] == 0 or x.shape[0] == 0):
        # A shard without experts, or an empty ubatch (a graph of 1 row in 2 ubatches).
        return torch.zeros_like(x)
    if _triton_ready(x):
        from afdserve.kernels.moe import decode as triton_moe
        from afdserve.kernels.moe import grouped as triton_grouped_moe
        from afdserve.kernels.moe.routing import in_row_chunks

        many = topk_ids.numel() > triton_moe.MAX_PAIRS
        if many and triton_grouped_moe.supports(x, gate_up, down):
            return triton_grouped_moe.moe_experts(
                x, topk_ids, topk_weights, gate_up, down, limit=limit, glu=glu
            )
        if triton_moe.supports(x, gate_up, down):
            x = x.contiguous()

            def run(rows: slice) -> torch.Tensor:
                ids, weights = topk_ids[rows], topk_weights[rows]
                return triton_moe.moe_experts(x[rows], ids, weights, gate_up, down, limit, glu)

            return in_row_chunks(topk_ids, triton_moe.MAX_PAIRS, run)
    return _reference_experts(x, topk_ids, topk_weights, gate_up, down, limit, glu)


def _reference_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float | None = None,
    glu: ExpertGLU | None = None,
) -> torch.Tensor:
    """The reference, or inside a CUDA graph capture its sync-free dense form (the reference
    reads per-expert counts back to the host, which a graph cannot)."""
    args = (x, topk_ids, topk_weights, gate_up, down, limit, glu)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return reference.moe_experts_dense(*args)
    return reference.moe_experts(*args)


def fp8_linear(
    x: torch.Tensor | fp8.Fp8Rows,
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int],
) -> torch.Tensor:
    """A block-scaled FP8 weight. On CUDA a Triton GEMM reads the FP8 weight itself: w8a8 for
    bf16/fp16 x (its rows quantized per 128-group, kernels/triton/fp8_w8a8.py, or already, by
    `add_rms_norm(quantize=True)`), weight-only for float32 x (kernels/triton/fp8_weight_only.py);
    elsewhere the weight-only reference dequantizes the whole weight first."""
    if isinstance(x, fp8.Fp8Rows):  # made only where quantizes_for_gemm held
        from afdserve.kernels.triton import fp8_w8a8 as triton_fp8_w8a8

        return triton_fp8_w8a8.fp8_linear(x, q, scale_inv, bias)
    if _triton_ready(x):
        from afdserve.kernels.triton import fp8_w8a8 as triton_fp8_w8a8
        from afdserve.kernels.triton import fp8_weight_only as triton_fp8

        if triton_fp8.supports(x, q, scale_inv, block):
            if triton_fp8.w8a8(x.dtype):
                return triton_fp8_w8a8.fp8_linear(x, q, scale_inv, bias)
            return triton_fp8.fp8_linear(x, q, scale_inv, bias)
    return fp8.fp8_linear(x, q, scale_inv, bias, block)


def fp8_grouped_linear(
    x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, groups: int, block: tuple[int, int]
) -> torch.Tensor | None:
    """A grouped projection of a block-scaled FP8 weight: x [rows, groups * in], q [groups *
    out, in] -> [rows, groups * out], group g of x's g-th `in` columns (DeepSeek-V4's grouped
    output projection), as the w8a8 GEMM of every FP8 projection on CUDA, in one launch that
    reads the weight as stored; None where it does not apply (off CUDA, float32 rows, groups
    off the 128-wide blocks) and the caller dequantizes the weight for its own product."""
    if not _triton_ready(x):
        return None
    from afdserve.kernels.triton import fp8_w8a8 as triton_fp8_w8a8
    from afdserve.kernels.triton import fp8_weight_only as triton_fp8

    if not (triton_fp8.w8a8(x.dtype) and triton_fp8.weight_fits(q, scale_inv, block)):
        return None
    if x.dim() != 2 or not triton_fp8_w8a8.grouped_supports(x, q, groups):
        return None
    return triton_fp8_w8a8.fp8_linear(x, q, scale_inv, None, groups=groups)


def dequantize_fp8(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]
) -> torch.Tensor:
    """A block-scaled FP8 weight as a matrix in `dtype` (for code that uses it as one: MLA's
    absorbed attention), the same values on every path; on CUDA one Triton pass."""
    if _triton_ready(q):
        from afdserve.kernels.triton import fp8_weight_only as triton_fp8

        if triton_fp8.weight_fits(q, scale_inv, block):
            return triton_fp8.dequantize(q, scale_inv, dtype)
    return fp8.dequantize_blockwise(q, scale_inv, dtype, block)


def moe_experts_fp8(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    block: tuple[int, int],
    limit: float | None = None,
) -> torch.Tensor:
    """Routed experts whose weights are block-scaled FP8 ((q, scale_inv) pairs); `limit`: the
    SwiGLU clamp (DeepSeek-V4). On CUDA the stacks stay FP8 and the Triton kernels scale their
    tiles in registers: the decode kernels (kernels/moe/fp8_decode.py) for few pairs, the grouped
    GEMM for more (any count: the alternative is a bf16 copy of every expert). Where those do not
    apply (fp32 activations, odd shapes, a clamp, which they do not apply yet) the stacks are
    dequantized whole and take `moe_experts` (graph capturable, at the cost of that transient).
    Elsewhere the reference dequantizes only the experts the rows are routed to."""
    if _triton_ready(x) and limit is None:
        from afdserve.kernels.moe import fp8_decode as triton_fp8_moe
        from afdserve.kernels.moe import grouped as triton_grouped_moe

        if gate_up[0].shape[0] == 0:  # a shard without experts
            return torch.zeros_like(x)
        pairs = topk_ids.numel()
        small = pairs <= triton_fp8_moe.MAX_PAIRS
        if small and triton_fp8_moe.supports(x, gate_up[0], down[0], block):
            return triton_fp8_moe.moe_experts(x, topk_ids, topk_weights, gate_up, down)
        if 0 < FP8_DEQUANTIZE_FROM <= pairs:
            out = _fp8_experts_as_bf16(x, topk_ids, topk_weights, gate_up, down, block)
            if out is not None:
                return out
        if tuple(block) == (128, 128) and triton_grouped_moe.supports(x, gate_up[0], down[0]):
            return triton_grouped_moe.moe_experts(
                x, topk_ids, topk_weights, gate_up[0], down[0], (gate_up[1], down[1])
            )
    if x.is_cuda:
        w13 = fp8.dequantize_gate_up(*gate_up, x.dtype, block)
        w2 = fp8.dequantize_blockwise(*down, x.dtype, block)
        return moe_experts(x, topk_ids, topk_weights, w13, w2, limit)
    return fp8.moe_experts_fp8(x, topk_ids, topk_weights, gate_up, down, block, limit)


# Pairs from which FP8 experts (block 128 x 128, bf16 x) are dequantized to a bf16 copy of the
# layer's experts for torch's grouped GEMM, where that copy is at most FP8_DEQUANTIZE_MAX_BYTES
# (0: never). A prefill chunk is compute-bound, and the Triton grouped kernels' 16-row FP8 tiles
# are made for decode's few pairs per expert. The copy's fixed cost a layer breaks even against
# their per-pair cost near 24k pairs, hence 32768 (docs/benchmarks.md, "FP8 prefill").
FP8_DEQUANTIZE_FROM = 32768
FP8_DEQUANTIZE_MAX_BYTES = 2 << 30


def dequantize_stack(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor | None:
    """An FP8 expert stack [E, N, K] with its 128 x 128 grid [E, N / 128, K / 128] in `dtype`, in
    one Triton pass over it as the matrix [E * N, K] (the same values as `fp8.dequantize_blockwise`
    per expert); None where N is not whole blocks (gate/up halves that do not meet on a block
    boundary keep a grid each, `fp8.dequantize_gate_up`), the grid is not 128 x 128 blocks or
    the stack is not contiguous. The caller checks the device (`_triton_ready`)."""
    from afdserve.kernels.triton import fp8_weight_only as triton_fp8

    experts, n, k = q.shape
    block = (128, 128)
    if (
        n % 128
        or not q.is_contiguous()
        or scale_inv.shape != (experts, *fp8.scale_grid(n, k, block))
    ):
        return None
    # Whole blocks of N: the stack's grid, its experts' stacked, is the matrix's.
    q2d, s2d = q.view(experts * n, k), scale_inv.reshape(experts * n // 128, -1)
    if not triton_fp8.grid_fits(q2d, s2d, block):
        return None
    return triton_fp8.dequantize(q2d, s2d, dtype).view(experts, n, k)


def _fp8_experts_as_bf16(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    block: tuple[int, int],
) -> torch.Tensor | None:
    """`moe_experts_fp8` through a transient bf16 copy of the stacks (`dequantize_stack`) and
    torch's grouped GEMM: weight-only, x stays bf16. None where it does not apply (the copy too
    large, a grid that does not tile a stack as one matrix)."""
    from afdserve.kernels.moe import torch_grouped

    (q13, s13), (q2, s2) = gate_up, down
    if x.dtype != torch.bfloat16 or tuple(block) != (128, 128):
        return None
    if 2 * (q13.numel() + q2.numel()) > FP8_DEQUANTIZE_MAX_BYTES:
        return None
    w13 = dequantize_stack(q13, s13, x.dtype)
    w2 = dequantize_stack(q2, s2, x.dtype) if w13 is not None else None
    if w2 is None or not torch_grouped.supports(x, w13, w2):
        return None
    return torch_grouped.moe_experts(x, topk_ids, topk_weights, w13, w2)


def moe_experts_fp4(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    limit: float | None = None,
    glu: ExpertGLU | None = None,
) -> torch.Tensor:
    """Routed experts whose weights are FP4 ((packed, scale) pairs, kernels/reference/fp4.py). On
    CUDA the Triton kernels read the FP4 bytes and dequantize in registers (no bf16 copy of the
    experts, graph capturable); from `fp4_grouped.MIN_PAIRS` pairs (past one decode launch) in
    tiles of pairs grouped by expert, each weight tile decoded once per tile; elsewhere the
    reference dequantizes the routed experts one at a time. `glu`: gpt-oss's biases and gain
    (MXFP4 is this format)."""
    if _triton_ready(x):
        from afdserve.kernels.moe import fp4_decode as triton_fp4_moe
        from afdserve.kernels.moe import fp4_grouped

        if gate_up[0].shape[0] == 0 and x.is_cuda:  # a shard without experts
            return torch.zeros_like(x)
        if topk_ids.numel() >= fp4_grouped.MIN_PAIRS and fp4_grouped.supports(x, gate_up, down):
            # Past one launch of the decode kernels: each weight decoded once per tile of pairs,
            # not once per decode-kernel chunk.
            return fp4_grouped.moe_experts(x, topk_ids, topk_weights, gate_up, down, limit, glu)
        if triton_fp4_moe.supports(x, gate_up, down):
            return triton_fp4_moe.moe_experts(
                x, topk_ids, topk_weights, gate_up, down, limit, glu=glu
            )
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        # Rows the kernels do not take (float32) in a graph: the reference reads per-expert
        # counts back to the host, so every expert is dequantized and run (small models only).
        w13 = fp4.dequantize_fp4(*gate_up, x.dtype)
        w2 = fp4.dequantize_fp4(*down, x.dtype)
        return reference.moe_experts_dense(x, topk_ids, topk_weights, w13, w2, limit, glu)
    return fp4.moe_experts_fp4(x, topk_ids, topk_weights, gate_up, down, limit, glu)


def _slots_contiguous(states: torch.Tensor) -> bool:
    """Each slot of `states` [slots, ...] contiguous, the slots at any stride (they may live in
    the paged groups' pages: model/cache.py's `SlotPlan`)."""
    return states.shape[0] == 0 or states[0].is_contiguous()


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
    fresh: torch.Tensor,
) -> torch.Tensor:
    """One decode step of the gated delta rule over state slots, in place
    (kernels/reference/delta_rule.py's `step_slots`)."""
    if _triton_ready(v) and _slots_contiguous(states):
        from afdserve.kernels.triton import delta_rule as triton_delta_rule

        return triton_delta_rule.step_slots(q, k, v, g, beta, states, slots, fresh)
    return reference_delta_rule.step_slots(q, k, v, g, beta, states, slots, fresh)


def causal_conv_spans(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, spans: torch.Tensor
) -> torch.Tensor:
    """The delta-rule layers' short causal convolution and SiLU over spans of rows, each after its
    slot's window, the windows updated in place (kernels/reference/delta_chunked.py's
    `conv_spans`). On CUDA one Triton launch, no host sync."""
    if _triton_ready(x) and _slots_contiguous(windows):
        from afdserve.kernels.triton import short_conv as triton_short_conv

        return triton_short_conv.conv_spans(x, weight, windows, spans)
    return reference_delta_chunked.conv_spans(x, weight, windows, spans)


def delta_rule_spans(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    spans: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """The gated delta rule's chunked form over spans of rows, each from its slot's state, the
    states updated in place, outputs into `out` (kernels/reference/delta_chunked.py's
    `chunked_spans`). On CUDA one Triton launch, no host sync."""
    if _triton_ready(v) and _slots_contiguous(states) and out.is_contiguous():
        from afdserve.kernels.triton import delta_chunked as triton_delta_chunked

        triton_delta_chunked.chunked_spans(q, k, v, g, beta, states, spans, out)
        return
    reference_delta_chunked.chunked_spans(q, k, v, g, beta, states, spans, out)
