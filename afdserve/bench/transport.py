"""`afdserve bench transport`: what one layer's hand-over costs between two GPUs of one host, per
transport, with nothing else running: the attention rank sends a tile of hidden rows (and its ids),
the FFN rank sends the tile straight back; all layers in one CUDA graph on each side, timed on the
attention GPU. This is the measurement the data-plane transport is chosen by.

Transports:
  nccl        the mirrored point-to-point batches of afd/dataplane/wire.py (NCCL send/recv kernels)
  nccl-fp8    as nccl with a2e_dtype=fp8: the rows go as fp8 bytes with their scales, and the
              time includes quantizing and dequantizing them (kernels/a2e.py)
  ipc         connector="ipc" (afd/dataplane/ipc.py): the sender's push kernel writes the rows
              and ids straight into the receiver's symmetric-memory inbox, then raises a flag
  ipc-copy    as ipc, but the rows and ids go by `copy_` (copy-engine transfers)
  ipc-signal  the flags alone, no rows: the floor of any flag-based transport
"""

from __future__ import annotations

import argparse
import os
import statistics
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from afdserve.afd.dataplane.payload import HEADER
from afdserve.afd.dataplane.wire import P2P, Wire
from afdserve.bench.flags import add_bench_flags, names, sizes
from afdserve.config_args import build, option
from afdserve.kernels.a2e import A2EFormat, scale_groups
from afdserve.model.checkpoint.loader import TORCH_DTYPES

TRANSPORTS = ("nccl", "nccl-fp8", "ipc", "ipc-copy", "ipc-signal")


@dataclass(frozen=True)
class TransportBench:
    rows: tuple[int, ...] = option(
        (1, 64, 256), parse=sizes, help="hidden rows per transfer, comma-separated"
    )
    hidden: int = option(2048, help="the hidden size of a row")
    layers: int = option(48, help="round trips per step, one per MoE layer")
    dtype: str = "bfloat16"
    transports: tuple[str, ...] = option(TRANSPORTS, parse=names, help="comma-separated")
    steps: int = option(20, help="timed steps per row count")

    def __post_init__(self) -> None:
        if not self.rows or min(self.rows) < 1:
            raise ValueError(f"bench.rows={self.rows!r} is not allowed: positive integers")
        if self.hidden < 1 or self.layers < 1 or self.steps < 1:
            raise ValueError("bench.hidden, bench.layers and bench.steps must be positive")
        if self.dtype not in TORCH_DTYPES:
            raise ValueError(
                f"bench.dtype={self.dtype!r} is not allowed: one of {sorted(TORCH_DTYPES)}"
            )
        for name in self.transports:
            if name not in TRANSPORTS:
                raise ValueError(f"bench.transports: {name!r} is not allowed: one of {TRANSPORTS}")


def nccl_layers(
    rank: int, layers: int, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor
) -> None:
    """The mirrored batches of afd/dataplane/wire.py for one tile per layer, both ways, with no
    compute: rank 0 as the attention rank, rank 1 as the FFN rank."""
    wire, peer = Wire(rank), 1 - rank
    for _ in range(layers):
        if rank == 0:
            works = wire.post([P2P("send", x, peer), P2P("send", ids, peer)])
            works += wire.post([P2P("recv", out, peer)])
        else:
            works = wire.post([P2P("recv", x, peer), P2P("recv", ids, peer)])
            works += wire.post([P2P("send", out, peer)])
        for work in works:
            work.wait()


def nccl_fp8_layers(
    rank: int, layers: int, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor
) -> None:
    """nccl_layers with the fp8 A2E payload: [rows (uint8), scales, ids] then [output]."""
    wire, peer, fp8 = Wire(rank), 1 - rank, A2EFormat("fp8", x.dtype)
    rows, hidden = x.shape
    q_in = torch.empty(rows, hidden, dtype=fp8.wire_dtype, device=x.device)
    scales_in = torch.empty(rows, scale_groups(hidden), dtype=torch.float32, device=x.device)
    for _ in range(layers):
        if rank == 0:
            q, scales = fp8.encode(x)
            works = wire.post(
                [
                    P2P("send", q.view(torch.uint8), peer),
                    P2P("send", scales, peer),
                    P2P("send", ids, peer),
                ]
            )
            works += wire.post([P2P("recv", out, peer)])
        else:
            works = wire.post(
                [
                    P2P("recv", q_in.view(torch.uint8), peer),
                    P2P("recv", scales_in, peer),
                    P2P("recv", ids, peer),
                ]
            )
            for work in works:
                work.wait()
            out.copy_(fp8.decode(q_in, scales_in))  # the FFN half would read these rows
            works = wire.post([P2P("send", out, peer)])
        for work in works:
            work.wait()


def layer_bytes(spec: TransportBench, rows: int) -> dict[str, int]:
    """Bytes one layer moves for a tile of `rows`: the A2E rows (scales included, ids apart) in
    the model dtype and in fp8, and the E2A rows, which stay in the model dtype."""
    dtype = TORCH_DTYPES[spec.dtype]
    plain = A2EFormat("auto", dtype).row_bytes(spec.hidden)
    return {
        "a2e": rows * plain,
        "a2e_fp8": rows * A2EFormat("fp8", dtype).row_bytes(spec.hidden),
        "e2a": rows * plain,
    }


class _IPC:
    """One symmetric buffer per rank: an inbox (hidden rows, then ids) the peer copies into."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        self.rows, self.hidden, self.dtype = rows, hidden, dtype
        row_bytes = hidden * dtype.itemsize
        self.ids_offset = rows * row_bytes
        size = self.ids_offset + (HEADER + rows) * 4
        self.local = symm_mem.empty(size, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.local, dist.group.WORLD)

    def view(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [rows, hidden], ids [HEADER + rows]) of `rank`'s inbox, seen from here."""
        raw = self.handle.get_buffer(rank, (self.local.numel(),), torch.uint8)
        hidden = raw[: self.ids_offset].view(self.dtype).view(self.rows, self.hidden)
        ids = raw[self.ids_offset :].view(torch.int32)
        return hidden, ids

    def layers(
        self, rank: int, layers: int, x: torch.Tensor, ids: torch.Tensor, data: bool
    ) -> None:
        peer = 1 - rank
        peer_hidden, peer_ids = self.view(peer)
        my_hidden, _ = self.view(rank)
        for _ in range(layers):
            if rank == 0:
                if data:
                    peer_hidden.copy_(x)
                    peer_ids.copy_(ids)
                self.handle.put_signal(peer)
                self.handle.wait_signal(peer)
            else:
                self.handle.wait_signal(peer)
                if data:
                    peer_hidden.copy_(my_hidden)  # the reply lands in the attention inbox
                self.handle.put_signal(peer)


def ipc_layers(
    inboxes, rank: int, layers: int, x: torch.Tensor, ids: torch.Tensor, step: torch.Tensor
) -> None:
    """connector="ipc"'s hand-over of one tile per layer, both ways, with no compute: rank 0 as
    the attention rank, rank 1 as the FFN rank replying with the rows it received."""
    from afdserve.afd.dataplane.ipc import push

    rows = x.shape[0]
    for layer in range(layers):
        if rank == 0:
            push(
                x,
                inboxes.hidden(1, 0)[:rows],
                ids,
                inboxes.ids(1, 0)[: HEADER + rows],
                step,
                layer,
                0,
            )
            inboxes.signal(1, 0)
            inboxes.wait(1, 0)
        else:
            inboxes.wait(0, 0)
            push(inboxes.hidden(1, 0)[:rows], inboxes.hidden(0, 0)[:rows])
            inboxes.signal(0, 0)


def time_graph(body, layers: int, steps: int) -> float:
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        body()
    graph.replay()
    times = []
    for _ in range(steps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / layers)
    return statistics.median(times)


def _rank_main(rank: int, spec: TransportBench, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", rank=rank, world_size=2, device_id=device, timeout=timedelta(seconds=120)
    )
    dtype = TORCH_DTYPES[spec.dtype]
    rows_out = []
    for rows in spec.rows:
        x = torch.randn(rows, spec.hidden, device=device).to(dtype)
        ids = torch.arange(HEADER + rows, dtype=torch.int32, device=device)
        out = torch.empty_like(x)
        for name in spec.transports:
            if name in ("nccl", "nccl-fp8"):
                layers_of = nccl_layers if name == "nccl" else nccl_fp8_layers

                def body(x=x, ids=ids, out=out, layers_of=layers_of):
                    layers_of(rank, spec.layers, x, ids, out)
            elif name == "ipc":
                from afdserve.afd.dataplane.ipc import Inboxes

                inboxes = Inboxes(dist.group.WORLD, device, dtype, spec.hidden, 1, 1, 1, rows)
                step = torch.zeros(1, dtype=torch.int32, device=device)

                def body(inboxes=inboxes, x=x, ids=ids[HEADER:], step=step):
                    ipc_layers(inboxes, rank, spec.layers, x, ids, step)
            else:
                ipc = _IPC(rows, spec.hidden, dtype, device)

                def body(ipc=ipc, x=x, ids=ids, data=(name == "ipc-copy")):
                    ipc.layers(rank, spec.layers, x, ids, data)

            dist.barrier()
            us = time_graph(body, spec.layers, spec.steps)
            if name == "nccl-fp8" and rank == 0:  # the reply is the tile as the FFN read it
                torch.cuda.synchronize()
                if not torch.equal(out, A2EFormat("fp8", dtype).roundtrip(x)):
                    raise RuntimeError(f"nccl-fp8 transport: the reply of {rows} rows differs")
            if name == "ipc" and rank == 0:  # the reply equals what was sent
                torch.cuda.synchronize()
                if not torch.equal(inboxes.hidden(0, 0)[:rows], x):
                    raise RuntimeError(f"ipc transport: the reply of {rows} rows differs")
            if name == "ipc-copy" and rank == 0:
                reply, _ = ipc.view(0)
                torch.cuda.synchronize()
                if not torch.equal(reply, x):
                    raise RuntimeError(f"ipc-copy transport: the reply of {rows} rows differs")
            rows_out.append((rows, name, us))
    if rank == 0:
        results.put(rows_out)
    dist.barrier()
    dist.destroy_process_group()


def run_transport_bench(spec: TransportBench) -> list[tuple[int, str, float]]:
    if torch.cuda.device_count() < 2:
        raise RuntimeError("bench transport needs two CUDA devices")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    mp.start_processes(_rank_main, args=(spec, port, results), nprocs=2, start_method="spawn")
    return results.get(timeout=10)


def format_transport_table(spec: TransportBench, rows: list[tuple[int, str, float]]) -> str:
    """One line per tile size: bytes per layer (A2E in the model dtype and in fp8, E2A), then
    the time per layer of every transport."""
    lines = [
        "| rows | A2E bytes | A2E bytes, fp8 | E2A bytes | " + " | ".join(spec.transports) + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in spec.transports) + " |",
    ]
    for n in spec.rows:
        us = {name: t for r, name, t in rows if r == n}
        cells = " | ".join(f"{us[name]:.1f} us" for name in spec.transports)
        sizes = layer_bytes(spec, n)
        lines.append(f"| {n} | {sizes['a2e']} | {sizes['a2e_fp8']} | {sizes['e2a']} | {cells} |")
    return "\n".join(lines)


def add_transport_parser(kinds: argparse._SubParsersAction) -> None:
    p = kinds.add_parser("transport", help="one layer's A2E + E2A between two GPUs, per transport")
    add_bench_flags(p, TransportBench)
    p.set_defaults(func=main_transport)


def main_transport(args: argparse.Namespace) -> int:
    spec = build(TransportBench, args)
    print(format_transport_table(spec, run_transport_bench(spec)))
    return 0
