"""The frontend <-> rank wire format: the frozen message types of messages.py as JSON, checked
field by field against their type hints on the way in.

Why not pickle: unpickling runs whatever the bytes name, so one peer holding the key (or a bug
that lets bytes through) would run code in the frontend and in every rank. Here decoding can build
nothing but the dataclasses listed below, each through its own constructor (whose
`__post_init__` checks run), from JSON values of the types its fields declare: a frame that is
not JSON, names another type, lacks or adds a field, or carries a value of the wrong type is a
`DecodeError`, and nothing was built. A tuple travels as a JSON list, a dict as a JSON object
(an int key as its decimal string), a dataclass as the list of its fields in declaration order
(both ends run the same afdserve); floats as JSON numbers (inf and nan as Python's json writes
them), so every value comes back equal. The encoder is json.dumps with a hook for the
dataclasses; the decoder is made once per type from its hints, with fast paths for the common
shapes (a tuple of ints, an optional number). Checking every value costs more than unpickling.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import re
import types
import typing
from collections.abc import Callable

from afdserve.afd.ranks import messages
from afdserve.config import AFDConfig, EngineConfig, GraphConfig, SpeculativeConfig
from afdserve.engine.factory import MemoryReport
from afdserve.engine.logprobs import Logprob
from afdserve.engine.requests import RequestLimits, TokenDelta
from afdserve.engine.sampling_params import RequestOutputKind, SamplingParams
from afdserve.engine.structured import StructuredOutputsParams

MESSAGES: tuple[type, ...] = (
    messages.WorkerSpec,
    messages.Hello,
    messages.RankReady,
    messages.AddRequest,
    messages.AbortRequest,
    messages.Shutdown,
    messages.Nudge,
    messages.Outputs,
    messages.Rejected,
    messages.RankFailed,
    messages.Rejoin,
    messages.Parted,
)
# Types a message may hold inside it (a field's hint names them); nothing else is ever built.
NESTED: tuple[type, ...] = (
    EngineConfig,
    SpeculativeConfig,
    AFDConfig,
    GraphConfig,
    MemoryReport,
    RequestLimits,
    TokenDelta,
    SamplingParams,
    StructuredOutputsParams,
    messages.RankStats,
)
# Enums a field may hold: each travels as its value.
ENUMS: tuple[type, ...] = (RequestOutputKind,)
_BY_NAME = {cls.__name__: cls for cls in MESSAGES}
_ALLOWED = frozenset(MESSAGES + NESTED)

Decoder = Callable[[object, str], object]
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls) if f.init) for cls in _ALLOWED}
# attrgetter of several names returns their tuple, in C: the encoder's only Python work per object.
_GETTERS = {cls: operator.attrgetter(*names) for cls, names in _FIELDS.items() if len(names) > 1}
_GETTERS.update(
    {
        cls: (lambda v, n=names: tuple(getattr(v, x) for x in n))
        for cls, names in _FIELDS.items()
        if len(names) <= 1
    }
)


def _entries(entries: tuple) -> list:
    """Logprob entries as {token: [logprob, rank]}: json writes a Logprob (a float) as its bare
    number, which would drop its rank."""
    return [
        None if e is None else {t: [float(v), getattr(v, "rank", None)] for t, v in e.items()}
        for e in entries
    ]


_delta_fields = _GETTERS[TokenDelta]
_LOGPROB_FIELDS = tuple(
    _FIELDS[TokenDelta].index(n) for n in ("new_logprobs", "new_prompt_logprobs")
)


def _delta(value: TokenDelta) -> tuple:
    fields = _delta_fields(value)
    if not (value.new_logprobs or value.new_prompt_logprobs):
        return fields  # the common case: no entries to convert
    out = list(fields)
    for i in _LOGPROB_FIELDS:
        out[i] = _entries(out[i])
    return tuple(out)


_GETTERS[TokenDelta] = _delta
_INT_KEY = re.compile(r"-?(0|[1-9][0-9]{0,19})")
_PRIMITIVES = (int, float, str, bool, type(None))


class DecodeError(ValueError):
    """A frame that is not one of the message types, well formed; says where it went wrong."""


def encode(message: object) -> bytes:
    if type(message) not in _BY_NAME.values():
        raise TypeError(f"{type(message).__name__} is not a frontend <-> rank message")
    return json.dumps(
        [type(message).__name__, message], default=_fields, separators=(",", ":")
    ).encode()


def _fields(value: object) -> object:
    if type(value) in ENUMS:
        return value.value  # type: ignore[attr-defined]
    fields = _GETTERS.get(type(value))
    if fields is None:
        raise TypeError(f"the rank codec cannot carry a {type(value).__name__}")
    return fields(value)


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


def _hints(cls: type) -> list[tuple[str, object]]:
    hints = typing.get_type_hints(cls)
    return [(name, hints[name]) for name in _FIELDS[cls]]


_DECODERS: dict[object, Decoder] = {}


def _decoder(hint: object) -> Decoder:
    if hint not in _DECODERS:
        _DECODERS[hint] = _make_decoder(hint)
    return _DECODERS[hint]


def _primitive(hint: type) -> Decoder:
    if hint is float:  # a float that JSON wrote without a fraction comes back as an int

        def number(v: object, where: str) -> float:
            if type(v) is float or type(v) is int:
                return float(v)
            raise _fail(where, "a number", v)

        return number
    name = "null" if hint is type(None) else hint.__name__

    def exact(v: object, where: str) -> object:
        if type(v) is hint:  # exact: True is no int here, 1 no bool
            return v
        raise _fail(where, name, v)

    return exact


def _make_decoder(hint: object) -> Decoder:
    if hint in _ALLOWED:
        return _dataclass_decoder(hint)
    if hint is Logprob:

        def logprob(v: object, where: str) -> Logprob:
            if (
                type(v) is list
                and len(v) == 2
                and type(v[0]) in (float, int)
                and (v[1] is None or type(v[1]) is int)
            ):
                return Logprob(float(v[0]), v[1])
            raise _fail(where, "[logprob, rank]", v)

        return logprob
    if hint in ENUMS:
        values = {m.value: m for m in hint}  # type: ignore[attr-defined]

        def member(v: object, where: str) -> object:
            if type(v) in (int, str) and v in values:
                return values[v]
            raise _fail(where, f"one of {hint.__name__}'s values", v)  # type: ignore[attr-defined]

        return member
    if hint in _PRIMITIVES:
        return _primitive(hint)
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _union_decoder(hint, args)
    if typing.get_origin(hint) is tuple:
        return _tuple_decoder(args)
    if typing.get_origin(hint) is dict:
        return _dict_decoder(*args)
    raise TypeError(f"the rank codec cannot carry a field of type {hint!r}")


def _union_decoder(hint: object, args: tuple) -> Decoder:
    rest = [a for a in args if a is not type(None)]
    if len(rest) == 1:  # X | None
        inner = _decoder(rest[0])
        return lambda v, where: None if v is None else inner(v, where)
    if all(a in _PRIMITIVES for a in args):  # e.g. bool | str: the JSON type says which
        by_type = {a: _primitive(a) for a in args}
        if float in by_type and int not in by_type:
            by_type[int] = by_type[float]

        def primitive(v: object, where: str) -> object:
            arm = by_type.get(type(v))
            if arm is None:
                raise _fail(where, str(hint), v)
            return arm(v, where)

        return primitive
    raise TypeError(f"the rank codec cannot carry a field of type {hint!r}")


def _tuple_decoder(args: tuple) -> Decoder:
    if len(args) == 2 and args[1] is Ellipsis:
        if args[0] is int:

            def ints(v: object, where: str) -> tuple:
                if type(v) is list and all(type(x) is int for x in v):
                    return tuple(v)
                raise _fail(where, "a list of integers", v)

            return ints
        item = _decoder(args[0])

        def each(v: object, where: str) -> tuple:
            if type(v) is not list:
                raise _fail(where, "a list", v)
            return tuple([item(x, where) for x in v])

        return each
    items = [_decoder(a) for a in args]

    def fixed(v: object, where: str) -> tuple:
        if not (type(v) is list and len(v) == len(items)):
            raise _fail(where, f"a list of {len(items)}", v)
        return tuple([dec(x, where) for dec, x in zip(items, v)])

    return fixed


def _dict_decoder(key: object, value: object) -> Decoder:
    if key not in (int, str):
        raise TypeError(f"the rank codec cannot carry a dict keyed by {key!r}")
    val = _decoder(value)

    def entries(v: object, where: str) -> dict:
        if type(v) is not dict:
            raise _fail(where, "an object", v)
        if key is str:
            return {k: val(x, where) for k, x in v.items()}
        out = {}
        for k, x in v.items():
            if not _INT_KEY.fullmatch(k):
                raise DecodeError(f"{where}: a key must be an integer, got {k[:32]!r}")
            out[int(k)] = val(x, where)
        return out

    return entries


def _dataclass_decoder(cls: type) -> Decoder:
    # Built lazily: a field's hint may name a class whose own decoder is not made yet.
    fields: list[tuple[Decoder, str]] = []
    count = len(_FIELDS[cls])

    def build(v: object, where: str) -> object:
        if not fields:
            fields.extend((_decoder(h), f"{cls.__name__}.{name}") for name, h in _hints(cls))
        if not (type(v) is list and len(v) == count):
            raise _fail(where, f"a {cls.__name__} (a list of its {count} fields)", v)
        args = [dec(x, name) for (dec, name), x in zip(fields, v)]
        try:
            return cls(*args)
        except (TypeError, ValueError) as e:  # its __post_init__ refused
            raise DecodeError(f"{where}: {e}") from None

    return build


def _check(hint: object, seen: set) -> None:
    """Every field of every message has a type the decoder handles: fails at import."""
    if hint in seen:
        return
    seen.add(hint)
    _decoder(hint)
    if hint in _ALLOWED:
        for _, h in _hints(hint):
            _check(h, seen)
    for arg in typing.get_args(hint):
        if arg is not Ellipsis:
            _check(arg, seen)


_SEEN: set = set()
for _cls in MESSAGES:
    _check(_cls, _SEEN)
