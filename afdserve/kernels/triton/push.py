"""One launch that writes a tile into a peer's inbox (afd/dataplane/ipc.py): the hidden rows, zeros
on the pad rows, and optionally the token-id payload (header, then one id per row, -1 on pad rows).

A copy through `tensor.copy_` into peer memory becomes a copy-engine transfer, whose start-up
dominates at these sizes; a kernel's stores go out over NVLink at once, and one launch covers
rows, pad rows and ids.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 4


@triton.jit
def _push_kernel(
    SRC,
    DST,
    IDS_SRC,
    IDS_DST,
    STEP,
    rows,
    tile,
    width,
    stride_src,
    stride_dst,
    layer,
    ubatch,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
    HEADER: tl.constexpr,
    WITH_IDS: tl.constexpr,
):
    pid = tl.program_id(0)
    r = pid * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R]
    in_tile = r < tile
    real = r < rows
    for start in range(0, width, BLOCK_W):
        c = start + tl.arange(0, BLOCK_W)  # [BLOCK_W]
        cmask = c < width
        x = tl.load(
            SRC + r[:, None] * stride_src + c[None, :],
            mask=real[:, None] & cmask[None, :],
            other=0.0,
        )
        tl.store(
            DST + r[:, None] * stride_dst + c[None, :],
            x.to(DST.dtype.element_ty),
            mask=in_tile[:, None] & cmask[None, :],
        )
    if WITH_IDS:
        ids = tl.load(IDS_SRC + r, mask=real, other=-1)
        tl.store(IDS_DST + HEADER + r, ids.to(tl.int32), mask=in_tile)
        if pid == 0:
            tl.store(IDS_DST + 0, tl.load(STEP))
            tl.store(IDS_DST + 1, layer)
            tl.store(IDS_DST + 2, ubatch)
            tl.store(IDS_DST + 3, tile)


def push_tile(
    src: torch.Tensor,
    dst: torch.Tensor,
    ids: torch.Tensor | None = None,
    ids_dst: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
    layer: int = 0,
    ubatch: int = 0,
    header: int = 4,
) -> None:
    """dst[:rows] = src, dst[rows:] = 0 (dst is the tile, [tile, width]); with `ids`, also
    ids_dst = [step, layer, ubatch, tile, ids..., -1 on pad rows]."""
    rows, width = src.shape
    tile = dst.shape[0]
    if rows > tile or dst.shape[1] != width or src.stride(1) != 1 or dst.stride(1) != 1:
        raise ValueError(
            f"push_tile: {tuple(src.shape)} rows do not fit a tile "
            f"{tuple(dst.shape)} (or a row is not contiguous)"
        )
    with_ids = ids is not None
    if with_ids and (ids_dst is None or step is None or ids_dst.numel() != header + tile):
        raise ValueError("push_tile: ids need ids_dst of header + tile entries and a step")
    if tile == 0:
        return
    if rows == 0:  # an empty tensor may have no storage: hand the kernel a real (masked) one
        src = dst
        ids = ids_dst if with_ids else None
    placeholder = dst  # any tensor: unused when WITH_IDS is off
    _push_kernel[(triton.cdiv(tile, BLOCK_ROWS),)](
        src,
        dst,
        ids if with_ids else placeholder,
        ids_dst if with_ids else placeholder,
        step if with_ids else placeholder,
        rows,
        tile,
        width,
        src.stride(0),
        dst.stride(0),
        layer,
        ubatch,
        BLOCK_R=BLOCK_ROWS,
        BLOCK_W=min(1024, triton.next_power_of_2(width)),
        HEADER=header,
        WITH_IDS=with_ids,
        num_warps=4,
    )
