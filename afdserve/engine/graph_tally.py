"""What one rank's CUDA-graph captures cost, by kind of graph, for the line its warm-up logs:
`full` captures a decode and a mixed graph of every size, about twice `full_decode_only`'s time
and memory, and the line says so."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class CaptureTally:
    """Graphs captured, seconds and device bytes taken, per kind ("decode", "mixed", "ffn")."""

    graphs: dict[str, int] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    @contextmanager
    def capturing(self, kind: str) -> Iterator[None]:
        """Counts one capture of `kind`: its warm run and capture, and the device memory they
        left taken (the graph's pool and anything allocated on the way, as the device sees it)."""
        free = torch.cuda.mem_get_info()[0]
        start = time.perf_counter()
        yield
        torch.cuda.synchronize()
        self.graphs[kind] = self.graphs.get(kind, 0) + 1
        self.seconds[kind] = self.seconds.get(kind, 0.0) + time.perf_counter() - start
        taken = free - torch.cuda.mem_get_info()[0]
        self.bytes[kind] = self.bytes.get(kind, 0) + taken

    def line(self) -> str | None:
        """e.g. "captured 70 CUDA graphs in 9.1 s, 0.52 GiB: decode 35 (4.0 s, 0.20 GiB), mixed
        35 (5.1 s, 0.32 GiB)"; None when nothing was captured."""
        if not self.graphs:
            return None
        total = sum(self.graphs.values())
        seconds, taken = sum(self.seconds.values()), sum(self.bytes.values())
        kinds = ", ".join(
            f"{kind} {n} ({self.seconds[kind]:.1f} s, {self.bytes[kind] / 2**30:.2f} GiB)"
            for kind, n in self.graphs.items()
        )
        return f"captured {total} CUDA graphs in {seconds:.1f} s, {taken / 2**30:.2f} GiB: {kinds}"
