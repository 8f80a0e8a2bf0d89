"""Point-to-point batches between ranks, and the contract NCCL holds them to.

The contract: for every pair of ranks, each batch of point-to-point operations that one posts with
the other mirrors exactly one batch that the other posts with it, in the same order: send <-> recv,
same sizes, same dtypes. NCCL pairs the batches of two ranks one to one (its lazy connection set-up
exchanges per-batch channel information), so an attention rank that posts [send, send, recv]
against an FFN rank's [recv, recv] and then [send] fails on real GPUs with "Message truncated";
gloo forgives the breach. Every batch in afdserve goes through `Wire.post`, which can log it, and
`mirror_errors` checks the logs of a whole world, so a breach fails on CPU too.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class P2P:
    """One operation of a batch: send `tensor` to `peer`, or receive it from `peer`."""

    kind: str  # "send" | "recv"
    tensor: torch.Tensor
    peer: int


class Wire:
    """Posts one rank's batches. With a log path, every batch is written as one JSON line:
    {"rank", "step", "layer", "ubatch", "ops": [[kind, peer, shape, dtype], ...]} (plus any
    extra fields the caller records, such as the headers an FFN rank received)."""

    def __init__(self, rank: int, log_path: str | None = None) -> None:
        self.rank = rank
        self._log = open(log_path, "a") if log_path else None  # noqa: SIM115

    @property
    def logging(self) -> bool:
        return self._log is not None

    def post(self, ops: Sequence[P2P], **where: int) -> list:
        """Post `ops` as one batch; returns the works to wait on."""
        if self._log is not None:
            self.note(
                ops=[[op.kind, op.peer, list(op.tensor.shape), str(op.tensor.dtype)] for op in ops],
                **where,
            )
        p2p = [
            dist.P2POp(dist.isend if op.kind == "send" else dist.irecv, op.tensor, op.peer)
            for op in ops
        ]
        return dist.batch_isend_irecv(p2p)

    def note(self, **record: Any) -> None:
        """Write one record to the log (no-op without a log)."""
        if self._log is not None:
            self._log.write(json.dumps({"rank": self.rank, **record}) + "\n")
            self._log.flush()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


def read_wire_log(paths: Iterable[str]) -> dict[int, list[dict]]:
    """Every rank's batch records (records without "ops" are skipped), in posting order."""
    batches: dict[int, list[dict]] = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                record = json.loads(line)
                if "ops" in record:
                    batches.setdefault(record["rank"], []).append(record)
    return batches


def _with(batch: dict, peer: int) -> list[tuple]:
    return [(kind, tuple(shape), dtype) for kind, p, shape, dtype in batch["ops"] if p == peer]


def mirror_errors(batches: dict[int, list[dict]]) -> list[str]:
    """Every breach of the contract in a world's logs (empty when it holds)."""
    flip = {"send": "recv", "recv": "send"}
    errors: list[str] = []
    ranks = sorted(batches)
    for a in ranks:
        for b in ranks:
            if b <= a:
                continue
            mine = [(r, ops) for r in batches[a] if (ops := _with(r, b))]
            theirs = [(r, ops) for r in batches[b] if (ops := _with(r, a))]
            if len(mine) != len(theirs):
                errors.append(
                    f"ranks {a} and {b}: rank {a} posted {len(mine)} batches with {b}, "
                    f"rank {b} posted {len(theirs)} with {a}"
                )
            for (ra, ops_a), (_, ops_b) in zip(mine, theirs):
                expect = [(flip[kind], shape, dtype) for kind, shape, dtype in ops_a]
                if ops_b != expect:
                    where = {k: ra.get(k) for k in ("step", "layer", "ubatch")}
                    errors.append(
                        f"ranks {a} and {b} at {where}: rank {a} posted {ops_a}, "
                        f"rank {b} posted {ops_b}; a mirror is {expect}"
                    )
                    break
    return errors
