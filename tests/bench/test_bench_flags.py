"""Every flag of every bench is its spec's field, declared once: walked from the parser, each
flag's default is its field's default (a default written a second time by hand, which could drift
from the field's, fails here), every field is a flag, and parsed flags build the spec as the
command line says."""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest

from afdserve.bench.calibrate import CalibrateBench
from afdserve.bench.capacity import CapacityBench
from afdserve.bench.control import ControlBench
from afdserve.bench.decode import DecodeBench
from afdserve.bench.generate import GenerateBench
from afdserve.bench.serve import ServeBench
from afdserve.bench.transport import TransportBench
from afdserve.cli import build_parser
from afdserve.config import ENGINE_CONFIGS
from afdserve.config_args import build, keyword_fields

SPECS = {
    "decode": DecodeBench,
    "control": ControlBench,
    "serve": ServeBench,
    "transport": TransportBench,
    "generate": GenerateBench,
    "capacity": CapacityBench,
    "calibrate": CalibrateBench,
}
# Flags that are no part of what a bench measures: where its results are also written.
OUTPUT_FLAGS = {"capacity": {"json"}, "generate": {"json"}, "serve": {"json"}}
# Benches that take every engine flag `serve` takes, with the engine's defaults, into one field.
ENGINE_FLAGS = {"generate": "engine"}
ENGINE_FIELDS = {k: f for cls in ENGINE_CONFIGS for k, f in keyword_fields(cls).items()}


def bench_kinds() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    kinds = next(
        a for a in sub.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    return dict(kinds.choices)


def flags(kind: str) -> list[argparse.Action]:
    return [a for a in bench_kinds()[kind]._actions if not isinstance(a, argparse._HelpAction)]


def parse(line: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", *line.split()])


def test_every_bench_kind_has_its_spec() -> None:
    assert set(bench_kinds()) == set(SPECS)


def shown(value: object) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)


def declared_shown(spec: type, key: str) -> bool:
    """Whether the field (the spec's own, or the engine's it shares) says in words what its
    default means ("None, give it or --preset") instead of the value."""
    engine = [f for cls in ENGINE_CONFIGS for k, f in keyword_fields(cls).items() if k == key]
    return any("shown" in f.metadata for f in [keyword_fields(spec)[key], *engine])


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_every_flag_default_is_its_spec_fields(kind: str) -> None:
    spec, fields = SPECS[kind], keyword_fields(SPECS[kind])
    dests = set()
    for action in flags(kind):
        if action.dest in OUTPUT_FLAGS.get(kind, ()):
            continue
        if kind in ENGINE_FLAGS and action.dest not in fields:
            engine = ENGINE_FIELDS[action.dest]  # an engine flag: the engine's own default
            want = None if engine.metadata.get("positional") else engine.default
            if engine.default is not dataclasses.MISSING and not engine.metadata.get("negate"):
                assert action.default == want, (kind, action.dest)
            continue
        assert action.dest in fields, (
            f"bench {kind}: {action.option_strings} is no field of {spec.__name__}"
        )
        dests.add(action.dest)
        field = fields[action.dest]
        if field.default is dataclasses.MISSING:
            assert action.required, (kind, action.dest)
            continue
        assert action.default == field.default, (kind, action.dest)
        assert type(action.default) is type(field.default), (kind, action.dest)
        if not declared_shown(spec, action.dest):
            assert action.help.endswith(f"(default: {shown(field.default)})"), action.help
    assert set(fields) - {ENGINE_FLAGS.get(kind)} == dests, f"{spec.__name__} fields without a flag"


def test_an_empty_command_line_builds_the_spec_of_its_defaults() -> None:
    for kind, spec in SPECS.items():
        if kind in ("decode", "capacity", "generate", "calibrate"):
            continue  # these need a model (and calibrate an --out)
        assert build(spec, parse(kind)) == spec(), kind
    decode = build(DecodeBench, parse("decode --preset tiny --random-weights"))
    assert decode == DecodeBench(preset="tiny", random_weights=True)
    assert decode.batch_sizes == (1, 8, 64) and decode.context_len == 1024


def test_list_flags_parse_into_the_spec() -> None:
    decode = build(DecodeBench, parse("decode --model m --batch-sizes 2,4 --context-len 9"))
    assert (decode.model_dir, decode.batch_sizes, decode.context_len) == ("m", (2, 4), 9)
    capacity = build(CapacityBench, parse("capacity --model m --topologies 1A1F"))
    assert capacity.topologies == ("1A1F",)
    transport = build(TransportBench, parse("transport --rows 8 --transports nccl,ipc"))
    assert (transport.rows, transport.transports) == ((8,), ("nccl", "ipc"))
    serve = build(ServeBench, parse("serve --request-rate 1,inf --timeout 5"))
    assert serve.request_rates == (1.0, math.inf) and serve.timeout_s == 5.0
    control = build(ControlBench, parse("control --control-plane shm --control-plane gloo"))
    assert control.control_planes == ("shm", "gloo")
    with pytest.raises(SystemExit):
        parse("transport --rows 1,x")
    with pytest.raises(SystemExit):
        parse("control --control-plane tcp")


@pytest.mark.parametrize(
    ("spec", "line", "error"),
    [
        (DecodeBench, "decode --model m --steps 1", "bench.steps=1 is not allowed"),
        (DecodeBench, "decode --model m --batch-sizes ,", "bench.batch_sizes=() is not allowed"),
        (CapacityBench, "capacity --model m --topologies 2A1F", "bench.topologies=('2A1F',)"),
        (GenerateBench, "generate --model m --input-len 0", "bench.input_len=0 is not allowed"),
        (TransportBench, "transport --transports nccl,tcp", "bench.transports: 'tcp'"),
        (ServeBench, "serve --num-prompts 0", "bench serve: num_prompts=0"),
        (ControlBench, "control --rounds 0", "bench.rounds=0 is not allowed: an integer >= 1"),
    ],
)
def test_the_specs_check_what_the_flags_give(spec, line, error) -> None:
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        build(spec, parse(line))
