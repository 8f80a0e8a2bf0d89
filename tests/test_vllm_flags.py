"""A vLLM command line means here what it means in vLLM: every flag of every command has help and
shows its default (walked from the parser, not listed), --help is grouped by the config class each
option lives on, --config FILE.yaml is vLLM's, and vLLM's spellings (-dp, --dtype half, several
--served-model-name, --model) are taken while -tp/-pp are refused saying what to use instead."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from afdserve.cli import build_parser, llm_kwargs
from afdserve.config import ENGINE_CONFIGS, AFDConfig, EngineConfig, GraphConfig, engine_configs
from afdserve.config_args import build, keyword_fields, parse_with_config
from afdserve.server.options import ServeOptions

DEFAULT = re.compile(r"\(default: [^)]+\)$")


def commands(parser: argparse.ArgumentParser, prefix: str = ""):
    """(name, parser) of every command and sub-command, walked from the parser itself."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix}{name}", sub
                yield from commands(sub, f"{prefix}{name} ")


LEAVES = sorted(
    name
    for name, sub in commands(build_parser())
    if not any(isinstance(a, argparse._SubParsersAction) for a in sub._actions)
)


def test_the_walk_finds_every_command() -> None:
    assert {"serve", "generate", "make-tiny-model", "bench generate", "bench serve"} <= set(LEAVES)


@pytest.mark.parametrize("command", LEAVES)
def test_every_flag_has_help_ending_in_its_default(command: str) -> None:
    """A required flag says so instead ("(required)", from config_args for fields without a
    default)."""
    parser = dict(commands(build_parser()))[command]
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(actions) >= 2

    def explained(a: argparse.Action) -> bool:
        text = (a.help or "") % {"default": a.default}
        return bool(DEFAULT.search(text)) or (a.required and text.endswith("(required)"))

    missing = [a.option_strings or a.dest for a in actions if not explained(a)]
    assert missing == []


def test_serve_help_is_grouped_by_the_class_each_option_lives_on() -> None:
    serve = dict(commands(build_parser()))["serve"]
    groups = {g.title: {a.dest for a in g._group_actions} for g in serve._action_groups}
    for cls in (*ENGINE_CONFIGS, ServeOptions):
        assert set(keyword_fields(cls)) <= groups[cls.__name__], cls.__name__
    text = serve.format_help()
    assert "EngineConfig:\n  One attention rank's engine" in text
    body = text[text.index("\n\n") :]  # after the usage lines
    where = [body.index(s) for s in ("AFDConfig:", "--data-parallel-size", "GraphConfig:")]
    assert where == sorted(where)


def parse(*argv: str) -> argparse.Namespace:
    return parse_with_config(build_parser(), ["serve", *argv])


def configs(args: argparse.Namespace):
    kwargs = llm_kwargs(args)
    assert kwargs.pop("frontend_address") is None
    return engine_configs(kwargs)


def test_vllm_spellings() -> None:
    args = parse(
        "--model",
        "/m",
        "-dp",
        "2",
        "--dtype",
        "half",
        "--served-model-name",
        "a",
        "b",
        "--enable-log-requests",
        "--disable-log-stats",
        "--enforce-eager",
    )
    engine, afd, graph = configs(args)
    assert (engine.model, engine.dtype) == ("/m", "float16")
    assert (afd.data_parallel_size, afd.topology) == (2, "2A0F")
    assert graph == GraphConfig(enforce_eager=True)
    assert graph.resolved("cuda").mode == "none"
    options = build(ServeOptions, args)
    assert options.served_model_name == ("a", "b")
    assert (options.log_requests, options.log_stats) == (True, False)
    assert parse("-dp", "3", "/m").model == "/m"  # the 3 is -dp's, not the model path
    assert EngineConfig(model="m", dtype="float").dtype == "float32"


def test_request_logs_are_off_by_default_as_in_vllm() -> None:
    assert build(ServeOptions, parse()).log_requests is False
    assert build(ServeOptions, parse("--disable-log-requests")).log_requests is False
    assert build(ServeOptions, parse()).log_stats is True


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["-tp", "2"],
            "tensor_parallel_size=2 is not supported: afdserve has no tensor parallelism; "
            "split the model into attention and FFN ranks with --topology <A>A<F>F",
        ),
        (["--pipeline-parallel-size", "2"], "pipeline_parallel_size=2 is not supported"),
        (
            ["-dp", "2", "--topology", "2A1F"],
            "data_parallel_size=2 is not allowed with topology='2A1F'",
        ),
        (["-dp", "0"], "AFDConfig.data_parallel_size=0 is not allowed: an integer >= 1"),
        (["--graph-mode", "full", "--enforce-eager"], "enforce_eager=True contradicts graph_mode"),
    ],
)
def test_what_afdserve_cannot_honour_is_refused_by_name(flags: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        llm_kwargs(parse(*flags))


def test_one_is_the_only_tensor_and_pipeline_parallel_size() -> None:
    assert AFDConfig(tensor_parallel_size=1, pipeline_parallel_size=1) == AFDConfig()
    # data_parallel_size and topology <N>A0F are one setting, whichever is given.
    assert AFDConfig(data_parallel_size=2) == AFDConfig(topology="2A0F")
    assert AFDConfig(topology="2A0F").data_parallel_size == 2


def test_graph_mode_auto_follows_the_device() -> None:
    assert GraphConfig().resolved("cuda").mode == "full_decode_only"
    assert GraphConfig().resolved("cuda:1").mode == "full_decode_only"
    assert GraphConfig().resolved("cpu").mode == "none"
    assert GraphConfig(mode="full").resolved("cpu").mode == "full"  # explicit stays
    assert GraphConfig(mode="none").resolved("cuda").mode == "none"
    with pytest.raises(ValueError, match="must be resolved"):
        GraphConfig().capture_sizes(8)


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_keys_are_flags_and_the_command_line_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "model: /m\nport: 9000\nmax_num_seqs: 8\nmax-model-len: 512\n"
        "served-model-name: [a, b]\nenable-log-requests: true\n"
        "use-tqdm-on-load: false\ncuda-graph-sizes: [4, 1]\n"
        "disable-log-stats: true\n-dp: 2\n",
    )
    from_file = parse("--config", path)
    same = parse(
        "/m",
        "--port",
        "9000",
        "--max-num-seqs",
        "8",
        "--max-model-len",
        "512",
        "--served-model-name",
        "a",
        "b",
        "--enable-log-requests",
        "--no-use-tqdm-on-load",
        "--cuda-graph-sizes",
        "4,1",
        "--disable-log-stats",
        "-dp",
        "2",
    )
    assert vars(from_file) == vars(same)
    overridden = parse("--config", path, "--port", "9001", "--max-num-seqs", "4", "/other")
    assert (overridden.port, overridden.max_num_seqs, overridden.model) == (9001, 4, "/other")
    assert overridden.max_model_len == 512


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max-num-sqs: 8\n", "unknown key 'max-num-sqs'; the keys are the flags of this command:"),
        ("- port\n", "expected a mapping of flag: value, got list"),
        ("enforce-eager: 1\n", "enforce-eager: expected true or false, got 1"),
        ("port: [\n", "not valid YAML"),
    ],
)
def test_a_bad_config_file_is_one_error_naming_what_is_wrong(
    tmp_path: Path, text: str, message: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse("--config", write(tmp_path, text))


def test_every_engine_field_default_is_what_no_flag_gives() -> None:
    """The new fields keep the configs of a command line without them unchanged."""
    for config in configs(parse("m")):
        defaults = {f.name: f.default for f in dataclasses.fields(config)}
        assert {k: v for k, v in defaults.items() if k != "model"} == {
            k: getattr(config, k) for k in defaults if k != "model"
        }


def test_a_directory_taken_as_a_served_name_is_refused(tmp_path: Path, capsys) -> None:
    from afdserve.cli import main

    code = main(["serve", "--served-model-name", "q", str(tmp_path), "--port", "0"])
    assert code == 2  # not the bundled tiny model served as "q" and the directory's path
    assert f"--served-model-name took the directory {str(tmp_path)!r}" in capsys.readouterr().err
