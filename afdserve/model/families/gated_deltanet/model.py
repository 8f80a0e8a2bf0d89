"""Qwen3-Next and Qwen3.5-MoE as two halves per layer (model/parts.py's CausalLM).

attention half (layer i): h -> norm -> Gated DeltaNet (linear layers) or gated attention (full
layers) -> + h -> norm -> x; FFN half: the routed experts plus a shared expert scaled by
sigmoid(shared_expert_gate(x)) (dense MLP on Qwen3-Next's `mlp_only_layers`). Every norm of the
residual stream is centred on zero. Module names follow the checkpoints (`model.layers.{i}.
linear_attn...`); the image-text checkpoint's `model.language_model.` is read as `model.`, its
vision tower and the multi-token-prediction head are skipped by name.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.config import ModelConfig
from afdserve.model.families.gated_deltanet.attention import GatedAttention, ZeroCenteredRMSNorm
from afdserve.model.families.gated_deltanet.config import LINEAR
from afdserve.model.families.gated_deltanet.deltanet import GatedDeltaNet
from afdserve.model.layers.common import GatedMLP
from afdserve.model.layers.moe import MoEBlock, Router, RouterHolder, Routing, make_ffn
from afdserve.model.parts import ModelParts

# Checkpoint tensors that text-only serving never reads: the vision tower, the MTP head.
SKIPPED_PREFIXES = ("model.visual.", "mtp.")


class SharedGatedMoE(MoEBlock):
    """The routed experts plus one shared expert whose output a sigmoid gate scales per row."""

    def __init__(self, config: ModelConfig, layer: int, with_router: bool, held) -> None:
        super().__init__(config, layer, with_router, held)
        size = config.family_config.shared_expert_intermediate_size
        self.shared_expert = GatedMLP(config.hidden_size, size)
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class HybridLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, parts: ModelParts) -> None:
        super().__init__()
        moe = config.layer_types[layer] != "dense"
        gate_here = parts.gate_on_attention and moe
        eps = config.rms_norm_eps
        if parts.attention:
            self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)
            if config.family_config.attention_types[layer] == LINEAR:
                self.linear_attn = GatedDeltaNet(config)
            else:
                self.self_attn = GatedAttention(config)
            self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)
        if parts.ffn:
            if moe:
                self.mlp = SharedGatedMoE(config, layer, not gate_here, parts.experts)
            else:
                self.mlp = make_ffn(config, layer)
            if gate_here and parts.attention:
                self.mlp.gate = Router(config, layer)
        elif gate_here:
            self.mlp = RouterHolder(config, layer)


class HybridBody(nn.Module):
    def __init__(self, config: ModelConfig, parts: ModelParts) -> None:
        super().__init__()
        if parts.attention:
            self.embed_tokens = nn.Embedding(
                config.vocab_size,
                config.hidden_size,
                _weight=torch.empty(config.vocab_size, config.hidden_size),
            )
            self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(HybridLayer(config, i, parts) for i in range(config.num_layers))


class HybridCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, parts: ModelParts | None = None) -> None:
        super().__init__()
        if config.quantization is not None:
            raise ValueError(
                f"quantization for {config.family!r} is not supported yet: serve its bf16 "
                "checkpoint without quantization='fp8'"
            )
        self.config, self.parts = config, parts or ModelParts.colocated()
        self.dtype = torch.get_default_dtype()
        self.model = HybridBody(config, self.parts)
        if self.parts.attention and not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._inv_freq: torch.Tensor | None = None
        prefix = config.family_config.checkpoint_prefix
        self._rename = None if prefix == "model." else (prefix, "model.")

    def checkpoint_name(self, name: str) -> str | None:
        """A checkpoint tensor's name in this model, or None for one skipped by name."""
        if self._rename is not None and name.startswith(self._rename[0]):
            name = self._rename[1] + name[len(self._rename[0]) :]
        return None if name.startswith(SKIPPED_PREFIXES) else name

    # ----- attention half -----
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv_freq
        if inv is None or inv.device != positions.device:
            # Built on the first (eager) step, never inside a graph capture: not a checkpoint
            # tensor, so not a buffer the loader would leave unwritten.
            inv = torch.tensor(self.config.rope_inv_freq, device=positions.device)
            self._inv_freq = inv
        freqs = positions.float()[:, None] * inv[None, :]  # [rows, rotary_dim / 2]
        return freqs.cos(), freqs.sin()

    def attention_half(
        self,
        layer: int,
        h: torch.Tensor,
        ffn_out: torch.Tensor | None,
        meta: AttentionMetadata,
        cache,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        block = self.model.layers[layer]
        if ffn_out is not None:
            x, h = block.input_layernorm.add(h, ffn_out)
        else:
            x = block.input_layernorm(h)
        if hasattr(block, "linear_attn"):
            out = block.linear_attn(x, meta, cache)
        else:
            out = block.self_attn(x, meta, cache, cos_sin)
        return block.post_attention_layernorm.add(h, out)

    def add_ffn_output(self, h: torch.Tensor, ffn_out: torch.Tensor) -> torch.Tensor:
        return h + ffn_out

    def route_on_attention(
        self,
        layer: int,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        ffn_view: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Routing | None:
        if not self.parts.gate_on_attention or self.config.layer_types[layer] == "dense":
            return None
        return self.model.layers[layer].mlp.gate(ffn_view(x) if ffn_view else x, token_ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        weight = (
            self.model.embed_tokens.weight
            if self.config.tie_word_embeddings
            else self.lm_head.weight
        )
        return torch.nn.functional.linear(self.model.norm(h), weight).float()

    # ----- FFN half -----
    def ffn_half(
        self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, routing: Routing | None = None
    ) -> torch.Tensor:
        return self.model.layers[layer].mlp(x, token_ids, routing)

    def expected_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict(keep_vars=True))
