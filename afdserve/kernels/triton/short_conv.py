"""The delta-rule layers' short depthwise causal convolution (SiLU after it) over varlen spans as
one Triton launch: each span's rows after its slot's window of the K - 1 inputs before them,
the window after them written back. Same math as kernels/reference/delta_chunked.py's
`conv_spans`; sums in float32. No host sync: the spans are read on the device, a span of slot
-1 (the pad marker of a table sized by capacity, as a CUDA graph's) skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _conv_kernel(
    X,  # [rows, channels], row stride stride_x
    W,  # [channels, TAPS]
    WIN,  # [slots, channels, TAPS - 1], slot stride stride_win
    SPANS,  # [n, 4] int32: row_start, row_end, state_slot, fresh
    OUT,  # [rows, channels] contiguous
    stride_x,
    stride_win,
    channels,
    TAPS: tl.constexpr,
    BW: tl.constexpr,  # >= TAPS - 1, a power of two
    BR: tl.constexpr,
    BC: tl.constexpr,
):
    span, cblock = tl.program_id(0), tl.program_id(1)
    width = TAPS - 1
    r0 = tl.load(SPANS + span * 4)
    slot = tl.load(SPANS + span * 4 + 2).to(tl.int64)
    active = slot >= 0  # slot -1: the pad marker, a span of no rows, no window read or written
    r1 = tl.where(active, tl.load(SPANS + span * 4 + 1), r0)
    slot = tl.maximum(slot, 0)
    # not fresh: the window holds earlier inputs
    keep = (tl.load(SPANS + span * 4 + 3) == 0) & active
    rc = cblock * BC + tl.arange(0, BC)
    mc = (rc < channels) & active
    window = WIN + slot * stride_win
    for b0 in range(r0, r1, BR):
        rows = (b0 + tl.arange(0, BR)).to(tl.int64)
        live = rows < r1
        acc = tl.zeros((BR, BC), dtype=tl.float32)
        for t in tl.static_range(TAPS):
            src = rows - (width - t)  # the input this tap reads; before r0 it is the window's
            in_x = (src >= r0) & live
            in_window = (src < r0) & live & keep
            x_mask = in_x[:, None] & mc[None, :]
            x = tl.load(X + src[:, None] * stride_x + rc[None, :], mask=x_mask)
            col = src - r0 + width  # the window's column of an input before r0
            old_mask = in_window[:, None] & mc[None, :]
            old = tl.load(window + rc[None, :] * width + col[:, None], mask=old_mask)
            tap = tl.load(W + rc * TAPS + t, mask=mc, other=0.0).to(tl.float32)
            x = tl.where(in_x[:, None], x.to(tl.float32), 0.0)
            old = tl.where(in_window[:, None], old.to(tl.float32), 0.0)
            acc += (x + old) * tap[None, :]
        out = acc * tl.sigmoid(acc)
        tl.store(
            OUT + rows[:, None] * channels + rc[None, :],
            out.to(OUT.dtype.element_ty),
            mask=live[:, None] & mc[None, :],
        )
    # The window after the span: its last K - 1 inputs, the old window's where the span is shorter.
    jw = tl.arange(0, BW)
    src = (r1 - width + jw).to(tl.int64)
    in_x = (src >= r0) & (jw < width)
    in_window = (src < r0) & (jw < width) & keep
    x = tl.load(X + src[None, :] * stride_x + rc[:, None], mask=mc[:, None] & in_x[None, :])
    col = src - r0 + width
    old_mask = mc[:, None] & in_window[None, :]
    old = tl.load(window + rc[:, None] * width + col[None, :], mask=old_mask)
    old = tl.where(in_window[None, :], old.to(tl.float32), 0.0)
    new = tl.where(in_x[None, :], x.to(tl.float32), old)  # [BC, BW]
    # Other threads of this program may still be reading the old window's columns.
    tl.debug_barrier()
    tl.store(
        window + rc[:, None] * width + jw[None, :],
        new.to(WIN.dtype.element_ty),
        mask=mc[:, None] & (jw < width)[None, :],
    )


def conv_spans(
    x: torch.Tensor, weight: torch.Tensor, windows: torch.Tensor, spans: torch.Tensor
) -> torch.Tensor:
    """As reference.delta_chunked.conv_spans (its docstring has the shapes); each slot's window
    contiguous (the slots at any stride)."""
    rows, channels = x.shape
    taps = weight.shape[-1]
    out = torch.zeros(rows, channels, dtype=x.dtype, device=x.device)
    if spans.shape[0] == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    bc = min(128, triton.next_power_of_2(channels))
    grid = (spans.shape[0], triton.cdiv(channels, bc))
    _conv_kernel[grid](
        x,
        weight.contiguous(),
        windows,
        spans.to(torch.int32).contiguous(),
        out,
        x.stride(0),
        windows.stride(0),
        channels,
        TAPS=taps,
        BW=max(2, triton.next_power_of_2(taps - 1)),
        BR=16,
        BC=bc,
    )
    return out
