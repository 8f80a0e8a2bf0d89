"""Time from `kill -9` of one rank to /health 200 again, for a real `afdserve serve` world.

    PYTHONPATH=$PWD python tools/recovery_time.py --topology 2A1F --victims 2 0 --repeat 3

starts `python -m afdserve.cli serve --on-engine-failure restart` (the bundled tiny model unless
the arguments after `--` say otherwise), waits for /health 200, keeps --streams streaming
completions running, and then for each victim rank, --repeat times, --gap s after the previous
recovery: SIGKILLs that rank's process, polls /health every 10 ms, and reports the seconds until
it answers 200 again with the victim's rank in a new process.
The script imports nothing from afdserve (PYTHONPATH picks the afdserve under test), so the
same file measures an older tree, run from outside any checkout (`python -m` puts the current
directory first on sys.path): `cd /tmp && PYTHONPATH=/path/to/main python .../recovery_time.py`.
Prints one JSON line per kill and a summary line per victim (median, min, max).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_pids(server_pid: int) -> dict[int, int]:
    """rank -> pid of the server's running world (a rank names itself afdserve-rankN)."""
    ranks: dict[int, int] = {}
    children = [
        pid
        for task in Path(f"/proc/{server_pid}/task").glob("*")
        for pid in (task / "children").read_text().split()
    ]
    for child in children:
        try:
            if not Path(f"/proc/{child}/comm").read_text().startswith("afdserve-rank"):
                continue
            stat = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0]
            if stat == "Z":
                continue
            for item in Path(f"/proc/{child}/environ").read_bytes().split(b"\0"):
                if item.startswith(b"RANK="):
                    ranks[int(item[5:])] = int(child)
        except OSError:
            continue
    return ranks


def health(url: str) -> int | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code
    except httpx.TransportError:
        return None


def keep_streaming(url: str, stop: threading.Event, index: int) -> None:
    # Token ids: a dummy-weight model directory has no tokenizer files.
    body = {
        "prompt": [10 + index, 20, 30],
        "max_tokens": 200,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    while not stop.is_set():
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
                for _ in r.iter_lines():
                    if stop.is_set():
                        break
        except httpx.HTTPError:
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topology", default="2A1F")
    parser.add_argument("--victims", type=int, nargs="+", default=[2, 0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument(
        "--gap",
        type=float,
        default=10.0,
        help="seconds between a recovery and the next kill (the standby world "
        "of the next restart starts meanwhile)",
    )
    parser.add_argument(
        "serve_args",
        nargs=argparse.REMAINDER,
        help="after --: more `afdserve serve` arguments (--model DIR ...)",
    )
    parser.add_argument("--log", default="/tmp/recovery_time_server.log")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "afdserve.cli",
        "serve",
        "--port",
        str(port),
        "--topology",
        args.topology,
        "--on-engine-failure",
        "restart",
        "--max-restarts",
        "100",
        # each kill is the first failure of its window: no back-off before its restart
        "--restart-window",
        str(args.gap / 2),
    ]
    command += [a for a in args.serve_args if a != "--"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(args.log, "wb") as log:
        server = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 300
        while health(url) != 200:
            if server.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"the server did not start; see {args.log}")
            time.sleep(0.2)
        streams = [
            threading.Thread(target=keep_streaming, args=(url, stop, i), daemon=True)
            for i in range(args.streams)
        ]
        for thread in streams:
            thread.start()
        results: dict[int, list[float]] = {}
        for victim in args.victims:
            for _ in range(args.repeat):
                time.sleep(args.gap)  # streams in flight; the standby world started
                old = rank_pids(server.pid)
                killed_at = time.monotonic()
                os.kill(old[victim], signal.SIGKILL)
                while True:
                    if time.monotonic() - killed_at > 300:
                        sys.exit(f"no recovery within 300 s; see {args.log}")
                    now = rank_pids(server.pid)
                    replaced = victim in now and now[victim] != old[victim]
                    if replaced and len(now) == len(old) and health(url) == 200:
                        break
                    time.sleep(0.01)
                took = time.monotonic() - killed_at
                kept = sorted(r for r in old if r != victim and now.get(r) == old[r])
                results.setdefault(victim, []).append(took)
                print(
                    json.dumps({"victim": victim, "seconds": round(took, 3), "ranks_kept": kept}),
                    flush=True,
                )
        load = os.getloadavg()
        for victim, times in results.items():
            print(
                json.dumps(
                    {
                        "victim": victim,
                        "median_s": round(statistics.median(times), 3),
                        "min_s": round(min(times), 3),
                        "max_s": round(max(times), 3),
                        "n": len(times),
                        "loadavg": [round(x, 2) for x in load],
                    }
                )
            )
    finally:
        stop.set()
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    main()
