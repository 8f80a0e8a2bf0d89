"""The frontend <-> rank wire format: the frozen message types of messages.py as JSON, checked
field by field against their type hints on the way in.

Why not pickle: unpickling runs whatever the bytes name, so one peer holding the key (or a bug
that lets bytes through) would run code in the frontend and in every rank. Here decoding can build
nothing but the dataclasses listed below, each through its own constructor (whose
`__post_init__` checks run), from JSON values of the types its fields declare: a frame that is
not JSON, names another type, lacks or adds a field, or carries a value of the wrong type is a
`DecodeError`, and nothing was built. A tuple travels as a JSON list, a dict (token ids are int
keys) as a list of [key, value] pairs; floats as JSON numbers (inf and nan as Python's json
writes them), so every value comes back equal.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable

from afdserve.afd.ranks import messages
from afdserve.config import AFDConfig, EngineConfig, GraphConfig
from afdserve.engine.factory import MemoryReport
from afdserve.engine.requests import RequestLimits, TokenDelta
from afdserve.engine.sampling_params import SamplingParams
from afdserve.engine.structured import StructuredOutputsParams

MESSAGES: tuple[type, ...] = (
    messages.WorkerSpec,
    messages.Hello,
    messages.RankReady,
    messages.AddRequest,
    messages.AbortRequest,
    messages.Shutdown,
    messages.Outputs,
    messages.Rejected,
    messages.RankFailed,
)
# Types a message may hold inside it (a field's hint names them); nothing else is ever built.
NESTED: tuple[type, ...] = (
    EngineConfig,
    AFDConfig,
    GraphConfig,
    MemoryReport,
    RequestLimits,
    TokenDelta,
    SamplingParams,
    StructuredOutputsParams,
    messages.RankStats,
)
_BY_NAME = {cls.__name__: cls for cls in MESSAGES}
_ALLOWED = frozenset(MESSAGES + NESTED)

Decoder = Callable[[object, str], object]
Encoder = Callable[[object], object]


class DecodeError(ValueError):
    """A frame that is not one of the message types, well formed; says where it went wrong."""


def encode(message: object) -> bytes:
    cls = type(message)
    if cls not in _BY_NAME.values():
        raise TypeError(f"{cls.__name__} is not a frontend <-> rank message")
    body = _encoder(cls)(message)
    return json.dumps([cls.__name__, body], separators=(",", ":")).encode()


def decode(frame: bytes) -> object:
    try:
        value = json.loads(frame)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise DecodeError(f"not a JSON frame ({type(e).__name__})") from None
    if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)):
        raise DecodeError("a frame is [type name, body]")
    cls = _BY_NAME.get(value[0])
    if cls is None:
        raise DecodeError(f"unknown message type {value[0][:64]!r}")
    return _decoder(cls)(value[1], cls.__name__)


def _fail(where: str, wanted: str, value: object) -> DecodeError:
    return DecodeError(f"{where}: expected {wanted}, got {type(value).__name__}")


def _args(hint: object) -> tuple:
    return typing.get_args(hint)


def _is_union(hint: object) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType)


_ENCODERS: dict[object, Encoder] = {}
_DECODERS: dict[object, Decoder] = {}


def _hints(cls: type) -> list[tuple[str, object]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


def _encoder(hint: object) -> Encoder:
    if hint not in _ENCODERS:
        _ENCODERS[hint] = _make_encoder(hint)
    return _ENCODERS[hint]


def _make_encoder(hint: object) -> Encoder:
    if hint in _ALLOWED:
        fields = [(name, _encoder(h)) for name, h in _hints(hint)]
        return lambda v: {name: enc(getattr(v, name)) for name, enc in fields}
    origin = typing.get_origin(hint)
    if _is_union(hint):
        arms = [(a, _encoder(a)) for a in _args(hint)]
        return lambda v: next(enc for a, enc in arms if _matches(a, v))(v)
    if origin is tuple:
        args = _args(hint)
        if len(args) == 2 and args[1] is Ellipsis:
            item = _encoder(args[0])
            return lambda v: [item(x) for x in v]
        items = [_encoder(a) for a in args]
        return lambda v: [enc(x) for enc, x in zip(items, v)]
    if origin is dict:
        key, val = (_encoder(a) for a in _args(hint))
        return lambda v: [[key(k), val(x)] for k, x in v.items()]
    if hint in (int, float, str, bool, type(None)):
        return lambda v: v
    raise TypeError(f"the rank codec cannot carry a field of type {hint!r}")


def _matches(hint: object, value: object) -> bool:
    """Which arm of a union a value being encoded belongs to."""
    if hint is type(None):
        return value is None
    origin = typing.get_origin(hint) or hint
    if origin is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, origin)


def _decoder(hint: object) -> Decoder:
    if hint not in _DECODERS:
        _DECODERS[hint] = _make_decoder(hint)
    return _DECODERS[hint]


def _make_decoder(hint: object) -> Decoder:
    if hint in _ALLOWED:
        return _dataclass_decoder(hint)
    origin = typing.get_origin(hint)
    if _is_union(hint):
        arms = [_decoder(a) for a in _args(hint)]
        return lambda v, where: _first_arm(arms, v, where, hint)
    if origin is tuple:
        return _tuple_decoder(_args(hint))
    if origin is dict:
        key, val = (_decoder(a) for a in _args(hint))

        def pairs(v: object, where: str) -> dict:
            if not isinstance(v, list):
                raise _fail(where, "a list of [key, value] pairs", v)
            out = {}
            for p in v:
                if not (isinstance(p, list) and len(p) == 2):
                    raise _fail(where, "a [key, value] pair", p)
                out[key(p[0], where)] = val(p[1], where)
            return out

        return pairs
    if hint is type(None):
        return lambda v, where: v if v is None else _raise(_fail(where, "null", v))
    if hint is float:
        return lambda v, where: (
            float(v)
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            else _raise(_fail(where, "a number", v))
        )
    if hint is int:
        return lambda v, where: (
            v
            if isinstance(v, int) and not isinstance(v, bool)
            else _raise(_fail(where, "an integer", v))
        )
    if hint in (str, bool):
        name = hint.__name__
        return lambda v, where: v if type(v) is hint else _raise(_fail(where, f"a {name}", v))
    raise TypeError(f"the rank codec cannot carry a field of type {hint!r}")


def _raise(error: Exception) -> typing.NoReturn:
    raise error


def _first_arm(arms: list[Decoder], value: object, where: str, hint: object) -> object:
    for arm in arms:
        try:
            return arm(value, where)
        except DecodeError:
            continue
    raise _fail(where, str(hint), value)


def _tuple_decoder(args: tuple) -> Decoder:
    if len(args) == 2 and args[1] is Ellipsis:
        item = _decoder(args[0])

        def each(v: object, where: str) -> tuple:
            if not isinstance(v, list):
                raise _fail(where, "a list", v)
            return tuple(item(x, where) for x in v)

        return each
    items = [_decoder(a) for a in args]

    def fixed(v: object, where: str) -> tuple:
        if not (isinstance(v, list) and len(v) == len(items)):
            raise _fail(where, f"a list of {len(items)}", v)
        return tuple(dec(x, where) for dec, x in zip(items, v))

    return fixed


def _dataclass_decoder(cls: type) -> Decoder:
    # Built lazily: a field's hint may name a class whose own decoder is not made yet.
    fields: dict[str, Decoder] = {}

    def build(v: object, where: str) -> object:
        if not fields:
            fields.update({name: _decoder(h) for name, h in _hints(cls)})
        if not isinstance(v, dict):
            raise _fail(where, f"a {cls.__name__} object", v)
        unknown = v.keys() - fields.keys()
        if unknown:
            raise DecodeError(f"{where}: {cls.__name__} has no field {sorted(unknown)[0][:64]!r}")
        kwargs = {name: fields[name](x, f"{where}.{name}") for name, x in v.items()}
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:  # a missing field, or its __post_init__ refused
            raise DecodeError(f"{where}: {e}") from None

    return build


for _cls in MESSAGES:  # an unsupported field type fails at import, not on the first frame
    _encoder(_cls)
    _decoder(_cls)
