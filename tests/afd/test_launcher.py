"""The launcher: rank failures surface with the rank's own error and leave no process behind."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
from safetensors.torch import load_file, save_file

from afdserve import LLM, SamplingParams
from afdserve.afd.launcher import WorkerError

from .conftest import GREEDY


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie still answers kill(0); read its state
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_shutdown_leaves_no_process(afd_models):
    with LLM(str(afd_models["mixtral"]), topology="2A1F", dtype="float32") as llm:
        pids = [p.pid for p in llm.engine.procs]
        assert all(_alive(pid) for pid in pids)
        llm.generate([[1, 2, 3]], GREEDY)
    assert not any(_alive(pid) for pid in pids)


def test_ffn_rank_failing_at_startup_shows_its_error(afd_models, tmp_path):
    """An FFN half missing an expert tensor: the FFN rank's CheckpointError reaches the caller."""
    broken = tmp_path / "broken"
    shutil.copytree(afd_models["qwen3_moe"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        LLM(str(broken), topology="2A1F", dtype="float32")
    message = str(info.value)
    assert "rank 2 failed during start-up" in message
    assert "CheckpointError" in message
    assert "model.layers.2.mlp.experts.5.down_proj.weight" in message
    assert time.monotonic() - start < 120
    assert not _stray_workers()


def _stray_workers() -> list[int]:
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().split(")")[-1].split()
        except OSError:
            continue
        if b"afdserve.afd.worker" in cmd and int(fields[1]) == me and fields[0] != "Z":
            found.append(int(entry))
    return found


def test_rank_dying_mid_serve_fails_requests_and_stops_all(afd_models):
    llm = LLM(str(afd_models["qwen3_moe"]), topology="2A1F", dtype="float32")
    pids = [p.pid for p in llm.engine.procs]
    try:
        llm.generate([[4, 5, 6]], GREEDY)
        os.kill(pids[2], signal.SIGKILL)  # the FFN rank
        start = time.monotonic()
        with pytest.raises(WorkerError, match="rank"):
            llm.generate([[7, 8, 9]], SamplingParams(max_tokens=50, temperature=0.0))
        assert time.monotonic() - start < 60
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 30
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in pids)
