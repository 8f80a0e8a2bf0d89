"""The data plane between attention and FFN ranks. Every size comes from the StepPlan.

Per layer and ubatch each attention peer sends its FFN rank, in this order:
  hidden  [tile_rows, hidden]  model dtype; pad rows are zeros
  ids     [4 + tile_rows]      int32: header (step, layer, ubatch, tile_rows), then token ids,
                               -1 on pad rows
  routing (gate on the attention side only): topk ids [tile_rows, k] int32,
                               weights [tile_rows, k] fp32
and receives the FFN output [tile_rows, hidden] back. The header lets the FFN rank prove it reads
the tile its peer wrote for this very step, layer and ubatch, instead of trusting that both agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from afdserve.afd.plan import AttentionRankPlan, FFNRankPlan
from afdserve.engine.model_runner import Ready
from afdserve.model.moe import Routing

HEADER = 4


class LayoutError(RuntimeError):
    """A payload that does not match the plan: names rank, layer, ubatch, expected and actual."""


def _header(step: int, layer: int, ubatch: int, rows: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([step % (1 << 31), layer, ubatch, rows], dtype=torch.int32, device=device)


def check_payload(
    *,
    rank: int,
    peer: int,
    step: int,
    layer: int,
    ubatch: int,
    tile_rows: int,
    hidden: torch.Tensor,
    ids: torch.Tensor,
    vocab_size: int,
) -> None:
    """The receiver's check: rows and header match the plan; every id is -1 or in the vocab."""
    where = f"FFN rank {rank} from attention rank {peer}, layer {layer}, ubatch {ubatch}"
    if hidden.shape[0] != tile_rows:
        raise LayoutError(f"{where}: expected {tile_rows} hidden rows, got {hidden.shape[0]}")
    if ids.shape[0] != HEADER + tile_rows:
        raise LayoutError(f"{where}: expected {tile_rows} token ids, got {ids.shape[0] - HEADER}")
    header = ids[:HEADER].tolist()
    expected = [step % (1 << 31), layer, ubatch, tile_rows]
    if header != expected:
        raise LayoutError(
            f"{where}: expected (step, layer, ubatch, rows) = {tuple(expected)}, "
            f"the peer wrote {tuple(header)}"
        )
    tokens = ids[HEADER:]
    bad = (tokens < -1) | (tokens >= vocab_size)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise LayoutError(
            f"{where}: token id {int(tokens[row])} at row {row} is outside [-1, {vocab_size})"
        )


def planned_tile(plan: AttentionRankPlan, layer: int, ubatch: int, rows: int) -> tuple[int, int]:
    """The tile this rank sends in `ubatch`; more rows than the plan's tile is a layout bug."""
    tile = plan.tile_rows[ubatch]
    if rows > tile:
        raise LayoutError(
            f"attention rank {plan.rank}, layer {layer}, ubatch {ubatch}: "
            f"{rows} rows exceed the planned tile of {tile}"
        )
    return tile, rows


class _Pending:
    def __init__(self, works: list, out: torch.Tensor, rows: int, keep: tuple) -> None:
        self.works, self.out, self.rows, self.keep = works, out, rows, keep

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.keep = ()
        return self.out[: self.rows]


class _Empty:
    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def wait(self) -> torch.Tensor:
        return torch.zeros_like(self.x)


class AttentionConnector:
    """Attention side over torch.distributed point-to-point (gloo on CPU, NCCL on CUDA)."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        self.hidden, self.dtype, self.device = hidden_size, dtype, device
        self.plan: AttentionRankPlan | None = None
        self.step = 0

    def begin_step(self, plan: AttentionRankPlan, step: int) -> None:
        self.plan, self.step = plan, step

    def post(
        self,
        layer: int,
        ubatch: int,
        x: torch.Tensor,
        route_ids: torch.Tensor,
        routing: Routing | None,
    ):
        tile, rows = planned_tile(self.plan, layer, ubatch, x.shape[0])
        if tile == 0:
            return _Empty(x)
        hidden = torch.zeros(tile, self.hidden, dtype=self.dtype, device=self.device)
        hidden[:rows] = x
        ids = torch.full((HEADER + tile,), -1, dtype=torch.int32, device=self.device)
        ids[:HEADER] = _header(self.step, layer, ubatch, tile, self.device)
        ids[HEADER : HEADER + rows] = route_ids
        out = torch.empty(tile, self.hidden, dtype=self.dtype, device=self.device)
        sends = [hidden, ids]
        if routing is not None:
            topk_ids, topk_w = routing
            k = topk_ids.shape[1]
            packed_ids = torch.zeros(tile, k, dtype=torch.int32, device=self.device)
            packed_w = torch.zeros(tile, k, dtype=torch.float32, device=self.device)
            packed_ids[:rows], packed_w[:rows] = topk_ids, topk_w
            sends += [packed_ids, packed_w]
        peer = self.plan.ffn_rank  # the plan names the FFN rank, like every other layout fact
        ops = [dist.P2POp(dist.isend, t, peer) for t in sends]
        ops.append(dist.P2POp(dist.irecv, out, peer))
        works = dist.batch_isend_irecv(ops)
        return _Pending(works, out, rows, tuple(sends))


class InProcessConnector:
    """1A1F in one process: the attention side hands its padded tile straight to the FFN half.
    Same plan, same padding and the same pad-row ids as over the wire; no copy beyond the pad."""

    def __init__(self, ffn_model, vocab_size: int) -> None:
        self.ffn_model, self.vocab = ffn_model, vocab_size
        self.plan: AttentionRankPlan | None = None

    def begin_step(self, plan: AttentionRankPlan, step: int) -> None:
        self.plan = plan

    def post(self, layer: int, ubatch: int, x: torch.Tensor, route_ids: torch.Tensor,
             routing: Routing | None):
        tile, rows = planned_tile(self.plan, layer, ubatch, x.shape[0])
        if tile == 0:
            return _Empty(x)
        if tile > rows:
            x = torch.cat((x, x.new_zeros(tile - rows, x.shape[1])))
            route_ids = torch.cat((route_ids, route_ids.new_full((tile - rows,), -1)))
            if routing is not None:
                routing = tuple(torch.cat((t, t.new_zeros(tile - rows, t.shape[1])))
                                for t in routing)
        y = self.ffn_model.ffn_half(layer, x, route_ids, routing)
        return Ready(y[:rows])


class FFNExchange:
    """FFN side: receive every peer's tile, run the FFN half once over all of them, send back."""

    def __init__(
        self,
        model,
        rank: int,
        vocab_size: int,
        top_k: int,
        gate_on_attention: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model, self.rank, self.vocab = model, rank, vocab_size
        self.top_k, self.gate_on_attention = top_k, gate_on_attention
        self.dtype, self.device = dtype, device
        self.hidden = model.config.hidden_size

    @torch.inference_mode()
    def run_step(self, plan: FFNRankPlan, step: int) -> None:
        pending_sends: list = []
        for layer in range(self.model.config.num_layers):
            moe_routed = self.gate_on_attention and self.model.config.layer_types[layer] != "dense"
            for ubatch, tile in enumerate(plan.tile_rows):
                if tile == 0:
                    continue
                y, sends = self._one(plan, step, layer, ubatch, tile, moe_routed)
                pending_sends.extend(dist.batch_isend_irecv(sends))
                del y
        for work in pending_sends:
            work.wait()

    def _one(self, plan, step, layer, ubatch, tile, routed):
        peers = plan.peers
        hidden = torch.empty(len(peers) * tile, self.hidden, dtype=self.dtype, device=self.device)
        ids = torch.empty(len(peers), HEADER + tile, dtype=torch.int32, device=self.device)
        ops = []
        topk_ids = topk_w = None
        if routed:
            topk_ids = torch.empty(
                len(peers) * tile, self.top_k, dtype=torch.int32, device=self.device
            )
            topk_w = torch.empty(
                len(peers) * tile, self.top_k, dtype=torch.float32, device=self.device
            )
        for i, peer in enumerate(peers):
            rows = slice(i * tile, (i + 1) * tile)
            ops.append(dist.P2POp(dist.irecv, hidden[rows], peer))
            ops.append(dist.P2POp(dist.irecv, ids[i], peer))
            if routed:
                ops.append(dist.P2POp(dist.irecv, topk_ids[rows], peer))
                ops.append(dist.P2POp(dist.irecv, topk_w[rows], peer))
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if self.device.type == "cpu":
            for i, peer in enumerate(peers):
                check_payload(
                    rank=self.rank,
                    peer=peer,
                    step=step,
                    layer=layer,
                    ubatch=ubatch,
                    tile_rows=tile,
                    hidden=hidden[i * tile : (i + 1) * tile],
                    ids=ids[i],
                    vocab_size=self.vocab,
                )
        else:
            # Reading the header back would sync the GPU every layer: assert on the device.
            expected = _header(step, layer, ubatch, tile, self.device)
            tokens = ids[:, HEADER:]
            ok = (ids[:, :HEADER] == expected).all() & (tokens >= -1).all()
            torch._assert_async(ok & (tokens < self.vocab).all(), "AFD payload off the plan")
        token_ids = ids[:, HEADER:].reshape(-1).long()
        routing = (topk_ids.long(), topk_w) if routed else None
        y = self.model.ffn_half(layer, hidden, token_ids, routing).to(self.dtype).contiguous()
        sends = [
            dist.P2POp(dist.isend, y[i * tile : (i + 1) * tile], peer)
            for i, peer in enumerate(peers)
        ]
        return y, sends
