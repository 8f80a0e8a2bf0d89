"""The FFN half of an expert-parallel FFN group: each FFN rank holds a shard of the routed experts
(layout/experts.py) and the group computes every row's experts together.

Per MoE layer and ubatch, on every FFN rank of the group (same order everywhere):
  1. route its own received rows (the replicated router, or the routing its peers sent); pad rows
     (token id -1, and those up to `group_rows`) go to no expert (routing id -1);
  2. all-gather [group_rows, hidden] hidden states and [group_rows, 2k] routing (top-k ids and
     the float32 weights' bits, both int32: one collective) over the FFN group;
  3. run its own experts over the gathered rows, and reduce-scatter (sum) the partial sums: each
     rank gets its own rows' routed output back;
  4. add the shared experts of its own rows (replicated, computed once per row).
Dense layers run on the home rank alone; token ids never leave it (hash layers route there).
Every size is the plan's `group_rows[u]`, so the collectives match on every rank and a CUDA graph
of the step holds them (why this design, and its cost: docs/design.md). The collectives run on a
process group of the FFN ranks only (NCCL on CUDA, gloo on CPU); a wire log notes each, so tests
check that every member ran the same ones in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from afdserve.afd.dataplane.payload import LayoutError
from afdserve.afd.dataplane.wire import Wire
from afdserve.model.layers.moe import Routing
from afdserve.model.parts import CausalLM


class ExpertGroup:
    def __init__(
        self,
        model: CausalLM,
        group: tuple[int, ...],
        process_group: dist.ProcessGroup | None,
        wire: Wire,
    ) -> None:
        self.model, self.group, self.process_group, self.wire = model, group, process_group, wire
        config = model.config
        self.hidden, self.top_k, self.layer_types = (
            config.hidden_size,
            config.top_k,
            config.layer_types,
        )
        self.dtype = model.dtype  # the activations' (FP8 weights are float8)

    def ffn(
        self,
        layer: int,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        routing: Routing | None,
        group_rows: int,
        where: dict,
    ) -> torch.Tensor:
        """x [rows, hidden] (this rank's received rows, rows <= group_rows) -> y [rows, hidden]."""
        block = self.model.model.layers[layer].mlp
        if self.layer_types[layer] == "dense":
            return block(x, token_ids)
        rows, k, dev = x.shape[0], self.top_k, x.device
        if rows > group_rows:  # the plan sizes group_rows to hold every rank's rows: a bug
            raise LayoutError(
                f"FFN group {self.group}, layer {layer}, ubatch "
                f"{where.get('ubatch')}: {rows} rows exceed the planned "
                f"group_rows of {group_rows}"
            )
        hidden = torch.zeros(group_rows, self.hidden, dtype=self.dtype, device=dev)
        route = torch.full((group_rows, 2 * k), -1, dtype=torch.int32, device=dev)
        route[:, k:] = 0  # weight bits of 0.0 on pad rows
        if rows:
            if routing is None:
                routing = block.gate(x, token_ids)
            ids, weights = routing
            ids = ids.masked_fill((token_ids < 0).unsqueeze(1), -1)
            hidden[:rows] = x
            route[:rows, :k] = ids
            route[:rows, k:] = weights.float().contiguous().view(torch.int32)
        size = len(self.group)
        # [size * group_rows, hidden] and [size * group_rows, 2k]: the group's rows in rank order
        all_hidden = torch.empty(size * group_rows, self.hidden, dtype=self.dtype, device=dev)
        all_route = torch.empty(size * group_rows, 2 * k, dtype=torch.int32, device=dev)
        self._note("all_gather", where, all_hidden, all_route)
        dist.all_gather_single(all_hidden, hidden, group=self.process_group)
        dist.all_gather_single(all_route, route, group=self.process_group)
        gathered = (all_route[:, :k].long(), all_route[:, k:].contiguous().view(torch.float32))
        partial = block.experts(all_hidden, gathered).to(self.dtype).contiguous()
        mine = torch.empty(group_rows, self.hidden, dtype=self.dtype, device=dev)
        self._note("reduce_scatter", where, partial)
        dist.reduce_scatter_single(mine, partial, group=self.process_group)
        y = mine[:rows]
        shared = block.shared(x)
        return y if shared is None else y + shared

    def _note(self, collective: str, where: dict, *tensors: torch.Tensor) -> None:
        if self.wire.logging and not (
            tensors[0].is_cuda and torch.cuda.is_current_stream_capturing()
        ):
            self.wire.note(
                collective=collective,
                group=list(self.group),
                **where,
                tensors=[[list(t.shape), str(t.dtype)] for t in tensors],
            )
