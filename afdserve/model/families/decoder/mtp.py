"""DeepSeek-V3's multi-token-prediction (MTP) layer: the draft of speculative decoding's `mtp`
method, read from checkpoint layer N = num_hidden_layers (`model.layers.{N}.*`).

For the main model's last hidden state h_p (after its final norm) at position p and the token
t_{p+1} that follows it:

    h' = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])          (the embedding's half first)
    g  = decoder layer N at h' (MLA over the MTP's own KV, then its MoE), position p
    (the embedding's half is zeros at position 0, as in vLLM's DeepSeek MTP layer)
    logits = shared_head.head(shared_head.norm(g))              (main lm_head without a head)

predicts t_{p+2}. A chain of k drafts feeds g back in as the next h_p (vLLM reuses its one MTP
layer k times the same way). `embed_tokens` and `shared_head.head` are the layer's own where the
checkpoint carries them (DeepSeek-V3's does), else the main model's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.cache import CacheLayout, PagedKV
from afdserve.model.config import ModelConfig
from afdserve.model.families.decoder.model import (
    MTP_FAMILIES,
    DecoderLayer,
    MoECausalLM,
    uninitialized_embedding,
)
from afdserve.model.layers.common import RMSNorm
from afdserve.model.layers.fp8 import convert_to_fp8
from afdserve.model.layers.moe import Routing
from afdserve.model.parts import ModelParts


class Projection(nn.Module):
    """A bias-free projection kept in the model dtype: not an nn.Linear, so FP8 conversion
    leaves it alone (DeepSeek-V3's FP8 checkpoint keeps eh_proj and the head unquantized)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if own_head:
            self.head = Projection(config.hidden_size, config.vocab_size)


class MTPLayer(DecoderLayer):
    """A full decoder layer plus the MTP's input projection and output head. The projection,
    the head and the layer's own embedding sit with the attention half (the attention ranks
    under AFD); an FFN half holds the layer's MoE only."""

    def __init__(
        self, config: ModelConfig, layer: int, parts: ModelParts, own_embed: bool, own_head: bool
    ) -> None:
        super().__init__(config, layer, parts)
        if not parts.attention:
            return
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = Projection(2 * hidden, hidden)
        self.shared_head = SharedHead(config, own_head)
        if own_embed:
            self.embed_tokens = uninitialized_embedding(config.vocab_size, hidden)


class LayerAt(nn.ModuleDict):
    """The draft's one layer under its checkpoint index (`model.layers.{N}`), read by that
    index as a number too, as a model's layer list is (the FFN side's expert group does)."""

    def __getitem__(self, key: int | str) -> nn.Module:
        return super().__getitem__(str(key))


def draft_config(config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
    """The main config with one more layer, the MTP's: MoE past first_k_dense_replace."""
    layer = config.num_layers
    dense = layer < (raw.get("first_k_dense_replace", 0) or 0)
    return dataclasses.replace(
        config,
        num_layers=layer + 1,
        layer_types=(*config.layer_types, "dense" if dense else "moe"),
    )


def mtp_layers_refusal(config: ModelConfig) -> str | None:
    """Why this family gives no MTP draft (None: it does; model/checkpoint/draft.py checks
    that the checkpoint has the layers)."""
    if config.family not in MTP_FAMILIES:
        return (
            f"model family {config.family!r} has no MTP layers afdserve builds (MTP drafts: "
            f"{MTP_FAMILIES})"
        )
    return None


class DeepSeekMTP(nn.Module):
    """The MTP layer of a loaded main model, the halves its main model holds (colocated: both;
    under AFD the attention ranks hold the attention half, the FFN ranks the MoE, which they
    run like any layer's: `ffn_half(N, ...)`). Its tensors carry the checkpoint's names
    (`model.layers.{N}.*`), so the loader fills it like a model."""

    def __init__(
        self, main: MoECausalLM, raw: dict[str, Any], own_embed: bool, own_head: bool
    ) -> None:
        super().__init__()
        self.config = draft_config(main.config, raw)
        self.parts = main.parts
        self.dtype = main.dtype
        self.row_shape = (main.config.hidden_size,)
        self.index = main.config.num_layers
        # The main model is read (embedding, final norm, rotary, lm_head), never registered as
        # a submodule: its tensors are not the draft's to load.
        self.__dict__["main"] = main
        self.model = nn.Module()
        layer = MTPLayer(self.config, self.index, self.parts, own_embed, own_head)
        self.model.layers = LayerAt({str(self.index): layer})
        config = self.config
        if config.quantization is not None:
            convert_to_fp8(self, config.family, config.num_experts, config.quantization)

    @property
    def layer(self) -> MTPLayer:
        return self.model.layers[self.index]

    def cache_layout(self) -> CacheLayout:
        """The MTP layer's own KV, a cache group of one layer over the main blocks."""
        config = self.config
        tensors = 1 if config.attention == "mla" else 2
        spec = PagedKV((0,), config.num_cache_heads, config.kv_cache_dim, tensors, kind="MTP")
        return CacheLayout((spec,), 1)

    def first_input(
        self, main_hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """h' from the main model's residual rows (what its layer loop returns) [rows, hidden],
        the token after each row's [rows] and each row's position [rows]."""
        return self.chain_input(self.main.model.norm(main_hidden), next_ids, positions)

    def chain_input(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """h' from a hidden state already normed as h_p is (or a previous MTP output). The
        embedding half of a row at position 0 is zeros, as vLLM's DeepSeek MTP layer masks it
        (a sequence's first row has no earlier token to pair the next one with)."""
        layer = self.layer
        embed = getattr(layer, "embed_tokens", None)
        embed = self.main.model.embed_tokens if embed is None else embed
        e = embed(next_ids).masked_fill((positions == 0).unsqueeze(-1), 0.0)
        both = torch.cat([layer.enorm(e), layer.hnorm(hidden)], dim=-1)
        return layer.eh_proj(both)

    def attention_half(
        self,
        h: torch.Tensor,
        meta: AttentionMetadata,
        cache: Any,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h' [rows, hidden] -> (x the MoE's normalised input, the residual after attention)."""
        layer = self.layer
        x = layer.input_layernorm(h)
        attn = layer.self_attn(x, meta, self.main.rotary, cache, cos_sin)
        norm = layer.post_attention_layernorm
        return ops.add_rms_norm(h, attn, norm.weight, norm.eps)

    def route_on_attention(
        self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, ffn_view=None
    ) -> Routing | None:
        """The top-k routing that travels with x where the gate sits on the attention side."""
        if not self.parts.gate_on_attention or self.config.layer_types[layer] == "dense":
            return None
        return self.layer.mlp.gate(ffn_view(x) if ffn_view else x, token_ids)

    def ffn_half(
        self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, routing: Routing | None = None
    ) -> torch.Tensor:
        """The layer's MoE (or dense MLP) over x: `layer` is N, as the FFN side names it."""
        return self.model.layers[layer].mlp(x, token_ids, routing)

    def add_ffn_output(self, h: torch.Tensor, ffn_out: torch.Tensor) -> torch.Tensor:
        """g, the layer's output (before shared_head.norm)."""
        return h + ffn_out

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        head = self.layer.shared_head
        if hasattr(head, "head"):
            weight = head.head.weight
        elif self.config.tie_word_embeddings:
            weight = self.main.model.embed_tokens.weight
        else:
            weight = self.main.lm_head.weight
        return F.linear(head.norm(g), weight).float()

    def expected_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict(keep_vars=True))


def build_mtp(main: MoECausalLM, raw: dict[str, Any], names: set[str] | None) -> DeepSeekMTP:
    """The draft of `main` (call on meta); `names`: the checkpoint's tensor names, which say
    whether the layer carries its own embedding and head (None: dummy weights, it shares the
    main model's)."""
    why = mtp_layers_refusal(main.config)
    if why is not None:
        raise ValueError(why)
    prefix = f"model.layers.{main.config.num_layers}."
    own_embed = names is not None and prefix + "embed_tokens.weight" in names
    own_head = names is not None and prefix + "shared_head.head.weight" in names
    return DeepSeekMTP(main, raw, own_embed, own_head)
