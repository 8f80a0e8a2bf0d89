"""gpt-oss on the decoder of model/families/decoder/model.py, with layers of its own.

Attention: GQA with q/k/v/o biases, a learned sink logit per head in the softmax's denominator,
and every other layer a sliding window (`layer_types`), read through the same paged cache.
FFN: a router with a bias (top-k of the logits, then a softmax over those k) and experts whose
SwiGLU has biases, clamps and a gain: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate,
limit), as transformers' GptOssExperts. Checkpoint names (model/families/gpt_oss/names.py)
map onto these modules: the router becomes `mlp.gate`, the experts' stacks ours.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.kernels import ops
from afdserve.model.config import ModelConfig
from afdserve.model.families.decoder.model import MoECausalLM
from afdserve.model.families.gpt_oss.config import GptOssConfig
from afdserve.model.families.gpt_oss.quant import convert_to_mxfp4
from afdserve.model.layers.attention import GQAAttention
from afdserve.model.layers.common import RMSNorm
from afdserve.model.layers.moe import Experts, Routing
from afdserve.model.parts import ModelParts


class GptOssAttention(GQAAttention):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config)
        family: GptOssConfig = config.family_config
        hidden, bias = config.hidden_size, config.attention_bias
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.sinks = nn.Parameter(torch.empty(self.heads))
        self.window = family.window(layer)


class GptOssRouter(nn.Module):
    """Top-k of x W^T + b, weights the softmax of those k logits (in float32)."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.top_k = config.top_k
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.empty(config.num_experts))

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.weight.float(), self.bias.float())
        top, ids = logits.topk(self.top_k, dim=-1)
        return ids, top.softmax(dim=-1)


class GptOssExperts(Experts):
    """Experts with gpt-oss's biases: `gate_up_proj_bias` [E, 2I] (gate half first, as
    `gate_up_proj` [E, 2I, H]) and `down_proj_bias` [E, H]."""

    def __init__(self, config: ModelConfig, held: tuple[int, ...] | None = None) -> None:
        super().__init__(config, held)
        e, i, h = self.gate_up_proj.shape[0], config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha = config.family_config.swiglu_alpha

    def glu(self) -> ops.ExpertGLU:
        return ops.ExpertGLU(self.gate_up_proj_bias, self.down_proj_bias, self.alpha)

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global ids -> this shard's (-1: pad, or an expert held elsewhere)."""
        if self.held is None:
            return ids
        return torch.where(ids >= 0, self.local_index[ids.clamp(min=0)], -1)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        ids, weights = routing
        ids = self.local_ids(ids)
        return ops.moe_experts(
            x, ids, weights, self.gate_up_proj, self.down_proj, self.limit, self.glu()
        )


class GptOssMoE(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        with_router: bool = True,
        held: tuple[int, ...] | None = None,
    ) -> None:
        super().__init__()
        self.gate = GptOssRouter(config, layer) if with_router else None
        self.experts = GptOssExperts(config, held)
        self.shared_experts = None  # none in gpt-oss (an expert-parallel group asks, as MoEBlock)

    def shared(self, x: torch.Tensor) -> None:
        """What shared experts add (MoEBlock.shared, which an expert-parallel group calls): none."""
        return None

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor, routing: Routing | None = None
    ) -> torch.Tensor:
        if routing is None:
            routing = self.gate(x, token_ids)
        return self.experts(x, routing)


class RouterHolder(nn.Module):
    """The attention side's `mlp.gate` when the router runs there."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.gate = GptOssRouter(config, layer)


class GptOssLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, parts: ModelParts) -> None:
        super().__init__()
        if parts.attention:
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.self_attn = GptOssAttention(config, layer)
            self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if parts.ffn:
            self.mlp = GptOssMoE(
                config, layer, with_router=not parts.gate_on_attention, held=parts.experts
            )
            if parts.gate_on_attention and parts.attention:
                self.mlp.gate = GptOssRouter(config, layer)  # colocated: one module holds both
        elif parts.gate_on_attention:
            self.mlp = RouterHolder(config, layer)


class GptOssCausalLM(MoECausalLM):
    layer_class = GptOssLayer

    def convert_quantized(self) -> None:
        """MXFP4 checkpoints: the routed experts stay FP4 (quant.py); online FP8 is refused."""
        convert_to_mxfp4(self, self.config)
