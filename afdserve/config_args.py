"""Command-line flags and keyword arguments read from frozen dataclasses (vLLM's
`EngineArgs.add_cli_args`, but declared on the config classes themselves).

Each field says once, in its metadata (see `option`), what a user reads about it: its help, and
where they differ from the field's name its keyword (`GraphConfig.mode` is `graph_mode=`) and its
flag. From that, `add_dataclass_arguments` adds the argparse arguments of a class,
`build` constructs the class back from keywords or a parsed namespace, and `split_kwargs`
sorts one keyword dict into several classes. A new option is one field.

The bottom layer: no torch, no other afdserve import.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

_UNSET: Any = object()  # "no override" (None is a real default)


def option(
    default: Any = dataclasses.MISSING,
    *,
    help: str,  # noqa: A002 - argparse's own name for it
    flag: str | None = None,
    kwarg: str | None = None,
    choices: Sequence[str] | None = None,
    allowed: Sequence[str] | None = None,
    parse: Callable[[str], Any] | None = None,
    metavar: str | None = None,
    shown: str | None = None,
    nargs: str | None = None,
    const: Any = None,
    negate: bool = False,
    positional: bool = False,
    aliases: Sequence[str] = (),
    off_flag: str | None = None,
    repeat: bool = False,
) -> Any:
    """A dataclass field with its user-facing declaration (metavar, nargs, const: argparse's).

    help: what the option does; "(default: X)" is appended, or `shown` where the value alone
        would not tell what it means (max_model_len=None: "the model's max_position_embeddings").
    flag: the flag, when not `--` + the keyword with `_` as `-` and no trailing `_s`
        (`heartbeat_timeout_s` is `--heartbeat-timeout`); aliases: more flags (vLLM's `-dp`);
        kwarg: the keyword (and argparse dest), when not the field's name.
    choices: values argparse enforces. allowed: values only shown (as the metavar), left to the
        class's own validation so that a wrong value is its one-line error.
    parse: turns the flag's text into the value, for types other than str, int, float, bool.
    negate: a True-by-default bool set False by the flag (`--disable-log-stats`). off_flag: a
        flag that sets a False-by-default bool False again (vLLM's older spelling of a switch
        whose default flipped: `--disable-log-requests`).
    positional: an optional positional argument, and a flag (`--model`) beside it, as in vLLM.
    repeat: a tuple field whose flag is given once per value (`--control-plane gloo
        --control-plane shm`); its default must be None (argparse would append to any other).
    """
    meta = {
        "help": help,
        "flag": flag,
        "kwarg": kwarg,
        "choices": choices,
        "allowed": allowed,
        "parse": parse,
        "metavar": metavar,
        "shown": shown,
        "nargs": nargs,
        "const": const,
        "negate": negate,
        "positional": positional,
        "aliases": tuple(aliases),
        "off_flag": off_flag,
        "repeat": repeat,
    }
    kept = {k: v for k, v in meta.items() if v is not None and v is not False and v != ()}
    return dataclasses.field(default=default, metadata=kept)


def kwarg_of(field: dataclasses.Field) -> str:
    return field.metadata.get("kwarg") or field.name


def flag_of(field: dataclasses.Field) -> str:
    if field.metadata.get("flag"):
        return field.metadata["flag"]
    return "--" + kwarg_of(field).removesuffix("_s").replace("_", "-")


def keyword_fields(cls: type) -> dict[str, dataclasses.Field]:
    """keyword -> field, in declaration order."""
    return {kwarg_of(f): f for f in dataclasses.fields(cls)}


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _base_type(hint: Any) -> Any:
    """`int | None` -> int; anything else unchanged (a union of several types stays a union)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        return rest[0] if len(rest) == 1 else hint
    return hint


def _shown(default: Any) -> str:
    if isinstance(default, tuple):
        return ",".join(str(v) for v in default)
    return str(default)


def help_with_default(field: dataclasses.Field, default: Any = _UNSET) -> str:
    """The field's help ending in its default, as vLLM's --help shows it (or "required")."""
    if default is _UNSET and field.default is dataclasses.MISSING and "shown" not in field.metadata:
        return f"{field.metadata['help']} (required)"
    if default is _UNSET:
        shown = field.metadata.get("shown") or _shown(field.default)
    else:
        shown = _shown(default)
    return f"{field.metadata['help']} (default: {shown})"


def add_field_argument(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    name: str,
    *,
    flag: str | None = None,
    default: Any = _UNSET,
    choices: Sequence[str] | None = None,
) -> argparse.Action:
    """One field of `cls` as an argument, its dest the field's keyword. A caller whose own
    default or narrower choices differ (the benches) passes them; the rest is the field's."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta = field.metadata
    if "help" not in meta:
        raise TypeError(f"{cls.__name__}.{name} declares no help: use config_args.option")
    if default is not _UNSET and default == field.default:
        default = _UNSET  # the field's own: "(default: X)" says what it stands for
    value = (None if meta.get("positional") else field.default) if default is _UNSET else default
    if meta.get("negate"):  # the flag's own default: not given
        text = help_with_default(field, not value)
    else:
        text = help_with_default(field, default)
    flag = flag or flag_of(field)
    kind = _base_type(_hints(cls)[name])
    if meta.get("repeat"):  # tuple[X, ...]: each flag's value is an X
        if value is not None:
            raise TypeError(f"{cls.__name__}.{name}: a repeated flag's default must be None")
        kind = typing.get_args(kind)[0]
    if kind is bool and not meta.get("parse"):
        kw = {"action": _bool_action(meta, value)}
    else:
        kw = _typed(cls, field, kind, flag, choices)
    if meta.get("positional"):
        # SUPPRESS: an absent positional must not overwrite the flag's value (argparse sets a
        # missing optional positional to its default after the flags are read).
        positional = parser.add_argument(
            kwarg_of(field), nargs="?", default=argparse.SUPPRESS, **kw
        )
        positional.help = text.replace("%", "%%")
        kw["metavar"] = kw.get("metavar") or flag.lstrip("-").replace("-", "_").upper()
        text = f"the same as the positional {kwarg_of(field)}: " + text
    flags = (flag, *meta.get("aliases", ()))
    if value is dataclasses.MISSING:  # a field without a default: the flag must be given
        action = parser.add_argument(*flags, dest=kwarg_of(field), required=True, **kw)
    else:
        action = parser.add_argument(*flags, dest=kwarg_of(field), default=value, **kw)
    # Set after construction: BooleanOptionalAction would append its own "(default: ...)".
    action.help = text.replace("%", "%%")
    if meta.get("off_flag"):
        off = parser.add_argument(
            meta["off_flag"], dest=kwarg_of(field), action="store_false", default=value
        )
        off.help = f"the opposite of {flag}, which is off by default (default: {not value})"
    return action


def _typed(
    cls: type, field: dataclasses.Field, kind: Any, flag: str, choices: Sequence[str] | None
) -> dict[str, Any]:
    """type, choices, metavar (and nargs) of a field that takes a value."""
    meta = field.metadata
    if not meta.get("parse") and kind not in (str, int, float):
        raise TypeError(f"{cls.__name__}.{field.name}: give option(parse=...) for {kind}")
    kw: dict[str, Any] = {"type": meta.get("parse") or kind}
    kw["choices"] = choices if choices is not None else meta.get("choices")
    allowed = meta.get("allowed") if choices is None else None
    kw["metavar"] = meta.get("metavar") or ("{" + ",".join(allowed) + "}" if allowed else None)
    if kw["metavar"] is None and kw["choices"] is None and not meta.get("positional"):
        # Named after the flag, not the dest (--restart-window RESTART_WINDOW).
        kw["metavar"] = flag.lstrip("-").replace("-", "_").upper()
    if meta.get("nargs"):
        kw["nargs"], kw["const"] = meta["nargs"], meta.get("const")
    if meta.get("repeat"):
        kw["action"] = "append"
    return kw


def _bool_action(meta: Mapping[str, Any], default: Any) -> Any:
    if meta.get("negate"):
        return "store_false"  # the flag turns a True default off
    # As vLLM: a False default is switched on by its flag; a True one has --no-... too, and so
    # has a None one (the engine decides unless told either way).
    return argparse.BooleanOptionalAction if default or default is None else "store_true"


def add_dataclass_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    flags: Mapping[str, str] | None = None,
    skip: Iterable[str] = (),
) -> None:
    """Every field of `cls` (less `skip`, by keyword) as an argument; `flags` renames the
    flags of some (keyword -> flag) where a command's own flag has the name."""
    flags = flags or {}
    for key, field in keyword_fields(cls).items():
        if key not in skip:
            add_field_argument(parser, cls, field.name, flag=flags.get(key))


def values_of(source: argparse.Namespace | Mapping[str, Any], cls: type) -> dict[str, Any]:
    """keyword -> value for each field of `cls` that `source` (a namespace or dict) holds."""
    found = vars(source) if isinstance(source, argparse.Namespace) else source
    return {k: found[k] for k in keyword_fields(cls) if k in found}


def build(cls: type, source: argparse.Namespace | Mapping[str, Any], **overrides: Any) -> Any:
    """`cls` from its fields' keywords in `source` (others there are ignored), then `overrides`;
    an int given for a float field is taken as that float, as argparse's type=float would, and
    the list a repeated flag gathers (option(repeat=True)) as a tuple."""
    values = {**values_of(source, cls), **overrides}
    hints = _hints(cls)
    by_name = {}
    for key, field in keyword_fields(cls).items():
        if key not in values:
            continue
        value = values[key]
        if _base_type(hints[field.name]) is float and type(value) is int:
            value = float(value)
        elif field.metadata.get("repeat") and isinstance(value, list):
            value = tuple(value)
        by_name[field.name] = value
    return cls(**by_name)


def split_kwargs(
    kwargs: Mapping[str, Any], classes: Sequence[type], owner: str, also: Iterable[str] = ()
) -> list[dict[str, Any]]:
    """`kwargs` sorted into one dict per class by its fields' keywords. A keyword no class has
    is a TypeError naming it and every allowed one (those of the classes, then `also`)."""
    parts: list[dict[str, Any]] = [{} for _ in classes]
    owners = {k: i for i, cls in enumerate(classes) for k in keyword_fields(cls)}
    unknown = [k for k in kwargs if k not in owners]
    if unknown:
        allowed = ", ".join([*owners, *also])
        raise TypeError(
            f"{owner} got an unexpected keyword argument {unknown[0]!r}; "
            f"the keywords are: {allowed}"
        )
    for key, value in kwargs.items():
        parts[owners[key]][key] = value
    return parts


def parse_sizes(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4] (a flag's parse)."""
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def parse_placement(text: str) -> list[list[int]]:
    """'0,1;2,3' -> [[0, 1], [2, 3]]: ids per FFN rank, ';' between ranks (a flag's parse)."""
    try:
        return [[int(e) for e in shard.split(",") if e.strip()] for shard in text.split(";")]
    except ValueError:
        msg = f"expected expert ids per FFN rank like '0,1,2;3,4,5', got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def parse_with_config(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`parser.parse_args(argv)`, where `COMMAND ... --config FILE.yaml ...` first reads FILE as
    vLLM's --config: a mapping whose keys are the command's flags (`max-num-seqs: 8`, also
    `max_num_seqs`, `model: DIR`), put before the command line's own flags so that those
    override it. A key that is no flag of the command is a ValueError naming it."""
    argv = list(argv)
    path, rest = _config_path(argv)
    if path is None or not rest:
        return parser.parse_args(argv)
    sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    command = sub.choices.get(rest[0]) if sub is not None else None
    if command is None:
        return parser.parse_args(argv)  # argparse's own error for an unknown command
    return parser.parse_args([rest[0], *config_file_args(command, path), *rest[1:]])


def _config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1], argv[:i] + argv[i + 2 :]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
    return None, argv


def config_file_args(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """The command-line flags that FILE's keys stand for (see `parse_with_config`)."""
    import yaml

    try:
        with open(path) as f:
            loaded = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({' '.join(str(e).split())})") from None
    if loaded is None:
        return []
    if not isinstance(loaded, dict):
        raise ValueError(
            f"--config {path}: expected a mapping of flag: value, got {type(loaded).__name__}"
        )
    flags = {
        s.lstrip("-"): (s, a)
        for a in parser._actions
        for s in a.option_strings
        if s != "--config" and not isinstance(a, argparse._HelpAction)
    }
    args: list[str] = []
    for key, value in loaded.items():
        name = str(key).lstrip("-").replace("_", "-")
        if name not in flags:
            raise ValueError(
                f"--config {path}: unknown key {key!r}; the keys are the flags of "
                f"this command: {', '.join(sorted(flags))}"
            )
        args += _flag_args(*flags[name], value)
    return args


def _flag_args(flag: str, action: argparse.Action, value: Any) -> list[str]:
    if value is None:
        return []  # the flag's default
    if action.nargs == 0:  # store_true, store_false, BooleanOptionalAction
        if not isinstance(value, bool):
            raise ValueError(f"--config: {flag.lstrip('-')}: expected true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []
    if action.nargs == "?" and isinstance(value, bool):
        return [flag] if value else []
    if isinstance(value, dict):  # a JSON-valued flag (--speculative-config)
        return [flag, json.dumps(value)]
    if isinstance(value, (list, tuple)):
        if action.nargs in ("+", "*"):
            return [flag, *(str(v) for v in value)]
        return [flag, ",".join(str(v) for v in value)]  # a comma-separated flag (N,N,...)
    return [flag, str(value).lower() if isinstance(value, bool) else str(value)]
