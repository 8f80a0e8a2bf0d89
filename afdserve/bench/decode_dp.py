"""`afdserve bench decode -dp N`: N colocated replicas of the model, one process each on its own
device (cuda:0 .. cuda:N-1; on the CPU, each its share of the cores), every replica decoding the
same batches. What AFD on N GPUs is compared against: N independent GPUs, measured at once.

Each replica builds its model and warms each batch up on its own, then all wait at a barrier,
so that their timed steps run at the same time (a replica that ran alone would miss whatever
the others take from the host: its CPU, memory bandwidth, PCIe); they meet again before the
next batch is built. The aggregate is the sum of the replicas' tokens/s, per GPU that over N.
"""

from __future__ import annotations

import os
import queue
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from afdserve.bench.bytes import measure_copy_bandwidth
from afdserve.bench.decode_steps import DecodeResult, DecodeSpec, bench_batch, build_halves
from afdserve.model.presets import hf_config_of

BARRIER_TIMEOUT_S = 1800.0  # a replica building a large model; a dead one breaks it sooner


@dataclass(frozen=True)
class DataParallelResult:
    """One batch size, timed on every replica at once."""

    batch: int
    replicas: tuple[DecodeResult, ...]
    devices: tuple[str, ...]  # where each replica's model sat: cuda:i, or cpu

    @property
    def tokens_per_s(self) -> float:
        return sum(r.tokens_per_s for r in self.replicas)

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / len(self.replicas)


def check_devices(replicas: int, device: str) -> None:
    """Refuses, before any process starts, N replicas on fewer than N GPUs."""
    if device != "cuda":
        return
    visible = torch.cuda.device_count()
    if visible < replicas:
        raise ValueError(
            f"bench.data_parallel_size={replicas} needs {replicas} GPUs, one "
            f"replica each: this process sees {visible}"
        )


def _replica_main(replica: int, spec: DecodeSpec, replicas: int, barrier, results) -> None:
    try:
        if spec.device == "cuda":
            torch.cuda.set_device(replica)  # "cuda" below is this replica's GPU
        else:  # each its share of the cores, as each has its own GPU on CUDA
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // replicas))
        copy_gbps = None
        if spec.device == "cuda":
            copy_gbps = measure_copy_bandwidth(torch.device("cuda", replica))
        attn, ffn = build_halves(spec, hf_config_of(spec.preset, spec.model_dir))
        rows = []
        for batch in spec.batch_sizes:
            rows.append(bench_batch(attn, ffn, spec, batch, copy_gbps, ready=barrier.wait))
            barrier.wait()  # none builds the next batch while another is still timing
        results.put((replica, str(next(attn.parameters()).device), rows))
    except BaseException as e:  # the parent reports it; the others stop at the barrier
        results.put((replica, spec.device, f"{type(e).__name__}: {e}"))
        barrier.abort()


def run_dp_decode_bench(spec: DecodeSpec, replicas: int) -> list[DataParallelResult]:
    check_devices(replicas, spec.device)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(replicas, timeout=BARRIER_TIMEOUT_S), ctx.Queue()
    procs = [
        ctx.Process(
            target=_replica_main,
            args=(i, spec, replicas, barrier, results),
            name=f"afdserve-bench-replica{i}",
        )
        for i in range(replicas)
    ]
    for p in procs:
        p.start()
    got: dict[int, list[DecodeResult]] = {}
    devices: dict[int, str] = {}
    try:
        while len(got) < replicas:
            try:
                replica, where, rows = results.get(timeout=1.0)
            except queue.Empty:
                dead = [
                    (i, p.exitcode)
                    for i, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and i not in got
                ]
                if dead:
                    raise RuntimeError(
                        f"bench replica {dead[0][0]} exited with {dead[0][1]}"
                    ) from None
                continue
            if isinstance(rows, str):
                raise RuntimeError(f"bench replica {replica} ({where}): {rows}")
            got[replica], devices[replica] = rows, where
    finally:
        for p in procs:
            p.join(timeout=60 if len(got) == replicas else 1)
            if p.is_alive():
                p.terminate()
                p.join(10)
    where = tuple(devices[i] for i in range(replicas))
    return [
        DataParallelResult(batch, tuple(got[i][k] for i in range(replicas)), where)
        for k, batch in enumerate(spec.batch_sizes)
    ]


def format_dp_table(results: list[DataParallelResult], device: str) -> str:
    """A line per replica (each a colocated run, its own GPU), then the replicas together."""
    lines = ["batch  replica  device  step_ms  tokens/s  GB/s  of_copy_bw"]
    unit = "GPU" if device == "cuda" else "replica"
    for row in results:
        for i, (r, where) in enumerate(zip(row.replicas, row.devices)):
            frac = f"{r.achieved_gbps / r.copy_gbps:10.1%}" if r.copy_gbps else "         -"
            lines.append(
                f"{row.batch:5d}  {i:7d}  {where:>6}  {r.step_ms:7.2f}  "
                f"{r.tokens_per_s:8.1f}  {r.achieved_gbps:4.0f}  {frac}"
            )
        n = len(row.replicas)
        lines.append(
            f"{row.batch:5d}  {'all':>7}  {n:>6}  {'':7}  {row.tokens_per_s:8.1f}  "
            f"(aggregate of {n} at once; {row.tokens_per_s_per_device:.1f} tokens/s "
            f"per {unit})"
        )
    return "\n".join(lines)
