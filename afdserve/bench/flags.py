"""The flags of a bench, each declared once on its spec's field: a field declared with
`config_args.option` is the bench's own (flag, type, choices, default and help all from it); any
other is an option the bench shares with the engine (--device, --dtype, --connector,
--load-format, --graph-mode, ...), its flag, type and help from the engine's config field
(afdserve/config.py) and its default from the bench spec's."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from afdserve.config import DEVICES, ENGINE_CONFIGS, GRAPH_MODES, LOAD_FORMATS
from afdserve.config_args import add_field_argument, keyword_fields, option
from afdserve.model.presets import PRESET_HELP

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


def comma_list(kind: Callable[[str], Any], what: str) -> Callable[[str], tuple]:
    """A bench flag's parse for comma-separated values: '1,8,64' -> (1, 8, 64)."""

    def parse(text: str) -> tuple:
        try:
            return tuple(kind(s) for s in text.split(",") if s.strip())
        except ValueError:
            msg = f"expected comma-separated {what}, got {text!r}"
            raise argparse.ArgumentTypeError(msg) from None

    return parse


sizes = comma_list(int, "integers")


def model_dir_option() -> Any:
    """--model of a bench that takes a model directory or a --preset."""
    return option(
        None,
        flag="--model",
        metavar="MODEL_DIR",
        help="a Hugging Face model dir",
        shown="None, give it or --preset",
    )


def preset_option(what: str) -> Any:
    """--preset NAME[:LAYERS]; `what`: what the bench makes of it, appended to the list."""
    return option(None, metavar="NAME[:LAYERS]", help=PRESET_HELP + what)


def names(text: str) -> tuple[str, ...]:
    """'colocated, 1A1F' -> ('colocated', '1A1F') (a bench flag's parse; the spec checks them)."""
    return tuple(s.strip() for s in text.split(",") if s.strip())


def add_bench_flags(
    p: argparse.ArgumentParser, spec: type, keywords: Sequence[str] | None = None
) -> None:
    """The flags of the spec's fields named by `keywords` (all, when None), in that order (the
    order of --help): the bench's own from the field's `option`, the engine's by
    `add_engine_flags`."""
    fields = keyword_fields(spec)
    for key in fields if keywords is None else keywords:
        if "help" in fields[key].metadata:
            add_field_argument(p, spec, fields[key].name)
        else:
            add_engine_flags(p, spec, (key,))


def add_engine_flags(p: argparse.ArgumentParser, spec: type, keywords: Sequence[str]) -> None:
    """The engine options a bench spec shares (by keyword) with the engine's configs: flag,
    type and help from the config's field, the default from the bench spec's field."""
    for key in keywords:
        found = next(
            ((c, f) for c in ENGINE_CONFIGS for k, f in keyword_fields(c).items() if k == key), None
        )
        if found is None:
            raise TypeError(
                f"{spec.__name__}.{key} is no engine option: declare it with config_args.option"
            )
        cls, field = found
        add_field_argument(
            p,
            cls,
            field.name,
            default=spec.__dataclass_fields__[key].default,
            choices=NARROWED.get(key, field.metadata.get("choices")),
        )


def add_json_flag(p: argparse.ArgumentParser) -> None:
    """--json FILE: where a bench also writes its results (the output, not part of its spec)."""
    p.add_argument(
        "--json", default=None, metavar="FILE", help="also write the results here (default: None)"
    )
