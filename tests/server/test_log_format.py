"""`--log-format json` on a live 1A1F server started as an operator starts it: every line of its
log, the ranks' included, is one JSON object with time, level, logger and message; the request
lines and the stats line are among them, and say what was sent."""

from __future__ import annotations

import json
import time
from datetime import datetime

import httpx
import pytest

from afdserve.server.options import ServeOptions

from .conftest import SERVED_NAME, free_port, start_cli_server

FORGED = '{"level": "ERROR", "message": "FORGED"}'


def test_json_log_lines(tmp_path) -> None:
    server = start_cli_server(
        tmp_path,
        free_port(),
        "--topology",
        "1A1F",
        "--log-format",
        "json",
        "--enable-log-requests",
        "--stats-interval",
        "0.5",
    )
    try:
        server.wait_healthy()
        for max_tokens in (3, 5):
            body = {
                "model": SERVED_NAME,
                "prompt": list(range(7, 19)),
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert response.status_code == 200, response.text
        # A field named to forge a line, among 100,000 unknown ones: one record, a few kB.
        unknown = {f"field_{i}": 0 for i in range(100_000)}
        forged = {"prompt": "hi", "max_tokens": 1, f"a\n{FORGED}": 0, **unknown}
        response = httpx.post(f"{server.url}/v1/completions", json=forged, timeout=60)
        assert response.status_code == 200, response.text
        deadline = time.monotonic() + 30
        while "generation" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.25)
    finally:
        server.stop()
    records = []
    for line in server.log().splitlines():
        if line.strip():
            record = json.loads(line)  # a line that is not JSON fails here, and shows itself
            assert {"time", "level", "logger", "message"} <= set(record), record
            datetime.fromisoformat(record["time"])
            records.append(record)
    messages = [r["message"] for r in records if r["logger"].startswith("afdserve")]
    started = [m for m in messages if m.startswith("request ") and "prompt(s) of 12 tokens" in m]
    finished = [m for m in messages if m.startswith("request ") and " finished: " in m]
    assert len(started) == 2, messages
    assert [m.split(": ", 1)[1].split(" in ")[0] for m in finished] == [
        "3 tokens",
        "5 tokens",
        "1 tokens",
    ]
    assert any(m.startswith("ready: serving 'tiny'") for m in messages), messages
    assert any(m.startswith("running ") and "generation" in m for m in messages), messages
    assert all(r["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") for r in records)
    forging = [r for r in records if "FORGED" in json.dumps(r)]
    assert len(forging) == 1 and forging[0]["level"] == "WARNING", forging
    assert f"a\\n{FORGED}" in forging[0]["message"] and "\n" not in forging[0]["message"]
    assert len(json.dumps(forging[0])) < 2000, forging[0]


def test_unknown_log_format_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match=r"log_format='xml' is not allowed: one of \('text', 'json'\)"
    ):
        ServeOptions(log_format="xml")
