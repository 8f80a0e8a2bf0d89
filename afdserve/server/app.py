"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics.

Every HTTP request becomes one or more engine requests (n choices per prompt), submitted to the
engine thread (engine_loop.py) and gathered on one asyncio queue. A client that goes away aborts
its engine requests at once, so that their KV blocks are freed for the others.
"""

from __future__ import annotations

import asyncio
import errno
import json
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from afdserve.engine.engine_core import RequestOutput
from afdserve.engine.sampling_params import SamplingParams
from afdserve.server import protocol as api
from afdserve.server.engine_loop import EngineLoop, Generation
from afdserve.server.metrics import CONTENT_TYPE, RequestCounter, ServerMetrics
from afdserve.server.protocol import APIError, bad_request

if TYPE_CHECKING:
    from afdserve.llm import LLM

MAX_CHOICES = 128  # engine requests one HTTP request may start (prompts x n)
CLIENT_CLOSED = 499  # logged and counted when the client left before its answer
WARMUP_TIMEOUT_S = 600.0
GRACEFUL_SHUTDOWN_S = 3


class ServerState:
    """What the handlers share. The engine part is attached once the LLM is built."""

    def __init__(self, served_model_name: str | None) -> None:
        self.served_model_name = served_model_name
        self.model_name = served_model_name or ""
        self.llm: LLM | None = None
        self.engine: EngineLoop | None = None
        self.names: api.TokenText | None = None
        self.max_model_len = 0
        self.metrics = ServerMetrics(lambda: self.engine.stats() if self.engine else None)

    def attach(self, llm: LLM) -> None:
        self.llm, self.names = llm, api.TokenText(llm.tokenizer)
        self.model_name = self.served_model_name or llm.model_name
        self.max_model_len = llm.engine.max_model_len
        self.engine = EngineLoop(llm.engine).start()

    def stop(self) -> None:
        if self.engine is not None:
            self.engine.stop()

    def ready(self) -> tuple[EngineLoop, LLM, api.TokenText]:
        if self.engine is None or self.llm is None or self.names is None:
            raise APIError(503, "the model is still loading")
        if not self.engine.healthy:
            raise APIError(503, self.engine.error or "the server is shutting down")
        return self.engine, self.llm, self.names

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            message = f"model: {model!r} does not exist; this server serves {self.model_name!r}"
            raise APIError(404, message, "model", "model_not_found")


# ----- request -> engine requests -----


def sampling_params(
    body: api.SamplingFields, max_tokens: int, logprobs: int | None, count: int
) -> list[SamplingParams]:
    """One SamplingParams per choice; with a seed and several choices, choice i gets seed + i so
    that choices differ yet the set is reproducible."""
    if body.seed is not None:
        seeds = [body.seed + i if count > 1 else body.seed for i in range(count)]
    else:
        seeds = [None] * count
    try:
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=seed,
                stop=body.stop or (),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
            )
            for seed in seeds
        ]
    except ValueError as e:
        raise bad_request(str(e).removeprefix("SamplingParams.")) from None


def check_n(n: int, prompts: int) -> None:
    if n < 1 or n * prompts > MAX_CHOICES:
        allowed = f"n >= 1 and n x prompts <= {MAX_CHOICES}"
        raise bad_request(f"n: {n} for {prompts} prompt(s); allowed: {allowed}", "n")


def completion_prompts(llm: LLM, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [llm.encode(prompt)]
    if prompt and isinstance(prompt[0], (str, list)):
        return [llm.encode(p) for p in prompt]
    return [list(prompt)]


def chat_prompt(llm: LLM, body: api.ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = llm.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    except Exception as e:  # the template refuses this conversation (roles, order, ...)
        raise bad_request(f"messages: the chat template refused them: {e}", "messages") from None
    return llm.encode(text)


def new_tokens(out: RequestOutput) -> tuple[list[int], list[dict[int, float] | None]]:
    start = len(out.token_ids) - len(out.new_token_ids)
    return out.new_token_ids, out.logprobs[start:]


# ----- responses -----

Choice = Callable[[int, str, dict | None, str | None], dict]
Logprobs = Callable[[list[int], list], dict]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def respond(
    gen: Generation,
    request: Request,
    body: api.SamplingFields,
    head: dict,
    choice: Choice,
    logprobs: Logprobs | None,
    opening: tuple[dict, ...] = (),
) -> Response:
    """Run `gen` to the end as one JSON body, or as server-sent events when `body.stream`.
    `logprobs` formats a choice's logprobs; None when the request asked for none."""

    def make(index: int, text: str, ids: list[int], entries: list, out: RequestOutput) -> dict:
        lp = logprobs(ids, entries) if logprobs is not None else None
        return choice(index, text, lp, api.finish_reason(out))

    if not body.stream:
        outs = await gen.collect(request.receive)
        if outs is None:
            return Response(status_code=CLIENT_CLOSED)
        choices = [make(i, o.text, o.token_ids, o.logprobs, o) for i, o in enumerate(outs)]
        return JSONResponse({**head, "choices": choices, "usage": gen.usage(body.n)})

    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        watcher = asyncio.ensure_future(gen.watch_disconnect(request.receive))
        try:
            for obj in opening:
                yield sse(obj)
            async for index, out in gen.events():
                ids, entries = new_tokens(out)
                if out.new_text or out.finished or (ids and logprobs is not None):
                    c = make(index, out.new_text, ids, entries, out)
                    yield sse({**head, "choices": [c]})
            if include_usage and not gen.open:
                yield sse({**head, "choices": [], "usage": gen.usage(body.n)})
        except APIError as e:  # the engine failed mid-stream: tell the client in-band
            yield sse(e.body())
        finally:
            watcher.cancel()
            gen.abort()
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# ----- the app -----


def create_app(served_model_name: str | None = None) -> FastAPI:
    """The app without an engine: /health answers 503 until `app.state.server.attach(llm)`."""
    state = ServerState(served_model_name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        state.stop()

    app = FastAPI(title="afdserve", lifespan=lifespan)
    app.state.server = state
    app.add_middleware(RequestCounter, metrics=state.metrics)

    @app.exception_handler(APIError)
    async def on_api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = api.validation_message(list(e.errors()))
        return JSONResponse(api.error_body(400, message, param), status_code=400)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, e: HTTPException) -> JSONResponse:
        message = f"{request.method} {request.url.path}: {e.detail}"
        return JSONResponse(api.error_body(e.status_code, message), status_code=e.status_code)

    @app.get("/health")
    async def health() -> Response:
        state.ready()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> Response:
        state.ready()
        card = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "afdserve"}
        card["max_model_len"] = state.max_model_len
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        engine, llm, names = state.ready()
        state.check_model(body.model)
        if body.echo:
            raise bad_request("echo: true is not supported", "echo")
        prompts = completion_prompts(llm, body.prompt)
        check_n(body.n, len(prompts))
        max_tokens = 16 if body.max_tokens is None else body.max_tokens
        params = sampling_params(body, max_tokens, body.logprobs, len(prompts) * body.n)
        choices = [p for p in prompts for _ in range(body.n)]
        gen = Generation(engine, state.metrics, choices, params)
        await gen.start()
        head = api.envelope("text_completion", f"cmpl-{gen.ids[0][:24]}", state.model_name)

        def logprobs(token_ids: list[int], entries: list) -> dict:
            return api.completion_logprobs(names, token_ids, entries, body.logprobs or 0)

        formatter = logprobs if body.logprobs is not None else None
        return await respond(gen, request, body, head, api.completion_choice, formatter)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request) -> Response:
        engine, llm, names = state.ready()
        state.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")
        prompt = chat_prompt(llm, body)
        check_n(body.n, 1)
        max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = body.max_tokens
        if max_tokens is None:  # as much as fits; the engine refuses a prompt that fills it
            max_tokens = max(1, state.max_model_len - len(prompt))
        top = body.top_logprobs or 0
        try:
            params = sampling_params(body, max_tokens, top if body.logprobs else None, body.n)
        except APIError as e:
            if e.param == "logprobs":  # the engine's name for what chat calls top_logprobs
                e.param, e.message = "top_logprobs", "top_" + e.message
            raise
        gen = Generation(engine, state.metrics, [prompt] * body.n, params)
        await gen.start()
        head = api.envelope("chat.completion", f"chatcmpl-{gen.ids[0][:24]}", state.model_name)

        def logprobs(token_ids: list[int], entries: list) -> dict:
            return api.chat_logprobs(names, token_ids, entries, top)

        formatter = logprobs if body.logprobs else None
        if not body.stream:
            return await respond(gen, request, body, head, api.chat_choice, formatter)
        head = {**head, "object": "chat.completion.chunk"}
        role = {"role": "assistant", "content": ""}
        opening = tuple(
            {**head, "choices": [{**api.chat_choice(i, "", None, None, True), "delta": role}]}
            for i in range(body.n)
        )

        def delta(index: int, text: str, lp: dict | None, finish: str | None) -> dict:
            return api.chat_choice(index, text, lp, finish, delta=True)

        return await respond(gen, request, body, head, delta, formatter, opening)

    return app


def build_app(llm: LLM, served_model_name: str | None = None) -> FastAPI:
    """An app serving an already built LLM. The caller keeps the LLM and shuts it down."""
    app = create_app(served_model_name)
    app.state.server.attach(llm)
    return app


# ----- serving -----


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


def run_server(
    llm_factory: Callable[[], LLM],
    host: str,
    port: int,
    served_model_name: str | None = None,
    log_level: str = "info",
) -> None:
    """Serve until SIGINT or SIGTERM, then stop uvicorn and every rank process. A port that is
    taken (or cannot be bound) raises SystemExit with a message before the LLM is built.

    uvicorn runs in a thread from the start (so /health answers 503 while loading) and the main
    thread builds the LLM: a signal raises KeyboardInterrupt there, which also interrupts a
    start-up in progress; the LLM's own clean-up then stops the ranks already started.
    """
    import uvicorn

    sock = listen_socket(host, port)
    app = create_app(served_model_name)
    state: ServerState = app.state.server
    config = uvicorn.Config(
        app, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn")
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    llm = None
    try:
        thread.start()
        progress(f"listening on http://{host}:{port}; loading the model")
        llm = llm_factory()
        progress("warming up")
        warm_up(llm)
        state.attach(llm)
        progress(f"ready: serving {state.model_name!r} on http://{host}:{port}")
        while thread.is_alive():
            thread.join(0.5)
    except KeyboardInterrupt:
        progress("shutting down")
    finally:
        # A second signal must not cut the clean-up short: that would leave ranks behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
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
