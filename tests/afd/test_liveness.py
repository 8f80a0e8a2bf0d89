"""A rank that dies or stops (SIGSTOP) under load is noticed within the heartbeat timeout: the
client fails with an error naming the cause, and no rank process is left behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from afdserve import LLM, SamplingParams
from afdserve.frontend.process import WorkerError

HEARTBEAT_S = 3.0
LOAD = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped) is gone too
        return f.read().split(") ")[1][0] != "Z"


@pytest.mark.parametrize(
    ("victim", "sig", "within_s", "control_plane"),
    [
        (2, signal.SIGSTOP, HEARTBEAT_S + 3, "shm"),  # the FFN rank hangs mid-load
        (1, signal.SIGSTOP, HEARTBEAT_S + 3, "shm"),  # an attention rank hangs
        (0, signal.SIGKILL, 3.0, "shm"),  # an attention rank dies: seen at once
        (2, signal.SIGKILL, 3.0, "shm"),  # the FFN rank dies
        (2, signal.SIGSTOP, HEARTBEAT_S + 3, "gloo"),
        (0, signal.SIGKILL, 3.0, "gloo"),
    ],
)
def test_dead_or_hung_rank_fails_the_engine_quickly(
    afd_models, victim, sig, within_s, control_plane
):
    llm = LLM(
        str(afd_models["qwen3_moe"]),
        topology="2A1F",
        dtype="float32",
        heartbeat_timeout_s=HEARTBEAT_S,
        max_num_batched_tokens=16,
        control_plane=control_plane,
    )
    pids = [p.pid for p in llm.engine.core_client.world.procs]
    try:
        for i in range(4):
            llm.engine.add_request(f"r{i}", [1 + i, 2, 3, 4], LOAD)
        for _ in range(5):
            llm.engine.step()
        os.kill(pids[victim], sig)
        start = time.monotonic()
        with pytest.raises(WorkerError) as failure:
            while time.monotonic() - start < 60:
                llm.engine.step()
        elapsed = time.monotonic() - start
    finally:
        llm.shutdown()
    assert elapsed < within_s, (elapsed, str(failure.value))
    if sig == signal.SIGSTOP:
        assert "made no progress" in str(failure.value)
    assert not [pid for pid in pids if _alive(pid)]
