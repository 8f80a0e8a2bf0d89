"""MiniMax-M2: the decoder family's model (model/families/decoder/model.py) and its plain paged
KV cache; what differs (q/k norms over the whole row, partial rotary, the routing) is read from
its config (config.py)."""

from __future__ import annotations

from afdserve.model.families.decoder.family import cache_layout
from afdserve.model.families.decoder.model import MoECausalLM
from afdserve.model.families.minimax_m2.config import FAMILY as MODEL_TYPE
from afdserve.model.families.minimax_m2.config import parse_minimax_m2_config
from afdserve.model.families.minimax_m2.presets import PRESETS
from afdserve.model.families.minimax_m2.tiny import make_tiny_minimax_m2
from afdserve.model.parts import Family

FAMILY = Family(
    (MODEL_TYPE,),
    {"MiniMaxM2ForCausalLM": MODEL_TYPE},
    parse_minimax_m2_config,
    MoECausalLM,
    cache_layout,
    presets=PRESETS,
    make_tiny=make_tiny_minimax_m2,
)
