"""DeepSeek-V3.2 and GLM-5: the decoder family's MoE causal LM with DSA attention layers.

Everything but attention is `MoECausalLM`'s (embedding, norms, router, experts, shared experts,
the FFN half AFD ranks run). The attention half also carries the last full layer's selection
from layer to layer (`DSAResidual`), which GLM-5's shared layers reuse; it never crosses to the
FFN side.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.config import ModelConfig
from afdserve.model.families.decoder.model import MoECausalLM
from afdserve.model.families.dsa.attention import DSAAttention
from afdserve.model.layers.attention import LayerCache
from afdserve.model.parts import ModelParts


class DSAResidual(NamedTuple):
    """What the attention half carries between layers: the residual stream [rows, hidden] and
    the selection [rows, index_topk] of the last layer that ran its indexer."""

    h: torch.Tensor
    selected: torch.Tensor


class DSACausalLM(MoECausalLM):
    def __init__(self, config: ModelConfig, parts: ModelParts | None = None) -> None:
        if config.family_config is None:
            raise ValueError(f"DSACausalLM needs a DSA config, not {config.family!r}'s")
        super().__init__(config, parts, DSAAttention)

    def keep_float32(self) -> None:
        """The indexer's head weights stay float32, as transformers keeps them (the loader calls
        this before it fills the weights)."""
        for name, module in self.named_modules():
            if name.endswith("indexer.weights_proj"):
                module.weight = nn.Parameter(module.weight.float(), requires_grad=False)

    def attention_half(
        self,
        layer: int,
        h: torch.Tensor | DSAResidual,
        ffn_out: torch.Tensor | None,
        meta: AttentionMetadata,
        cache: LayerCache,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, DSAResidual]:
        """As `MoECausalLM.attention_half`, with the selection carried along in the residual."""
        residual, selected = (h.h, h.selected) if isinstance(h, DSAResidual) else (h, None)
        block = self.model.layers[layer]
        norm = block.input_layernorm
        if ffn_out is None:
            x = norm(residual)
        else:
            x, residual = ops.add_rms_norm(residual, ffn_out, norm.weight, norm.eps)
        attn, selected = block.self_attn(x, meta, self.rotary, cache, cos_sin, selected)
        norm = block.post_attention_layernorm
        x, residual = ops.add_rms_norm(residual, attn, norm.weight, norm.eps)
        return x, DSAResidual(residual, selected)

    def add_ffn_output(self, h: DSAResidual, ffn_out: torch.Tensor) -> torch.Tensor:
        return h.h + ffn_out
