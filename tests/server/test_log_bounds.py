"""logs.Bounded and logs.RateLimit, in-process: what a record from a request can write to the
log, in either format."""

from __future__ import annotations

import json
import logging
import sys

from uvicorn.logging import AccessFormatter

from afdserve.server.logs import Bounded, RateLimit, formatter

FORGED = "x\nERROR 2025-01-01 00:00:00,000 afdserve.server: FORGED\r\x1b[2K\u2028"


def _written(record: logging.LogRecord, log_format: str) -> str:
    assert Bounded().filter(record)
    return formatter(log_format).format(record)


def _record(msg: str, args: tuple = (), exc_info: object = None) -> logging.LogRecord:
    return logging.LogRecord(
        "afdserve.server",
        logging.WARNING,
        __file__,
        1,
        msg,
        args,
        exc_info,  # type: ignore[arg-type]
    )


def test_a_huge_or_forging_value_is_one_short_line_in_either_format() -> None:
    for value in ("n" * 7_500_000, FORGED, FORGED * 100_000, "\ud800"):
        text = _written(_record("fields ignored: %s", (value,)), "text")
        assert "\n" not in text and "\r" not in text and "\x1b" not in text, text[:200]
        assert "\u2028" not in text and len(text.encode()) < 1200, len(text)
        line = _written(_record("fields ignored: %s", (value,)), "json")
        assert "\n" not in line and len(line.encode()) < 1400
        message = json.loads(line)["message"]
        assert "\n" not in message and "\x1b" not in message
    assert "x\\nERROR" in _written(_record("%s", (FORGED,)), "text")


def test_a_long_template_or_many_values_are_cut_too() -> None:
    assert len(_written(_record("x" * 1_000_000), "text")) < 4300
    many = _record("%s " * 100, tuple("v" * 1000 for _ in range(100)))
    assert len(_written(many, "text")) < 4300
    numbers = _record("%d requests, %.1f s", (3, 2.25))
    assert _written(numbers, "text").endswith(": 3 requests, 2.2 s")


def test_a_traceback_is_cut_and_cannot_start_a_line() -> None:
    try:
        raise ValueError(FORGED * 10_000)
    except ValueError:
        exc_info = sys.exc_info()
    text = _written(_record("%s failed", ("POST /v1/completions",), exc_info), "text")
    first, *rest = text.split("\n")
    assert first.endswith("afdserve.server: POST /v1/completions failed"), first
    assert rest and all(line.startswith(" ") for line in rest), rest
    assert "FORGED" in text and len(text.encode()) < 8192 + 400
    line = _written(_record("failed", (), exc_info), "json")
    assert len(line.encode()) < 9000 and "ValueError" in json.loads(line)["exception"]


def test_uvicorn_access_lines_keep_their_arguments() -> None:
    args = ("127.0.0.1:5000", "GET", "/" + "a" * 100_000, "1.1", 200)
    template = '%s - "%s %s HTTP/%s" %d'  # uvicorn's
    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, template, args, None)
    assert Bounded().filter(record)
    line = AccessFormatter('%(client_addr)s "%(request_line)s" %(status_code)s').format(record)
    assert line.startswith('127.0.0.1:5000 "GET /aaa') and line.endswith('HTTP/1.1" 200 OK')
    assert len(line) < 1200


def test_the_rate_limit_counts_bytes() -> None:
    limit = RateLimit(window_s=60, burst=20, burst_bytes=16_000, total_bytes=40_000)
    big = _record("fields ignored: %s", ("f" * 5000,))
    assert Bounded().filter(big)
    size = len(big.getMessage())  # about 1 kB: the value was cut
    assert sum(limit.filter(big) for _ in range(100)) == 16_000 // size  # not 20 lines
    written = 16_000 // size * size
    for i in range(100):  # other kinds: the bytes of all of them are bounded too
        other = _record(f"kind {i}: %s", ("f" * 5000,))
        if Bounded().filter(other) and limit.filter(other):
            written += len(other.getMessage())
    assert 40_000 - 1100 < written <= 40_000
