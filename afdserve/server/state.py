"""`ServerState`: what the HTTP handlers share, and the states a server goes through.

loading (503) -> serving -> draining (SIGTERM: new requests 503, in-flight ones finish) -> stopped;
serving -> failed (a rank died or hung: 503, then exit or a restart back to loading).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from afdserve.engine.generation_config import generation_defaults
from afdserve.server import responses as shape
from afdserve.server.engine_loop import EngineLoop, Generation
from afdserve.server.limits import Admission
from afdserve.server.metrics import ServerMetrics
from afdserve.server.options import PROMPT_CHARS_PER_TOKEN, ServeOptions
from afdserve.server.protocol import APIError, overloaded

if TYPE_CHECKING:
    from afdserve.llm import LLM

log = logging.getLogger("afdserve.server")


class ServerState:
    """The engine part is attached once the LLM is built, and detached for a restart."""

    def __init__(self, options: ServeOptions) -> None:
        self.options = options
        self.served_model_name = options.served_model_name
        self.chat_template = options.chat_template
        self.generation_config = options.generation_config
        self.log_requests = options.log_requests
        self.defaults: dict[str, Any] = {}
        self.model_name = options.served_model_name or ""
        self.llm: LLM | None = None
        self.engine: EngineLoop | None = None
        self.names: shape.TokenText | None = None
        self.max_model_len = 0
        self.vocab_size = 0
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

    def attach(self, llm: LLM) -> None:
        self.llm, self.names = llm, shape.TokenText(llm.tokenizer)
        self.model_name = self.served_model_name or llm.model_name
        self.max_model_len = llm.engine.max_model_len
        self.vocab_size = llm.engine.vocab_size
        self.defaults = generation_defaults(self.generation_config, llm.engine_config.model)
        if self.defaults:
            log.info(
                "defaults of requests that leave them out (generation config): %s", self.defaults
            )
        self.engine = EngineLoop(llm.engine).start()
        self.restarting = None

    def detach(self, why: str) -> None:
        """Before a restart: requests get 503 until the next attach."""
        self.restarting = why
        self.stop()
        self.engine, self.llm = None, None

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    @property
    def failed(self) -> bool:
        return self.engine is not None and self.engine.error is not None

    @property
    def max_prompt_chars(self) -> int:
        limit = self.options.max_prompt_chars
        return limit if limit is not None else PROMPT_CHARS_PER_TOKEN * self.max_model_len

    def ready(self) -> tuple[EngineLoop, LLM, shape.TokenText]:
        if self.draining:
            raise overloaded("the server is shutting down", self.options.retry_after_s, "draining")
        if self.restarting is not None:
            message = f"the engine is restarting ({self.restarting})"
            raise APIError(503, message, rejected="unavailable")
        if self.engine is None or self.llm is None or self.names is None:
            raise APIError(503, "the model is still loading", rejected="unavailable")
        if not self.engine.healthy:
            message = self.engine.error or "the server is shutting down"
            raise APIError(503, message, rejected="unavailable")
        return self.engine, self.llm, self.names

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            message = f"model: {model!r} does not exist; this server serves {self.model_name!r}"
            raise APIError(404, message, "model", "model_not_found")

    def model_card(self) -> dict:
        return {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "afdserve",
            "root": self.llm.model_name if self.llm else self.model_name,
            "max_model_len": self.max_model_len,
        }
