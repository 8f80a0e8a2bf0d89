"""Every option is declared once, on its config field: these tests read the dataclasses (not a
hand list) and check that each field has help and is a serve flag, a generate flag (the engine's)
and an LLM keyword, that --help shows the defaults, and that flags -> configs round-trips."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re

import pytest

from afdserve.cli import build_parser, llm_kwargs
from afdserve.config import (
    ENGINE_CONFIGS,
    AFDConfig,
    EngineConfig,
    GraphConfig,
    engine_configs,
)
from afdserve.config_args import (
    add_dataclass_arguments,
    build,
    keyword_fields,
    option,
    parse_placement,
    parse_sizes,
    split_kwargs,
)
from afdserve.llm import LLM
from afdserve.server.options import ServeOptions

ALL = (*ENGINE_CONFIGS, ServeOptions)


def fields_of(*classes: type) -> list[tuple[type, str, dataclasses.Field]]:
    return [(cls, key, f) for cls in classes for key, f in keyword_fields(cls).items()]


def subparser(command: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def actions_by_dest(command: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in subparser(command)._actions}


def rendered(action: argparse.Action) -> str:
    return action.help % {"default": action.default}


@pytest.mark.parametrize(
    ("cls", "key", "field"), fields_of(*ALL), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_field_has_help_and_is_a_serve_flag(cls, key, field) -> None:
    assert field.metadata.get("help"), f"{cls.__name__}.{field.name} declares no help"
    action = actions_by_dest("serve")[key]
    assert action.option_strings or key == "model", key
    assert re.search(r"\(default: [^)]+\)$", rendered(action)), action.help


@pytest.mark.parametrize(
    ("cls", "key", "field"),
    fields_of(*ENGINE_CONFIGS),
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_every_engine_field_is_a_generate_flag_and_an_llm_keyword(cls, key, field) -> None:
    action = actions_by_dest("generate")[key]
    assert action.option_strings or key == "model", key
    assert rendered(action) == rendered(actions_by_dest("serve")[key])
    # The LLM hands its keywords to engine_configs; `model` is its positional parameter.
    if key == "model":
        assert "model" in inspect.signature(LLM).parameters
    else:
        default = field.default
        configs = engine_configs({"model": "m", key: default})
        assert configs == engine_configs({"model": "m"})


def test_keywords_and_flags_are_unique() -> None:
    keys = [key for _, key, _ in fields_of(*ALL)]
    assert len(keys) == len(set(keys))
    for command in ("serve", "generate"):
        flags = [s for a in subparser(command)._actions for s in a.option_strings]
        assert len(flags) == len(set(flags)), command


def test_public_names_stay() -> None:
    """The keyword and flag names users, docs and tests know."""
    serve = actions_by_dest("serve")
    assert serve["graph_mode"].option_strings == ["--graph-mode"]
    assert serve["cuda_graph_sizes"].option_strings == ["--cuda-graph-sizes"]
    assert serve["heartbeat_timeout_s"].option_strings == ["--heartbeat-timeout"]
    assert serve["use_tqdm_on_load"].option_strings == [
        "--use-tqdm-on-load",
        "--no-use-tqdm-on-load",
    ]
    assert serve["seed"].option_strings == ["--seed"]  # serve's --seed is the engine seed
    # vLLM's switch, and its older spelling (now the default) still accepted.
    log_flags = [a.option_strings for a in subparser("serve")._actions if a.dest == "log_requests"]
    assert log_flags == [["--enable-log-requests"], ["--disable-log-requests"]]
    assert serve["log_stats"].option_strings == ["--disable-log-stats"]
    assert serve["data_parallel_size"].option_strings == ["--data-parallel-size", "-dp"]
    assert serve["tensor_parallel_size"].option_strings == ["--tensor-parallel-size", "-tp"]
    assert serve["pipeline_parallel_size"].option_strings == ["--pipeline-parallel-size", "-pp"]
    assert serve["enforce_eager"].option_strings == ["--enforce-eager"]
    assert serve["restart_window_s"].option_strings == ["--restart-window"]
    generate = actions_by_dest("generate")
    assert generate["seed"].option_strings == ["--engine-seed"]
    assert generate["sampling_seed"].option_strings == ["--seed"]


def test_help_shows_the_defaults() -> None:
    text = " ".join(subparser("serve").format_help().split())
    for expected in (
        "--heartbeat-timeout S",
        "request fails and the world stops (default: 10.0)",
        "--max-num-seqs MAX_NUM_SEQS the most sequences one step runs (default: auto: 1024 on "
        "a GPU of 70 GiB or more other than an A100, 256 on other GPUs, 64 on the CPU)",
        "(default: 1,2,4,8,16,... every 8 up to 256, every 16 past it, up to max_num_seqs or 512)",
        "--no-use-tqdm-on-load a progress bar",
        "(default: True)",
        "--enable-log-requests log a line per request",
        "(default: False)",
        "--disable-log-stats do not log the engine statistics line",
        "--on-engine-failure {exit,restart}",
        "(default: exit)",
        "model a Hugging Face model directory, or a hub id (org/name) read through "
        "the Hugging Face cache (default: the bundled tiny model)",
        "--device DEVICE where the engine runs: auto",
        "(default: auto)",
    ):
        assert expected in text, expected
    assert text.count("(default: True) (default: True)") == 0


def test_flags_round_trip_to_the_configs() -> None:
    argv = """
        serve --device cuda:1 --dtype bfloat16 --max-num-seqs 8 --max-model-len 512
        --kv-cache-blocks 40 --gpu-memory-utilization 0.5 --seed 7 --load-format dummy
        --no-use-tqdm-on-load --topology 1A2F --ubatches 2 --gate-on-attention --log-step-plan
        --connector p2p --dist-timeout 60 --heartbeat-timeout 3 --control-plane gloo
        --log-data-plane /tmp/dp --ffn-expert-parallel --expert-placement 0,1;2,3
        --graph-mode full --cuda-graph-sizes 4,1,2 --port 0 --disable-log-requests
        --max-restarts 0 --request-timeout 2.5 --retry-after 3
    """.split()
    args = build_parser().parse_args(argv)
    kwargs = llm_kwargs(args)
    assert kwargs.pop("frontend_address") is None
    assert engine_configs({**kwargs, "model": "m"}) == (
        EngineConfig(
            model="m",
            device="cuda:1",
            dtype="bfloat16",
            max_num_seqs=8,
            max_model_len=512,
            kv_cache_blocks=40,
            gpu_memory_utilization=0.5,
            seed=7,
            load_format="dummy",
            use_tqdm_on_load=False,
        ),
        AFDConfig(
            topology="1A2F",
            ubatches=2,
            gate_on_attention=True,
            log_step_plan=True,
            connector="p2p",
            timeout_s=60.0,
            heartbeat_timeout_s=3.0,
            control_plane="gloo",
            log_data_plane="/tmp/dp",
            ffn_expert_parallel=True,
            expert_placement=((0, 1), (2, 3)),
        ),
        GraphConfig(mode="full", sizes=(1, 2, 4)),
    )
    assert build(ServeOptions, args) == ServeOptions(
        port=0, log_requests=False, max_restarts=0, request_timeout_s=2.5, retry_after_s=3
    )


def test_no_flags_are_the_defaults() -> None:
    for command in ("serve", "generate"):
        kwargs = llm_kwargs(build_parser().parse_args([command]))
        assert kwargs.pop("frontend_address") is None
        assert engine_configs({**kwargs, "model": "m"}) == (
            EngineConfig(model="m"),
            AFDConfig(),
            GraphConfig(),
        )
    assert build(ServeOptions, build_parser().parse_args(["serve"])) == ServeOptions()


def test_unknown_llm_keyword_is_a_type_error_naming_it() -> None:
    # Raised before the model directory is read or any process starts.
    with pytest.raises(
        TypeError,
        match=r"LLM\(\) got an unexpected keyword argument "
        r"'graph_sizes'; the keywords are: model, .*"
        r"cuda_graph_sizes.*frontend_address",
    ):
        LLM("/no/such/model", graph_sizes=[1])


def test_split_and_build_by_keyword() -> None:
    parts = split_kwargs({"graph_mode": "full", "ubatches": 2}, ENGINE_CONFIGS, "x")
    assert parts == [{}, {"ubatches": 2}, {"graph_mode": "full"}]
    # An int for a float field is that float, as type=float would give.
    assert build(EngineConfig, {"model": "m", "gpu_memory_utilization": 1}) == EngineConfig(
        model="m", gpu_memory_utilization=1.0
    )
    with pytest.raises(ValueError, match=r"AFDConfig.ubatches=9 is not allowed"):
        engine_configs({"model": "m", "ubatches": 9})


def test_value_parsers() -> None:
    assert parse_sizes("1,2,4") == [1, 2, 4]
    assert parse_placement("0,1;2,3") == [[0, 1], [2, 3]]
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers"):
        parse_sizes("1,x")
    with pytest.raises(argparse.ArgumentTypeError, match="expert ids per FFN rank"):
        parse_placement("0;a")


def test_a_field_without_help_or_parser_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bare:
        x: int = 1

    with pytest.raises(TypeError, match="Bare.x declares no help"):
        add_dataclass_arguments(argparse.ArgumentParser(), Bare)


def test_a_repeated_flag_gathers_a_tuple() -> None:
    @dataclasses.dataclass(frozen=True)
    class Planes:
        planes: tuple[str, ...] | None = option(
            None, flag="--plane", choices=("a", "b"), repeat=True, shown="both", help="planes"
        )

    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, Planes)
    assert build(Planes, parser.parse_args([])).planes is None
    assert build(Planes, parser.parse_args("--plane b --plane a".split())).planes == ("b", "a")
    with pytest.raises(SystemExit):
        parser.parse_args(["--plane", "c"])

    @dataclasses.dataclass(frozen=True)
    class Defaulted:
        planes: tuple[str, ...] | None = option(("a",), repeat=True, help="planes")

    with pytest.raises(TypeError, match="Defaulted.planes: a repeated flag's default must be"):
        add_dataclass_arguments(argparse.ArgumentParser(), Defaulted)


def test_bench_flags_come_from_the_config_fields() -> None:
    parser = build_parser()
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    kinds = next(
        a for a in bench.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    engine_help = {k: f.metadata["help"] for _, k, f in fields_of(*ENGINE_CONFIGS)}
    for kind, keys in {
        "decode": ("device", "dtype", "connector", "graph_mode"),
        "generate": ("device", "dtype", "connector", "load_format", "graph_mode"),
        "capacity": ("device", "dtype", "connector", "load_format", "graph_mode"),
        "transport": ("dtype",),
    }.items():
        actions = {a.dest: a for a in kinds.choices[kind]._actions}
        for key in keys:
            assert actions[key].help.startswith(engine_help[key]), (kind, key)
    decode = {a.dest: a for a in kinds.choices["decode"]._actions}
    assert (decode["device"].default, decode["device"].choices) == ("cuda", ("cpu", "cuda"))
    assert decode["connector"].choices == ("p2p", "ipc")
