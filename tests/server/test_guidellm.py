"""vLLM's load generator, guidellm, against a real `afdserve serve` (colocated tiny model): 16
chat requests at concurrency 4 all succeed with the token counts asked for. guidellm pins its own
torch, so it lives in its own environment: the test runs the CLI named by $GUIDELLM, or the
`guidellm` on PATH, and is skipped without one (docs/serving.md says how to install it)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from afdserve.model.fixtures.bundled import resolve_model

from .conftest import SERVED_NAME, free_port, start_server

GUIDELLM = os.environ.get("GUIDELLM") or shutil.which("guidellm")
REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 16, 32, 16

pytestmark = [
    pytest.mark.guidellm,
    pytest.mark.skipif(GUIDELLM is None, reason="guidellm not installed (set $GUIDELLM)"),
]


def test_guidellm_smoke(tmp_path: Path) -> None:
    server = start_server(tmp_path, free_port(), topology="colocated", log_requests=False)
    report = tmp_path / "guidellm.json"
    try:
        server.wait_healthy()
        run = subprocess.run(
            [
                str(GUIDELLM),
                "run",
                "--backend",
                f"kind=openai_http,target={server.url},model={SERVED_NAME}",
                "--profile",
                "kind=concurrent,streams=4",
                "--constraint",
                f"kind=max_requests,count={REQUESTS}",
                "--tokenizer",
                f"kind=hf_auto,model={resolve_model(None)}",
                "--data",
                f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
                "--output",
                f"kind=json,path={report}",
                "--disable-progress",
            ],
            capture_output=True,
            text=True,
            timeout=90,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    finally:
        server.stop()
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    made = benchmark["scheduler_metrics"]["requests_made"]
    assert made["successful"] == REQUESTS and made["errored"] == 0, made
    output = benchmark["metrics"]["output_token_count"]["successful"]
    assert output["min"] == output["max"] == OUTPUT_TOKENS
