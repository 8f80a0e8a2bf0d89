"""The launcher: rank failures surface with the rank's own error and leave no process behind."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
from safetensors.torch import load_file, save_file

from afdserve import LLM, SamplingParams
from afdserve.frontend.process import WorkerError

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
        pids = [p.pid for p in llm.engine.core_client.world.procs]
        assert all(_alive(pid) for pid in pids)
        llm.generate([[1, 2, 3]], GREEDY)
    assert not any(_alive(pid) for pid in pids)


def test_ffn_rank_failing_at_startup_shows_its_error(afd_models, tmp_path):
    """An FFN half with an expert tensor of the wrong shape (the frontend's preflight reads
    names, not shapes): the FFN rank's CheckpointError reaches the caller."""
    broken = tmp_path / "broken"
    shutil.copytree(afd_models["qwen3_moe"], broken)
    tensors = load_file(str(broken / "model.safetensors"))
    name = "model.layers.2.mlp.experts.5.down_proj.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
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
        if b"afdserve.afd.ranks.worker" in cmd and int(fields[1]) == me and fields[0] != "Z":
            found.append(int(entry))
    return found


def test_rank_dying_mid_serve_fails_requests_and_stops_all(afd_models):
    llm = LLM(str(afd_models["qwen3_moe"]), topology="2A1F", dtype="float32")
    pids = [p.pid for p in llm.engine.core_client.world.procs]
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


def test_ranks_started_elsewhere_join_the_frontend(afd_models, monkeypatch):
    """The torchrun path: ranks are started by someone else with env:// variables and connect to a
    frontend that only listens."""
    import subprocess
    import sys

    from afdserve.frontend.process import free_port

    key, frontend, master = os.urandom(16).hex(), free_port(), free_port()
    monkeypatch.setenv("AFDSERVE_AUTHKEY", key)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "afdserve.afd.ranks.worker"],
            env=dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master),
                WORLD_SIZE="3",
                RANK=str(rank),
                AFDSERVE_FRONTEND=f"127.0.0.1:{frontend}",
            ),
        )
        for rank in range(3)
    ]
    try:
        model = afd_models["qwen3_moe"]
        with LLM(
            str(model), topology="2A1F", dtype="float32", frontend_address=f"127.0.0.1:{frontend}"
        ) as llm:
            got = llm.generate([[3, 4, 5], [6, 7]], GREEDY)
        with LLM(str(model), dtype="float32") as ref:
            want = ref.generate([[3, 4, 5], [6, 7]], GREEDY)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for p in procs:
            assert p.wait(timeout=30) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


@pytest.mark.parametrize(
    ("topology", "device", "gpus", "spawned", "chosen"),
    [
        ("1A1F", "cuda", 2, True, "ipc"),  # a GPU per rank on this host: the fastest data plane
        ("2A2F", "cuda", 8, True, "ipc"),
        ("1A1F", "cuda", 1, True, "inprocess"),  # one GPU: both halves in one process
        ("2A1F", "cuda", 2, True, "p2p"),  # fewer GPUs than ranks: NCCL refuses, as it says
        ("1A1F", "cuda", 2, False, "p2p"),  # ranks started elsewhere (torchrun): maybe 2 hosts
        ("2A1F", "cpu", 0, True, "p2p"),
        ("colocated", "cuda", 2, True, "auto"),  # no data plane at all
    ],
)
def test_auto_connector_resolves_by_where_ranks_run(topology, device, gpus, spawned, chosen):
    from afdserve.config import AFDConfig

    resolved = AFDConfig(topology=topology).resolve_connector(device, gpus, spawned)
    assert resolved.connector == chosen
    assert (
        AFDConfig(topology=topology, connector="p2p")
        .resolve_connector(device, gpus, spawned)
        .connector
        == "p2p"
    )  # an explicit choice is kept
    # MTP's draft passes are not carried over ipc: auto picks p2p for them where it would.
    mtp = AFDConfig(topology=topology).resolve_connector(device, gpus, spawned, mtp=True)
    assert mtp.connector == ("p2p" if chosen == "ipc" else chosen)


def test_ipc_needs_cuda_and_an_afd_topology():
    from afdserve.config import AFDConfig

    with pytest.raises(ValueError, match="connector='ipc' needs device='cuda'"):
        AFDConfig(topology="1A1F", connector="ipc").check_device("cpu")
    with pytest.raises(ValueError, match="needs an AFD topology"):
        AFDConfig(topology="colocated", connector="ipc")
    with pytest.raises(ValueError, match="connector='ipc' needs device='cuda'"):
        LLM(None, topology="1A1F", connector="ipc", device="cpu")
