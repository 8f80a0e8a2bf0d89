"""`afdserve serve | generate | bench | make-tiny-model`; defaults come from the config classes."""

from __future__ import annotations

import argparse
import json
import os
import sys

from afdserve.config import (
    CONNECTORS,
    LOAD_FORMATS,
    AFDConfig,
    EngineConfig,
    GraphConfig,
    check_model_dir,
)


def _sizes(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def _placement(text: str) -> list[list[int]]:
    try:
        return [[int(e) for e in shard.split(",") if e.strip()] for shard in text.split(";")]
    except ValueError:
        msg = f"expected expert ids per FFN rank like '0,1,2;3,4,5', got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    e = EngineConfig.__dataclass_fields__
    p.add_argument("model", nargs="?", default=None,
                   help="Hugging Face model directory (default: the bundled tiny model)")
    p.add_argument("--topology", default=AFDConfig.topology,
                   help="'colocated' or <A>A<F>F, e.g. 2A1F")
    p.add_argument("--device", default=e["device"].default, help="cpu or cuda")
    p.add_argument("--load-format", default=e["load_format"].default, choices=LOAD_FORMATS,
                   help="dummy: random weights from config.json alone (reads no safetensors)")
    p.add_argument("--dtype", default=e["dtype"].default,
                   help="auto, float32, bfloat16 or float16")
    p.add_argument("--max-num-seqs", type=int, default=e["max_num_seqs"].default)
    p.add_argument("--max-num-batched-tokens", type=int,
                   default=e["max_num_batched_tokens"].default)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=e["block_size"].default)
    p.add_argument("--gpu-memory-utilization", type=float,
                   default=e["gpu_memory_utilization"].default)
    p.add_argument("--graph-mode", default=GraphConfig.mode,
                   help="none, full_decode_only or full")
    p.add_argument("--cuda-graph-sizes", type=_sizes, default=None,
                   help="comma-separated capture sizes (default: 1,2,4,8,16,... to max-num-seqs)")
    p.add_argument("--ubatches", type=int, default=AFDConfig.ubatches)
    p.add_argument("--connector", default=AFDConfig.connector, choices=CONNECTORS,
                   help="data plane of an AFD topology: p2p (torch.distributed), ipc (symmetric "
                        "GPU memory, one host), inprocess (1A1F in one process), auto")
    p.add_argument("--gate-on-attention", action="store_true",
                   help="run the MoE router on the attention ranks")
    p.add_argument("--ffn-expert-parallel", action="store_true",
                   help="FFN ranks shard the routed experts (allows A < F, e.g. 1A2F)")
    p.add_argument("--expert-placement", type=_placement, default=None, metavar="E,E;E,E",
                   help="with --ffn-expert-parallel: the experts of each FFN rank, ';' between "
                        "ranks (default: contiguous shards)")
    p.add_argument("--frontend-address", default=None, metavar="HOST:PORT",
                   help="listen here for ranks started elsewhere (torchrun) instead of spawning")
    p.add_argument("--log-step-plan", nargs="?", const=True, default=False, metavar="PATH",
                   help="write one JSON line per rank per step (to PATH)")
    p.add_argument("--heartbeat-timeout", type=float, default=AFDConfig.heartbeat_timeout_s,
                   metavar="S", help="an attention rank silent this long means a rank is hung")
    p.add_argument("--use-tqdm-on-load", action=argparse.BooleanOptionalAction,
                   default=e["use_tqdm_on_load"].default,
                   help="a progress bar over checkpoint shards while loading (on a terminal)")
    p.add_argument("--control-plane", default=AFDConfig.control_plane,
                   help="how ranks exchange step reports: auto, gloo or shm (shared memory, "
                        "one host; auto takes it for worlds this command spawns)")


def llm_kwargs(args: argparse.Namespace) -> dict:
    return {
        "model": args.model, "topology": args.topology, "device": args.device,
        "dtype": args.dtype, "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len, "kv_cache_blocks": args.kv_cache_blocks,
        "block_size": args.block_size, "gpu_memory_utilization": args.gpu_memory_utilization,
        "graph_mode": args.graph_mode, "cuda_graph_sizes": args.cuda_graph_sizes,
        "ubatches": args.ubatches, "connector": args.connector,
        "gate_on_attention": args.gate_on_attention,
        "log_step_plan": args.log_step_plan,
        "heartbeat_timeout_s": args.heartbeat_timeout,
        "control_plane": args.control_plane,
        "frontend_address": args.frontend_address,
        "seed": getattr(args, "engine_seed", EngineConfig.seed),
        "load_format": args.load_format,
        "ffn_expert_parallel": args.ffn_expert_parallel,
        "expert_placement": args.expert_placement,
        "use_tqdm_on_load": args.use_tqdm_on_load,
    }


def check_engine_args(kwargs: dict) -> None:
    """Every configuration error, in one line, before any port is bound or process started."""
    from afdserve.model.bundled import resolve_model

    if kwargs["model"] not in (None, "", "tiny"):
        check_model_dir(kwargs["model"])
    EngineConfig(
        model=resolve_model(kwargs["model"]), device=kwargs["device"], dtype=kwargs["dtype"],
        max_num_seqs=kwargs["max_num_seqs"],
        max_num_batched_tokens=kwargs["max_num_batched_tokens"],
        max_model_len=kwargs["max_model_len"], kv_cache_blocks=kwargs["kv_cache_blocks"],
        block_size=kwargs["block_size"],
        gpu_memory_utilization=float(kwargs["gpu_memory_utilization"]), seed=kwargs["seed"],
        load_format=kwargs["load_format"], use_tqdm_on_load=kwargs["use_tqdm_on_load"],
    )
    afd = AFDConfig(topology=kwargs["topology"], ubatches=kwargs["ubatches"],
                    connector=kwargs["connector"],
                    gate_on_attention=kwargs["gate_on_attention"],
                    log_step_plan=kwargs["log_step_plan"],
                    heartbeat_timeout_s=kwargs["heartbeat_timeout_s"],
                    control_plane=kwargs["control_plane"],
                    ffn_expert_parallel=kwargs["ffn_expert_parallel"],
                    expert_placement=kwargs["expert_placement"])
    afd.check_device(kwargs["device"])
    sizes = kwargs["cuda_graph_sizes"]
    GraphConfig(mode=kwargs["graph_mode"], sizes=tuple(sizes) if sizes is not None else None)


def cmd_generate(args: argparse.Namespace) -> int:
    from afdserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    kwargs = llm_kwargs(args)
    check_engine_args(kwargs)
    with LLM(**kwargs) as llm:
        prompts = args.prompt or ["Hello, my name is"]
        for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
            if args.json:
                print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                                  "finish_reason": out.finish_reason}))
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


def cmd_serve(args: argparse.Namespace) -> int:
    from afdserve import LLM
    from afdserve.server.serve import ServeOptions, run_server

    kwargs = llm_kwargs(args)
    check_engine_args(kwargs)
    options = ServeOptions(
        host=args.host, port=args.port, served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get("AFDSERVE_API_KEY") or None,
        log_requests=not args.disable_log_requests, log_level=args.log_level,
        uvicorn_log_level=args.uvicorn_log_level,
        chat_template=read_chat_template(args.chat_template),
        generation_config=args.generation_config,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        **{name: getattr(args, name) for name in RELIABILITY_OPTIONS},
    )
    from afdserve.engine.generation_config import generation_defaults
    from afdserve.model.bundled import resolve_model

    # A bad file or directory: one line, now. The LLM reads the same source, so that its
    # get_default_sampling_params() agrees with the server's request defaults.
    generation_defaults(args.generation_config, resolve_model(kwargs["model"]))
    return run_server(lambda: LLM(**kwargs, generation_config=args.generation_config), options)


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from afdserve.model.tiny import make_tiny_model

    path = make_tiny_model(args.dir, args.family, hash_layers=args.hash_layers, seed=args.seed,
                           dtype=args.dtype)
    print(path)
    return 0


def cmd_make_config(args: argparse.Namespace) -> int:
    from afdserve.model.presets import write_preset_config

    print(write_preset_config(args.preset, args.dir))
    return 0


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
# ServeOptions field -> (flag, type, help); defaults come from ServeOptions.
RELIABILITY_OPTIONS = {
    "on_engine_failure": ("--on-engine-failure", str,
                          "when a rank dies or hangs: exit 1 (for a supervisor) or restart "
                          "the ranks in place"),
    "max_restarts": ("--max-restarts", int,
                     "--on-engine-failure restart: exit 1 on the failure after this many "
                     "restarts within --restart-window; restarts after the first wait 1, 2, "
                     "4, ... s"),
    "restart_window_s": ("--restart-window", float,
                         "seconds over which --max-restarts counts restarts"),
    "drain_timeout_s": ("--drain-timeout", float,
                        "SIGTERM: seconds in-flight requests may take to finish"),
    "max_waiting_requests": ("--max-waiting-requests", int,
                             "503 + Retry-After beyond this many requests without a first token"),
    "max_waiting_tokens": ("--max-waiting-tokens", int,
                           "503 + Retry-After beyond this many prompt tokens waiting"),
    "max_request_body_bytes": ("--max-request-body-bytes", int, "413 for a larger body"),
    "max_prompt_chars": ("--max-prompt-chars", int,
                         "400 for a longer prompt, before tokenizing (default: 32 x "
                         "max-model-len)"),
    "request_timeout_s": ("--request-timeout", float,
                          "504 for a request not finished this many seconds after arrival"),
    "limit_concurrency": ("--limit-concurrency", int,
                          "requests in progress beyond this get 503 + Retry-After; connections "
                          "beyond it are closed"),
    "timeout_keep_alive_s": ("--timeout-keep-alive", int,
                             "uvicorn: seconds an idle keep-alive connection stays open"),
    "max_header_bytes": ("--max-header-bytes", int, "h11: the largest request head accepted"),
    "header_timeout_s": ("--header-timeout", float,
                         "close a connection that sent no complete request head in time"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="afdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text offline")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--json", action="store_true", help="one JSON object per prompt")
    gen.set_defaults(func=cmd_generate)

    from afdserve.server.tool_parsers import PARSERS

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None,
                       help="the model name clients use (default: the model path)")
    serve.add_argument("--seed", dest="engine_seed", type=int, default=EngineConfig.seed,
                       help="seed of the engine's generator, for requests without a seed")
    serve.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' (default: $AFDSERVE_API_KEY); "
                            "/health and /metrics stay open")
    serve.add_argument("--chat-template", default=None, metavar="FILE|TEMPLATE",
                       help="a Jinja chat template (or a file holding one) instead of the "
                            "tokenizer's")
    serve.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                       help="defaults of omitted request fields: the model's "
                            "generation_config.json (auto), none (vllm), or DIR's")
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='honour tool_choice "auto" by reading the model\'s calls with '
                            "--tool-call-parser")
    serve.add_argument("--tool-call-parser", default=None, choices=PARSERS,
                       help="the model's tool-call format (hermes: Hermes, Qwen2.5, Qwen3)")
    serve.add_argument("--disable-log-requests", action="store_true",
                       help="do not log a line per request")
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                       help="afdserve's own log level")
    serve.add_argument("--uvicorn-log-level", default="warning", choices=LOG_LEVELS,
                       help="uvicorn's log level (its access log shows at info)")
    from afdserve.server.options import ON_ENGINE_FAILURE, ServeOptions

    for name, (flag, kind, text) in RELIABILITY_OPTIONS.items():
        default = ServeOptions.__dataclass_fields__[name].default
        choices = ON_ENGINE_FAILURE if name == "on_engine_failure" else None
        text = text if "default:" in text else f"{text} (default: {default})"
        serve.add_argument(flag, dest=name, type=kind, default=default, choices=choices,
                           help=text)
    serve.set_defaults(func=cmd_serve)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random HF checkpoint")
    tiny.add_argument("dir")
    tiny.add_argument("--family", required=True,
                      choices=("qwen3_moe", "deepseek_v2", "deepseek_v3", "mixtral"))
    tiny.add_argument("--hash-layers", type=int, default=0)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    tiny.set_defaults(func=cmd_make_tiny)

    from afdserve.model.presets import PRESETS

    make_config = sub.add_parser(
        "make-config", help="write a preset's config.json: a model dir for --load-format dummy")
    make_config.add_argument("--preset", required=True, choices=sorted(PRESETS))
    make_config.add_argument("dir")
    make_config.set_defaults(func=cmd_make_config)

    try:
        from afdserve.bench.cli import add_bench_parser
    except ImportError:
        pass
    else:
        add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"afdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
