"""Step times from a step-plan log (`--log-step-plan PATH`): each line carries the wall clocks at
which its step was planned (`start`) and this rank had run it (`end`), host work included. Prints,
per mode and real rows, the steps' times (count, median, p90, max in ms) and the host gap
before each step: from the end of the rank's previous step, where it came right after (no idle
round between), to this one's plan.

    python tools/step_times.py steps.jsonl [--rank 0] [--window START END]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def bucket(rows: int) -> str:
    for b in BUCKETS:
        if rows <= b:
            return f"<={b}"
    return f">{BUCKETS[-1]}"


def summary(ms: list[float]) -> str:
    if not ms:
        return f"{'':>8} {'':>8} {'':>8}"
    ms = sorted(ms)
    p90 = ms[min(len(ms) - 1, int(0.9 * len(ms)))]
    return f"{statistics.median(ms):8.2f} {p90:8.2f} {ms[-1]:8.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument(
        "--window",
        type=float,
        nargs=2,
        metavar=("START", "END"),
        help="only the steps planned between these wall clocks (Unix seconds)",
    )
    args = ap.parse_args()
    with open(args.log) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    start, end = args.window or (float("-inf"), float("inf"))
    mine = [r for r in lines if r["rank"] == args.rank and start <= r["start"] <= end]
    mine.sort(key=lambda r: r["step"])
    steps: dict[tuple, list[float]] = defaultdict(list)
    gaps: dict[tuple, list[float]] = defaultdict(list)
    for before, this in zip([None, *mine], mine):
        key = (this["mode"], bucket(this["real_rows"]))
        steps[key].append((this["end"] - this["start"]) * 1e3)
        if before is not None and this["step"] == before["step"] + 1:
            gaps[key].append((this["start"] - before["end"]) * 1e3)
    print(f"rank {args.rank}: {len(mine)} steps logged")
    print(
        f"{'mode':8} {'rows':>7} {'steps':>6} {'median':>8} {'p90':>8} {'max':>8}"
        f" {'gap_med':>8} {'gap_p90':>8} {'gap_max':>8}"
    )
    for key in sorted(steps, key=lambda key: (key[0], len(key[1]), key[1])):
        mode, rows = key
        print(f"{mode:8} {rows:>7} {len(steps[key]):6d} {summary(steps[key])} {summary(gaps[key])}")


if __name__ == "__main__":
    main()
