"""The frontend <-> rank channel: both sides prove the key (HMAC-SHA256); frames are the message
codec's JSON, never pickle; a wrong key, a silent peer, or a peer holding the key that sends
garbage, a pickle, an unknown type, half a frame or an absurd length is dropped and logged without
holding up the others; a built-in world listens on loopback only, and its rendezvous store is a
file only this user can open."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import pickle
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from afdserve import LLM
from afdserve.afd.ranks import channel as channel_module
from afdserve.afd.ranks.channel import (
    CHALLENGE_BYTES,
    HANDSHAKE_TIMEOUT_S,
    MAX_FRAME_BYTES,
    ChannelError,
    RankListener,
    connect,
    read_key,
)
from afdserve.afd.ranks.codec import DecodeError, decode, encode
from afdserve.afd.ranks.messages import (
    AddRequest,
    Hello,
    Nudge,
    Outputs,
    Parted,
    RankReady,
    RankStats,
    Rejoin,
    Shutdown,
    WorkerSpec,
)
from afdserve.config import AFDConfig, EngineConfig, GraphConfig
from afdserve.engine.factory import MemoryReport
from afdserve.engine.requests import RequestLimits, TokenDelta
from afdserve.engine.sampling_params import RequestOutputKind, SamplingParams
from afdserve.engine.structured import StructuredOutputsParams

KEY = os.urandom(32)


@pytest.fixture
def listener():
    server = RankListener(("127.0.0.1", 0), KEY)
    yield server
    server.close()


def _wait_rejected(listener: RankListener, n: int, within: float = HANDSHAKE_TIMEOUT_S + 5) -> None:
    deadline = time.monotonic() + within
    while listener.rejected < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert listener.rejected == n


def _connected_pair(listener: RankListener, rank: int = 0) -> tuple:
    """(the rank's channel, the frontend's channel) of one authenticated connection, after the
    rank's Hello."""
    got = {}
    worker = threading.Thread(target=lambda: got.setdefault("conn", connect(listener.address, KEY)))
    worker.start()
    worker.join(5)
    got["conn"].send(Hello(rank))
    hello, frontend = listener.get(timeout=5)
    assert hello == Hello(rank)
    return got["conn"], frontend


def test_both_sides_prove_the_key(listener):
    rank, conn = _connected_pair(listener, 2)
    conn.send(Shutdown())
    assert rank.recv(timeout=5) == Shutdown()
    with pytest.raises(ChannelError):
        connect(listener.address, os.urandom(32))  # the frontend drops it: the peer sees it
    _wait_rejected(listener, 1)
    assert listener.get(timeout=0.2) is None


def test_both_ends_send_each_message_at_once(listener):
    """Nagle's algorithm is off at both ends: a message is one write and waits for no
    acknowledgement of the one before."""
    rank, frontend = _connected_pair(listener)
    for conn in (rank, frontend):
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


def test_a_ranks_next_output_is_not_held_after_the_frontend_sent(listener):
    """The pattern of a served request: the rank streams outputs, the frontend sends a request,
    the rank's next outputs follow. With Nagle's algorithm on, that next message waited for the
    frontend's delayed acknowledgement (40 ms on Linux) every time; the median of several rounds
    stays far below it even on a loaded machine."""
    rank, frontend = _connected_pair(listener)
    delays = []
    for _ in range(7):
        rank.send(Nudge())
        assert frontend.recv(timeout=5) == Nudge()
        frontend.send(Nudge())  # a request to the rank
        assert rank.recv(timeout=5) == Nudge()
        rank.send(Nudge())  # the first output after it
        assert frontend.recv(timeout=5) == Nudge()
        time.sleep(0.005)  # the rank's next step
        start = time.monotonic()
        rank.send(Nudge())
        assert frontend.recv(timeout=5) == Nudge()
        delays.append(time.monotonic() - start)
    assert sorted(delays)[len(delays) // 2] < 0.02, delays


def test_a_frontend_without_the_key_is_refused():
    """Keys differ: the handshake fails on both sides, and the rank gets no connection."""
    impostor = RankListener(("127.0.0.1", 0), os.urandom(32))
    try:
        with pytest.raises(ChannelError):
            connect(impostor.address, KEY)
    finally:
        impostor.close()


def test_silent_peers_do_not_block_others(listener):
    silent = [socket.create_connection(listener.address) for _ in range(3)]
    try:
        start = time.monotonic()
        conn = connect(listener.address, KEY)
        conn.send(Hello(0))
        assert listener.get(timeout=5) is not None
        assert time.monotonic() - start < 2.0  # not queued behind the silent ones
        conn.close()
        _wait_rejected(listener, 3)  # each dropped after the handshake deadline
    finally:
        for s in silent:
            s.close()


# --- rogue peers: real sockets speaking the handshake by hand ---------------------------------


def _mac(key: bytes, role: bytes, challenge: bytes) -> bytes:
    import hmac

    return hmac.new(key, role + challenge, hashlib.sha256).digest()


def _authenticated_socket(address, key: bytes = KEY) -> socket.socket:
    """A peer that holds the key and passes the handshake, then sends what the test says."""
    sock = socket.create_connection(address, timeout=5)
    challenge = sock.recv(CHALLENGE_BYTES, socket.MSG_WAITALL)
    mine = os.urandom(CHALLENGE_BYTES)
    sock.sendall(_mac(key, b"afdserve-rank", challenge) + mine)
    assert sock.recv(32, socket.MSG_WAITALL) == _mac(key, b"afdserve-frontend", mine)
    return sock


class _TouchOnLoad:
    """Unpickling this creates a file: proof of code run by a pickle."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _frame(payload: bytes) -> bytes:
    return struct.pack("!I", len(payload)) + payload


ROGUES = {
    "wrong key": lambda addr, tmp: _send_raw(addr, wrong_key=True),
    "garbage bytes": lambda addr, tmp: _send_raw(addr, garbage=os.urandom(64)),
    "a pickle": lambda addr, tmp: _send_raw(
        addr, _frame(pickle.dumps(_TouchOnLoad(tmp / "pwned")))
    ),
    "a pickled Hello": lambda addr, tmp: _send_raw(addr, _frame(pickle.dumps(Hello(0)))),
    "an unknown type": lambda addr, tmp: _send_raw(addr, _frame(b'["Evil",[0]]')),
    "a field of the wrong type": lambda addr, tmp: _send_raw(addr, _frame(b'["Hello",["0"]]')),
    "an extra field": lambda addr, tmp: _send_raw(addr, _frame(b'["Hello",[0,"os.system"]]')),
    "not a Hello first": lambda addr, tmp: _send_raw(addr, _frame(encode(Shutdown()))),
    "an absurd length": lambda addr, tmp: _send_raw(addr, struct.pack("!I", MAX_FRAME_BYTES + 1)),
    "half a frame, then silence": lambda addr, tmp: _send_raw(
        addr, struct.pack("!I", 100) + b'["Hello",'
    ),
    "half a frame, then gone": lambda addr, tmp: _send_raw(
        addr, struct.pack("!I", 100) + b"{", close=True
    ),
}
_held: list[socket.socket] = []


def _send_raw(
    address,
    payload: bytes = b"",
    wrong_key: bool = False,
    garbage: bytes = b"",
    close: bool = False,
) -> None:
    """Kept open unless `close`: the frontend must decide on what was sent, not on an EOF."""
    if wrong_key or garbage:
        sock = socket.create_connection(address, timeout=5)
        sock.recv(CHALLENGE_BYTES, socket.MSG_WAITALL)
        sock.sendall(garbage or (os.urandom(32) + os.urandom(CHALLENGE_BYTES)))
    else:
        sock = _authenticated_socket(address)
        sock.sendall(payload)
    if close:
        sock.close()
    else:
        _held.append(sock)
        # The frontend has long given up on the oldest (its handshake deadline): close them, so a
        # long start-up does not run the test out of file descriptors.
        while len(_held) > 64:
            _held.pop(0).close()


@pytest.mark.parametrize("rogue", list(ROGUES))
def test_a_rogue_peer_is_dropped_and_logged(listener, rogue, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=channel_module.__name__)
    ROGUES[rogue](listener.address, tmp_path)
    good = connect(listener.address, KEY)  # a real rank, right behind the rogue
    good.send(Hello(1))
    start = time.monotonic()
    got = listener.get(timeout=5)
    assert got is not None and got[0] == Hello(1)
    assert time.monotonic() - start < 2.0  # not held up by the rogue
    _wait_rejected(listener, 1)
    assert listener.get(timeout=0.2) is None  # the rogue never reaches the world
    assert "rejected a rank connection from 127.0.0.1" in caplog.text
    assert not (tmp_path / "pwned").exists()  # nothing was unpickled
    for sock in _held:
        sock.close()
    _held.clear()


def test_a_rank_that_sends_a_malformed_frame_mid_stream_is_an_error_not_a_hang(listener):
    """After the Hello: half a frame leaves poll() False at once (no blocking read); a frame
    that is not a message is a ChannelError for the caller to drop."""
    sock = _authenticated_socket(listener.address)
    sock.sendall(_frame(encode(Hello(0))))
    _, conn = listener.get(timeout=5)
    sock.sendall(struct.pack("!I", 50) + b"[")
    start = time.monotonic()
    assert conn.poll(0.1) is False and time.monotonic() - start < 1.0
    sock.sendall(b"x" * 49)  # the rest of the frame: 50 bytes of not-JSON
    assert conn.poll(2.0) is True
    with pytest.raises(ChannelError, match="malformed"):
        conn.recv()
    sock.close()


# --- the codec ----------------------------------------------------------------------------------


def test_every_message_type_round_trips_equal(afd_models):
    """The oracle is equality with what was sent, for each message type, with nested
    dataclasses, optional fields, dicts keyed by token id, tuples of tuples and inf/nan."""
    params = SamplingParams(
        max_tokens=5,
        temperature=0.7,
        seed=-(2**63),
        stop=("x",),
        logit_bias={3: -1.5},
        logprobs=2,
        structured_outputs=None,
        bad_words=("never",),
        allowed_token_ids=(1, 2, 3),
        output_kind=RequestOutputKind.DELTA,
    )
    spec = WorkerSpec(
        EngineConfig(model=str(afd_models["qwen3_moe"]), max_model_len=128),
        AFDConfig(
            topology="2A2F",
            log_step_plan="plan.jsonl",
            ffn_expert_parallel=True,
            expert_placement=((0, 1), (2, 3)),
        ),
        GraphConfig(),
        log_path=None,
        threads=2,
    )
    delta = TokenDelta(
        "r1", (5, 6), ({5: -0.1, 7: -math.inf}, None), False, None, 2, 123.5, None, 124.0
    )
    messages = [
        spec,
        Hello(3),
        Shutdown(),
        Nudge(),
        RankReady(
            0,
            "attention",
            MemoryReport("attention", 0, 10, 20, 3, None, "bfloat16", 4),
            ("a.weight", "b.bias"),
            RequestLimits(128, 1000, 64, 16),
        ),
        RankReady(
            2,
            "ffn",
            MemoryReport("ffn", 2, 10, 0, 3),
            ("c.weight",),
            None,
            generation=3,
            loads=1,
        ),
        dataclasses.replace(spec, store_path="/tmp/afdserve-store-x/store.3", generation=3),
        Rejoin(3, "/tmp/afdserve-store-x/store.3"),
        Parted(1, "Traceback ...\nRuntimeError: Connection closed by peer"),
        AddRequest("r1", (1, 2, 3), params),
        AddRequest(
            "r2",
            (4,),
            SamplingParams(structured_outputs=StructuredOutputsParams(choice=("yes", "no"))),
        ),
        Outputs(1, (delta,), RankStats(1, 2, 0.25, {"attention:eager": 7})),
    ]
    for message in messages:
        assert decode(encode(message)) == message
    nan = decode(
        encode(Outputs(0, (dataclasses.replace(delta, arrival_time=math.nan),), RankStats()))
    )
    assert math.isnan(nan.outputs[0].arrival_time)


_LOGIT_BIAS = [f.name for f in dataclasses.fields(SamplingParams)].index("logit_bias")


def _add_request(field: int, value: object) -> bytes:
    """A well-formed AddRequest frame with one field of its SamplingParams replaced."""
    import json

    frame = json.loads(encode(AddRequest("a", (1,), SamplingParams())))
    frame[1][2][field] = value
    return json.dumps(frame).encode()


@pytest.mark.parametrize(
    "frame, why",
    [
        (b"\x80\x04K\x01.", "not a JSON frame"),
        (b'{"rank":0}', "a frame is"),
        (b'["WorkerSpec"]', "a frame is"),
        (b'["os.system",{}]', "unknown message type"),
        (b'["Hello",[]]', "Hello"),  # a missing field
        (b'["Hello",{"rank":0}]', "a list of its 1 fields"),
        (b'["Hello",[true]]', "Hello.rank: expected int, got bool"),
        (_add_request(0, 0), "max_tokens"),  # SamplingParams' own check
        (_add_request(_LOGIT_BIAS, {"x1": 2.0}), "a key must be an integer"),
        (_add_request(_LOGIT_BIAS, [[1, 2.0]]), "expected an object"),
        (b"[" * 100000 + b"]" * 100000, "not a JSON frame"),
    ],
)
def test_decoding_refuses_what_is_not_a_message(frame, why):
    with pytest.raises(DecodeError, match=why):
        decode(frame)


def test_encoding_refuses_what_is_not_a_message():
    with pytest.raises(TypeError, match="not a frontend <-> rank message"):
        encode({"hello": 1})


# --- the key ------------------------------------------------------------------------------------


def test_the_key_comes_from_the_environment_or_a_file_and_no_error_shows_it(tmp_path):
    key = os.urandom(32)
    assert read_key({}) is None
    assert read_key({"AFDSERVE_AUTHKEY": key.hex()}) == key
    (tmp_path / "k").write_text(key.hex() + "\n")
    assert read_key({"AFDSERVE_AUTHKEY_FILE": str(tmp_path / "k")}) == key
    with pytest.raises(ValueError, match="cannot be read"):
        read_key({"AFDSERVE_AUTHKEY_FILE": str(tmp_path / "missing")})
    bad = "zz" + key.hex()
    with pytest.raises(ValueError, match="AFDSERVE_AUTHKEY: must be a hex string") as info:
        read_key({"AFDSERVE_AUTHKEY": bad})
    assert bad not in str(info.value)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        read_key({"AFDSERVE_AUTHKEY": "abcd"})


def _listening_inodes() -> dict[str, str]:
    """inode -> local address of every listening TCP socket (IPv4 and IPv6)."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    out[fields[9]] = fields[1]
    return out


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _is_loopback(address: str) -> bool:
    host = address.split(":")[0]
    if len(host) == 8:  # IPv4, little-endian hex: 127.x.x.x ends in 7F
        return host.endswith("7F")
    return host in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def _store_path(pid: int) -> str:
    with open(f"/proc/{pid}/environ", "rb") as f:
        env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    return env[b"AFDSERVE_STORE_PATH"].decode()


def _can_open_as_nobody(path: str) -> bool:
    """Whether another user could read the rendezvous store (needs root to become nobody)."""
    code = (
        f"import os; os.setgid(65534); os.setuid(65534)\n"
        f"try:\n open({path!r}, 'rb'); print('open')\n"
        f"except PermissionError: print('denied')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() in ("open", "denied"), out.stderr
    return out.stdout.strip() == "open"


def test_a_built_in_world_listens_on_loopback_only(afd_models):
    """No socket beyond loopback; the rendezvous store is a file in a 0700 directory that
    another user cannot open, removed at shutdown."""
    with LLM(str(afd_models["qwen3_moe"]), topology="2A1F", dtype="float32") as llm:
        listening = _listening_inodes()
        procs = llm.engine.core_client.world.procs
        pids = [os.getpid()] + [p.pid for p in procs]
        mine = {
            inode: listening[inode]
            for pid in pids
            for inode in _socket_inodes(pid)
            if inode in listening
        }
        store = _store_path(procs[0].pid)
        store_dir = os.path.dirname(store)
        assert stat.S_IMODE(os.stat(store_dir).st_mode) == 0o700
        assert os.stat(store_dir).st_uid == os.getuid()
        assert os.path.exists(store)
        if os.getuid() == 0:
            assert not _can_open_as_nobody(store)
    assert mine, "the world listens on no TCP socket at all"
    assert {a for a in mine.values() if not _is_loopback(a)} == set()
    assert not os.path.exists(store_dir)


def _rogues_at(
    address: tuple[str, int], stop: threading.Event, tried: list[str], round_done: threading.Event
) -> None:
    """Knock until the frontend listens, then send every kind of bad opening, over and over;
    `round_done` is set once every kind has reached the frontend."""
    kinds = [k for k in ROGUES if k != "half a frame, then silence"] + [
        "half a frame, then silence"
    ]
    while not stop.is_set():
        for kind in kinds:
            try:
                ROGUES[kind](address, Path("/nonexistent"))
                tried.append(kind)
            except (OSError, AssertionError):
                time.sleep(0.05)  # not listening yet, or closed after start-up
            if stop.is_set():
                return
        if set(tried) == set(ROGUES):
            round_done.set()


def test_a_world_starts_and_serves_with_rogues_at_its_door(afd_models, monkeypatch, caplog):
    """Ranks started elsewhere (the torchrun path) join a frontend that rogue peers, some holding
    the key, keep knocking on: the ranks start only once every kind of rogue has reached the
    frontend, and the rogues go on knocking while the ranks connect. The world starts, answers
    like the colocated engine, and the log says where the key came from but never shows it.
    Once every rank is in, the port closes."""
    from afdserve.frontend.process import free_port

    from .conftest import GREEDY, colocated_tokens

    caplog.set_level(logging.INFO)
    # The world's key is KEY, the one the authenticated rogues hold (_authenticated_socket):
    # with any other key those rogues would fail their own handshake and never reach the world.
    key, frontend, master = KEY.hex(), free_port(), free_port()
    monkeypatch.setenv("AFDSERVE_AUTHKEY", key)
    # Short, so the silent rogue costs little, but not so short that a real rank misses it: the
    # deadline runs from accept to the rank's Hello, and on a loaded 2-core box (three ranks
    # importing torch beside the frontend) 1 s was missed now and then, which left the world a
    # rank short until its start-up timeout.
    monkeypatch.setattr(channel_module, "HANDSHAKE_TIMEOUT_S", 3.0)
    address = ("127.0.0.1", frontend)
    stop, round_done, tried = threading.Event(), threading.Event(), []
    knocker = threading.Thread(
        target=_rogues_at, args=(address, stop, tried, round_done), daemon=True
    )
    knocker.start()
    procs: list[subprocess.Popen] = []

    def start_ranks() -> None:
        if not round_done.wait(timeout=120):
            return  # the assertion below names it; the frontend's start-up times out
        for rank in range(3):
            env = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(master),
                WORLD_SIZE="3",
                RANK=str(rank),
                AFDSERVE_FRONTEND=f"127.0.0.1:{frontend}",
            )
            procs.append(
                subprocess.Popen([sys.executable, "-m", "afdserve.afd.ranks.worker"], env=env)
            )

    starter = threading.Thread(target=start_ranks, daemon=True)
    starter.start()
    model = afd_models["qwen3_moe"]
    prompts = [[3, 4, 5], [6, 7]]
    try:
        with LLM(
            str(model), topology="2A1F", dtype="float32", frontend_address=f"127.0.0.1:{frontend}"
        ) as llm:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection(address, timeout=5)
            got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            stop.set()
        starter.join(timeout=10)
        for p in procs:
            assert p.wait(timeout=30) == 0
    finally:
        stop.set()
        starter.join(timeout=10)
        for p in procs:
            if p.poll() is None:
                p.kill()
        for sock in _held:
            sock.close()
        _held.clear()
    assert round_done.is_set(), f"only {sorted(set(tried))} reached the frontend"
    assert got == colocated_tokens(model, prompts)
    assert "rejected a rank connection" in caplog.text
    assert "the key from AFDSERVE_AUTHKEY" in caplog.text and key not in caplog.text


def test_a_frontend_without_a_key_writes_one_to_a_private_file(monkeypatch, caplog, afd_models):
    """Ranks started elsewhere, no key given: the log names a 0600 file holding a fresh key,
    not the key; a start that fails (no rank came) removes the file."""
    from afdserve.afd.ranks.world import RankWorld, WorkerError

    monkeypatch.delenv("AFDSERVE_AUTHKEY", raising=False)
    monkeypatch.delenv("AFDSERVE_AUTHKEY_FILE", raising=False)
    caplog.set_level(logging.INFO)
    seen: dict = {}

    class WhileWaiting(logging.Handler):
        """Reads the file while the frontend waits for ranks: the moment they would read it."""

        def emit(self, record: logging.LogRecord) -> None:
            if "waiting for 2 ranks" in record.getMessage():
                path = record.getMessage().split("AFDSERVE_AUTHKEY_FILE=")[1].strip()
                seen.update(path=path, mode=stat.S_IMODE(os.stat(path).st_mode))
                seen["key"] = read_key({"AFDSERVE_AUTHKEY_FILE": path})

    handler = WhileWaiting()
    world_log = logging.getLogger("afdserve.afd.ranks.world")
    world_log.addHandler(handler)
    spec = WorkerSpec(
        EngineConfig(model=str(afd_models["qwen3_moe"])), AFDConfig(topology="1A1F"), GraphConfig()
    )
    try:
        with pytest.raises(WorkerError, match="0 of 2 ranks connected"):
            RankWorld(spec, spawn=False, startup_timeout_s=0.5)
    finally:
        world_log.removeHandler(handler)
    assert seen["mode"] == 0o600
    assert seen["key"] is not None and seen["key"].hex() not in caplog.text
    assert not os.path.exists(seen["path"])


_OUT_OF_DESCRIPTORS = """
import logging, os, resource, socket, sys, time
from afdserve.afd.ranks import channel
from afdserve.afd.ranks.messages import Hello
logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
channel.HANDSHAKE_TIMEOUT_S = 0.5
key = os.urandom(32)
listener = channel.RankListener(("127.0.0.1", 0), key)
used = len(os.listdir("/proc/self/fd"))
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 16, hard))
held = []
try:  # peers that connect and say nothing, until the process has no descriptor left
    for _ in range(64):
        held.append(socket.create_connection(listener.address, timeout=1))
except OSError:
    pass
time.sleep(1.0)  # accept has met EMFILE by now (its log line); the held peers are timed out
for sock in held:
    sock.close()
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
conn = channel.connect(listener.address, key)
conn.send(Hello(2))
got = listener.get(timeout=10)
print("RANK", None if got is None else got[0].rank)
"""


def test_the_listener_outlives_running_out_of_file_descriptors() -> None:
    """Peers that hold connections open until the frontend has no file descriptor left make
    accept fail (EMFILE); the listener logs it and keeps listening, so the rank that comes once
    they are gone still gets in."""
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("needs /proc/self/fd to count the open descriptors")
    run = subprocess.run(
        [sys.executable, "-c", _OUT_OF_DESCRIPTORS], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    assert "accepting a rank connection failed" in run.stdout, run.stdout
    assert "RANK 2" in run.stdout, run.stdout


def test_a_waker_ends_a_wait_on_connections_and_drains():
    """Another thread's wake() ends a wait that includes the waker at once; drained, the waker
    is quiet again; wakes pile up without blocking and are ignored once it is closed."""
    from multiprocessing.connection import wait

    from afdserve.afd.ranks.channel import Waker

    waker = Waker()
    quiet_a, quiet_b = socket.socketpair()  # a connection that never speaks
    try:
        assert wait([quiet_a, waker], timeout=0.0) == []
        timer = threading.Timer(0.05, waker.wake)
        started = time.monotonic()
        timer.start()
        assert wait([quiet_a, waker], timeout=30.0) == [waker]
        assert time.monotonic() - started < 10.0  # woken, not timed out
        timer.join()
        waker.drain()
        assert wait([quiet_a, waker], timeout=0.0) == []
        for _ in range(100_000):  # far more than a socket buffer holds: never blocks
            waker.wake()
        assert wait([waker], timeout=0.0) == [waker]
        waker.drain()
        assert wait([waker], timeout=0.0) == []
    finally:
        waker.close()
        quiet_a.close()
        quiet_b.close()
    waker.wake()  # closed: ignored
