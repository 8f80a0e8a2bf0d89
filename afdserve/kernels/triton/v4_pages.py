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
