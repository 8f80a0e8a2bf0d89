"""`ServeOptions`: the frontend's own settings (the engine's are the LLM's), validated on
construction so that a wrong value is one line before any port is bound or rank started."""

from __future__ import annotations

from dataclasses import dataclass

from afdserve.config_args import option
from afdserve.engine.log_format import LOG_FORMATS
from afdserve.server.reasoning import REASONING_PARSERS
from afdserve.server.tool_parsers import PARSERS

STATS_INTERVAL_S = 5.0
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
ON_ENGINE_FAILURE = ("exit", "restart")
# A prompt string longer than this many characters per context token cannot fit: checked
# before tokenizing, so that a 10 MB prompt costs no tokenizer time. Generous, since one token
# may stand for a long run of characters (whitespace, repeated punctuation).
PROMPT_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class ServeOptions:
    """Each field is a flag of `afdserve serve` (config_args.option declares it)."""

    host: str = option("127.0.0.1", help="the address to listen on")
    port: int = option(8000, help="the port to listen on")
    # Several names, as vLLM: the first is the one responses and metrics carry; requests may
    # name any of them.
    served_model_name: tuple[str, ...] | None = option(
        None,
        parse=str,
        nargs="+",
        metavar="NAME",
        help="the model names clients use (several: any is accepted, the first is reported)",
        shown="the model as given, a path or hub id",
    )
    api_key: str | None = option(
        None,
        help="require 'Authorization: Bearer KEY'; /health and /metrics stay open",
        shown="$AFDSERVE_API_KEY",
    )  # the CLI reads the variable
    # Off by default, as vLLM's (since 0.10): a line per request is a lot of log under load.
    log_requests: bool = option(
        False,
        flag="--enable-log-requests",
        off_flag="--disable-log-requests",
        help="log a line per request (its sizes and parameters) and one when it finishes",
    )
    log_stats: bool = option(
        True,
        flag="--disable-log-stats",
        negate=True,
        help="do not log the engine statistics line every --stats-interval seconds",
    )
    log_level: str = option("info", choices=LOG_LEVELS, help="afdserve's own log level")
    # engine/log_format.py: the ranks' lines too, and uvicorn's.
    log_format: str = option(
        "text",
        choices=LOG_FORMATS,
        help="text, or json: one object per line with time, level, logger and message",
    )
    uvicorn_log_level: str = option(
        "warning", choices=LOG_LEVELS, help="uvicorn's log level (its access log shows at info)"
    )
    stats_interval_s: float = option(
        STATS_INTERVAL_S, help="seconds between the engine statistics lines in the log"
    )
    # The CLI reads --chat-template FILE; the field holds the template itself.
    chat_template: str | None = option(
        None,
        metavar="FILE|TEMPLATE",
        help="a Jinja chat template (or a file holding one) instead of the tokenizer's",
    )
    generation_config: str = option(
        "auto",
        metavar="auto|vllm|DIR",  # read by frontend/generation_config.py
        help="defaults of omitted request fields: the model's generation_config.json (auto), "
        "none (vllm), or DIR's",
    )
    # tool_choice "auto" (vLLM's two flags): the model's calls read by this parser.
    enable_auto_tool_choice: bool = option(
        False,
        help='honour tool_choice "auto" by reading the model\'s calls with --tool-call-parser',
    )
    tool_call_parser: str | None = option(
        None,
        choices=PARSERS,
        help="the model's tool-call format (hermes: Hermes, Qwen2.5, "
        "Qwen3; qwen3_coder; deepseek_v3; kimi_k2)",
    )
    # The thinking between <think> and </think> as the message's reasoning_content.
    reasoning_parser: str | None = option(
        None, choices=REASONING_PARSERS, help="the model's reasoning format (deepseek_r1, qwen3)"
    )
    # "exit" like vLLM: a supervisor (systemd, Kubernetes) restarts the process.
    on_engine_failure: str = option(
        "exit",
        choices=ON_ENGINE_FAILURE,
        help="when a rank dies or hangs: exit 1 (for a supervisor) or restart the ranks in place",
    )
    # server/restarts.py counts them.
    max_restarts: int = option(
        3,
        help="--on-engine-failure restart: exit 1 on the failure after this many restarts "
        "within --restart-window; restarts after the first wait 1, 2, 4, ... s",
    )
    restart_window_s: float = option(
        600.0, help="seconds over which --max-restarts counts restarts"
    )
    # engine_loop.Recovery: requests wait out a restart and go on from the tokens they had.
    max_request_resumes: int = option(
        3,
        help="--on-engine-failure restart: a request goes on after the restart from the "
        "tokens it had; one whose engine failed under it more often than this fails",
    )
    drain_timeout_s: float = option(
        30.0, help="SIGTERM: seconds in-flight requests may take to finish"
    )
    max_waiting_requests: int | None = option(
        None, help="503 + Retry-After beyond this many requests without a first token"
    )
    max_waiting_tokens: int | None = option(
        None, help="503 + Retry-After beyond this many prompt tokens waiting"
    )
    retry_after_s: int = option(1, help="the Retry-After of a 503 for overload, in seconds")
    max_request_body_bytes: int = option(8 * 1024 * 1024, help="413 for a larger body")
    max_prompt_chars: int | None = option(
        None,
        help="400 for a longer prompt, before tokenizing",
        shown=f"{PROMPT_CHARS_PER_TOKEN} x max-model-len",
    )
    request_timeout_s: float | None = option(
        None,
        help="504 for a request not finished this many seconds after arrival",
        shown="None, no limit",
    )
    limit_concurrency: int | None = option(
        1024,
        help="requests in progress beyond this get 503 + Retry-After; connections beyond "
        "it and --max-reading-connections are closed, slow ones first",
    )
    timeout_keep_alive_s: int = option(
        5, help="uvicorn: seconds an idle keep-alive connection stays open"
    )
    max_header_bytes: int = option(64 * 1024, help="h11: the largest request head accepted")
    header_timeout_s: float = option(
        10.0, help="close a connection that sent no complete request head in time"
    )
    # server/limits.py (BodyLimit) and server/connections.py.
    body_timeout_s: float = option(
        30.0,
        help="408 (and the connection closes) for a request body not all received this "
        "many seconds after its head",
    )
    max_connections_per_client: int | None = option(
        512,
        help="connections from one client address beyond this are closed at once, so that "
        "one client cannot take every slot of --limit-concurrency",
    )
    # server/slots.py: slow clients take reading slots from each other, not from the others.
    max_reading_connections: int | None = option(
        None,
        help="connections still sending their request (or idle between two) beyond this: the "
        "oldest of the client address holding the most is closed. Slots of their own, on top "
        "of --limit-concurrency's",
        shown="a quarter of --limit-concurrency",
    )

    def __post_init__(self) -> None:
        names = self.served_model_name
        if isinstance(names, str):
            names = (names,)
        if names is not None:
            names = tuple(names)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(
                    f"ServeOptions.served_model_name={self.served_model_name!r} is "
                    "not allowed: one or more non-empty names, or None"
                )
            object.__setattr__(self, "served_model_name", names)
        if self.log_format not in LOG_FORMATS:
            raise ValueError(
                f"ServeOptions.log_format={self.log_format!r} is not allowed: one of {LOG_FORMATS}"
            )
        for name in ("log_level", "uvicorn_log_level"):
            value = getattr(self, name)
            if value not in LOG_LEVELS:
                raise ValueError(
                    f"ServeOptions.{name}={value!r} is not allowed: one of {LOG_LEVELS}"
                )
        if not (isinstance(self.port, int) and 0 <= self.port <= 65535):
            raise ValueError(
                f"ServeOptions.port={self.port!r} is not allowed: an integer in 0..65535"
            )
        if self.api_key is not None and not self.api_key:
            raise ValueError("ServeOptions.api_key='' is not allowed: a non-empty key, or none")
        if self.on_engine_failure not in ON_ENGINE_FAILURE:
            raise ValueError(
                f"ServeOptions.on_engine_failure={self.on_engine_failure!r} is not allowed: "
                f"one of {ON_ENGINE_FAILURE}"
            )
        if self.tool_call_parser not in (None, *PARSERS):
            raise ValueError(
                f"ServeOptions.tool_call_parser={self.tool_call_parser!r} is not "
                f"allowed: one of {PARSERS}"
            )
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(
                f"ServeOptions.reasoning_parser={self.reasoning_parser!r} is not "
                f"allowed: one of {REASONING_PARSERS}"
            )
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "ServeOptions.enable_auto_tool_choice=True is not allowed without "
                f"a tool_call_parser (one of {PARSERS})"
            )
        _positive(self, "stats_interval_s", "a number of seconds > 0")
        _positive(self, "drain_timeout_s", "a number of seconds >= 0", zero=True)
        _positive(self, "max_restarts", "an integer >= 0", zero=True, integer=True)
        _positive(self, "restart_window_s", "a number of seconds > 0")
        _positive(self, "max_request_resumes", "an integer >= 0", zero=True, integer=True)
        _positive(self, "header_timeout_s", "a number of seconds > 0")
        _positive(self, "body_timeout_s", "a number of seconds > 0")
        _positive(self, "request_timeout_s", "a number of seconds > 0, or none", optional=True)
        for name in (
            "max_waiting_requests",
            "max_waiting_tokens",
            "max_prompt_chars",
            "limit_concurrency",
            "max_connections_per_client",
            "max_reading_connections",
        ):
            _positive(self, name, "an integer > 0, or none", optional=True, integer=True)
        for name in (
            "retry_after_s",
            "max_request_body_bytes",
            "timeout_keep_alive_s",
            "max_header_bytes",
        ):
            _positive(self, name, "an integer > 0", integer=True)

    @property
    def reading_connections(self) -> int | None:
        """The reading connections' share (slots.py); None: no share."""
        if self.max_reading_connections is not None:
            return self.max_reading_connections
        if self.limit_concurrency is None:
            return None
        return max(1, self.limit_concurrency // 4)

    @property
    def max_connections(self) -> int | None:
        """The cap on all connections: the requests in progress and the reading share."""
        if self.limit_concurrency is None:
            return None
        return self.limit_concurrency + (self.reading_connections or 0)


def _positive(
    options: ServeOptions,
    name: str,
    allowed: str,
    optional: bool = False,
    integer: bool = False,
    zero: bool = False,
) -> None:
    value = getattr(options, name)
    if value is None and optional:
        return
    kinds = (int,) if integer else (int, float)
    ok = isinstance(value, kinds) and not isinstance(value, bool)
    if not ok or not (value >= 0 if zero else value > 0):
        raise ValueError(f"ServeOptions.{name}={value!r} is not allowed: {allowed}")
