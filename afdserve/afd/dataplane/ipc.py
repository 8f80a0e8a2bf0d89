"""The same-host data plane (`connector="ipc"`): every rank owns an inbox in symmetric memory (CUDA
IPC over NVLink, multicast off), and a sender writes its tile straight into the receiver's inbox
(a kernel: kernels/triton/push.py), then raises a flag in the receiver's signal pad; the
receiver's stream waits on that flag. No NCCL kernel runs on the data path, which is what makes
the hand-over cheaper than NCCL's (`afdserve bench transport`, docs/benchmarks.md).

Why one inbox per ubatch is enough, with no double buffering: the hand-over of a ubatch strictly
alternates. An attention rank writes layer l + 1 of ubatch u only after it consumed the FFN
rank's reply to layer l of u, and the FFN rank replies only after its FFN half has read layer l
from the inbox (stream order). Likewise the FFN rank writes its reply to layer l + 1 only after
the attention rank signalled layer l + 1, which it does after consuming the reply to layer l.
The flags are channel u of the symmetric handle: put waits for the slot to be free, wait takes
the flag back, so a flag never overtakes the one before it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from afdserve.afd.dataplane.connector import AttentionSide
from afdserve.afd.dataplane.payload import HEADER, LayoutError, WaitClock
from afdserve.engine.model_runner import Ready
from afdserve.kernels.a2e import A2EFormat
from afdserve.layout.plan import FFNRankPlan
from afdserve.model.config import ModelConfig
from afdserve.model.layers.moe import Routing

_ALIGN = 256


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class Inboxes:
    """Every rank's inbox, seen from this rank (a collective: every rank of `group` builds it at
    the same point, with the same sizes, as symmetric memory requires).

    Per ubatch: hidden [peers_cap * tile_cap, hidden]; ids [peers_cap * HEADER + peers_cap *
    tile_cap] int32, peer i's header and ids at i * (HEADER + tile); topk ids and weights
    [peers_cap * tile_cap, top_k]. An FFN rank's inbox receives its peers' tiles at the rows
    their plans name (`AttentionRankPlan.ffn_rows`, `FFNRankPlan.peer_rows`); an attention
    rank's inbox receives the replies in its hidden rows [0, tile)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        dtype: torch.dtype,
        hidden: int,
        top_k: int,
        ubatches: int,
        peers_cap: int,
        tile_cap: int,
    ) -> None:
        if device.type != "cuda":
            raise ValueError(f"connector='ipc' needs CUDA devices, this rank runs on {device}")
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype, self.width, self.top_k = dtype, hidden, top_k
        self.peers_cap, self.tile_cap = peers_cap, tile_cap
        rows = peers_cap * tile_cap
        self._hidden_bytes = _aligned(rows * hidden * dtype.itemsize)
        self._ids_bytes = _aligned((peers_cap * HEADER + rows) * 4)
        self._topk_bytes = _aligned(rows * max(top_k, 1) * 4)
        self._ubatch_bytes = self._hidden_bytes + self._ids_bytes + 2 * self._topk_bytes
        size = ubatches * self._ubatch_bytes
        self.local = symm_mem.empty(size, dtype=torch.uint8, device=device)
        self.handle = symm_mem.rendezvous(self.local, group)
        self._raw: dict[int, torch.Tensor] = {}

    def _region(self, rank: int, ubatch: int, offset: int, nbytes: int) -> torch.Tensor:
        raw = self._raw.get(rank)
        if raw is None:
            raw = self._raw[rank] = self.handle.get_buffer(rank, (self.local.numel(),), torch.uint8)
        start = ubatch * self._ubatch_bytes + offset
        return raw[start : start + nbytes]

    def hidden(self, rank: int, ubatch: int) -> torch.Tensor:
        """[peers_cap * tile_cap, hidden] of `rank`'s inbox."""
        return (
            self._region(rank, ubatch, 0, self._hidden_bytes)[
                : self.peers_cap * self.tile_cap * self.width * self.dtype.itemsize
            ]
            .view(self.dtype)
            .view(-1, self.width)
        )

    def ids(self, rank: int, ubatch: int) -> torch.Tensor:
        """[peers_cap * (HEADER + tile_cap)] int32 of `rank`'s inbox."""
        n = self.peers_cap * (HEADER + self.tile_cap)
        return self._region(rank, ubatch, self._hidden_bytes, n * 4).view(torch.int32)

    def topk(self, rank: int, ubatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk ids int32, topk weights fp32), each [peers_cap * tile_cap, top_k]."""
        n = self.peers_cap * self.tile_cap * self.top_k * 4
        base = self._hidden_bytes + self._ids_bytes
        ids = self._region(rank, ubatch, base, n).view(torch.int32).view(-1, self.top_k)
        w = self._region(rank, ubatch, base + self._topk_bytes, n).view(torch.float32)
        return ids, w.view(-1, self.top_k)

    def check_rows(self, end_row: int, where: str) -> None:
        if end_row > self.peers_cap * self.tile_cap:
            raise LayoutError(
                f"{where}: rows up to {end_row} exceed the inbox of "
                f"{self.peers_cap} x {self.tile_cap} rows (connector='ipc' sizes it "
                f"from max_num_batched_tokens and the capture sizes)"
            )

    def signal(self, peer: int, ubatch: int) -> None:
        self.handle.put_signal(peer, ubatch)

    def wait(self, peer: int, ubatch: int) -> None:
        self.handle.wait_signal(peer, ubatch)


def push(
    src: torch.Tensor,
    dst: torch.Tensor,
    ids: torch.Tensor | None = None,
    ids_dst: torch.Tensor | None = None,
    step: torch.Tensor | None = None,
    layer: int = 0,
    ubatch: int = 0,
) -> None:
    from afdserve.kernels.triton.push import push_tile

    push_tile(src, dst, ids, ids_dst, step, layer, ubatch, HEADER)


class _Reply:
    def __init__(
        self,
        inboxes: Inboxes,
        peer: int,
        ubatch: int,
        out: torch.Tensor,
        stamps=None,
        clock: WaitClock | None = None,
    ) -> None:
        self.inboxes, self.peer, self.ubatch, self.out = inboxes, peer, ubatch, out
        self.stamps, self.clock = stamps, clock or WaitClock()
        self.waited = False

    def wait(self) -> torch.Tensor:
        # The reply is a view of this rank's inbox; the model runner consumes it before it posts
        # this ubatch again, and only that post lets the FFN rank overwrite it (module doc).
        if self.waited:
            raise RuntimeError("an IPC reply is waited for once")
        self.waited = True
        if self.stamps is not None:
            self.stamps.mark()
        self.clock.time(lambda: self.inboxes.wait(self.peer, self.ubatch))
        if self.stamps is not None:
            self.stamps.mark()
        return self.out


class IPCAttentionConnector(AttentionSide):
    """Attention side of connector="ipc". Same plan, padding, header and ids as over the wire."""

    def __init__(
        self, config: ModelConfig, inboxes: Inboxes, rank: int, gate_on_attention: bool
    ) -> None:
        # The push kernel writes the rows in the inbox's dtype, the model's: a plain A2E format.
        super().__init__(
            config, inboxes.local.device, gate_on_attention, A2EFormat("auto", inboxes.dtype)
        )
        self.inboxes, self.rank = inboxes, rank

    def post(
        self,
        layer: int,
        ubatch: int,
        x: torch.Tensor,
        route_ids: torch.Tensor,
        routing: Routing | None,
    ) -> _Reply | Ready:
        plan, inboxes = self.plan, self.inboxes
        rows = x.shape[0]
        tile = self._tile(layer, ubatch, rows, routing)
        if tile == 0:
            return Ready(x)
        ffn = plan.ffn_rank
        lo, hi = plan.ffn_rows(ubatch)
        inboxes.check_rows(hi, f"attention rank {plan.rank}, layer {layer}, ubatch {ubatch}")
        first_id = plan.peer_index * HEADER + lo
        ids_dst = inboxes.ids(ffn, ubatch)[first_id : first_id + HEADER + tile]
        push(
            x,
            inboxes.hidden(ffn, ubatch)[lo:hi],
            route_ids,
            ids_dst,
            self.step.value,
            layer,
            ubatch,
        )
        if routing is not None:
            topk_ids, topk_w = inboxes.topk(ffn, ubatch)
            topk_ids[lo:hi].zero_()
            topk_w[lo:hi].zero_()
            topk_ids[lo : lo + rows].copy_(routing[0])
            topk_w[lo : lo + rows].copy_(routing[1])
        inboxes.signal(ffn, ubatch)
        return _Reply(
            inboxes, ffn, ubatch, inboxes.hidden(self.rank, ubatch)[:rows], self.stamps, self.clock
        )


class IPCTransport:
    """FFN side of connector="ipc": what FFNExchange receives and how it replies."""

    def __init__(self, inboxes: Inboxes, rank: int) -> None:
        self.inboxes, self.rank = inboxes, rank
        self.stamps = None  # kernels/triton_stamp.Stamps around the waits: the benches set it
        self.clock = WaitClock()  # waiting for the peers' tiles

    def receive(self, plan: FFNRankPlan, ubatch: int, routed: bool, where: dict):
        """(hidden [rows, hidden], no scales, ids [peers, HEADER + tile], topk ids, topk weights)
        as views of this rank's inbox, after every peer's flag for `ubatch` is up."""
        inboxes = self.inboxes
        rows, tile = plan.receive_rows[ubatch], plan.tile_rows[ubatch]
        inboxes.check_rows(rows, f"FFN rank {self.rank}, {where}")
        if self.stamps is not None:
            self.stamps.mark()
        for peer, _, _ in plan.peer_rows(ubatch):
            self.clock.time(lambda peer=peer: inboxes.wait(peer, ubatch))
        if self.stamps is not None:
            self.stamps.mark()
        peers = len(plan.peers)
        hidden = inboxes.hidden(self.rank, ubatch)[:rows]
        ids = inboxes.ids(self.rank, ubatch)[: peers * (HEADER + tile)].view(peers, HEADER + tile)
        topk_ids = topk_w = None
        if routed:
            topk_ids, topk_w = inboxes.topk(self.rank, ubatch)
            topk_ids, topk_w = topk_ids[:rows], topk_w[:rows]
        return hidden, None, ids, topk_ids, topk_w  # no scales: ipc carries plain rows

    def reply(self, plan: FFNRankPlan, ubatch: int, y: torch.Tensor, where: dict) -> list:
        for peer, lo, hi in plan.peer_rows(ubatch):
            push(y[lo:hi], self.inboxes.hidden(peer, ubatch)[: hi - lo])
            self.inboxes.signal(peer, ubatch)
        return []
