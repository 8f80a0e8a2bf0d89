"""What the engine and the ranks know of a model: which half a process holds (`ModelParts`), the
calls they drive it through (`CausalLM`) and what a family registers (`Family`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.cache import CacheLayout
from afdserve.model.config import ModelConfig


@dataclass(frozen=True)
class ModelParts:
    """Which half a process holds. The router lives with the FFN half unless gate_on_attention."""

    attention: bool = True
    ffn: bool = True
    gate_on_attention: bool = False
    # The routed experts this FFN half holds (an expert-parallel shard); None = all of them.
    experts: tuple[int, ...] | None = None

    @staticmethod
    def colocated(gate_on_attention: bool = False) -> ModelParts:
        return ModelParts(True, True, gate_on_attention)


class CausalLM(Protocol):
    """A model as two halves per layer, split at the FFN boundary. The residual the attention
    half carries from layer to layer is the family's own (a tensor, or DeepSeek-V4's streams);
    only `x`, the normalised FFN input, and the FFN output cross the boundary."""

    config: ModelConfig
    parts: ModelParts
    dtype: torch.dtype

    def embed(self, token_ids: torch.Tensor) -> Any: ...

    def cos_sin(self, positions: torch.Tensor) -> Any: ...

    def attention_half(
        self,
        layer: int,
        h: Any,
        ffn_out: torch.Tensor | None,
        meta: AttentionMetadata,
        cache: Any,
        cos_sin: Any,
    ) -> tuple[torch.Tensor, Any]: ...

    def route_on_attention(
        self,
        layer: int,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        ffn_view: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Any: ...

    def add_ffn_output(self, h: Any, ffn_out: torch.Tensor) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def ffn_half(
        self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, routing: Any = None
    ) -> torch.Tensor: ...

    def expected_tensors(self) -> dict[str, torch.Tensor]: ...


class MTPDraft(Protocol):
    """A checkpoint's next-token-prediction layer beside its main model (speculative decoding's
    `mtp` method; engine/mtp.py drives it): h' from a main hidden row (or its own previous
    output), the next token and the row's position; its decoder layer over its own KV as two
    halves split at the FFN boundary like a main layer's (`config.num_layers - 1` = N is the
    layer's index, the FFN half runs where the main layers' do); logits from its head."""

    config: ModelConfig
    parts: ModelParts
    dtype: torch.dtype
    # One row of what first_input and chain_input take and the layer gives back, e.g.
    # (hidden,); DeepSeek-V4's mHC streams are (hc_mult, hidden).
    row_shape: tuple[int, ...]

    def cache_layout(self) -> CacheLayout: ...

    def first_input(
        self, main_hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor: ...

    def chain_input(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor: ...

    def attention_half(
        self, h: torch.Tensor, meta: AttentionMetadata, cache: Any, cos_sin: Any
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def route_on_attention(
        self,
        layer: int,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        ffn_view: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> Any: ...

    def ffn_half(
        self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, routing: Any = None
    ) -> torch.Tensor: ...

    def add_ffn_output(self, h: torch.Tensor, ffn_out: torch.Tensor) -> torch.Tensor: ...

    def logits(self, g: torch.Tensor) -> torch.Tensor: ...

    def expected_tensors(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class Family:
    """What a model family gives the rest of afdserve (model/families/ registers each)."""

    model_types: tuple[str, ...]  # config.json's model_type values it serves
    architectures: Mapping[str, str]  # config.json's architectures -> model_type
    parse_config: Callable[[dict[str, Any], str], ModelConfig]  # (raw, model_type)
    model_class: type
    cache_layout: Callable[[ModelConfig], CacheLayout]
    # Published configs for the benches (model/presets.py): preset name -> config.json dict.
    presets: Mapping[str, dict[str, Any]] = field(default_factory=dict)
    # Writes a tiny random checkpoint (model/fixtures/tiny.py's make_tiny_model hands over to it):
    # (out_dir, model_type, hash_layers, seed, dtype, quantization) -> out_dir. None: the
    # decoder families' builder in tiny.py.
    make_tiny: Callable[..., Path] | None = None
    # Builds (on meta) the MTP draft of a loaded main model: (main, config.json dict, the
    # checkpoint's tensor names or None for dummy weights) -> a module with the draft's calls
    # (an `MTPDraft`, model/checkpoint/draft.py); raises ValueError saying why the checkpoint
    # gives none. None: the family builds no MTP layers.
    mtp_draft: Callable[..., MTPDraft] | None = None
