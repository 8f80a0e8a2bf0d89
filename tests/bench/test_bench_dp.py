"""`afdserve bench decode -dp N` on the CPU: the flag reaches the spec, what cannot run is refused
in one line before any work, and two replica processes decode the batches of a one-process
colocated run (the same bytes per step), their aggregate the sum of the two."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from afdserve.bench.cli import add_bench_parser
from afdserve.bench.decode import DecodeBench, main_decode, run_decode_bench
from afdserve.bench.decode_dp import run_dp_decode_bench
from afdserve.config_args import build


def spec(**overrides) -> DecodeBench:
    fields = dict(
        model_dir=None,
        preset="tiny",
        random_weights=True,
        batch_sizes=(1, 3),
        context_len=20,
        steps=3,
        dtype="float32",
        device="cpu",
    )
    fields.update(overrides)
    return DecodeBench(**fields)


def parse(line: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(line.split())


@pytest.mark.parametrize("flag", ["-dp 2", "--data-parallel-size 2"])
def test_the_flag_reaches_the_spec(flag: str) -> None:
    args = parse(f"bench decode --preset tiny --random-weights {flag}")
    assert build(DecodeBench, args, batch_sizes=(1,)).data_parallel_size == 2
    args = parse("bench decode --preset tiny --random-weights")
    assert build(DecodeBench, args, batch_sizes=(1,)).data_parallel_size == 1


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"data_parallel_size": 0}, "data_parallel_size"),
        ({"data_parallel_size": 2, "topology": "in-process"}, "data_parallel_size"),
        ({"data_parallel_size": 2, "topology": "1A1F"}, "data_parallel_size"),
        ({"data_parallel_size": 2, "compare_hf": True}, "compare_hf"),
    ],
)
def test_what_cannot_run_names_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"bench.{field}="):
        spec(**overrides)


def test_more_replicas_than_gpus_is_one_line_before_any_work() -> None:
    """No GPU visible (CUDA_VISIBLE_DEVICES empty): -dp 2 on CUDA is refused by the CLI, naming
    the count, before a model is built or a process started (nothing on stdout)."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "afdserve.cli",
            "bench",
            "decode",
            "--preset",
            "tiny",
            "--random-weights",
            "--device",
            "cuda",
            "-dp",
            "2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and done.stdout == "", done.stderr
    assert "data_parallel_size=2 needs 2 GPUs" in lines[0] and "sees 0" in lines[0]


def test_two_cpu_replicas_decode_what_one_process_decodes() -> None:
    two = run_dp_decode_bench(spec(data_parallel_size=2), 2)
    alone, _ = run_decode_bench(spec())
    assert [row.batch for row in two] == [1, 3]
    for row, one in zip(two, alone):
        assert len(row.replicas) == 2 and row.devices == ("cpu", "cpu")
        for replica in row.replicas:
            # The same model, tokens and cache as one colocated process: the same bytes a step.
            assert (replica.batch, replica.weight_bytes, replica.kv_bytes) == (
                one.batch,
                one.weight_bytes,
                one.kv_bytes,
            )
            assert replica.step_ms > 0 and replica.copy_gbps is None
        assert row.tokens_per_s == pytest.approx(sum(r.tokens_per_s for r in row.replicas))
        assert row.tokens_per_s_per_device == pytest.approx(row.tokens_per_s / 2)


@pytest.mark.slow
def test_the_cli_prints_each_replica_and_the_aggregate(capsys) -> None:
    args = parse(
        "bench decode --preset tiny --random-weights --batch-sizes 2 --context-len 9 "
        "--steps 2 --dtype float32 --device cpu -dp 2"
    )
    assert main_decode(args) == 0
    out = capsys.readouterr().out
    assert "x2 replicas at once" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("    2")]
    assert [r[1:3] for r in rows] == [["0", "cpu"], ["1", "cpu"], ["all", "2"]]
    assert float(rows[2][3]) == pytest.approx(float(rows[0][4]) + float(rows[1][4]), abs=0.11)
