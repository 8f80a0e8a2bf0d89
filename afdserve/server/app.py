"""The OpenAI-compatible HTTP app: middleware, error handlers, and the routes of routes/
(/v1/completions, /v1/chat/completions, /v1/models[/{id}], vLLM's /tokenize, /detokenize and
/version, /health, /metrics).

Every HTTP request becomes one or more engine requests (n choices, or best_of candidates, per
prompt; convert.py), submitted to the engine thread (engine_loop.py) and gathered on one asyncio
queue (streams.py). A client that goes away aborts its engine requests at once, so that their KV
blocks are freed for the others.

Everything that may take long with a large input (tokenizing, applying the chat template,
detokenizing) runs in a worker thread, so that one big request cannot stall /health or the other
streams; sizes are bounded before that (limits.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

import afdserve
from afdserve.server import protocol as api
from afdserve.server.auth import APIKeyCheck
from afdserve.server.limits import BodyLimit, ConcurrencyLimit
from afdserve.server.metrics import UNCOUNTED_PATHS, RequestCounter
from afdserve.server.options import ServeOptions
from afdserve.server.protocol import APIError
from afdserve.server.routes import chat, completions, models, probes, responses_api, tokens
from afdserve.server.state import ServerState

log = logging.getLogger("afdserve.server")


def create_app(options: ServeOptions | None = None) -> FastAPI:
    """The app without an engine: /health answers 503 until `app.state.server.attach(view)`
    (serve.py builds the EngineView from an LLM). `options`: every setting of the HTTP side
    (ServeOptions' defaults when None)."""
    options = options if options is not None else ServeOptions()
    state = ServerState(options)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        state.stop()

    app = FastAPI(title="afdserve", version=afdserve.__version__, lifespan=lifespan)
    app.state.server = state
    add_middleware(app, state)
    add_error_handlers(app, state)
    for domain in (probes, models, tokens, completions, chat, responses_api):
        app.include_router(domain.router(state))
    return app


def add_middleware(app: FastAPI, state: ServerState) -> None:
    options = state.options
    # The last added runs first: count, bound the requests in progress, check the key, then
    # read the body (bounded), so that a client without the key cannot make us read a body.
    app.add_middleware(
        BodyLimit,
        max_bytes=options.max_request_body_bytes,
        timeout_s=options.body_timeout_s,
        on_refused=state.metrics.rejected,
    )
    if options.api_key:
        app.add_middleware(APIKeyCheck, api_key=options.api_key)
    if options.limit_concurrency is not None:
        app.add_middleware(
            ConcurrencyLimit,
            limit=options.limit_concurrency,
            retry_after_s=options.retry_after_s,
            exempt=UNCOUNTED_PATHS,
            on_refused=lambda: state.metrics.rejected("concurrency"),
        )
    app.add_middleware(RequestCounter, metrics=state.metrics)


def add_error_handlers(app: FastAPI, state: ServerState) -> None:
    """Every error is OpenAI's error body; refusals of new work are counted by reason."""

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> JSONResponse:
        if e.rejected is not None and request.url.path not in UNCOUNTED_PATHS:
            state.metrics.rejected(e.rejected)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = api.validation_message(list(e.errors()))
        return JSONResponse(api.error_body(400, message, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(api.error_body(e.status_code, message), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, e: Exception) -> JSONResponse:
        # A bug while serving one request fails that request; the engine thread is not involved.
        # The client gets no text of the exception: it may name files and values of the server.
        log.exception("%s %s failed", request.method, request.url.path)
        message = f"internal error while serving this request ({type(e).__name__}); see the log"
        return JSONResponse(api.error_body(500, message), status_code=500)
