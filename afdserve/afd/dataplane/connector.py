"""The attention side of the data plane. Every size comes from the rank's plan.

Per layer and ubatch each attention peer posts two batches with its FFN rank, in this order:
  1. sends: hidden [tile_rows, hidden] in the model dtype, zeros on pad rows (a2e_dtype fp8:
     float8_e4m3fn values as their uint8 bytes, and scales [tile_rows, groups] float32, one per
     128 channels, 0 on pad rows; kernels/a2e.py); ids [4 + tile_rows] int32, a header
     (step, layer, ubatch, tile_rows) then token ids, -1 on pad rows; and in `routed_layers` the
     routing: topk ids [tile_rows, k] int32, weights [tile_rows, k] fp32;
  2. receives: the FFN output [tile_rows, hidden].
The FFN rank posts their mirrors (afd/dataplane/ffn.py; the contract is in wire.py): one batch
receiving every peer's tile, one sending every peer its output. The header lets the FFN rank
prove it reads the tile its peer wrote for this very step, layer and ubatch.

Everything here is CUDA-graph capturable: the step number is read from a device tensor that
`begin_step` fills, and the other header fields are constants of the captured layout.
"""

from __future__ import annotations

import torch

from afdserve.afd.dataplane.payload import (
    HEADER,
    STEP_MODULO,
    LayoutError,
    StepCounter,
    WaitClock,
    check_token_ids,
    routed_layers,
)
from afdserve.afd.dataplane.wire import P2P, Wire
from afdserve.engine.model_runner import Ready
from afdserve.kernels.a2e import A2EFormat, pad_zeroed
from afdserve.layout.plan import AttentionRankPlan
from afdserve.model.config import ModelConfig
from afdserve.model.layers.moe import Routing


def planned_tile(plan: AttentionRankPlan, layer: int, ubatch: int, rows: int) -> int:
    """The tile this rank sends in `ubatch`; more rows than the plan's tile is a layout bug."""
    tile = plan.tile_rows[ubatch]
    if rows > tile:
        raise LayoutError(
            f"attention rank {plan.rank}, layer {layer}, ubatch {ubatch}: "
            f"{rows} rows exceed the planned tile of {tile}"
        )
    return tile


def check_routing(
    plan: AttentionRankPlan, layer: int, routing: Routing | None, routed: tuple[bool, ...]
) -> None:
    if (routing is not None) != routed[layer]:
        raise LayoutError(
            f"attention rank {plan.rank}, layer {layer}: routing "
            f"{'present' if routing is not None else 'absent'}, but routed_layers says "
            f"{routed[layer]}"
        )


class _Pending:
    def __init__(
        self,
        works: list,
        out: torch.Tensor,
        rows: int,
        keep: tuple,
        stamps=None,
        clock: WaitClock | None = None,
    ) -> None:
        self.works, self.out, self.rows, self.keep, self.stamps = works, out, rows, keep, stamps
        self.clock = clock or WaitClock()

    def wait(self) -> torch.Tensor:
        if self.stamps is not None:
            self.stamps.mark()
        self.clock.time(lambda: [work.wait() for work in self.works])
        if self.stamps is not None:
            self.stamps.mark()
        self.keep = ()
        return self.out[: self.rows]


class AttentionSide:
    """What every multi-process attention connector shares: the routed layers, the step number
    on the device, the rank plan of the step, and the tile checks that open every post."""

    def __init__(
        self, config: ModelConfig, device: torch.device, gate_on_attention: bool, a2e: A2EFormat
    ) -> None:
        self.a2e = a2e
        self.routed = routed_layers(config, gate_on_attention)
        self.step = StepCounter(device)
        self.step_number = 0
        self.plan: AttentionRankPlan | None = None
        self.stamps = None  # kernels/triton_stamp.Stamps around every wait: the benches set it
        self.clock = WaitClock()

    def begin_step(self, plan: AttentionRankPlan, step: int) -> None:
        self.plan, self.step_number = plan, step
        self.step.set(step)

    def _tile(self, layer: int, ubatch: int, rows: int, routing: Routing | None) -> int:
        """The plan's tile for this post (0: an empty ubatch, nothing travels and its FFN rank
        expects nothing), after checking the rows and the routing against the plan."""
        tile = planned_tile(self.plan, layer, ubatch, rows)
        check_routing(self.plan, layer, routing, self.routed)
        return tile


class AttentionConnector(AttentionSide):
    """Attention side over torch.distributed point-to-point (gloo on CPU, NCCL on CUDA)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        gate_on_attention: bool,
        wire: Wire,
        a2e: A2EFormat | None = None,
    ) -> None:
        super().__init__(config, device, gate_on_attention, a2e or A2EFormat("auto", dtype))
        self.hidden, self.dtype, self.device, self.wire = config.hidden_size, dtype, device, wire

    def post(
        self,
        layer: int,
        ubatch: int,
        x: torch.Tensor,
        route_ids: torch.Tensor,
        routing: Routing | None,
    ) -> _Pending | Ready:
        plan = self.plan
        rows = x.shape[0]
        tile = self._tile(layer, ubatch, rows, routing)
        if tile == 0:
            return Ready(x)
        sends = [self._plain_rows(x, tile)] if self.a2e.plain else self._rows(x, route_ids, tile)
        ids = torch.full((HEADER + tile,), -1, dtype=torch.int32, device=self.device)
        ids[0:1].copy_(self.step.value)
        ids[1].fill_(layer)
        ids[2].fill_(ubatch)
        ids[3].fill_(tile)
        ids[HEADER : HEADER + rows] = route_ids
        sends.append(ids)
        if routing is not None:
            topk_ids, topk_w = routing
            k = topk_ids.shape[1]
            packed_ids = torch.zeros(tile, k, dtype=torch.int32, device=self.device)
            packed_w = torch.zeros(tile, k, dtype=torch.float32, device=self.device)
            packed_ids[:rows], packed_w[:rows] = topk_ids, topk_w
            sends += [packed_ids, packed_w]
        out = torch.empty(tile, self.hidden, dtype=self.dtype, device=self.device)
        peer = plan.ffn_rank  # the plan names the FFN rank, like every other layout fact
        where = {"step": self.step_number, "layer": layer, "ubatch": ubatch}
        works = self.wire.post([P2P("send", t, peer) for t in sends], **where)
        works += self.wire.post([P2P("recv", out, peer)], **where)
        return _Pending(works, out, rows, tuple(sends), self.stamps, self.clock)

    def _plain_rows(self, x: torch.Tensor, tile: int) -> torch.Tensor:
        """The tile in the model dtype (a2e_dtype auto): x itself when it fills the tile."""
        if x.shape[0] == tile and x.dtype == self.dtype and x.is_contiguous():
            return x
        hidden = torch.zeros(tile, self.hidden, dtype=self.dtype, device=self.device)
        hidden[: x.shape[0]] = x
        return hidden

    def _rows(self, x: torch.Tensor, route_ids: torch.Tensor, tile: int) -> list[torch.Tensor]:
        """The tile's rows in the A2E format, then (fp8) their scales; every pad row is zeros
        with scale 0 (pad_zeroed). Each row's bytes depend on that row alone
        (kernels/a2e.py)."""
        q, scales = self.a2e.encode(pad_zeroed(x, route_ids))
        rows = x.shape[0]
        hidden = torch.zeros(tile, self.hidden, dtype=q.dtype, device=self.device)
        hidden[:rows] = q
        if scales is None:
            return [hidden]
        # float8 travels as its bytes: gloo has no float8 type (nor NCCL before 2.24).
        padded = torch.zeros(tile, scales.shape[1], dtype=torch.float32, device=self.device)
        padded[:rows] = scales
        return [hidden.view(torch.uint8), padded]


class InProcessConnector:
    """1A1F in one process: the attention side hands its padded tile straight to the FFN half.
    Same plan, same padding, the same pad-row ids and the same id check as over the wire."""

    def __init__(
        self,
        ffn_model,
        gate_on_attention: bool,
        wire: Wire | None = None,
        a2e: A2EFormat | None = None,
        ffn_draft=None,
    ) -> None:
        self.ffn_model, self.wire = ffn_model, wire  # the wire only logs: nothing travels
        self.ffn_draft = ffn_draft  # the MTP layer's FFN half (layer N), with MTP drafts
        self.a2e = a2e or A2EFormat("auto", ffn_model.dtype)
        self.vocab = ffn_model.config.vocab_size
        config = (ffn_draft or ffn_model).config  # a draft's: the main layers, then layer N
        self.routed = routed_layers(config, gate_on_attention)
        self.plan: AttentionRankPlan | None = None
        self.step_number = 0

    def begin_step(self, plan: AttentionRankPlan, step: int) -> None:
        self.plan, self.step_number = plan, step

    def post(
        self,
        layer: int,
        ubatch: int,
        x: torch.Tensor,
        route_ids: torch.Tensor,
        routing: Routing | None,
    ) -> Ready:
        rows = x.shape[0]
        tile = planned_tile(self.plan, layer, ubatch, rows)
        check_routing(self.plan, layer, routing, self.routed)
        if tile == 0:
            return Ready(x)
        if tile > rows:
            x = torch.cat((x, x.new_zeros(tile - rows, x.shape[1])))
            route_ids = torch.cat((route_ids, route_ids.new_full((tile - rows,), -1)))
            if routing is not None:
                routing = tuple(
                    torch.cat((t, t.new_zeros(tile - rows, t.shape[1]))) for t in routing
                )
        main = layer < self.ffn_model.config.num_layers
        if layer == 0 or not main:  # the same ids in every main layer: one check per ubatch
            check_token_ids(route_ids, self.vocab, f"FFN half in process, ubatch {ubatch}")
        if self.wire is not None and self.wire.logging and not x.is_cuda:
            # What the FFN half ran, in the FFN rank's receive-log format.
            header = [self.step_number % STEP_MODULO, layer, ubatch, tile]
            self.wire.note(
                step=self.step_number,
                layer=layer,
                ubatch=ubatch,
                peer=self.plan.rank,
                header=header,
                real_rows=int((route_ids != -1).sum()),
            )
        x = self.a2e.ffn_rows(x, route_ids)  # the rows as an FFN rank would decode them
        y = (self.ffn_model if main else self.ffn_draft).ffn_half(layer, x, route_ids, routing)
        return Ready(y[:rows])
