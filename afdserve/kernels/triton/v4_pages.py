"""Reading DeepSeek-V4's "kv" pages (its window rows, compressed entries and indexer entries) in
a kernel, in either of the cache's forms (model/families/deepseek_v4/geometry.py's
`LayerGeometry.stored`): one page [flat rows, dim] in the model dtype, or an FP8 cache's two
pages, the unrotated channels [flat rows, nope] float8_e4m3fn and the rotated ones [flat rows,
dim - nope] bf16. FP8 rows are widened as the torch path's `LayerPages.take` widens them
(`reference.dequantize_kv`: e4m3 to float32 times the cache's scale), so the kernels and the
torch form read the same keys."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def page_rows(PAGE, ROPE_PAGE, paged, live, d, dim, nope, kv_scale, FP8: tl.constexpr):
    """Flat rows `paged` [N] of a page, channels d [BLOCK_D] of dim, zero where not `live` [N]
    or past dim: as stored (one page), or float32 (FP8: channels below `nope` from PAGE times
    kv_scale, the rest from ROPE_PAGE) for the caller's cast to the model dtype."""
    if FP8:
        flat = d < nope
        rotated = (d >= nope) & (d < dim)
        k_nope = tl.load(
            PAGE + paged[:, None] * nope + d[None, :],
            mask=live[:, None] & flat[None, :],
            other=0.0,
        )
        k_rope = tl.load(
            ROPE_PAGE + paged[:, None] * (dim - nope) + (d - nope)[None, :],
            mask=live[:, None] & rotated[None, :],
            other=0.0,
        )
        k = tl.where(flat[None, :], k_nope.to(tl.float32) * kv_scale, k_rope.to(tl.float32))
    else:
        k = tl.load(
            PAGE + paged[:, None] * dim + d[None, :],
            mask=live[:, None] & (d < dim)[None, :],
            other=0.0,
        )
    return k


def fp8_pages(
    dtype: torch.dtype, page: torch.Tensor, rope_page: torch.Tensor | None, dim: int
) -> bool | None:
    """Whether `page` (with `rope_page`) is an FP8 cache's pair for rows of `dim` channels read in
    `dtype` (True), one page in `dtype` (False), or neither (None: the kernels do not apply)."""
    if rope_page is None:
        return False if page.dtype == dtype and page.is_contiguous() else None
    fits = (
        page.dtype == torch.float8_e4m3fn
        and rope_page.dtype == torch.bfloat16
        and page.is_contiguous()
        and rope_page.is_contiguous()
        and page.dim() == rope_page.dim() == 2
        and page.shape[0] == rope_page.shape[0]
        and page.shape[1] + rope_page.shape[1] == dim
    )
    return True if fits else None


@triton.jit
def _e4m3_grid(x):
    """x (float32, within +-448) rounded to the nearest e4m3 value, ties to even, as float32:
    the float32 round-to-nearest-even of x over its e4m3 step (2^(e - 3), subnormals 2^-9), so
    that the cast after it is exact on every device and in the interpreter (whose own casts
    round otherwise), and equal to torch's. The sign is x's (-0.0 as torch gives it)."""
    bits = x.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    grid = tl.abs(((x / step + 12582912.0) - 12582912.0) * step)  # 1.5 * 2^23: rounds to even
    return tl.where(bits < 0, -grid, grid)  # the sign bit


@triton.jit
def store_row(PAGE, ROPE_PAGE, row, x, cols, keep, dim, nope, kv_scale, FP8: tl.constexpr):
    """Channels `cols` [BLOCK] of one row x (the model dtype) into flat row `row` of a page where
    `keep` -> x as the page gives it back (`LayerPages.as_stored`): FP8 quantizes the channels
    below `nope` as `reference.quantize_kv` (x / kv_scale, clamped to +-448, to e4m3) and keeps
    the rest bf16 in ROPE_PAGE."""
    if FP8:
        flat = cols < nope
        # Correctly rounded (Triton's `/` is approximate), as attention.quantize_fp8.
        scaled = tl.minimum(tl.maximum(tl.div_rn(x.to(tl.float32), kv_scale), -448.0), 448.0)
        quantized = _e4m3_grid(scaled)
        tl.store(PAGE + row * nope + cols, quantized.to(PAGE.dtype.element_ty), mask=keep & flat)
        rope = x.to(tl.bfloat16)
        rotated = (cols >= nope) & (cols < dim)
        tl.store(ROPE_PAGE + row * (dim - nope) + (cols - nope), rope, mask=keep & rotated)
        back = tl.where(flat, quantized * kv_scale, rope.to(tl.float32)).to(x.dtype)
    else:
        tl.store(PAGE + row * dim + cols, x, mask=keep & (cols < dim))
        back = x
    return back
