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


def test_idle_of_splits_the_gpus_idle_time_and_blames_late_launches():
    sys.path.insert(0, str(REPO / "tools"))
    from profile_prefill import DeviceSpan, idle_of

    spans = [
        DeviceSpan(130.0, 150.0, "c", launched=140.0, where="model.py:3"),  # launched late
        DeviceSpan(10.0, 50.0, "a", launched=5.0),
        DeviceSpan(40.0, 100.0, "b", launched=6.0),  # overlaps a: no gap between them
        DeviceSpan(160.0, 170.0, "d", launched=20.0),  # queued early: a gap of the GPU's own
        DeviceSpan(171.0, 180.0, "e"),  # no launch linked: never blamed on the host
    ]
    idle = idle_of(spans, begin=0.0, end=200.0)
    assert (idle.first, idle.last) == (10.0, 20.0)
    assert [(g.idle, g.host_late, g.before, g.after.name) for g in idle.gaps] == [
        (30.0, 30.0, "b", "c"),
        (10.0, 0.0, "c", "d"),
        (1.0, 0.0, "d", "e"),
    ]
    assert (idle.between, idle.host_late) == (41.0, 30.0)
    assert idle.gaps[0].after.where == "model.py:3"
    assert idle_of([], 0.0, 5.0).first == 5.0
