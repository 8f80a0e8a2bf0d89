"""`ServerState`: what the HTTP handlers share, and the states a server goes through.

loading (503) -> serving -> draining (SIGTERM: new requests 503, in-flight ones finish) -> stopped;
serving -> failed (a rank died or hung) -> exit, or restarting -> serving. Every 503 carries
Retry-After. While restarting (on_engine_failure="restart") /health is 503 but requests are
taken: the engine thread holds them, and those in flight, until the restarted engine resumes them.
"""

from __future__ import annotations

from afdserve.server.engine_loop import EngineLoop, Generation, Recovery
from afdserve.server.engine_view import EngineView
from afdserve.server.limits import Admission
from afdserve.server.metrics import ServerMetrics
from afdserve.server.options import PROMPT_CHARS_PER_TOKEN, ServeOptions
from afdserve.server.protocol import APIError, overloaded


class ServerState:
    """The engine part (an EngineView and the thread that drives its client) is attached once
    the engine is built, and detached for a restart."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.chat_template = options.chat_template
        self.log_requests = options.log_requests
        # Known before the engine is (the metrics' label): the served name, once one is attached.
        self.model_name = options.served_model_name or ""
        self.view: EngineView | None = None
        self.engine: EngineLoop | None = None
        self.draining = False
        self.restarting: str | None = None  # why the engine is being restarted
        self.live: set[Generation] = set()  # HTTP requests with engine work, for the drain
        self.admission = Admission(
            options.max_waiting_requests, options.max_waiting_tokens, options.retry_after_s
        )
        self.metrics = ServerMetrics(
            lambda: self.engine.stats() if self.engine else None,
            lambda: self.model_name,
            lambda: (self.admission.requests, self.admission.tokens),
        )

    def attach(self, view: EngineView) -> None:
        """Serve `view`'s engine; after a restart the engine thread that held the requests
        resumes them on it."""
        if self.engine is not None and self.engine.holds_requests:
            self.engine.resume_on(view.client)
        else:
            self.engine = EngineLoop(view.client, recovery=self.recovery()).start()
        self.view, self.model_name = view, view.served_name
        self.restarting = None

    def recovery(self) -> Recovery:
        return Recovery(
            resume=self.options.on_engine_failure == "restart",
            max_resumes=self.options.max_request_resumes,
            on_resume=self.metrics.resumes.inc,
            on_recovered=self.metrics.recovered,
        )

    def detach(self, why: str) -> None:
        """Before a restart: /health is 503 until the next attach. An engine thread that holds
        requests keeps them (and the view, for their tokenizer); otherwise requests get 503."""
        self.restarting = why
        if self.engine is not None and self.engine.holds_requests:
            return
        self.stop()
        self.engine, self.view = None, None

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    @property
    def failed(self) -> bool:
        return self.engine is not None and self.engine.error is not None

    def max_prompt_chars(self, view: EngineView) -> int:
        limit = self.options.max_prompt_chars
        return limit if limit is not None else PROMPT_CHARS_PER_TOKEN * view.max_model_len

    def ready(self) -> tuple[EngineLoop, EngineView]:
        """The engine thread and the view of the engine it drives, taken together (a restart
        replaces both), or the 503 that says why there are none. While the engine restarts, a
        thread that holds requests is ready: they wait for the restarted engine."""
        if self.draining:
            raise overloaded("the server is shutting down", self.options.retry_after_s, "draining")
        engine, view = self.engine, self.view
        if engine is not None and view is not None and engine.holds_requests:
            return engine, view
        self.check_serving()
        assert engine is not None and view is not None  # check_serving said so
        return engine, view

    def check_serving(self) -> None:
        """/health: 503 (with Retry-After) unless the engine is up and serving."""
        if self.draining:
            raise overloaded("the server is shutting down", self.options.retry_after_s, "draining")
        if self.restarting is not None:
            raise self.unavailable(f"the engine is restarting ({self.restarting})")
        if self.engine is None or self.view is None:
            raise self.unavailable("the model is still loading")
        if not self.engine.healthy:
            raise self.unavailable(self.engine.error or "the server is shutting down")

    def unavailable(self, message: str) -> APIError:
        headers = {"Retry-After": str(self.options.retry_after_s)}
        return APIError(503, message, headers=headers, rejected="unavailable")

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may give: the served name, then --served-model-name's others."""
        aliases = self.view.aliases if self.view is not None else ()
        return (self.model_name, *aliases)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            message = f"model: {model!r} does not exist; this server serves {self.model_name!r}"
            raise APIError(404, message, "model", "model_not_found")

    def model_card(self, view: EngineView, name: str | None = None) -> dict:
        return {
            "id": name or view.served_name,
            "object": "model",
            "created": 0,
            "owned_by": "afdserve",
            "root": view.root,
            "max_model_len": view.max_model_len,
        }
