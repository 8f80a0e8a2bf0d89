"""`afdserve serve | generate | bench | plan | make-tiny-model`; defaults come from the config
classes."""

from __future__ import annotations

import argparse
import json
import os
import sys

from afdserve.config import ENGINE_CONFIGS, EngineConfigs, engine_configs
from afdserve.config_args import add_dataclass_arguments, build, parse_with_config, values_of


def add_config_group(p: argparse.ArgumentParser, cls: type, **kw) -> argparse._ArgumentGroup:
    """The fields of `cls` as one group of --help, headed by the class and what it is for."""
    group = p.add_argument_group(cls.__name__, (cls.__doc__ or "").strip().splitlines()[0])
    add_dataclass_arguments(group, cls, **kw)
    return group


def add_engine_args(p: argparse.ArgumentParser, flags: dict[str, str] | None = None) -> None:
    """Every field of the engine's configs as a flag (config.py declares each once; `flags`
    renames some, keyword -> flag), and the LLM's --frontend-address."""
    for cls in ENGINE_CONFIGS:
        group = add_config_group(p, cls, flags=flags)
    group.add_argument(
        "--frontend-address",
        default=None,
        metavar="HOST:PORT",
        help="listen here for ranks started elsewhere (torchrun) instead of "
        "spawning them (default: None, spawn)",
    )
    p.add_argument(
        "--config",
        metavar="FILE.yaml",
        default=None,
        help="flags from a YAML file, one key per flag (max-num-seqs: 8, or "
        "max_num_seqs); flags on the command line override it (default: None)",
    )


def llm_kwargs(args: argparse.Namespace) -> dict:
    """The LLM's keywords from the parsed flags, checked by building the configs the LLM will
    build (`preflight` checks what needs the model and the devices)."""
    kwargs = {k: v for cls in ENGINE_CONFIGS for k, v in values_of(args, cls).items()}
    # The configs do not read the directory (the LLM resolves the bundled model's path).
    engine_configs({**kwargs, "model": kwargs["model"] or "tiny"}, owner="afdserve")
    return {**kwargs, "frontend_address": args.frontend_address}


def preflight(kwargs: dict, usage: str = "llm") -> EngineConfigs:
    """The configs as the LLM will run them, from `llm_kwargs`: every configuration error is one
    line here, before any port is bound or process started (a model that is no directory or
    cached hub id, --device cuda without a GPU, too few GPUs for the replicas). A hub id is
    fetched into the cache here (unless HF_HUB_OFFLINE), before any port."""
    from afdserve.llm import resolve_engine

    rest = {k: v for k, v in kwargs.items() if k not in ("model", "frontend_address")}
    spawned = kwargs["frontend_address"] is None
    return resolve_engine(kwargs["model"], rest, spawned, usage)


def cmd_generate(args: argparse.Namespace) -> int:
    from afdserve import LLM, SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
    )
    kwargs = llm_kwargs(args)
    preflight(kwargs)
    with LLM(**kwargs) as llm:
        prompts = args.prompt or ["Hello, my name is"]
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            if args.json:
                print(
                    json.dumps(
                        {
                            "prompt": prompt,
                            "text": out.text,
                            "token_ids": out.token_ids,
                            "finish_reason": out.finish_reason,
                        }
                    )
                )
            else:
                print(f"{prompt!r} -> {out.text!r} ({out.finish_reason})")
    return 0


def read_chat_template(value: str | None) -> str | None:
    """--chat-template: a file holding a Jinja template, or the template itself (like vLLM)."""
    if value is None or "{" in value:
        return value
    if not os.path.isfile(value):
        raise ValueError(f"chat_template={value!r}: no such file, and not a Jinja template")
    with open(value) as f:
        return f.read()


def check_served_names(model: str | None, names: list[str] | None) -> None:
    """`serve --served-model-name NAME DIR` reads DIR as a second name (several names, as in
    vLLM), and without a model the bundled tiny one would be served under them: say so."""
    if model is None and names:
        taken = [n for n in names[1:] if os.path.isdir(n)]
        if taken:
            raise ValueError(
                f"--served-model-name took the directory {taken[0]!r} as a name and "
                f"no model was given: put the model first (afdserve serve MODEL "
                f"--served-model-name NAME) or give it as --model"
            )


def cmd_serve(args: argparse.Namespace) -> int:
    from afdserve import LLM
    from afdserve.server.serve import ServeOptions, run_server

    kwargs = llm_kwargs(args)
    check_served_names(kwargs["model"], args.served_model_name)
    model_dir = preflight(kwargs, "server").engine.model
    options = build(
        ServeOptions,
        args,
        api_key=args.api_key or os.environ.get("AFDSERVE_API_KEY") or None,
        chat_template=read_chat_template(args.chat_template),
    )
    if options.on_engine_failure == "restart" and kwargs["frontend_address"]:
        from afdserve.afd.ranks.channel import read_key

        if read_key() is None:
            # A generated key is written for one world: restarted ranks elsewhere would start
            # against a file that is gone, holding a key the next world does not take.
            raise ValueError(
                "--on-engine-failure restart with --frontend-address needs the ranks' key "
                "given: set AFDSERVE_AUTHKEY (hex, >= 16 bytes) or AFDSERVE_AUTHKEY_FILE for "
                "the frontend and every rank"
            )
    from afdserve.frontend.generation_config import generation_defaults

    # A bad file or directory: one line, now. The LLM reads the same source, so that its
    # get_default_sampling_params() agrees with the server's request defaults.
    generation_defaults(options.generation_config, model_dir)
    return run_server(
        lambda: LLM(**kwargs, generation_config=options.generation_config, usage_context="server"),
        options,
    )


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from afdserve.model.fixtures.tiny import make_tiny_model

    hash_layers = args.hash_layers
    if hash_layers is None:
        hash_layers = 1 if args.family == "deepseek_v4" else 0
    path = make_tiny_model(
        args.dir,
        args.family,
        hash_layers=hash_layers,
        seed=args.seed,
        dtype=args.dtype,
        quantization=args.quantization,
        expert_dtype=args.expert_dtype,
        mtp_layers=args.mtp_layers,
    )
    print(path)
    return 0


def cmd_make_config(args: argparse.Namespace) -> int:
    from afdserve.model.presets import write_preset_config

    print(write_preset_config(args.preset, args.dir))
    return 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """`afdserve generate`: the engine's flags and the prompts' sampling."""
    gen = sub.add_parser("generate", help="generate text offline")
    # --seed is the sampling seed of these prompts; the engine's generator seed is renamed.
    add_engine_args(gen, flags={"seed": "--engine-seed"})
    gen.add_argument(
        "--prompt",
        action="append",
        help="a prompt (repeat for several) (default: 'Hello, my name is')",
    )
    gen.add_argument(
        "--max-tokens",
        type=int,
        default=32,
        help="tokens to generate per prompt at most (default: 32)",
    )
    gen.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature; 0 is greedy (default: 0.0)",
    )
    gen.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: the smallest set of tokens with this much "
        "probability (default: 1.0, all)",
    )
    gen.add_argument(
        "--top-k",
        type=int,
        default=-1,
        help="sample from this many most likely tokens (default: -1, all)",
    )
    gen.add_argument(
        "--seed",
        dest="sampling_seed",
        type=int,
        default=None,
        metavar="SEED",
        help="the prompts' sampling seed (default: None, the engine's generator)",
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="one JSON object per prompt (default: False, one line of text)",
    )
    gen.set_defaults(func=cmd_generate)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """`afdserve serve`: the engine's flags and the server's options."""
    from afdserve.server.options import ServeOptions

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    add_config_group(serve, ServeOptions)
    serve.set_defaults(func=cmd_serve)


def add_make_tiny_parser(sub: argparse._SubParsersAction) -> None:
    """`afdserve make-tiny-model`: a random HF checkpoint for tests."""
    from afdserve.model.families import FAMILIES as SERVED_FAMILIES

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random HF checkpoint")
    tiny.add_argument("dir", help="the directory to write (default: none, required)")
    tiny.add_argument(
        "--family",
        required=True,
        choices=SERVED_FAMILIES,
        help="the architecture, by its model_type (default: none, required)",
    )
    tiny.add_argument(
        "--hash-layers",
        type=int,
        default=None,
        help="hash-routed MoE layers (default: 0; deepseek_v4: 1)",
    )
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights (default: 0)")
    tiny.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="of the stored weights (default: float32)",
    )
    tiny.add_argument(
        "--quantization",
        default=None,
        choices=("fp8", "mxfp4"),
        help="fp8: linear weights in the public block-scaled FP8 layout "
        "(float8_e4m3fn, float32 weight_scale_inv per 128x128 block), with "
        "quantization_config in config.json; mxfp4 (gpt_oss): routed experts as "
        "e2m1 pairs with a ue8m0 scale per 32 inputs, as published (default: none)",
    )
    tiny.add_argument(
        "--expert-dtype",
        default=None,
        choices=("fp8", "fp4"),
        help="deepseek_v4 with --quantization fp8: its routed experts in FP8, or "
        "in FP4 (e2m1 pairs in int8, a ue8m0 scale per 32 inputs) as "
        "DeepSeek-V4-Flash ships them (default: fp8)",
    )
    tiny.add_argument(
        "--mtp-layers",
        type=int,
        default=0,
        choices=(0, 1),
        help="deepseek_v3, deepseek_v4: its next-token-prediction layer too "
        "(num_nextn_predict_layers), "
        'the draft of --speculative-config \'{"method": "mtp", ...}\' (default: 0)',
    )
    tiny.set_defaults(func=cmd_make_tiny)


def add_make_config_parser(sub: argparse._SubParsersAction) -> None:
    """`afdserve make-config`: a preset's config.json."""
    from afdserve.model.presets import PRESET_HELP

    make_config = sub.add_parser(
        "make-config", help="write a preset's config.json: a model dir for --load-format dummy"
    )
    make_config.add_argument(
        "--preset",
        required=True,
        metavar="NAME[:LAYERS]",
        help=PRESET_HELP + ": the config.json to write (default: none, required)",
    )
    make_config.add_argument("dir", help="the directory to write (default: none, required)")
    make_config.set_defaults(func=cmd_make_config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="afdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_generate_parser(sub)
    add_serve_parser(sub)
    add_make_tiny_parser(sub)
    add_make_config_parser(sub)

    from afdserve.planner.plan import add_plan_parser

    add_plan_parser(sub)

    try:
        from afdserve.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_with_config(build_parser(), sys.argv[1:] if argv is None else argv)
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"afdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
