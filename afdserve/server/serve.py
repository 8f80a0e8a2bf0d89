"""`afdserve serve`: bind the port, start uvicorn, build the LLM, warm it up, attach it, and stop
everything on SIGINT or SIGTERM."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import afdserve
from afdserve.engine.sampling_params import SamplingParams
from afdserve.server.app import ServerState, create_app

if TYPE_CHECKING:
    from afdserve.llm import LLM

log = logging.getLogger("afdserve.server")

WARMUP_TIMEOUT_S = 600.0
GRACEFUL_SHUTDOWN_S = 3
STATS_INTERVAL_S = 5.0
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def progress(message: str) -> None:
    print(f"afdserve: {message}", file=sys.stderr, flush=True)


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind the port before anything else starts, so that a busy port fails fast and cleanly."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise SystemExit(f"afdserve: cannot resolve host {host!r}: {e}") from None
    sock = socket.socket(family, kind, proto)
    # Like uvicorn: a port left in TIME_WAIT by a previous server may be reused; one that a live
    # process listens on may not.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise SystemExit(f"afdserve: port {port} on {host} is already in use") from None
        raise SystemExit(f"afdserve: cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock


def warm_up(llm: LLM) -> None:
    """One short greedy request through every rank before reporting ready."""
    prompt = llm.encode("Hello") or [0]
    llm.engine.add_request("warm-up", prompt, SamplingParams(max_tokens=2, temperature=0.0))
    deadline = time.monotonic() + WARMUP_TIMEOUT_S
    while not any(out.finished for out in llm.engine.step()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"warm-up request did not finish within {WARMUP_TIMEOUT_S:.0f} s")


def _interrupt(signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def setup_logging(level: str = "info") -> None:
    """afdserve's own loggers print at `level` (the frontend's log.info included), in one format,
    whatever uvicorn's level is."""
    logger = logging.getLogger("afdserve")
    if not any(getattr(h, "afdserve", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
        handler.afdserve = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel("DEBUG" if level == "trace" else level.upper())
    logger.propagate = False


def startup_summary(llm: LLM, model_name: str) -> str:
    """One line with what a reader of the log needs to know about this server's capacity."""
    engine, config = llm.engine, llm.engine_config
    limits = getattr(engine, "limits", None) or engine.core.limits  # type: ignore[attr-defined]
    ranks = llm.topology.attention_ranks
    kv_tokens = limits.num_blocks * limits.block_size * ranks
    full = kv_tokens / limits.max_model_len
    concurrency = min(full, config.max_num_seqs * ranks)
    dtype = config.dtype
    core = getattr(engine, "core", None)  # one-process engines: say what "auto" resolved to
    if dtype == "auto" and core is not None:
        dtype = f"auto ({str(next(core.model.parameters()).dtype).removeprefix('torch.')})"
    return (
        f"afdserve {afdserve.__version__}: model {model_name!r} ({config.model}), "
        f"topology {llm.afd_config.topology}, device {config.device}, dtype {dtype}, "
        f"max_model_len {limits.max_model_len}, KV cache {kv_tokens} tokens "
        f"({ranks} attention rank(s) x {limits.num_blocks} blocks x {limits.block_size}), "
        f"max concurrency {concurrency:.1f} requests of {limits.max_model_len} tokens "
        f"(max_num_seqs {config.max_num_seqs} per rank)"
    )


class StatsLogger:
    """A line every `interval_s` while the server has work: running, waiting, KV use, token
    rates. Reads the metrics registry, so it shows exactly what /metrics shows."""

    def __init__(self, state: ServerState, interval_s: float = STATS_INTERVAL_S) -> None:
        self.state, self.interval_s = state, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="afdserve-stats", daemon=True)
        self._last = (time.monotonic(), 0.0, 0.0)

    def start(self) -> StatsLogger:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def line(self) -> str | None:
        """The stats line, or None when nothing ran since the last one and nothing runs now."""
        stats = self.state.engine.stats() if self.state.engine else None
        registry = self.state.metrics.registry
        labels = {"model_name": self.state.model_name}
        prompt = registry.get_sample_value("vllm:prompt_tokens_total", labels) or 0.0
        generated = registry.get_sample_value("vllm:generation_tokens_total", labels) or 0.0
        now = time.monotonic()
        then, prompt_before, generated_before = self._last
        self._last = (now, prompt, generated)
        busy = stats is not None and (stats.running or stats.waiting)
        if not busy and prompt == prompt_before and generated == generated_before:
            return None
        elapsed = max(now - then, 1e-9)
        running, waiting, kv = (
            (stats.running, stats.waiting, stats.kv_cache_usage) if stats else (0, 0, 0.0)
        )
        return (
            f"running {running}, waiting {waiting}, KV cache {kv:.1%}, "
            f"prompt {(prompt - prompt_before) / elapsed:.1f} tokens/s, "
            f"generation {(generated - generated_before) / elapsed:.1f} tokens/s"
        )

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            line = self.line()
            if line is not None:
                log.info(line)


@dataclass(frozen=True)
class ServeOptions:
    """The frontend's own settings (the engine's are the LLM's)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    log_requests: bool = True
    log_level: str = "info"  # afdserve's loggers
    uvicorn_log_level: str = "warning"
    stats_interval_s: float = STATS_INTERVAL_S
    chat_template: str | None = None  # a Jinja template (the CLI reads --chat-template FILE)
    generation_config: str = "auto"  # "auto", "vllm" or a directory (convert.generation_defaults)

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
        if not self.stats_interval_s > 0:
            raise ValueError(
                f"ServeOptions.stats_interval_s={self.stats_interval_s!r}: must be > 0"
            )


def run_server(llm_factory: Callable[[], LLM], options: ServeOptions) -> None:
    """Serve until SIGINT or SIGTERM, then stop uvicorn and every rank process. A port that is
    taken (or cannot be bound) raises SystemExit with a message before the LLM is built.

    uvicorn runs in a thread from the start (so /health answers 503 while loading) and the main
    thread builds the LLM: a signal raises KeyboardInterrupt there, which also interrupts a
    start-up in progress; the LLM's own clean-up then stops the ranks already started.
    """
    import uvicorn

    setup_logging(options.log_level)
    host, port = options.host, options.port
    sock = listen_socket(host, port)
    app = create_app(
        options.served_model_name,
        options.api_key,
        options.log_requests,
        options.chat_template,
        options.generation_config,
    )
    state: ServerState = app.state.server
    config = uvicorn.Config(
        app,
        log_level=options.uvicorn_log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        lifespan="on",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn")
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    llm = None
    stats: StatsLogger | None = None
    try:
        thread.start()
        progress(f"listening on http://{host}:{port}; loading the model")
        llm = llm_factory()
        progress("warming up")
        warm_up(llm)
        state.attach(llm)
        log.info(startup_summary(llm, state.model_name))
        stats = StatsLogger(state, options.stats_interval_s).start()
        progress(f"ready: serving {state.model_name!r} on http://{host}:{port}")
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        progress("shutting down")
    finally:
        # A second signal must not cut the clean-up short: that would leave ranks behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if stats is not None:
            stats.stop()
        state.stop()  # fails in-flight requests, so open connections close promptly
        server.should_exit = True
        if thread.is_alive():
            thread.join(GRACEFUL_SHUTDOWN_S + 5)
        if llm is not None:
            llm.shutdown()
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        progress("stopped")
