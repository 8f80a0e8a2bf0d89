"""`ServeOptions`: the frontend's own settings (the engine's are the LLM's), validated on
construction so that a wrong value is one line before any port is bound or rank started."""

from __future__ import annotations

from dataclasses import dataclass

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
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    log_requests: bool = True
    log_level: str = "info"  # afdserve's loggers
    uvicorn_log_level: str = "warning"
    stats_interval_s: float = STATS_INTERVAL_S
    chat_template: str | None = None  # a Jinja template (the CLI reads --chat-template FILE)
    generation_config: str = "auto"  # "auto", "vllm" or a directory (engine/generation_config.py)
    # tool_choice "auto" (vLLM's two flags): the model's calls read by this parser.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # Reliability. "exit" like vLLM: a supervisor (systemd, Kubernetes) restarts the process.
    on_engine_failure: str = "exit"
    # "restart": at most this many restarts within any restart_window_s (server/restarts.py).
    max_restarts: int = 3
    restart_window_s: float = 600.0
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may take to finish
    max_waiting_requests: int | None = None  # engine requests without a first token yet
    max_waiting_tokens: int | None = None  # their prompt tokens
    retry_after_s: int = 1  # the Retry-After of a 503 for overload
    max_request_body_bytes: int = 8 * 1024 * 1024
    max_prompt_chars: int | None = None  # None: PROMPT_CHARS_PER_TOKEN x max_model_len
    request_timeout_s: float | None = None  # from arrival to the last token; None: no limit
    limit_concurrency: int | None = 1024  # requests in progress (503 beyond), open connections
    timeout_keep_alive_s: int = 5  # uvicorn: idle keep-alive connections close after this
    max_header_bytes: int = 64 * 1024  # h11: a request head larger than this is refused
    header_timeout_s: float = 10.0  # a connection without a complete request head is closed

    def __post_init__(self) -> None:
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
            raise ValueError(f"ServeOptions.tool_call_parser={self.tool_call_parser!r} is not "
                             f"allowed: one of {PARSERS}")  # fmt: skip
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("ServeOptions.enable_auto_tool_choice=True is not allowed without "
                             f"a tool_call_parser (one of {PARSERS})")  # fmt: skip
        _positive(self, "stats_interval_s", "a number of seconds > 0")
        _positive(self, "drain_timeout_s", "a number of seconds >= 0", zero=True)
        _positive(self, "max_restarts", "an integer >= 0", zero=True, integer=True)
        _positive(self, "restart_window_s", "a number of seconds > 0")
        _positive(self, "header_timeout_s", "a number of seconds > 0")
        _positive(self, "request_timeout_s", "a number of seconds > 0, or none", optional=True)
        for name in ("max_waiting_requests", "max_waiting_tokens", "max_prompt_chars",
                     "limit_concurrency"):  # fmt: skip
            _positive(self, name, "an integer > 0, or none", optional=True, integer=True)
        for name in ("retry_after_s", "max_request_body_bytes", "timeout_keep_alive_s",
                     "max_header_bytes"):  # fmt: skip
            _positive(self, name, "an integer > 0", integer=True)


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
