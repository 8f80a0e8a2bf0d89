"""A DeepSeek-V4 checkpoint through the command line: `afdserve generate DIR` prints the offline
API's greedy tokens, and `afdserve serve DIR` (colocated, and 2A1F: attention ranks holding the
mHC streams, an FFN rank) answers /v1/completions with them, over a real HTTP client."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from afdserve import LLM, SamplingParams
from afdserve.cli import main
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4

from .conftest import SERVED_NAME, free_port, start_cli_server

PROMPTS = [[72, 105, 33, 7, 9, 11, 13], [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_v4(tmp_path_factory.mktemp("v4-serve") / "tiny", seed=5)


@pytest.fixture(scope="module")
def oracle(v4_dir: Path) -> list[list[int]]:
    """The offline API's greedy tokens (tests/engine/test_deepseek_v4_engine.py holds those equal
    to transformers' full forward)."""
    with LLM(str(v4_dir), dtype="float32") as llm:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS] + ["Hello, V4"]
        return [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_generate_cli_runs_v4(v4_dir: Path, oracle: list[list[int]], capsys) -> None:
    code = main(
        [
            "generate",
            str(v4_dir),
            "--dtype",
            "float32",
            "--prompt",
            "Hello, V4",
            "--max-tokens",
            "9",
            "--temperature",
            "0",
            "--json",
        ]
    )
    assert code == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    (answer,) = (json.loads(line) for line in lines)
    assert answer["token_ids"] == oracle[2]


@pytest.mark.parametrize("topology", ["1A0F", pytest.param("2A1F", marks=pytest.mark.slow)])
def test_serve_runs_v4(
    v4_dir: Path, oracle: list[list[int]], tmp_path: Path, topology: str
) -> None:
    srv = start_cli_server(
        tmp_path,
        free_port(),
        str(v4_dir),
        "--dtype",
        "float32",
        "--topology",
        topology,
        "--max-num-batched-tokens",
        "8",
    )
    try:
        srv.wait_healthy()
        body = {
            "model": SERVED_NAME,
            "prompt": PROMPTS,
            "temperature": 0.0,
            "max_tokens": 9,
            "ignore_eos": True,
            "return_token_ids": True,
        }
        answer = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()
        got = [
            choice["token_ids"] for choice in sorted(answer["choices"], key=lambda c: c["index"])
        ]
        assert got == oracle[:2], answer
    finally:
        srv.stop()
