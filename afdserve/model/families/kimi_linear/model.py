"""Kimi-Linear on the decoder of model/families/decoder/model.py: the same halves, norms,
router (grouped sigmoid with a score bias) and shared experts; each layer's `self_attn` is Kimi
Delta Attention (kda.py, a state slot per sequence) or MLA without positional encoding (its
latent over the paged cache)."""

from __future__ import annotations

import torch
from torch import nn

from afdserve.model.config import ModelConfig
from afdserve.model.families.decoder.model import (
    DecoderLayer,
    MoECausalLM,
    uninitialized_embedding,
)
from afdserve.model.families.kimi_linear.config import LINEAR
from afdserve.model.families.kimi_linear.kda import KimiDeltaAttention
from afdserve.model.layers.attention import MLAAttention
from afdserve.model.layers.common import RMSNorm, Rotary
from afdserve.model.parts import ModelParts


class KimiLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, layer: int, parts: ModelParts) -> None:
        super().__init__(config, layer, parts)
        if parts.attention:
            linear = config.family_config.attention_types[layer] == LINEAR
            self.self_attn = KimiDeltaAttention(config) if linear else MLAAttention(config)


class KimiBody(nn.Module):
    def __init__(self, config: ModelConfig, parts: ModelParts) -> None:
        super().__init__()
        if parts.attention:
            self.embed_tokens = uninitialized_embedding(config.vocab_size, config.hidden_size)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(KimiLayer(config, i, parts) for i in range(config.num_layers))


class KimiLinearCausalLM(MoECausalLM):
    def __init__(self, config: ModelConfig, parts: ModelParts | None = None) -> None:
        nn.Module.__init__(self)
        if config.quantization is not None:
            raise ValueError("quantization for 'kimi_linear' is not supported yet")
        self.config, self.parts = config, parts or ModelParts.colocated()
        self.dtype = torch.get_default_dtype()
        self.model = KimiBody(config, self.parts)
        if self.parts.attention:
            self.rotary = Rotary(config)  # MLA's call; cos_sin below makes it the identity
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """NoPE: cos 1 and sin 0 leave MLA's shared key part as it is."""
        half = self.config.qk_rope_head_dim // 2
        ones = torch.ones(positions.shape[0], half, device=positions.device)
        return ones, torch.zeros_like(ones)
