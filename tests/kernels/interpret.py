"""Run a script of kernel cases under Triton's interpreter (TRITON_INTERPRET=1, numpy), in a
subprocess: the variable must be set before any @triton.jit function is defined, so not in the
test process. Skips where Triton is not installed, or older than `min_triton` (3.6's interpreter
cannot run a loop bounded by a reduced tensor, which several expert kernels have)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_interpreted(
    code: str,
    timeout: int,
    min_triton: tuple[int, int] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    triton = pytest.importorskip("triton")
    version = tuple(int(v) for v in triton.__version__.split(".")[:2])
    if min_triton is not None and version < min_triton:
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run these kernels")
    full_env = {**os.environ, "TRITON_INTERPRET": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, timeout=timeout
    )
