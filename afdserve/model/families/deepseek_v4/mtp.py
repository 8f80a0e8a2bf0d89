"""DeepSeek-V4's multi-token-prediction (MTP) layer: the draft of speculative decoding's `mtp`
method, read from the checkpoint's `mtp.0.*` (DeepSeek-V4-Flash carries one; its layer index is
N = num_hidden_layers, and compress_ratios[N], 0, makes it a sliding-window layer).

For the main model's streams h_p [hc_mult, hidden] after its last layer (before its head's
collapse) at position p and the token t_{p+1}:

    u = e_proj(enorm(embed(t_{p+1}))) + h_proj(hnorm(h_p))     (the first term on every stream)
    g = a V4 block at u (mHC, sliding attention over the layer's own window rows, its MoE), p
    logits = head(norm(hc_head(g)))       (the layer's own hc_head and norm, the main head)

predicts t_{p+2}; drafts 2..k feed g back in as h (engine/mtp.py). The embedding and the head
are the main model's (the checkpoint has no copy). Unlike DeepSeek-V3's layer (decoder/mtp.py)
no embedding row is masked at position 0: V4's definition has none.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.cache import CacheLayout
from afdserve.model.config import ModelConfig
from afdserve.model.families.decoder.mtp import LayerAt
from afdserve.model.families.deepseek_v4 import names
from afdserve.model.families.deepseek_v4.batched import step_attention
from afdserve.model.families.deepseek_v4.cache import LayerPages, V4Pages, V4Window
from afdserve.model.families.deepseek_v4.mhc import HyperHead, V4RMSNorm, connect, update_streams
from afdserve.model.families.deepseek_v4.model import StreamState, V4CausalLM, V4DecoderLayer
from afdserve.model.families.deepseek_v4.quant import convert_to_quantized
from afdserve.model.families.deepseek_v4.rows import StepRows
from afdserve.model.layers.moe import Routing

SLIDING = "sliding_attention"
_RATIO_TO_TYPE = {0: SLIDING, 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
# The head's collapse, spelled as the main model's top-level one; ours is a module.
_HC_HEAD = {"hc_head_fn": "hc_head.fn", "hc_head_base": "hc_head.base"}
_HC_HEAD["hc_head_scale"] = "hc_head.scale"


def mtp_attention_type(raw: dict[str, Any]) -> str:
    """The MTP layer's attention type: where compress_ratios or layer_types lists the MTP
    layers after the main ones (Flash's compress_ratios has 44 entries for 43 layers and one
    MTP layer; a preset's first N layers keep the list whole), the first of those, else
    sliding."""
    n = int(raw.get("num_hidden_layers", 43))
    extra = int(raw.get("num_nextn_predict_layers") or 1)
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        types = [_RATIO_TO_TYPE.get(r, str(r)) for r in raw["compress_ratios"]]
    kind = types[len(types) - extra] if types is not None and len(types) >= n + extra else SLIDING
    if kind != SLIDING:
        raise ValueError(
            f"deepseek_v4 MTP layer of attention type {kind!r} is not supported: its compressor "
            "would need sequence slots of its own (the published layer is sliding); allowed: "
            f"{SLIDING!r}"
        )
    return kind


def draft_config(config: ModelConfig, raw: dict[str, Any]) -> ModelConfig:
    """The main config with one more layer, the MTP's: sliding attention, a routed MoE."""
    v4 = config.family_config
    family = dataclasses.replace(v4, attention_types=(*v4.attention_types, mtp_attention_type(raw)))
    return dataclasses.replace(
        config,
        num_layers=config.num_layers + 1,
        layer_types=(*config.layer_types, "moe"),
        family_config=family,
    )


class V4MTPLayer(V4DecoderLayer):
    """A V4 block plus the MTP's input projections and its head's collapse and norm, all with
    the attention half; an FFN half holds the block's MoE only."""

    def __init__(self, config: ModelConfig, layer: int, parts) -> None:
        super().__init__(config, layer, parts)
        if not parts.attention:
            return
        hidden, eps, v4 = config.hidden_size, config.rms_norm_eps, config.family_config
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.enorm = V4RMSNorm(hidden, eps)
        self.hnorm = V4RMSNorm(hidden, eps)
        self.norm = V4RMSNorm(hidden, eps)
        self.hc_head = HyperHead(hidden, v4.hc_mult, v4.hc_eps, eps)


class V4MTP(nn.Module):
    """The MTP layer of a loaded V4 main model (`MTPDraft`, model/parts.py), the halves its
    main model holds. Its tensors are named `model.layers.{N}.*` as a main layer's would be;
    `checkpoint_name` reads `mtp.0.*` into them."""

    FLOAT32 = V4CausalLM.FLOAT32
    keep_float32 = V4CausalLM.keep_float32

    def __init__(self, main: V4CausalLM, raw: dict[str, Any]) -> None:
        super().__init__()
        self.config = draft_config(main.config, raw)
        self.parts, self.dtype = main.parts, main.dtype
        v4 = main.config.family_config
        self.row_shape = (v4.hc_mult, main.config.hidden_size)  # the mHC streams
        self.index = main.config.num_layers
        # Read (embedding, head, ropes), never registered: its tensors are not the draft's.
        self.__dict__["main"] = main
        self.model = nn.Module()
        layer = V4MTPLayer(self.config, self.index, self.parts)
        self.model.layers = LayerAt({str(self.index): layer})
        if self.config.quantization is not None:
            convert_to_quantized(self, self.config)

    @property
    def layer(self) -> V4MTPLayer:
        return self.model.layers[self.index]

    def checkpoint_name(self, name: str) -> str | None:
        """`mtp.0.<name>` -> this layer's tensor; the main model's are skipped by name."""
        bare = name.removeprefix("model.")
        if not bare.startswith("mtp.0."):
            return None
        rest = bare.removeprefix("mtp.0.")
        # Its own tensors (e_proj, h_proj, enorm, hnorm, norm) keep their names; the block's
        # and its hc_head's are a main layer's.
        return names.to_ours(f"layers.{self.index}.{_HC_HEAD.get(rest, rest)}")

    def cache_layout(self) -> CacheLayout:
        """The layer's window rows, a row per position over the main blocks (one layer)."""
        v4 = self.config.family_config
        one = dataclasses.replace(
            self.config,
            num_layers=1,
            layer_types=("moe",),
            family_config=dataclasses.replace(v4, attention_types=(v4.attention_types[-1],)),
        )
        kind, window = one.family_config.attention_types[0], v4.sliding_window
        return CacheLayout((V4Pages(kind, (0,), one), V4Window(kind, (0,), one, window)), 1)

    def first_input(
        self, main_hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """u from the main model's streams [rows, hc_mult, hidden] (what its layer loop
        returns), the token after each row [rows]; positions are not read."""
        return self.chain_input(main_hidden, next_ids, positions)

    def chain_input(
        self, hidden: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """u [rows, hc_mult, hidden] from streams (the main model's or this layer's g)."""
        layer = self.layer
        e = layer.e_proj(layer.enorm(self.main.model.embed_tokens(next_ids)))
        return e.unsqueeze(1) + layer.h_proj(layer.hnorm(hidden))

    def attention_half(
        self,
        h: torch.Tensor,
        meta: AttentionMetadata,
        cache: LayerPages,
        cos_sin: Any,
    ) -> tuple[torch.Tensor, StreamState]:
        """u -> (x [rows, hidden] the MoE's input, the streams' state `add_ffn_output` needs)."""
        layer = self.layer
        h, x, post, comb = connect(layer.attn_hc, layer.input_layernorm, h, None)
        ropes = self.main._ropes_on(x.device)
        rows = StepRows.find(meta)
        attn = layer.self_attn
        if rows is None:
            y = V4CausalLM._per_sequence(attn, cache, x, meta, ropes["main"], ropes["compress"])
        else:
            y = step_attention(attn, cache, x, rows, ropes["main"], ropes["compress"])
        norm = layer.post_attention_layernorm
        h, x, post, comb = connect(layer.ffn_hc, norm, h, (y, post, comb))
        return x, (h, post, comb)

    def route_on_attention(
        self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, ffn_view=None
    ) -> Routing | None:
        if not self.parts.gate_on_attention:
            return None
        return self.layer.mlp.gate(ffn_view(x) if ffn_view else x, token_ids)

    def ffn_half(
        self, layer: int, x: torch.Tensor, token_ids: torch.Tensor, routing: Routing | None = None
    ) -> torch.Tensor:
        """The layer's MoE over x: `layer` is N, as the FFN side names it."""
        return self.model.layers[layer].mlp(x, token_ids, routing)

    def add_ffn_output(self, state: StreamState, ffn_out: torch.Tensor) -> torch.Tensor:
        """g, the layer's streams [rows, hc_mult, hidden]."""
        return update_streams(state[0], ffn_out, state[1], state[2])

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        layer, main = self.layer, self.main
        weight = (
            main.model.embed_tokens.weight
            if self.config.tie_word_embeddings
            else main.lm_head.weight
        )
        return F.linear(layer.norm(layer.hc_head(g)), weight).float()

    def expected_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.state_dict(keep_vars=True))


def build_v4_mtp(main: V4CausalLM, raw: dict[str, Any], names: set[str] | None) -> V4MTP:
    """The draft of `main` (call on meta); `names` (the checkpoint's) are not needed: V4's
    layer has no embedding or head of its own."""
    return V4MTP(main, raw)
