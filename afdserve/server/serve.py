"""`afdserve serve`: bind the port, start uvicorn, build the LLM, warm it up, attach it; then watch
for a failed engine (exit non-zero, or restart the ranks: `on_engine_failure`) and for SIGINT or
SIGTERM (drain: new requests 503, in-flight ones finish within `drain_timeout_s`; a second signal
forces), and stop every rank process at the end."""

from __future__ import annotations

import errno
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from afdserve.afd.ranks.frontend_files import remove_own as remove_own_files
from afdserve.afd.ranks.world import STANDBY
from afdserve.frontend.generation_config import generation_defaults
from afdserve.server.app import create_app
from afdserve.server.connections import guarded_h11
from afdserve.server.engine_view import EngineView
from afdserve.server.logs import progress_line, rate_limit_servers, setup_logging
from afdserve.server.options import ServeOptions
from afdserve.server.restarts import RestartBudget
from afdserve.server.state import ServerState
from afdserve.server.stats_log import StatsLogger
from afdserve.server.warmup import startup_summary, warm_up

__all__ = ["ServeOptions", "build_app", "engine_view", "run_server"]

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from afdserve.llm import LLM

log = logging.getLogger("afdserve.server")

GRACEFUL_SHUTDOWN_S = 3
WATCH_INTERVAL_S = 0.2  # how often the main thread looks at the engine and the drain


def progress(message: str) -> None:
    """A start-up or shutdown line, whatever the log level (in the log's format). One write of
    the line and its newline (print makes two), so a log record another thread writes at the
    same moment cannot land between them and join two JSON records on one line."""
    sys.stderr.write(progress_line(message) + "\n")
    sys.stderr.flush()


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


class Signals:
    """SIGINT / SIGTERM. While serving, the first one starts the drain; during start-up or a
    restart, and the second time, it interrupts the main thread (KeyboardInterrupt)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.received = 0
        self.drain_deadline = 0.0

    def __call__(self, signum: int, _frame: Any) -> None:
        self.received += 1
        name = signal.Signals(signum).name
        if self.received > 1 or self.state.engine is None or self.state.failed:
            raise KeyboardInterrupt(name)
        self.state.draining = True
        self.drain_deadline = time.monotonic() + self.state.options.drain_timeout_s
        progress(
            f"{name}: draining {len(self.state.live)} request(s) for up to "
            f"{self.state.options.drain_timeout_s:g} s (a second signal stops at once)"
        )


def raise_open_files_limit() -> None:
    """Each connection is a file: take the hard limit, as vLLM does, so that a burst of clients
    meets limit_concurrency's 503 before it meets "Too many open files"."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass


def kill_leftover_ranks() -> None:
    """The last line of defence against a leaked rank: a signal lands between any two bytecodes,
    so one that interrupts a (re)start may leave a world that no object owns yet. SIGKILL every
    child of this process that runs a rank (Linux's /proc; elsewhere nothing to do)."""
    for task in Path("/proc/self/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in children:
            try:
                if b"afdserve.afd.ranks.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    log.warning("killing rank process %s left by an interrupted start", pid)
                    os.kill(int(pid), signal.SIGKILL)
            except OSError:
                continue


def engine_view(llm: LLM, options: ServeOptions) -> EngineView:
    """What the server needs from `llm`: the one place where the HTTP side reads the LLM. The
    request defaults come from the server's --generation-config, read from the model directory
    (which may differ from the LLM's own generation_config)."""
    model_dir = llm.engine_config.model
    defaults = generation_defaults(options.generation_config, model_dir)
    if defaults:
        log.info("defaults of requests that leave them out (generation config): %s", defaults)
    names = options.served_model_name or (llm.model_name,)
    return EngineView(
        client=llm.engine,
        tokenizer=llm.tokenizer,
        served_name=names[0],
        aliases=names[1:],
        root=llm.model_name,
        model_dir=llm.engine_config.tokenizer or model_dir,  # --tokenizer's, when given
        max_model_len=llm.engine.max_model_len,
        vocab_size=llm.engine.vocab_size,
        defaults=defaults,
    )


def build_app(llm: LLM, options: ServeOptions | None = None) -> FastAPI:
    """An app serving an already built LLM. The caller keeps the LLM and shuts it down."""
    app = create_app(options)
    state: ServerState = app.state.server
    state.attach(engine_view(llm, state.options))
    return app


class Engine:
    """The LLM this server runs, built by the factory at start-up and again at each restart."""

    def __init__(self, llm_factory: Callable[[], LLM], state: ServerState) -> None:
        self.llm_factory, self.state = llm_factory, state
        self.llm: LLM | None = None

    def start(self) -> LLM:
        """Build, warm up and attach a new LLM; one that fails on the way is shut down here."""
        llm = self.llm_factory()
        try:
            progress("warming up")
            warm_up(llm)
            self.state.attach(engine_view(llm, self.state.options))
        except BaseException:
            llm.shutdown()
            raise
        self.llm = llm
        return llm

    def repair(self) -> bool:
        """Rebuild the failed engine around the ranks that survived (only the failed ranks are
        replaced and reload their weights) and resume the held requests on it; False where its
        client cannot (then the caller starts a new LLM)."""
        if self.llm is None or not self.llm.engine.core_client.repair():
            return False
        self.state.attach(engine_view(self.llm, self.state.options))
        return True

    def stop(self) -> None:
        if self.llm is not None:
            self.llm.shutdown()
            self.llm = None


def back_off(delay_s: float, state: ServerState, thread: threading.Thread) -> bool:
    """Wait `delay_s` before a restart; False as soon as the server drains or HTTP stops."""
    deadline = time.monotonic() + delay_s
    while time.monotonic() < deadline:
        if state.draining or not thread.is_alive():
            return False
        time.sleep(max(0.0, min(WATCH_INTERVAL_S, deadline - time.monotonic())))
    return not state.draining


def http_server(app: FastAPI, options: ServeOptions) -> uvicorn.Server:
    import uvicorn

    config = uvicorn.Config(
        app,
        log_level=options.uvicorn_log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        lifespan="on",
        timeout_keep_alive=options.timeout_keep_alive_s,
        h11_max_incomplete_event_size=options.max_header_bytes,
        http=guarded_h11(options, app.state.server.metrics.connection_shed),
    )
    rate_limit_servers(options.log_format)
    return uvicorn.Server(config)


def watch(engine: Engine, signals: Signals, thread: threading.Thread) -> int:
    """Watch the engine and the drain while HTTP runs; returns the exit code (0, or 1 after an
    engine failure that is not, or can no longer be, restarted)."""
    state, options = engine.state, engine.state.options
    budget = RestartBudget(options.max_restarts, options.restart_window_s)
    while thread.is_alive():
        thread.join(WATCH_INTERVAL_S)
        error = state.engine.error if state.engine is not None else None
        if error is not None and options.on_engine_failure == "exit":
            progress(f"{error}; exiting (on_engine_failure=exit)")
            return 1  # also while draining: the supervisor should know
        if state.draining:
            if not state.live:
                progress("drained: every request finished")
                return 0
            if time.monotonic() > signals.drain_deadline:
                progress(f"drain timeout: stopping {len(state.live)} unfinished request(s)")
                return 0
        elif error is not None and not restart(engine, error, budget, thread):
            return 1
    return 0


def restart(engine: Engine, error: str, budget: RestartBudget, thread: threading.Thread) -> bool:
    """Replace the failed LLM after the budget's back-off; a restart that fails is itself a
    failure, retried while the budget has room. False when the server must exit instead (no
    restart left). The requests the engine thread holds resume on the new LLM."""
    state = engine.state
    delay = budget.next_delay(time.monotonic())
    if delay is None:
        progress(f"{error}; no restart left ({budget.describe()}); exiting")
        return False
    state.detach(str(error))
    if engine.llm is not None and engine.llm.engine.core_client.repairable:
        progress(
            f"{error}; replacing the failed rank(s) in {delay:g} s (on_engine_failure="
            f"restart: the others keep their weights)"
        )
        if not back_off(delay, state, thread):
            return True
        began = time.monotonic()
        if engine.repair():
            progress(
                f"rebuilt the world in {time.monotonic() - began:.1f} s: serving "
                f"{state.model_name!r} again"
            )
            return True
        error, delay = "the world could not be rebuilt around its surviving ranks", 0.0
    engine.stop()
    while True:
        progress(f"{error}; restarting the ranks in {delay:g} s (on_engine_failure=restart)")
        if not back_off(delay, state, thread):
            return True  # SIGTERM while waiting, or HTTP is gone: the watch ends it
        began = time.monotonic()
        try:
            engine.start()
        except Exception as e:
            log.exception("the restart failed")
            first_line = (str(e).splitlines() or [""])[0][:200]
            error = f"the restart failed: {type(e).__name__}: {first_line}"
            delay = budget.next_delay(time.monotonic())
            if delay is None:
                progress(f"{error}; no restart left ({budget.describe()}); exiting")
                return False
            continue
        took = time.monotonic() - began
        progress(f"restarted in {took:.1f} s: serving {state.model_name!r} again")
        return True


def run_server(llm_factory: Callable[[], LLM], options: ServeOptions) -> int:
    """Serve until SIGINT or SIGTERM (then drain), or until the engine fails with
    on_engine_failure="exit"; stop uvicorn and every rank process. Returns the exit code: 0, or 1
    after an engine failure. A port that is taken (or cannot be bound) raises SystemExit with a
    message before the LLM is built.

    uvicorn runs in a thread from the start (so /health answers 503 while loading) and the main
    thread builds the LLM and then watches it: a signal during start-up raises KeyboardInterrupt
    there, which interrupts the start-up; the LLM's own clean-up stops the ranks already started.
    """
    setup_logging(options.log_level, options.log_format)
    raise_open_files_limit()
    host, port = options.host, options.port
    sock = listen_socket(host, port)
    app = create_app(options=options)
    state: ServerState = app.state.server
    server = http_server(app, options)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn")
    signals = Signals(state)
    previous = {sig: signal.signal(sig, signals) for sig in (signal.SIGINT, signal.SIGTERM)}
    engine = Engine(llm_factory, state)
    stats: StatsLogger | None = None
    code = 0
    # A world restarted in place starts on rank processes started ahead (world.Standby).
    STANDBY.enabled = options.on_engine_failure == "restart"
    try:
        thread.start()
        progress(f"listening on http://{host}:{port}; loading the model")
        llm = engine.start()
        log.info(startup_summary(llm, state.model_name))
        if options.log_stats:
            stats = StatsLogger(state, options.stats_interval_s).start()
        progress(f"ready: serving {state.model_name!r} on http://{host}:{port}")
        code = watch(engine, signals, thread)
    except KeyboardInterrupt:
        progress("shutting down")
        if state.failed and options.on_engine_failure == "exit":
            code = 1  # a signal that came before the failure was acted on changes nothing
    finally:
        # A further signal must not cut the clean-up short: that would leave ranks behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if stats is not None:
            stats.stop()
        state.stop()  # fails in-flight requests, so open connections close promptly
        server.should_exit = True
        if thread.is_alive():
            thread.join(GRACEFUL_SHUTDOWN_S + 5)
        engine.stop()
        STANDBY.close()
        kill_leftover_ranks()
        # And for files: a store directory or key file whose world an interrupt left unowned.
        for path in remove_own_files():
            log.warning("removed %s, left by an interrupted start", path)
        sock.close()
        # A caller's own handlers come back; the default ones do not, as the process exits
        # next with `code`, and a SIGTERM landing in between would turn that into -15.
        for sig, handler in previous.items():
            if handler not in (signal.SIG_DFL, signal.default_int_handler):
                signal.signal(sig, handler)
        progress("stopped")
    return code
