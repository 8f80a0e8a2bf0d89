"""Shared by the GPU kernel tests: run a call with CUDA's sync debug mode set to raise, so a fast
path that syncs with the host (a `.item()`, a host copy) fails the test instead of passing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def no_sync(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn(*args, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
