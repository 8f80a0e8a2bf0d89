"""`afdserve bench KIND`: one subcommand per bench module, each adding its own parser."""

from __future__ import annotations

import argparse

from afdserve.bench.calibrate import add_calibrate_parser
from afdserve.bench.capacity import add_capacity_parser
from afdserve.bench.control import add_control_parser
from afdserve.bench.decode import add_decode_parser
from afdserve.bench.generate import add_generate_parser
from afdserve.bench.serve import add_serve_parser
from afdserve.bench.transport import add_transport_parser


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    for add in (
        add_decode_parser,
        add_control_parser,
        add_serve_parser,
        add_transport_parser,
        add_generate_parser,
        add_capacity_parser,
        add_calibrate_parser,
    ):
        add(kinds)
