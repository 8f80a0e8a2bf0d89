"""The FFN half of a layer: router -> routed experts (+ shared experts), or a dense MLP.

`ffn(x, token_ids, routing=None) -> y`. Token ids travel with the hidden states because hash-routed
layers pick experts from `tid2eid[token_id]`; pad rows carry id -1, which looks up row 0 and whose
output the caller drops. A routing id of -1 means "no expert" (the pair contributes nothing): an
expert-parallel shard uses it for pairs held elsewhere and for pad rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.kernels import ops
from afdserve.model.config import ModelConfig
from afdserve.model.layers.common import GatedMLP

Routing = tuple[torch.Tensor, torch.Tensor]  # topk ids [rows, k] int64, weights [rows, k] float32


class TokenIdError(ValueError):
    """A token id outside a hash layer's table: a layout bug upstream, never a valid input."""


def check_token_ids(token_ids: torch.Tensor, table_size: int, layer: int) -> None:
    """Ids must be -1 (pad) or in [0, table_size). On CUDA inside a graph capture this becomes a
    device-side assert; elsewhere it raises with the layer and the first offending row."""
    bad = (token_ids < -1) | (token_ids >= table_size)
    if token_ids.is_cuda and torch.cuda.is_current_stream_capturing():
        torch._assert_async(~bad.any(), "token id outside the hash table")
        return
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        raise TokenIdError(
            f"layer {layer}: token id {int(token_ids[row])} at row {row} is outside the hash "
            f"table [0, {table_size}) (pad rows use -1)"
        )


class Router(nn.Module):
    """Picks top-k experts per row and their weights, computed in float32."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.layer = layer
        self.weight = nn.Parameter(torch.empty(c.num_experts, c.hidden_size))
        self.hash = c.layer_types[layer] == "hash_moe"
        self.top_k, self.num_experts = c.top_k, c.num_experts
        self.scoring, self.method = c.scoring, c.topk_method
        self.n_group, self.topk_group = c.n_group, c.topk_group
        self.normalize, self.scale = c.norm_topk_prob, c.routed_scaling_factor
        # The hash path never reads the bias; DeepSeek-V4 checkpoints carry none for hash layers
        # (V3-shaped checkpoints with hash layers do, so they keep loading it).
        v4_hash = self.hash and c.family == "deepseek_v4"
        if self.method == "noaux_tc" and not v4_hash:
            self.register_buffer("e_score_correction_bias", torch.empty(c.num_experts))
        if self.hash:
            self.register_buffer("tid2eid", torch.empty(c.vocab_size, c.top_k, dtype=torch.long))

    def _scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.weight.float())
        if self.scoring == "sigmoid":
            return logits.sigmoid()
        if self.scoring == "sqrtsoftplus":  # DeepSeek-V4
            return F.softplus(logits).sqrt()
        return logits.softmax(dim=-1)

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> Routing:
        # One group of noaux_tc (MiniMax-M2) is greedy top-k over score + bias.
        one_group = self.method == "noaux_tc" and self.n_group == 1
        if (self.method == "greedy" or one_group) and not self.hash:
            bias = self.e_score_correction_bias if one_group else None
            fused = ops.route_greedy(
                x, self.weight, self.top_k, self.scoring, self.normalize, self.scale, bias
            )
            if fused is not None:
                return fused
        if self.hash:
            capturing = token_ids.is_cuda and torch.cuda.is_current_stream_capturing()
            if not capturing:  # eagerly a clear error before any kernel reads the ids
                check_token_ids(token_ids, self.tid2eid.shape[0], self.layer)
            table = (self.tid2eid, token_ids)
            fused = ops.route_greedy(
                x, self.weight, self.top_k, self.scoring, True, self.scale, hashed=table
            )
            if fused is not None:  # its kernel asserts the ids in range on the device
                return fused
            if capturing:
                check_token_ids(token_ids, self.tid2eid.shape[0], self.layer)
        scores = self._scores(x)  # [rows, experts]
        if self.hash:
            ids = self.tid2eid[token_ids.clamp(min=0).long()]
            weights = scores.gather(1, ids)
            return ids, weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scale
        if self.method == "noaux_tc":
            choice = scores + self.e_score_correction_bias.float()
            if self.n_group > 1:  # one group (DeepSeek-V4) keeps every expert
                groups = choice.view(-1, self.n_group, self.num_experts // self.n_group)
                group_scores = groups.topk(2, dim=-1).values.sum(-1)
                choice = self._mask_groups(choice, group_scores, float("-inf"))
            ids = choice.topk(self.top_k, dim=-1).indices
            weights = scores.gather(1, ids)
            if self.normalize:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            return ids, weights * self.scale
        if self.method == "group_limited_greedy":
            group_scores = scores.view(-1, self.n_group, self.num_experts // self.n_group).amax(-1)
            scores = self._mask_groups(scores, group_scores, 0.0)
        weights, ids = scores.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return ids, weights * self.scale

    def _mask_groups(self, scores: torch.Tensor, group_scores: torch.Tensor, fill: float):
        keep = group_scores.topk(self.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        mask = mask.repeat_interleave(self.num_experts // self.n_group, dim=1)
        return scores.masked_fill(~mask, fill)


class Experts(nn.Module):
    """Routed experts as stacked weights: gate_up [E, 2I, H], down [E, H, I]. With `held` (an
    expert-parallel shard) only those experts, in that order: routing ids stay global and the
    pairs of experts held elsewhere contribute nothing here (the group sums the shards)."""

    def __init__(self, config: ModelConfig, held: tuple[int, ...] | None = None) -> None:
        super().__init__()
        h, i = config.hidden_size, config.moe_intermediate_size
        self.held = held
        e = config.num_experts if held is None else len(held)
        self.limit = config.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        # Set by model/layers/fp8.py's quantize_experts: the weights are then block-scaled FP8 with
        # `gate_up_proj_scale_inv` and `down_proj_scale_inv` beside them.
        self.fp8_block: tuple[int, int] | None = None
        if held is not None:
            # global expert id -> index in this shard, -1 when held elsewhere (not a checkpoint
            # tensor, so not persistent; filled by `index_held` once the module has storage)
            self.register_buffer(
                "local_index", torch.empty(config.num_experts, dtype=torch.long), persistent=False
            )
            self.index_held()

    def index_held(self) -> None:
        if self.held is None or self.local_index.is_meta:
            return
        self.local_index.fill_(-1)
        self.local_index[list(self.held)] = torch.arange(
            len(self.held), device=self.local_index.device
        )

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        ids, weights = routing
        if self.held is not None:
            # Pad rows (id -1) stay -1; experts held elsewhere become -1.
            ids = torch.where(ids >= 0, self.local_index[ids.clamp(min=0)], -1)
        if self.fp8_block is not None:
            return ops.moe_experts_fp8(
                x,
                ids,
                weights,
                (self.gate_up_proj, self.gate_up_proj_scale_inv),
                (self.down_proj, self.down_proj_scale_inv),
                self.fp8_block,
                self.limit,
            )
        return ops.moe_experts(x, ids, weights, self.gate_up_proj, self.down_proj, self.limit)


class MoEBlock(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        with_router: bool = True,
        held: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.gate = Router(config, layer) if with_router else None
        self.experts = Experts(config, held)
        shared = config.n_shared_experts * config.moe_intermediate_size
        self.shared_experts = (
            GatedMLP(config.hidden_size, shared, config.swiglu_limit) if shared else None
        )

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor, routing: Routing | None = None
    ) -> torch.Tensor:
        if routing is None:
            routing = self.gate(x, token_ids)
        y = self.experts(x, routing)
        shared = self.shared(x)
        return y if shared is None else y + shared

    def shared(self, x: torch.Tensor) -> torch.Tensor | None:
        """What the shared experts add over rows x (None: there are none). A family whose shared
        expert is gated (Qwen3-Next) overrides it; an expert-parallel group calls it too."""
        return None if self.shared_experts is None else self.shared_experts(x)


class DenseFFN(GatedMLP):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size)

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, token_ids: torch.Tensor, routing: Routing | None = None
    ) -> torch.Tensor:
        return super().forward(x)


def make_ffn(
    config: ModelConfig, layer: int, with_router: bool = True, held: tuple[int, ...] | None = None
) -> nn.Module:
    if config.layer_types[layer] == "dense":
        return DenseFFN(config)
    return MoEBlock(config, layer, with_router, held)


class RouterHolder(nn.Module):
    """The attention side's `mlp.gate` when the gate runs there."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.gate = Router(config, layer)
