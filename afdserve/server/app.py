"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models[/{id}],
vLLM's /tokenize, /detokenize and /version, /health, /metrics.

Every HTTP request becomes one or more engine requests (n choices, or best_of candidates, per
prompt; convert.py), submitted to the engine thread (engine_loop.py) and gathered on one asyncio
queue. A client that goes away aborts its engine requests at once, so that their KV blocks are
freed for the others.

Everything that may take long with a large input (tokenizing, applying the chat template,
detokenizing) runs in a worker thread, so that one big request cannot stall /health or the other
streams; sizes are bounded before that (limits.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

import afdserve
from afdserve.engine.outputs import SequenceOutput, best
from afdserve.server import convert, tools
from afdserve.server import protocol as api
from afdserve.server import responses as shape
from afdserve.server.auth import APIKeyCheck
from afdserve.server.engine_loop import EngineLoop, Generation
from afdserve.server.limits import BodyLimit, ConcurrencyLimit, check_prompt_chars, check_text
from afdserve.server.metrics import CONTENT_TYPE, UNCOUNTED_PATHS, RequestCounter
from afdserve.server.options import ServeOptions
from afdserve.server.protocol import APIError, bad_request
from afdserve.server.state import ServerState

if TYPE_CHECKING:
    from afdserve.llm import LLM

log = logging.getLogger("afdserve.server")

CLIENT_CLOSED = 499  # logged and counted when the client left before its answer


def new_tokens(out: SequenceOutput) -> tuple[list[int], list[dict[int, float] | None]]:
    start = len(out.token_ids) - len(out.new_token_ids)
    return out.new_token_ids, out.logprobs[start:]


# ----- responses -----

Choice = Callable[[int, str, dict | None, str | None], dict]
Logprobs = Callable[[list[int], list], dict]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def chosen(outs: list[SequenceOutput], n: int, candidates: int) -> list[SequenceOutput]:
    """n choices per prompt: all of them, or the best n of best_of candidates."""
    if candidates == n:
        return outs
    picked = []
    for start in range(0, len(outs), candidates):
        group = outs[start : start + candidates]
        picked += [group[i] for i in best(group, n)]
    return picked


class GenerationStream(StreamingResponse):
    """A stream that releases its Generation however the response ends. The events generator's
    own `finally` does that too, but it never runs when the client leaves before the first
    chunk: a generator that never started has nothing to clean up, so its engine requests would
    run on and its admission and drain counts would never drop."""

    def __init__(self, gen: Generation, content: AsyncIterator[str], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.gen = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.gen.abort()
            self.gen.close()


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
    `logprobs` formats a choice's logprobs; None when the request asked for none.
    vLLM's `return_token_ids` adds each choice's `token_ids` (streamed: the new ones) and the
    prompt's `prompt_token_ids` (streamed: in the first chunk), per choice for completions,
    once per response for chat."""
    with_ids = bool(body.return_token_ids)
    prompt_ids_per_choice = not head["object"].startswith("chat.")
    prompts_sent: set[int] = set()

    def make(index: int, text: str, ids: list[int], entries: list, out: SequenceOutput) -> dict:
        lp = logprobs(ids, entries) if logprobs is not None else None
        made = choice(index, text, lp, shape.finish_reason(out))
        if with_ids:
            made["token_ids"] = list(ids)
            if prompt_ids_per_choice and index not in prompts_sent:
                made["prompt_token_ids"] = list(out.prompt_token_ids)
                prompts_sent.add(index)
        return made

    def prompt_ids(out: SequenceOutput) -> dict:
        if not with_ids or prompt_ids_per_choice or prompts_sent:
            return {}
        prompts_sent.add(-1)
        return {"prompt_token_ids": list(out.prompt_token_ids)}

    if not body.stream:
        outs = await gen.collect(request.receive)
        if outs is None:
            return Response(status_code=CLIENT_CLOSED)
        outs = chosen(outs, gen.fanout.n, gen.fanout.candidates)
        choices = [make(i, o.text, o.token_ids, o.logprobs, o) for i, o in enumerate(outs)]
        return JSONResponse({**head, **prompt_ids(outs[0]), "choices": choices,
                             "usage": gen.usage()})  # fmt: skip

    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    # vLLM's continuous_usage_stats: every chunk carries the usage so far too.
    every_chunk = include_usage and body.stream_options.continuous_usage_stats  # type: ignore[union-attr]

    async def events() -> AsyncIterator[str]:
        watcher = asyncio.ensure_future(gen.watch_disconnect(request.receive))
        try:
            for obj in opening:
                yield sse(obj)
            async for index, out in gen.events():
                ids, entries = new_tokens(out)
                # A chunk for every step that produced tokens, as vLLM does, even when the
                # detokenizer holds their text back (a partial UTF-8 character, a possible stop
                # string, a model without a tokenizer): clients time tokens by chunks.
                if ids or out.new_text or out.finished:
                    c = make(index, out.new_text, ids, entries, out)
                    usage = {"usage": gen.usage()} if every_chunk else {}
                    yield sse({**head, **prompt_ids(out), "choices": [c], **usage})
            if include_usage and not gen.open:
                yield sse({**head, "choices": [], "usage": gen.usage()})
        except APIError as e:  # the engine failed mid-stream: tell the client in-band
            yield sse(e.body())
        finally:
            watcher.cancel()
            gen.abort()
            gen.close()
        yield "data: [DONE]\n\n"

    return GenerationStream(gen, events(), media_type="text/event-stream")


async def start(
    state: ServerState, engine: EngineLoop, kind: str, fanout: convert.Fanout
) -> Generation:
    gen = Generation(
        engine, state.metrics, fanout, state.admission, state.options.request_timeout_s, state.live
    )
    await gen.start()
    if state.log_requests:
        log.info(
            "request %s: %s, %d prompt(s) of %s tokens, %s",
            gen.ids[0][:24], kind, len(fanout.prompts) // fanout.candidates,
            ",".join(str(len(p)) for p in fanout.prompts[:: fanout.candidates]), fanout.params[0],
        )  # fmt: skip
        gen.on_finish = lambda summary: log.info(
            "request %s finished: %s", gen.ids[0][:24], summary
        )
    return gen


# ----- the app -----


def create_app(
    served_model_name: str | None = None,
    api_key: str | None = None,
    log_requests: bool = True,
    chat_template: str | None = None,
    generation_config: str = "auto",
    options: ServeOptions | None = None,
) -> FastAPI:
    """The app without an engine: /health answers 503 until `app.state.server.attach(llm)`.
    `chat_template` (a Jinja template) replaces the tokenizer's own; `generation_config` says
    where request defaults come from (engine/generation_config.py). `options` gives the limits
    (and, when given, every other field: the arguments before it are then ignored)."""
    if options is None:
        options = ServeOptions(
            served_model_name=served_model_name, api_key=api_key, log_requests=log_requests,
            chat_template=chat_template, generation_config=generation_config,
        )  # fmt: skip
    state = ServerState(options)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        state.stop()

    app = FastAPI(title="afdserve", version=afdserve.__version__, lifespan=lifespan)
    app.state.server = state
    # The last added runs first: count, bound the requests in progress, check the key, then
    # read the body (bounded), so that a client without the key cannot make us read a body.
    app.add_middleware(
        BodyLimit,
        max_bytes=options.max_request_body_bytes,
        on_refused=lambda: state.metrics.rejected("body_too_large"),
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

    @app.get("/health")
    async def health() -> Response:
        state.ready()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": afdserve.__version__})

    @app.get("/v1/models")
    async def models() -> Response:
        state.ready()
        return JSONResponse({"object": "list", "data": [state.model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        state.ready()
        state.check_model(model_id)
        return JSONResponse(state.model_card())

    @app.post("/tokenize")
    async def tokenize(body: api.TokenizeRequest) -> Response:
        _, llm, _ = state.ready()
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt: give either prompt or messages", "prompt")
        if body.messages is not None:
            check_messages(state, body.messages)
            tokens = await asyncio.to_thread(
                convert.chat_prompt, llm, body.messages, body.add_generation_prompt,
                state.chat_template,
            )  # fmt: skip
        else:
            text = body.prompt or ""
            check_text(text, "prompt")
            check_prompt_chars(text, state.max_prompt_chars, "prompt")
            special = body.add_special_tokens
            tokens = await asyncio.to_thread(llm.tokenizer.encode, text, add_special_tokens=special)
        return JSONResponse(
            {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}
        )

    @app.post("/detokenize")
    async def detokenize(body: api.DetokenizeRequest) -> Response:
        _, llm, _ = state.ready()
        state.check_model(body.model)
        outside = [t for t in body.tokens if not 0 <= t < state.vocab_size]
        if outside:
            message = f"tokens: {outside[0]} is outside the vocabulary [0, {state.vocab_size})"
            raise bad_request(message, "tokens")
        return JSONResponse({"prompt": await asyncio.to_thread(llm.tokenizer.decode, body.tokens)})

    @app.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        engine, llm, names = state.ready()
        state.check_model(body.model)
        convert.check_fields(body)
        check_text(body.prompt, "prompt")
        check_text(body.stop, "stop")
        check_prompt_chars(body.prompt, state.max_prompt_chars, "prompt")
        if body.echo and body.logprobs is not None:
            raise bad_request("echo: with logprobs it needs the prompt's logprobs, which this "
                              "server does not compute; drop one of them", "echo")  # fmt: skip
        if body.prompt and isinstance(body.prompt, list):
            state.admission.check(len(body.prompt) if isinstance(body.prompt[0], str | list) else 1)
        else:
            state.admission.check(1)
        prompts = await asyncio.to_thread(convert.completion_prompts, llm, body.prompt)
        prompts = convert.truncate_prompts(prompts, body.truncate_prompt_tokens,
                                           state.max_model_len)  # fmt: skip
        default = state.defaults.get("max_tokens", convert.COMPLETION_MAX_TOKENS)
        max_tokens = convert.max_tokens_for(body.max_tokens, default, prompts, state.max_model_len)
        params = convert.sampling_params(
            body, max_tokens, body.logprobs, state.vocab_size, llm.engine_config.model,
            state.defaults,
        )  # fmt: skip
        gen = await start(state, engine, "completion", convert.fan_out(prompts, params))
        head = shape.envelope("text_completion", f"cmpl-{gen.ids[0][:24]}", state.model_name)

        def logprobs(token_ids: list[int], entries: list) -> dict:
            return shape.completion_logprobs(names, token_ids, entries, body.logprobs or 0)

        formatter = logprobs if body.logprobs is not None else None
        if not body.echo:
            return await respond(gen, request, body, head, shape.completion_choice, formatter)
        # echo: each choice's text starts with its prompt's (streamed: in its first chunk).
        echoes = await asyncio.to_thread(
            lambda: [llm.tokenizer.decode(p, skip_special_tokens=False) for p in prompts])
        echoed: set[int] = set()

        def echoing(index: int, text: str, lp: dict | None, finish: str | None) -> dict:
            if index not in echoed:
                echoed.add(index)
                text = echoes[index // params.n] + text
            return shape.completion_choice(index, text, lp, finish)

        return await respond(gen, request, body, head, echoing, formatter)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request) -> Response:
        engine, llm, names = state.ready()
        state.check_model(body.model)
        convert.check_fields(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")
        check_messages(state, body.messages)
        check_text(body.stop, "stop")
        options = state.options
        parser = options.tool_call_parser if options.enable_auto_tool_choice else None
        answering = tools.tool_choice(body, parser)
        state.admission.check(1)
        prompt = await asyncio.to_thread(
            convert.chat_prompt, llm, body.messages, chat_template=state.chat_template,
            tools=tools.template_tools(body),
        )  # fmt: skip
        (prompt,) = convert.truncate_prompts([prompt], body.truncate_prompt_tokens,
                                             state.max_model_len)  # fmt: skip
        requested = body.max_completion_tokens
        if requested is None:
            requested = body.max_tokens
        # Unset: as much as fits; the engine refuses a prompt that fills the context.
        default = state.defaults.get("max_tokens")
        max_tokens = convert.max_tokens_for(requested, default, [prompt], state.max_model_len)
        top = body.top_logprobs or 0
        try:
            logprobs_k = top if body.logprobs else None
            params = convert.sampling_params(
                body, max_tokens, logprobs_k, state.vocab_size, llm.engine_config.model,
                state.defaults, answering.schema if answering else None,
            )  # fmt: skip
        except APIError as e:
            if e.param == "logprobs":  # the engine's name for what chat calls top_logprobs
                e.param, e.message = "top_logprobs", "top_" + e.message
            raise
        gen = await start(state, engine, "chat", convert.fan_out([prompt], params))
        head = shape.envelope("chat.completion", f"chatcmpl-{gen.ids[0][:24]}", state.model_name)

        def logprobs(token_ids: list[int], entries: list) -> dict:
            return shape.chat_logprobs(names, token_ids, entries, top)

        formatter = logprobs if body.logprobs else None
        if answering is not None:
            if not body.stream:
                return await respond(gen, request, body, head, answering.message, formatter)
            head = {**head, "object": "chat.completion.chunk"}
            stream = answering.stream()
            opening = stream.opening(head, params.n)
            return await respond(gen, request, body, head, stream.delta, formatter, opening)
        if not body.stream:
            return await respond(gen, request, body, head, shape.chat_choice, formatter)
        head = {**head, "object": "chat.completion.chunk"}
        opening = shape.role_chunks(head, params.n)

        def delta(index: int, text: str, lp: dict | None, finish: str | None) -> dict:
            return shape.chat_choice(index, text, lp, finish, delta=True)

        return await respond(gen, request, body, head, delta, formatter, opening)

    return app


def check_messages(state: ServerState, messages: list[api.ChatMessage]) -> None:
    texts = [m.text() for m in messages]
    check_text(texts, "messages")
    check_prompt_chars(texts, state.max_prompt_chars, "messages")


def build_app(
    llm: LLM,
    served_model_name: str | None = None,
    api_key: str | None = None,
    log_requests: bool = True,
    chat_template: str | None = None,
    generation_config: str = "auto",
    options: ServeOptions | None = None,
) -> FastAPI:
    """An app serving an already built LLM. The caller keeps the LLM and shuts it down."""
    app = create_app(
        served_model_name, api_key, log_requests, chat_template, generation_config, options
    )
    app.state.server.attach(llm)
    return app
