"""DeepSeek-V4's attention half launches at most 30 kernels a decode layer of each type and 40 a
layer of a mixed step (tools/v4_launches.py: the CUDA dispatch run by Triton's interpreter on CPU,
each layer's Triton kernels and launching torch operators counted; what a ubatch builds once for
all its layers counted apart). A layer that rebuilt its rows, addresses or rotary tables, or a
fused path that fell back to torch ops, would exceed it."""

from __future__ import annotations

import ast

from tests.kernels.interpret import run_interpreted

CODE = """
from tools.v4_launches import main
print("RESULT", repr(main()))
"""


def test_v4_attention_launches_per_layer() -> None:
    run = run_interpreted(CODE, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    line = next(x for x in run.stdout.splitlines() if x.startswith("RESULT "))
    counts = ast.literal_eval(line.removeprefix("RESULT "))
    for step, bound in (("decode", 30), ("mixed", 40), ("prefill", 40)):
        layers = {kind: n for kind, n in counts[step].items() if kind != "per ubatch"}
        assert len(layers) == 3 and all(0 < n <= bound for n in layers.values()), (step, counts)
