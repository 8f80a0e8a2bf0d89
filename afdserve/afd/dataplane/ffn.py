"""The FFN side of the data plane: for every layer and ubatch of a step, receive every peer's tile,
run the FFN half once over all of them, send each peer its rows back. Every size comes from the
FFN rank's plan (`receive_rows`, `peer_rows`, `tile_rows`); the batches mirror the attention
side's (afd/dataplane/connector.py, contract in afd/dataplane/wire.py). In an expert-parallel group
the FFN half runs through `ExpertGroup` (afd/dataplane/expert_group.py) over the plan's
`group_rows`, and a rank whose peers sent nothing in a ubatch (or that has no peers) still takes
part in the group's exchange.

`FFNStepRunner` captures that whole step, per plan key, as one CUDA graph, and replays it exactly
when the plan says so; capture follows the attention side's order (a warm run, the capture, one
replay), so both roles communicate the same number of times in a capture step. An MTP draft
pass (layer N over the pass's tiles) is a step of its own key, captured and replayed alike.
"""

from __future__ import annotations

import torch

from afdserve.afd.dataplane.expert_group import ExpertGroup
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
from afdserve.engine.cuda_graphs import capture_graph, check_replayable
from afdserve.engine.graph_tally import CaptureTally
from afdserve.kernels.a2e import A2EFormat, scale_groups
from afdserve.layout.plan import FFNRankPlan
from afdserve.model.parts import CausalLM


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
    scales: torch.Tensor | None = None,
) -> None:
    """The receiver's check on CPU: rows and header match the plan; every id is -1 or in the
    vocab; with fp8 rows, the scales region (check_scales). Names rank, peer, layer, ubatch,
    expected and actual numbers."""
    where = f"FFN rank {rank} from attention rank {peer}, layer {layer}, ubatch {ubatch}"
    if hidden.shape[0] != tile_rows:
        raise LayoutError(f"{where}: expected {tile_rows} hidden rows, got {hidden.shape[0]}")
    if ids.shape[0] != HEADER + tile_rows:
        raise LayoutError(f"{where}: expected {tile_rows} token ids, got {ids.shape[0] - HEADER}")
    header = ids[:HEADER].tolist()
    expected = [step % STEP_MODULO, layer, ubatch, tile_rows]
    if header != expected:
        raise LayoutError(
            f"{where}: expected (step, layer, ubatch, rows) = {tuple(expected)}, "
            f"the peer wrote {tuple(header)}"
        )
    check_token_ids(ids[HEADER:], vocab_size, where)
    if scales is not None:
        check_scales(scales, ids[HEADER:], hidden.shape[1], where)


def check_scales(scales: torch.Tensor, ids: torch.Tensor, hidden: int, where: str) -> None:
    """An fp8 tile's scales: [tile_rows, groups] float32, finite and >= 0, and 0 on every pad
    row (token id -1), whose values are zeros."""
    shape = (ids.shape[0], scale_groups(hidden))
    if tuple(scales.shape) != shape or scales.dtype != torch.float32:
        raise LayoutError(
            f"{where}: expected scales {shape} float32, got {tuple(scales.shape)} {scales.dtype}"
        )
    bad = ~torch.isfinite(scales) | (scales < 0) | ((ids == -1).unsqueeze(1) & (scales != 0))
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise LayoutError(
            f"{where}: row {row} (token id {int(ids[row])}) has scales "
            f"{scales[row].tolist()}; pad rows must have scale 0"
        )


def scaled_rows(scales: torch.Tensor) -> int:
    """Rows with a nonzero scale: the real rows of an fp8 tile (a pad row's scale is 0)."""
    return int((scales != 0).any(dim=1).sum())


class WireTransport:
    """How an FFN rank receives its peers' tiles and replies over torch.distributed
    point-to-point: one batch receiving every peer's tile, one batch sending every peer its rows
    (the mirrors of the attention side's batches, afd/dataplane/wire.py)."""

    def __init__(
        self,
        wire: Wire,
        device: torch.device,
        dtype: torch.dtype,
        hidden: int,
        top_k: int,
        a2e: A2EFormat | None = None,
    ) -> None:
        self.wire, self.device, self.dtype = wire, device, dtype
        self.hidden, self.top_k = hidden, top_k
        self.a2e = a2e or A2EFormat("auto", dtype)
        self.stamps = None  # kernels/triton_stamp.Stamps around every wait: the benches set it
        self.clock = WaitClock()  # waiting for the peers' tiles

    def receive(self, plan: FFNRankPlan, ubatch: int, routed: bool, where: dict):
        """(hidden [rows, hidden] in the A2E format, its scales [rows, groups] or None, ids
        [peers, HEADER + tile], topk ids, topk weights)."""
        rows, tile, dev = plan.receive_rows[ubatch], plan.tile_rows[ubatch], self.device
        hidden = torch.empty(rows, self.hidden, dtype=self.a2e.wire_dtype, device=dev)
        scales = None
        if self.a2e.scaled:
            scales = torch.empty(rows, scale_groups(self.hidden), dtype=torch.float32, device=dev)
        # float8 travels as its bytes (the attention side's sends, afd/dataplane/connector.py).
        rows_in = hidden.view(torch.uint8) if self.a2e.scaled else hidden
        ids = torch.empty(len(plan.peers), HEADER + tile, dtype=torch.int32, device=dev)
        topk_ids = topk_w = None
        if routed:
            topk_ids = torch.empty(rows, self.top_k, dtype=torch.int32, device=dev)
            topk_w = torch.empty(rows, self.top_k, dtype=torch.float32, device=dev)
        ops: list[P2P] = []
        for i, (peer, lo, hi) in enumerate(plan.peer_rows(ubatch)):
            ops.append(P2P("recv", rows_in[lo:hi], peer))
            if scales is not None:
                ops.append(P2P("recv", scales[lo:hi], peer))
            ops.append(P2P("recv", ids[i], peer))
            if routed:
                ops += [P2P("recv", topk_ids[lo:hi], peer), P2P("recv", topk_w[lo:hi], peer)]
        works = self.wire.post(ops, **where)
        if self.stamps is not None:
            self.stamps.mark()
        self.clock.time(lambda: [work.wait() for work in works])
        if self.stamps is not None:
            self.stamps.mark()
        return hidden, scales, ids, topk_ids, topk_w

    def reply(self, plan: FFNRankPlan, ubatch: int, y: torch.Tensor, where: dict) -> list:
        out = [P2P("send", y[lo:hi], peer) for peer, lo, hi in plan.peer_rows(ubatch)]
        return self.wire.post(out, **where)


class FFNExchange:
    def __init__(
        self,
        model: CausalLM,
        rank: int,
        gate_on_attention: bool,
        device: torch.device,
        wire: Wire,
        expert: ExpertGroup | None = None,
        transport=None,
        a2e: A2EFormat | None = None,
        draft: CausalLM | None = None,
    ) -> None:
        self.model, self.rank, self.device, self.wire = model, rank, device, wire
        self.expert = expert  # this rank's expert-parallel group, if it is in one
        # The MTP layer's FFN half (its layer N = the main layers' count), which the plan's
        # draft passes run like any layer; its expert group shards it like the main layers'.
        self.draft, self.draft_expert = draft, None
        if draft is not None and expert is not None:
            self.draft_expert = ExpertGroup(draft, expert.group, expert.process_group, wire)
        config = model.config
        self.vocab, self.top_k, self.hidden = config.vocab_size, config.top_k, config.hidden_size
        self.dtype = model.dtype  # the activations' (FP8 weights are float8)
        # The draft's config is the main one with layer N appended: one answer for every layer.
        self.routed = routed_layers(draft.config if draft else config, gate_on_attention)
        self.step = StepCounter(device)
        self.a2e = a2e or A2EFormat("auto", self.dtype)
        # WireTransport, or afd/dataplane/ipc.py's IPCTransport: both receive views and reply alike.
        self.transport = transport or WireTransport(
            wire, device, self.dtype, self.hidden, self.top_k, self.a2e
        )

    @property
    def draft_layers(self) -> tuple[int, ...]:
        """The layer a draft pass runs: N, after the main layers."""
        return (self.model.config.num_layers,)

    @torch.inference_mode()
    def run(self, plan: FFNRankPlan, step: int, layers: tuple[int, ...] | None = None) -> None:
        """One step over the main layers (or a draft pass over `layers`), eagerly (or under
        capture: then the graph holds exactly this). The caller sets `self.step` first: a graph
        must read it, not hold it as a constant."""
        if plan.group and self.expert is None:
            raise LayoutError(
                f"FFN rank {self.rank}: the plan puts it in the expert-parallel "
                f"group {plan.group}, but it was built without one"
            )
        if layers is not None and self.draft is None:
            raise LayoutError(
                f"FFN rank {self.rank}: the plan gives it a draft pass, but it holds no MTP layer"
            )
        sends: list = []
        for layer in range(self.model.config.num_layers) if layers is None else layers:
            # In an expert-parallel group a rank whose peers sent nothing still serves its experts.
            for ubatch, rows in enumerate(plan.exchange_rows):
                if rows:
                    sends += self._layer(plan, step, layer, ubatch)
        for work in sends:
            work.wait()

    def _layer(self, plan: FFNRankPlan, step: int, layer: int, ubatch: int) -> list:
        rows, routed = plan.receive_rows[ubatch], self.routed[layer]
        where = {"step": step, "layer": layer, "ubatch": ubatch}
        if rows:
            hidden, scales, ids, topk_ids, topk_w = self.transport.receive(
                plan, ubatch, routed, where
            )
            self._check(plan, step, layer, ubatch, hidden, ids, scales)
            if not self.a2e.plain:
                # Dequantized here, on the home rank: an expert group exchanges model-dtype rows.
                hidden = self.a2e.decode(hidden, scales)
        else:  # an expert-parallel rank without tiles this ubatch receives nothing at all
            hidden = torch.empty(0, self.hidden, dtype=self.dtype, device=self.device)
            ids = torch.empty(0, HEADER, dtype=torch.int32, device=self.device)
            topk_ids = torch.empty(0, self.top_k, dtype=torch.int32, device=self.device)
            topk_w = torch.empty(0, self.top_k, dtype=torch.float32, device=self.device)
        token_ids = ids[:, HEADER:].reshape(-1).long()
        routing = (topk_ids.long(), topk_w) if routed else None
        main = layer < self.model.config.num_layers
        if plan.group:
            expert = self.expert if main else self.draft_expert
            y = expert.ffn(layer, hidden, token_ids, routing, plan.group_rows[ubatch], where)
        else:
            y = (self.model if main else self.draft).ffn_half(layer, hidden, token_ids, routing)
        y = y.to(self.dtype).contiguous()
        if not rows:
            return []
        return self.transport.reply(plan, ubatch, y, where)

    def _check(
        self,
        plan: FFNRankPlan,
        step: int,
        layer: int,
        ubatch: int,
        hidden: torch.Tensor,
        ids: torch.Tensor,
        scales: torch.Tensor | None,
    ) -> None:
        tile = plan.tile_rows[ubatch]
        if self.device.type == "cpu":
            for i, (peer, lo, hi) in enumerate(plan.peer_rows(ubatch)):
                check_payload(
                    rank=self.rank,
                    peer=peer,
                    step=step,
                    layer=layer,
                    ubatch=ubatch,
                    tile_rows=tile,
                    hidden=hidden[lo:hi],
                    ids=ids[i],
                    vocab_size=self.vocab,
                    scales=None if scales is None else scales[lo:hi],
                )
        else:
            # Reading the header back would sync the GPU every layer: assert on the device.
            header = ids[:, :HEADER]
            ok = (header[:, 0] == self.step.value) & (header[:, 1] == layer)
            ok &= (header[:, 2] == ubatch) & (header[:, 3] == tile)
            torch._assert_async(ok.all(), "AFD payload header off the plan")
            check_token_ids(ids[:, HEADER:], self.vocab, f"FFN rank {self.rank}")
            if scales is not None:
                pad = (ids[:, HEADER:] == -1).reshape(-1, 1)
                torch._assert_async(
                    ~(pad & (scales != 0)).any(), "AFD payload: a pad row's fp8 scale is not 0"
                )
        if self.wire.logging and not _capturing(hidden):
            # What this rank really received: each peer's header and its real (non-pad) rows,
            # and with fp8 rows the rows whose scales are not 0 (its real rows again).
            for i, (peer, lo, hi) in enumerate(plan.peer_rows(ubatch)):
                extra = {} if scales is None else {"scaled_rows": scaled_rows(scales[lo:hi])}
                self.wire.note(
                    step=step,
                    layer=layer,
                    ubatch=ubatch,
                    peer=peer,
                    header=ids[i, :HEADER].tolist(),
                    real_rows=int((ids[i, HEADER:] != -1).sum()),
                    **extra,
                )


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


class FFNStepRunner:
    """Runs the FFN rank's step as its plan says: eagerly, or as the CUDA graph of the plan's key
    (one per key). Without CUDA graphs (CPU, graph mode none) "capture" and "replay" run eagerly
    with the same layout, so the policy is the same everywhere."""

    def __init__(self, exchange: FFNExchange, use_graphs: bool) -> None:
        self.exchange, self.use_graphs = exchange, use_graphs
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.eager_keys: set[tuple] = set()  # keys whose capture failed: they run eagerly
        self.pool = None
        self.tally = CaptureTally()

    def run(self, plan: FFNRankPlan, step: int) -> None:
        if plan.mode == "idle":
            return
        self.exchange.step.set(step)
        self._run(plan, step)
        # The draft passes follow the main step, each eagerly or as its own key's graph (rule 10
        # of layout/plan.py), as the attention side runs them.
        for draft in plan.drafts:
            if draft.mode != "idle":
                self._run(draft, step, self.exchange.draft_layers)

    def _run(self, plan: FFNRankPlan, step: int, layers: tuple[int, ...] | None = None) -> None:
        """The main layers (or a draft pass over `layers`) as the plan's mode says."""
        if plan.mode == "eager" or not self.use_graphs:
            self.exchange.run(plan, step, layers)
            return
        key = plan.key
        if plan.mode == "capture":
            # A capture exchanges twice, as its peers do: the warm run, then the step.
            if key in self.graphs or key in self.eager_keys:
                # Held already: the key has no kind (layout/plan.py, rule 5), so a peer that
                # captures its other kind of graph finds this rank's graph of the layout made.
                self.exchange.run(plan, step, layers)
            elif not self._capture(plan, step, layers):
                # The warm run has exchanged once; the step's own exchange runs below, eagerly,
                # as the replay would have (the attention side sees the same sends and receives).
                self.eager_keys.add(key)
        if key in self.eager_keys:
            self.exchange.run(plan, step, layers)
            return
        check_replayable(plan.rank, plan.mode, key, self.graphs)
        self.graphs[key].replay()

    def _capture(self, plan: FFNRankPlan, step: int, layers: tuple[int, ...] | None) -> bool:
        with self.tally.capturing("ffn"):
            return self._warm_and_capture(plan, step, layers)

    def _warm_and_capture(
        self, plan: FFNRankPlan, step: int, layers: tuple[int, ...] | None
    ) -> bool:
        self.exchange.run(plan, step, layers)  # warm-up; the attention side warms up alike
        what = f"FFN rank {plan.rank}'s {plan.key}"
        run = lambda: self.exchange.run(plan, step, layers)  # noqa: E731
        captured = capture_graph(run, self.pool, what)
        if captured is None:
            return False
        if self.pool is None:
            self.pool = captured[0].pool()
        self.graphs[plan.key] = captured[0]
        return True
