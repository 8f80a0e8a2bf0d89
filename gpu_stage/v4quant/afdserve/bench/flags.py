"""The flags a bench shares with the engine (--device, --dtype, --connector, --load-format,
--graph-mode, ...): declared once, on the engine's config fields (afdserve/config.py)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from afdserve.config import DEVICES, ENGINE_CONFIGS, GRAPH_MODES, LOAD_FORMATS
from afdserve.config_args import add_field_argument, keyword_fields

# The data planes a 1A1F bench runs across two GPUs: NCCL point-to-point or symmetric memory.
BENCH_CONNECTORS = ("p2p", "ipc")
# What a bench accepts where the engine would take more ("auto", "cuda:N", "inprocess"), and
# checked by argparse where the engine leaves the check to its config.
NARROWED = {
    "connector": BENCH_CONNECTORS,
    "graph_mode": GRAPH_MODES,
    "device": DEVICES,
    "dtype": ("float32", "bfloat16", "float16"),
    "load_format": LOAD_FORMATS,
}


def add_engine_flags(p: argparse.ArgumentParser, spec: type, keywords: Sequence[str]) -> None:
    """The engine options a bench spec shares (by keyword) with the engine's configs: flag,
    type and help from the config's field, the default from the bench spec's field."""
    for key in keywords:
        cls, field = next((c, f) for c in ENGINE_CONFIGS
                          for k, f in keyword_fields(c).items() if k == key)
        add_field_argument(p, cls, field.name, default=spec.__dataclass_fields__[key].default,
                           choices=NARROWED.get(key, field.metadata.get("choices")))
