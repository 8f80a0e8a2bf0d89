"""Two hosts for real, on one machine: a world that spans a network, and what it does when a host is
lost. As root:

    PYTHONPATH=$PWD python tools/two_hosts.py --topology 2A1F --loss kill --outage 2

makes two Linux network namespaces, host A and host B, joined by a veth pair (10.231.0.1/30 and
10.231.0.2/30, the interface named `veth0` on both, like eth0 on two real hosts), and runs in them
what README.md ("Across hosts with torchrun") tells an operator to run:

- host A: `afdserve serve` (the bundled tiny model, CPU, `--on-engine-failure restart`) with
  `--frontend-address 10.231.0.1:5555`, and torchrun's first node, which holds the c10d rendezvous
  (10.231.0.1:29500) and runs the attention ranks [0, A);
- host B: torchrun's second node, the FFN ranks [A, A + F): every hidden row crosses the link.

What torchrun needs beyond the README's line (`start_node` says why for each): `--local-addr`
(its nodes are numbered by address, so host A's ranks come first), `--rdzv-conf is_host=1` on the
rendezvous host, `--max-restarts` (host A's torchrun restarts its ranks once their world broke,
so that they connect to the frontend's next world) and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.

It serves two greedy completions (curl inside host A: the reference), starts them again as
streams, loses host B in their middle (`kill`: every process of host B SIGKILLed, so their
sockets reset; `cut`: B's link down first, so that nothing reaches host A, then its processes
killed), sends a third stream while B is lost, waits `--outage` s, brings B back (link up, its
torchrun started again) and prints one JSON object: the start-up, the bytes the link carried for
the reference, how long the frontend took to notice (/health 503), what became of each stream
("resumed": the reference's tokens exactly; or "failed" with its error event), and how long after
B's torchrun started again /health answered 200 and a new request was served. torchrun forgets
a dead node 15 s after its last heartbeat (`keep_alive_interval` 5 s x `keep_alive_max_attempt`
3): B's new node joins no sooner, so a short outage shows that wait in the return time.

Everything stays on loopback and on 10.231.0.0/30 inside the two namespaces (they have no other
route); the namespaces, the veth pair and every process started are removed at the end, also on
failure or Ctrl-C. Needs root (ip netns), iproute2 and curl.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.231.0"  # .1 host A, .2 host B: a /30 of the namespaces' own
LINK = "veth0"
FRONTEND_PORT = 5555  # the rank channel, on host A's link address
RDZV_PORT = 29500  # torchrun's c10d rendezvous, on host A's link address
HTTP_PORT = 8000  # the OpenAI API, on host A's loopback
STARTUP_S = 300.0  # a cold start of the frontend and two torchruns on a busy 2-core machine
RETURN_S = 120.0  # host B back -> serving again, at most (the target is 30 s)
COMMAND_S = 20.0  # one `ip` or curl call


def namespaces_refused() -> str | None:
    """None where this machine lets this process make network namespaces and veth pairs, else
    why not (not root, no iproute2 or curl, a container without CAP_SYS_ADMIN)."""
    for tool in ("ip", "curl"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    probe = f"afdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"`ip netns add` refused: {made.stderr.strip() or made.returncode}"
    try:
        veth = subprocess.run(
            ["ip", "-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"],
            capture_output=True,
            text=True,
        )
        if veth.returncode:
            return f"`ip link add ... type veth` refused: {veth.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def ip(*args: str) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=COMMAND_S)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout


@dataclass
class Host:
    """One network namespace: a host with loopback and one interface on the link."""

    netns: str
    address: str
    procs: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, argv: list[str], env: dict[str, str], log: Path, **kw) -> subprocess.Popen:
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *argv],
                env=env,
                stdout=kw.pop("stdout", out),
                stderr=out,
                stdin=subprocess.DEVNULL,
                **kw,
            )
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        done = subprocess.run(
            ["ip", "netns", "pids", self.netns], capture_output=True, text=True, timeout=COMMAND_S
        )
        return [int(pid) for pid in done.stdout.split()]

    def kill_all(self) -> None:
        """SIGKILL every process in this namespace (a host that loses power), then reap ours."""
        for _ in range(5):  # a process may fork while the others die
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = [proc for proc in self.procs if proc.poll() is None]

    def link(self, up: bool) -> None:
        ip("-n", self.netns, "link", "set", LINK, "up" if up else "down")

    def link_bytes(self) -> int:
        """Bytes sent plus received on the link interface so far."""
        stats = json.loads(ip("-n", self.netns, "-s", "-j", "link", "show", LINK))[0]["stats64"]
        return stats["rx"]["bytes"] + stats["tx"]["bytes"]


def netns_prefix() -> str:
    """The names of this process's namespaces start with it (so `sweep` finds only ours)."""
    return f"afd{os.getpid()}-"


def sweep() -> list[str]:
    """Kill every process in this process's namespaces and delete them; their names. The last
    line of defence (a pytest finalizer): `TwoHosts` removes its own when it closes."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]
    ours = [name for name in names if name.startswith(netns_prefix())]
    for name in ours:
        Host(name, "").kill_all()
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ours


class TwoHosts:
    """Hosts A and B: two namespaces and the veth pair between them; `close` (or leaving the
    `with`) kills every process in them and deletes both (the veth pair goes with them)."""

    def __init__(self) -> None:
        tag = netns_prefix()
        self.a = Host(f"{tag}a", f"{SUBNET}.1")
        self.b = Host(f"{tag}b", f"{SUBNET}.2")
        self.made: list[Host] = []
        try:
            for host in (self.a, self.b):
                ip("netns", "add", host.netns)
                self.made.append(host)
                ip("-n", host.netns, "link", "set", "lo", "up")
            veth = f"link add name {LINK} netns {self.a.netns} type veth peer name {LINK} netns"
            ip(*veth.split(), self.b.netns)
            for host in (self.a, self.b):
                ip("-n", host.netns, "addr", "add", f"{host.address}/30", "dev", LINK)
                host.link(up=True)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for host in self.made:
            host.kill_all()
            subprocess.run(["ip", "netns", "del", host.netns], capture_output=True)
        self.made = []


def flags(**values: object) -> list[str]:
    """`--name value` for each keyword (underscores become dashes)."""
    return [
        part
        for name, value in values.items()
        for part in (f"--{name.replace('_', '-')}", str(value))
    ]


def base_env(key: str) -> dict[str, str]:
    """Every process gets the same key: a frontend given none makes a new one at each restart of
    its world, which the ranks started elsewhere would not hold."""
    return dict(os.environ, AFDSERVE_AUTHKEY=key, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def start_frontend(host: Host, topology: str, key: str, logs: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "afdserve.cli", "serve"] + flags(
        topology=topology,
        device="cpu",
        host="127.0.0.1",
        port=HTTP_PORT,
        frontend_address=f"{host.address}:{FRONTEND_PORT}",
        on_engine_failure="restart",
        heartbeat_timeout=4,
    )
    return host.popen(argv, base_env(key), logs / "frontend.log")


def start_node(host: Host, head: Host, nproc: int, key: str, logs: Path) -> subprocess.Popen:
    """torchrun on `host`, one of the two nodes; `head` holds the rendezvous and the frontend.
    `is_host` is said outright: torchrun guesses it from the machine's hostname, which both
    namespaces share and which resolves to neither link address. torchrun numbers the nodes in
    the order of their `--local-addr` (else their FQDN, then pid), so the head's come first.
    `--max-restarts`: a rank whose world broke exits 1, and its node's torchrun starts it again
    (after a new rendezvous, which waits for the lost host) to connect to the next world."""
    argv = [sys.executable, "-m", "torch.distributed.run"] + flags(
        nnodes=2,
        nproc_per_node=nproc,
        rdzv_backend="c10d",
        rdzv_endpoint=f"{head.address}:{RDZV_PORT}",
        rdzv_id="afdserve-two-hosts",
        rdzv_conf=f"is_host={int(host is head)}",
        local_addr=host.address,
        max_restarts=3,
        monitor_interval=0.5,
    )
    argv += ["-m", "afdserve.afd.ranks.worker"]
    env = dict(
        base_env(key),
        AFDSERVE_FRONTEND=f"{head.address}:{FRONTEND_PORT}",
        GLOO_SOCKET_IFNAME=LINK,
        LOGLEVEL="INFO",  # torchrun's own log: rendezvous rounds, worker restarts
        # torch 2.13's shared rendezvous store does not publish MASTER_ADDR again when node 0
        # stays node 0 in a later round, so a replaced node waits for it until the store times
        # out: each round's rank 0 worker hosts the world's store instead.
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    return host.popen(argv, env, logs / f"torchrun-{host.netns}.log")


def curl(host: Host, *args: str, timeout_s: float = COMMAND_S) -> subprocess.CompletedProcess:
    argv = ["ip", "netns", "exec", host.netns, "curl", "-sS", "--max-time", f"{timeout_s:g}"]
    return subprocess.run(
        [*argv, *args], capture_output=True, text=True, timeout=timeout_s + COMMAND_S
    )


def log_tails(logs: Path, lines: int = 25) -> str:
    """The end of every log, for an error message (torchrun's reverse-lookup warnings left out:
    the namespaces have no DNS)."""
    parts = []
    for path in sorted(logs.glob("*.log")):
        kept = [
            line
            for line in path.read_text(errors="replace").splitlines()
            if "hostname of the client socket" not in line
        ]
        parts.append(f"--- {path.name} ---\n" + "\n".join(kept[-lines:]))
    return "\n".join(parts)


class Failure(RuntimeError):
    """What went wrong, with the end of every log."""

    def __init__(self, what: str, logs: Path) -> None:
        super().__init__(f"{what} (logs in {logs})\n{log_tails(logs)}")


def health(host: Host) -> int | None:
    """/health's status on host A's loopback, or None when nothing answers."""
    url = f"http://127.0.0.1:{HTTP_PORT}/health"
    done = curl(host, "-o", "/dev/null", "-w", "%{http_code}", url, timeout_s=2)
    code = done.stdout.strip()
    return int(code) if code.isdigit() and code != "000" else None


def wait_health(
    host: Host, frontend: subprocess.Popen, ok: bool, deadline_s: float, logs: Path
) -> None:
    """Until /health is 200 (`ok`) or is not; Failure past `deadline_s` or when the frontend
    exits."""
    deadline = time.monotonic() + deadline_s
    while (health(host) == 200) != ok:
        if frontend.poll() is not None:
            raise Failure(f"the frontend exited with {frontend.returncode}", logs)
        if time.monotonic() > deadline:
            raise Failure(f"/health {'not ' if ok else ''}200 after {deadline_s:g} s", logs)
        time.sleep(0.05)


def request(prompt: str, max_tokens: int = 96) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def complete(host: Host, body: dict, timeout_s: float = 120.0) -> tuple[str, list[int]]:
    """A completion's text and token ids; ("", []) and the error in the text when it failed."""
    url = f"http://127.0.0.1:{HTTP_PORT}/v1/completions"
    data = json.dumps(body)
    done = curl(host, "-H", "content-type: application/json", "-d", data, url, timeout_s=timeout_s)
    try:
        choice = json.loads(done.stdout)["choices"][0]
    except (ValueError, KeyError):
        return f"error: {done.stdout or done.stderr}", []
    return choice["text"], choice["token_ids"]


class Stream:
    """A streaming completion through curl on host A: its text and token ids as they come,
    the error event if one came, and when it ended."""

    def __init__(self, host: Host, body: dict, log: Path, timeout_s: float) -> None:
        url = f"http://127.0.0.1:{HTTP_PORT}/v1/completions"
        argv = ["curl", "-sSN", "--max-time", f"{timeout_s:g}"]
        argv += ["-H", "content-type: application/json", "-d", json.dumps({**body, "stream": True})]
        self.proc = host.popen([*argv, url], os.environ.copy(), log, stdout=subprocess.PIPE)
        self.text, self.ids, self.error, self.done = "", [], None, False
        self.first, self.ended = threading.Event(), threading.Event()
        self.ended_at = 0.0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line == "data: [DONE]":
                self.done = True
            elif line.startswith("data: "):
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    self.error = chunk["error"]["message"]
                else:
                    self.text += chunk["choices"][0]["text"]
                    self.ids += chunk["choices"][0].get("token_ids") or []
                    self.first.set()
        self.ended_at = time.monotonic()
        self.ended.set()

    def outcome(self, want: tuple[str, list[int]], since: float, wait_s: float) -> dict:
        """What became of it: "resumed" (every token of an undisturbed run, `want`, and no
        more), "differs", "failed" (with the error event) or "open" (not ended in `wait_s`);
        `ended_s`: from `since` to its end."""
        if not self.ended.wait(wait_s):
            return {"outcome": "open"}
        ended = round(self.ended_at - since, 2)
        if self.error is not None or not self.done:
            return {"outcome": "failed", "error": self.error, "ended_s": ended}
        same = (self.text, self.ids) == want
        return {"outcome": "resumed" if same else "differs", "ended_s": ended}


@dataclass
class Report:
    topology: str
    loss: str
    outage_s: float
    startup_s: float = 0.0  # frontend and both torchruns started -> /health 200
    link_bytes: int = 0  # what the link carried for the reference requests
    detect_s: float = 0.0  # host B lost -> /health not 200
    streams: list[dict] = field(default_factory=list)  # the streams in flight: Stream.outcome
    held: dict = field(default_factory=dict)  # a stream sent while host B was lost
    return_s: float = 0.0  # host B's torchrun started again -> /health 200
    fresh_s: float = 0.0  # host B's torchrun started again -> a new request answered
    fresh_ok: bool = False  # that request got its 8 tokens
    logs: str = ""


PROMPTS = ("Hello", "Two hosts, one link")


def nodes(topology: str) -> tuple[int, int]:
    """Ranks per host: the attention ranks on host A, the FFN ranks on host B."""
    attention, ffn = topology.upper().removesuffix("F").split("A")
    return int(attention), int(ffn)


def run(topology: str, loss: str, outage_s: float, logs: Path) -> Report:
    """Everything the module docstring says, inside `TwoHosts`; the report of what was seen.
    Failure (with the end of every log) where the world does not start or come back."""
    key = os.urandom(16).hex()
    report = Report(topology, loss, outage_s, logs=str(logs))
    on_a, on_b = nodes(topology)
    stream_s = STARTUP_S + outage_s  # curl's own limit on a stream
    with TwoHosts() as hosts:
        a, b = hosts.a, hosts.b
        began = time.monotonic()
        frontend = start_frontend(a, topology, key, logs)
        start_node(a, a, on_a, key, logs)
        start_node(b, a, on_b, key, logs)
        wait_health(a, frontend, True, STARTUP_S, logs)
        report.startup_s = time.monotonic() - began

        carried = b.link_bytes()
        want = [complete(a, request(prompt)) for prompt in PROMPTS]
        report.link_bytes = b.link_bytes() - carried
        if not all(ids for _, ids in want):
            raise Failure(f"a reference request failed: {want}", logs)

        streams = [
            Stream(a, request(prompt), logs / f"stream-{i}.log", stream_s)
            for i, prompt in enumerate(PROMPTS)
        ]
        if not all(stream.first.wait(60) for stream in streams):
            raise Failure("a stream sent no token within 60 s", logs)
        lost = time.monotonic()
        if loss == "cut":
            b.link(up=False)  # nothing host B's processes send from here on reaches host A
        b.kill_all()
        wait_health(a, frontend, False, 60, logs)
        report.detect_s = time.monotonic() - lost
        held = Stream(a, request(PROMPTS[0]), logs / "stream-held.log", stream_s)

        time.sleep(outage_s)
        if loss == "cut":
            b.link(up=True)
        back = time.monotonic()
        start_node(b, a, on_b, key, logs)
        wait_health(a, frontend, True, RETURN_S, logs)
        report.return_s = time.monotonic() - back
        _, ids = complete(a, request(PROMPTS[1], max_tokens=8))
        report.fresh_s = time.monotonic() - back
        report.fresh_ok = len(ids) == 8

        report.streams = [s.outcome(w, lost, RETURN_S) for s, w in zip(streams, want)]
        report.held = held.outcome(want[0], lost, RETURN_S)
        if frontend.poll() is not None:
            raise Failure(f"the frontend exited with {frontend.returncode}", logs)
    for field_name in ("startup_s", "detect_s", "return_s", "fresh_s"):
        setattr(report, field_name, round(getattr(report, field_name), 2))
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="2A1F", help="xAyF; A ranks on host A, F on B")
    parser.add_argument("--loss", choices=("kill", "cut"), default="kill", help="how B is lost")
    parser.add_argument("--outage", type=float, default=2.0, help="seconds host B stays lost")
    parser.add_argument("--logs", default=None, help="directory of the logs (default: a temp dir)")
    args = parser.parse_args()
    refused = namespaces_refused()
    if refused is not None:
        sys.exit(f"two_hosts: this machine makes no network namespaces for us: {refused}")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="afdserve-two-hosts-"))
    logs.mkdir(parents=True, exist_ok=True)
    report = run(args.topology, args.loss, args.outage, logs)
    print(json.dumps(vars(report), indent=2))
    outcomes = {entry["outcome"] for entry in [*report.streams, report.held]}
    return 0 if outcomes == {"resumed"} and report.return_s <= 30 and report.fresh_ok else 1


if __name__ == "__main__":
    sys.exit(main())
