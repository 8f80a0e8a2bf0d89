"""Zeroed tile counters for launches whose K splits are summed by each tile's last split to finish
(triton/fp8_w8a8.py's GEMM, moe/fp4_decode.py's experts): every split counts itself in on its
tile's counter, the last one sums the partials in split order and zeroes the counter again, so
one set serves every launch and graph replay."""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def tile_counters(weight: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` zeroed counters of one weight's split tiles (its kernel's bound on them), one
    set per weight so that launches over different weights never share one."""
    key = (weight.device, weight.data_ptr())
    counters = _COUNTERS.get(key)
    if counters is None:
        counters = _COUNTERS[key] = torch.zeros(size, dtype=torch.int32, device=weight.device)
    return counters
