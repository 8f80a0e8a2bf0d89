"""Run a script of kernel cases under Triton's interpreter (TRITON_INTERPRET=1, numpy), in a
subprocess: the variable must be set before any @triton.jit function is defined, so not in the
test process. Skips where Triton is not installed, or older than `min_triton` (3.6's interpreter
cannot run a loop bounded by a reduced tensor, which several expert kernels have).

Which interpreter runs which: Triton 3.6 (the device's) on numpy < 2.4 runs every script but
those that ask for `min_triton` (3, 9); on numpy 2.4 its loops fail ("only 0-dimensional arrays
can be converted to Python scalars"). Triton 3.9 runs those, but rejects a mask that joins a
tensor with a scalar comparison ("mask has unsupported dtype", 2026-12-07), which most other
kernels have."""

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


# Prepend to a script whose kernels dot bfloat16 tiles: Triton 3.6's interpreter holds bf16 as
# numpy uint16 and multiplies those integers in tl.dot (garbage). This widens the operands to
# float32 first, exactly (bf16 products are exact in float32). Its float32 -> bf16 casts still
# truncate where a GPU rounds to nearest: bf16 tolerances here are about twice a GPU's.
BF16_DOTS = """
import numpy as _np
import triton.language as _tl
from triton.runtime import interpreter as _interp

_dot = _interp.InterpreterBuilder.create_dot


def _widen(x):
    if x.dtype.scalar != _tl.bfloat16:
        return x
    data = _interp._convert_float(x.data, _tl.bfloat16, _tl.float32, None).view(_np.float32)
    return _interp.TensorHandle(data, _tl.float32)


def _bf16_dot(self, a, b, acc, precision, imprecise):
    return _dot(self, _widen(a), _widen(b), acc, precision, imprecise)


_interp.InterpreterBuilder.create_dot = _bf16_dot
"""
