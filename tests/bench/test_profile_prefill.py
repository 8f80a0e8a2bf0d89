"""tools/profile_prefill.py on the CPU with the tiny preset: it prefills the prompts it says
(each request's one token checked inside), and reports the rate and the operators by time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_profile_prefill_reports_the_prompts_it_ran():
    args = "--preset tiny --device cpu --dtype float32 --prompts 3 --input-len 40"
    args += " --max-num-batched-tokens 64 --graph-mode none --rows 5"
    run = subprocess.run(
        [sys.executable, str(REPO / "tools/profile_prefill.py"), *args.split()],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "prefill: 3 x 40 tokens, 64 a step (~2 steps), 2 layers:" in out
    assert "aten::mm" in out  # the projections lead the operators
    ops = out.split("operator (self time; no GPU here)\n", 1)[1].strip().splitlines()
    assert len(ops) == 5


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--prompts", "0"], "must be >= 1"),
        (["--set", "BLOCK_ROWS"], "expected MODULE.NAME=INT"),
        (["--set", "afdserve.no_such_module.X=1"], "cannot import afdserve.no_such_module"),
        (["--set", "afdserve.bench.flops.nothing=1"], "has no integer constant nothing"),
        (["--set", "afdserve.bench.flops.active_parameters=1"], "no integer constant"),
        (["--set", "os.supports_bytes_environ=2"], "supports_bytes_environ is a switch: 0 or 1"),
    ],
)
def test_profile_prefill_refuses_bad_arguments(args, says):
    run = subprocess.run(
        [sys.executable, str(REPO / "tools/profile_prefill.py"), "--preset", "tiny", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert run.returncode == 2 and says in run.stderr, run.stderr[-2000:]
