"""Device-side timestamps: a one-thread kernel appends the GPU's global timer (ns) to a buffer.
Stamps are stream-ordered and can be captured in a CUDA graph (the slot comes from a device
counter), so they see inside replayed graphs, which the profiler does not (its busy shares of a
replayed AFD step read 0-16% on a GPU that was working most of the step)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _stamp_kernel(BUF, COUNT, capacity):
    i = tl.load(COUNT)
    now = tl.inline_asm_elementwise(
        "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
    )
    tl.store(BUF + i, now, mask=i < capacity)
    tl.store(COUNT, i + 1)


class Stamps:
    """A buffer of timestamps; `mark` appends one when the stream reaches it."""

    def __init__(self, device: torch.device, capacity: int = 1 << 16) -> None:
        self.buf = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.count = torch.zeros(1, dtype=torch.int32, device=device)

    def mark(self) -> None:
        _stamp_kernel[(1,)](self.buf, self.count, self.buf.numel(), num_warps=1)

    def reset(self) -> None:
        self.count.zero_()

    def read(self) -> list[int]:
        """Every stamp since the last reset, in ns (synchronises)."""
        n = int(self.count.item())
        if n > self.buf.numel():
            raise RuntimeError(f"{n} stamps overflowed a buffer of {self.buf.numel()}")
        return self.buf[:n].tolist()
