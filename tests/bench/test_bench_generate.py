"""CPU runs of `afdserve bench generate` with the tiny preset's config.json (dummy weights): every
request really produced its tokens, and the figures are computed from them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from afdserve.bench.generate import check_lengths, model_dir_for
from afdserve.cli import main
from afdserve.frontend.outputs import CompletionOutput, RequestOutput

CPU = ["--device", "cpu", "--dtype", "float32"]


@pytest.mark.parametrize("topology", ["colocated", "1A1F"])
def test_generate_bench_runs_and_counts_tokens(tmp_path, capsys, topology):
    out = tmp_path / "generate.json"
    code = main(
        [
            "bench",
            "generate",
            "--preset",
            "tiny",
            "--load-format",
            "dummy",
            "--topology",
            topology,
            "--batch-sizes",
            "2,3",
            "--input-len",
            "9",
            "--output-len",
            "5",
            "--max-num-batched-tokens",
            "16",
            "--json",
            str(out),
            *CPU,
        ]
    )
    assert code == 0
    record = json.loads(out.read_text())
    assert record["engine"]["topology"] == topology
    assert record["engine"]["load_format"] == "dummy"
    results = record["results"]
    assert [r["batch"] for r in results] == [2, 3]
    for r in results:
        assert r["input_tokens"] == r["batch"] * 9 and r["output_tokens"] == r["batch"] * 5
        assert 0 < r["prefill_s"] < r["wall_s"]
        assert r["output_tokens_per_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["total_tokens_per_s"] == pytest.approx(
            (r["input_tokens"] + r["output_tokens"]) / r["wall_s"]
        )
        assert r["prefill_tokens_per_s"] == pytest.approx(r["input_tokens"] / r["prefill_s"])
        # 2 FLOPs per active parameter per prompt token; no matmul peak measured on a CPU.
        assert r["prefill_tflops"] == pytest.approx(
            2 * r["active_parameters"] * r["prefill_tokens_per_s"] / 1e12
        )
        assert r["peak_tflops"] is None and r["prefill_share_of_peak"] is None
    printed = capsys.readouterr().out
    assert "batch    2:" in printed and "output tokens/s" in printed


@pytest.mark.slow  # tests/afd/test_data_parallel.py runs the replicas in CI
def test_generate_bench_runs_data_parallel_replicas(tmp_path):
    out = tmp_path / "generate.json"
    code = main(
        [
            "bench",
            "generate",
            "--preset",
            "tiny",
            "--load-format",
            "dummy",
            "-dp",
            "2",
            "--batch-sizes",
            "4",
            "--input-len",
            "9",
            "--output-len",
            "5",
            "--json",
            str(out),
            *CPU,
        ]
    )
    assert code == 0
    record = json.loads(out.read_text())
    assert record["engine"]["data_parallel_size"] == 2
    assert record["results"][0]["output_tokens"] == 4 * 5


def test_data_parallel_replicas_are_colocated_engines(capsys):
    code = main(
        [
            "bench",
            "generate",
            "--preset",
            "tiny",
            "--load-format",
            "dummy",
            "-dp",
            "2",
            "--topology",
            "1A1F",
            *CPU,
        ]
    )
    assert code == 2
    assert "data_parallel_size" in capsys.readouterr().err


def test_max_model_len_is_the_engines(capsys):
    """--max-model-len sets the engine's (as serve's), input + output without it; shorter than
    one request is refused by name."""
    args = ["bench", "generate", "--preset", "tiny", "--load-format", "dummy", *CPU]
    args += ["--batch-sizes", "2", "--input-len", "9", "--output-len", "5"]
    assert main([*args, "--max-model-len", "64"]) == 0
    assert "max_model_len=64," in capsys.readouterr().out
    assert main(args) == 0
    assert "max_model_len=14," in capsys.readouterr().out
    assert main([*args, "--max-model-len", "13"]) == 2
    assert "max_model_len=13 is not allowed: at least input_len + output_len = 14" in (
        capsys.readouterr().err
    )


def test_a_short_request_fails_the_bench():
    def output(tokens: int) -> RequestOutput:
        choice = CompletionOutput(0, "", list(range(tokens)), None, None, "stop")
        return RequestOutput("r", None, [1], [choice], True)

    check_lengths([output(4), output(4)], 4)
    with pytest.raises(RuntimeError, match="request 1 produced 3 tokens .*'stop'.*expected 4"):
        check_lengths([output(4), output(3)], 4)


def test_model_dir_for_a_preset(tmp_path):
    with model_dir_for(None, "tiny", "dummy") as model_dir:
        assert sorted(p.name for p in Path(model_dir).iterdir()) == ["config.json"]
    assert not Path(model_dir).exists()
    with pytest.raises(ValueError, match="load_format='auto' is not allowed with --preset"):
        with model_dir_for(None, "tiny", "auto"):
            pass
    with pytest.raises(ValueError, match="exactly one of --model DIR and --preset NAME"):
        with model_dir_for(str(tmp_path), "tiny", "dummy"):
            pass
