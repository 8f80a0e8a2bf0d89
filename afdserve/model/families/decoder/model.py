"""A MoE causal LM written as two halves per layer, split at the FFN boundary.

attention half (layer i): h -> input norm -> attention -> + h -> post-attention norm -> x
FFN half (layer i):       x, token_ids -> y           (router -> experts (+ shared), or dense MLP)
the attention half adds y to its residual stream.

Module names follow the Hugging Face checkpoints (model.layers.{i}.self_attn..., .mlp...), so a role
builds only its half and loads exactly the tensors that half names.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.config import ModelConfig
from afdserve.model.layers.attention import LayerCache, make_attention
from afdserve.model.layers.common import RMSNorm, Rotary
from afdserve.model.layers.fp8 import convert_to_fp8
from afdserve.model.layers.moe import Router, RouterHolder, Routing, make_ffn
from afdserve.model.parts import ModelParts

# (config, layer) -> the layer's attention module; a family that extends MLA passes its own.
AttentionFactory = Callable[[ModelConfig, int], nn.Module]


def decoder_attention(config: ModelConfig, layer: int) -> nn.Module:
    return make_attention(config)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        parts: ModelParts,
        attention: AttentionFactory = decoder_attention,
    ) -> None:
        super().__init__()
        moe = config.layer_types[layer] != "dense"
        router_here_on_attention = parts.gate_on_attention and moe
        if parts.attention:
            self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.self_attn = attention(config, layer)
            self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if parts.ffn:
            self.mlp = make_ffn(
                config, layer, with_router=not router_here_on_attention, held=parts.experts
            )
            if router_here_on_attention and parts.attention:
                self.mlp.gate = Router(config, layer)  # colocated: one module holds both
        elif router_here_on_attention:
            self.mlp = RouterHolder(config, layer)


def uninitialized_embedding(vocab_size: int, hidden_size: int) -> nn.Embedding:
    """An embedding without its random init: the loader writes every weight. Its init on the
    meta device (build_model) goes through torch._refs, whose first use imports torch._dynamo,
    seconds that each rank of every (re)started world would spend for nothing."""
    return nn.Embedding(vocab_size, hidden_size, _weight=torch.empty(vocab_size, hidden_size))


class ModelBody(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        parts: ModelParts,
        layer_class: Callable[..., nn.Module] = DecoderLayer,
    ) -> None:
        super().__init__()
        if parts.attention:
            self.embed_tokens = uninitialized_embedding(config.vocab_size, config.hidden_size)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(layer_class(config, i, parts) for i in range(config.num_layers))


class MoECausalLM(nn.Module):
    # A family on this decoder with layers of its own (gpt-oss) names its layer class here; its
    # layers keep the names `input_layernorm`, `self_attn`, `post_attention_layernorm`, `mlp`
    # (with the router as `mlp.gate`), which the halves below call. One that only changes the
    # attention (DSA) passes its `attention` factory to DecoderLayer instead.
    layer_class: type[nn.Module] = DecoderLayer

    def __init__(
        self,
        config: ModelConfig,
        parts: ModelParts | None = None,
        attention: AttentionFactory = decoder_attention,
    ) -> None:
        super().__init__()
        self.config = config
        self.parts = parts or ModelParts.colocated()
        # The dtype of activations and of every unquantized weight (FP8 weights are float8).
        self.dtype = torch.get_default_dtype()
        layer = self.layer_class
        if layer is DecoderLayer:
            layer = functools.partial(DecoderLayer, attention=attention)
        self.model = ModelBody(config, self.parts, layer)
        if self.parts.attention:
            self.rotary = Rotary(config)
            if not config.tie_word_embeddings:
                self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.quantization is not None:
            self.convert_quantized()

    def convert_quantized(self) -> None:
        """Swap in the quantized modules the config's quantization names (on meta, before the
        weights have storage)."""
        convert_to_fp8(self, self.config.family, self.config.num_experts, self.config.quantization)

    # ----- attention half -----
    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rotary.cos_sin(positions)

    def attention_half(
        self,
        layer: int,
        h: torch.Tensor,
        ffn_out: torch.Tensor | None,
        meta: AttentionMetadata,
        cache: LayerCache,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [rows, hidden] residual stream, plus the previous layer's FFN output (None at layer
        0) -> (x normalised FFN input, h after attention). Each residual add runs fused with the
        norm that follows it, and so does the FP8 quantization of the attention's input rows
        where its input projections are w8a8 GEMMs that would quantize them in a launch of their
        own (`takes_fp8_rows`; the same values either way)."""
        block = self.model.layers[layer]
        norm = block.input_layernorm
        if ffn_out is None:
            x = norm(h)
        else:
            fp8_rows = block.self_attn.takes_fp8_rows(h)
            x, h = ops.add_rms_norm(h, ffn_out, norm.weight, norm.eps, fp8_rows)
        attn = block.self_attn(x, meta, self.rotary, cache, cos_sin)
        norm = block.post_attention_layernorm
        return ops.add_rms_norm(h, attn, norm.weight, norm.eps)

    def add_ffn_output(self, h: torch.Tensor, ffn_out: torch.Tensor) -> torch.Tensor:
        """After the last layer: the residual stream plus its FFN output (what `logits` reads)."""
        return h + ffn_out

    def route_on_attention(
        self,
        layer: int,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        ffn_view: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Routing | None:
        """With gate_on_attention the top-k ids and weights computed here travel along with x.
        `ffn_view`: x as the FFN half will read it (the A2E format's round trip), so the router
        sees the rows the experts see, as it does where the gate sits with them."""
        if not self.parts.gate_on_attention or self.config.layer_types[layer] == "dense":
            return None
        return self.model.layers[layer].mlp.gate(ffn_view(x) if ffn_view else x, token_ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = self.model.norm(h)
        weight = (
            self.model.embed_tokens.weight
            if self.config.tie_word_embeddings
            else self.lm_head.weight
        )
        return torch.nn.functional.linear(h, weight).float()

    # ----- FFN half -----
    def ffn_half(
        self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, routing: Routing | None = None
    ) -> torch.Tensor:
        return self.model.layers[layer].mlp(x, token_ids, routing)

    def expected_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and persistent buffer this half needs from the checkpoint."""
        return dict(self.state_dict(keep_vars=True))

    def checkpoint_name(self, name: str) -> str | None:
        """None for a next-token-prediction layer's tensor (`model.layers.{N}.` and past, N =
        num_layers) of a family whose MTP draft loads them (model/checkpoint/draft.py); other
        families' stay reported as unexpected."""
        if self.config.family not in MTP_FAMILIES:
            return name
        match = _LAYER.match(name)
        return None if match and int(match[1]) >= self.config.num_layers else name


# The families whose next-token-prediction layer afdserve builds as a draft (mtp.py).
MTP_FAMILIES = ("deepseek_v3",)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
