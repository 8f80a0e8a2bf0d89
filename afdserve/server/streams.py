"""A Generation (engine_loop.py) as an HTTP response: started from the server's state, then run to
the end as one JSON body, or as server-sent events; both the completion and the chat routes answer
through `respond`, each with its own choice shape (responses.py, tools.py)."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from afdserve.frontend.outputs import SequenceOutput, best
from afdserve.server import convert
from afdserve.server import protocol as api
from afdserve.server import responses as shape
from afdserve.server.engine_loop import EngineLoop, Generation
from afdserve.server.protocol import APIError
from afdserve.server.state import ServerState

log = logging.getLogger("afdserve.server")

CLIENT_CLOSED = 499  # logged and counted when the client left before its answer


def new_tokens(out: SequenceOutput) -> tuple[list[int], list[dict[int, float] | None]]:
    start = len(out.token_ids) - len(out.new_token_ids)
    return out.new_token_ids, out.logprobs[start:]


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


class ChoiceMaker:
    """Shapes a request's outputs into choices, adding what vLLM's `return_token_ids` and
    `prompt_logprobs` ask for. A prompt's part goes out once: per choice for completions, once
    per response for chat (streamed: in the first chunk that carries it)."""

    def __init__(
        self,
        body: api.SamplingFields,
        head: dict,
        choice: Choice,
        logprobs: Logprobs | None,
        echo_logprobs: bool,
    ) -> None:
        self.choice, self.logprobs, self.echo_logprobs = choice, logprobs, echo_logprobs
        self.with_ids = bool(body.return_token_ids)
        self.with_prompt_logprobs = body.prompt_logprobs is not None
        self.per_choice = not head["object"].startswith("chat.")
        # Choices (or -1: the response) already given their prompt's part.
        self.prompts_sent: set[int] = set()

    def make(
        self, index: int, text: str, ids: list[int], entries: list, out: SequenceOutput
    ) -> dict:
        """Choice `index` of `text` and its tokens `ids` with their logprob `entries`."""
        first = index not in self.prompts_sent
        lp = None
        if self.logprobs is not None:
            if self.echo_logprobs and first:
                lp = self.logprobs(out.prompt_token_ids + ids, out.prompt_logprobs + entries)
            else:
                lp = self.logprobs(ids, entries)
        made = self.choice(index, text, lp, shape.finish_reason(out))
        made.setdefault("stop_reason", out.stop_reason)  # vLLM's: the stop string or token id
        if self.with_ids:
            made["token_ids"] = list(ids)
        if self.per_choice and first:
            if self.with_ids:
                made["prompt_token_ids"] = list(out.prompt_token_ids)
            if self.with_prompt_logprobs:
                made["prompt_logprobs"] = shape.prompt_logprobs(out.prompt_logprobs)
        self.prompts_sent.add(index)
        return made

    def prompt_part(self, out: SequenceOutput) -> dict:
        """The response's prompt fields (chat), the first time only."""
        if self.per_choice or -1 in self.prompts_sent:
            return {}
        self.prompts_sent.add(-1)
        part = {"prompt_token_ids": list(out.prompt_token_ids)} if self.with_ids else {}
        if self.with_prompt_logprobs:
            part["prompt_logprobs"] = shape.prompt_logprobs(out.prompt_logprobs)
        return part


async def respond(
    gen: Generation,
    request: Request,
    body: api.SamplingFields,
    head: dict,
    choice: Choice,
    logprobs: Logprobs | None,
    opening: tuple[dict, ...] = (),
    echo_logprobs: bool = False,
) -> Response:
    """Run `gen` to the end as one JSON body, or as server-sent events when `body.stream`.
    `logprobs` formats a choice's logprobs; None when the request asked for none.
    `echo_logprobs`: a choice's logprobs start with its prompt's tokens (the first without a
    logprob), as echo shows them. `opening`: events sent before the first choice."""
    maker = ChoiceMaker(body, head, choice, logprobs, echo_logprobs)
    if not body.stream:
        return await whole(gen, request, head, maker)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    # vLLM's continuous_usage_stats: every chunk carries the usage so far too.
    every_chunk = include_usage and body.stream_options.continuous_usage_stats  # type: ignore[union-attr]
    content = events(gen, request, head, maker, opening, include_usage, every_chunk)
    return GenerationStream(gen, content, media_type="text/event-stream")


async def whole(gen: Generation, request: Request, head: dict, maker: ChoiceMaker) -> Response:
    """`gen` run to the end as one JSON body (499 if the client left first)."""
    outs = await gen.collect(request.receive)
    if outs is None:
        return Response(status_code=CLIENT_CLOSED)
    outs = chosen(outs, gen.fanout.n, gen.fanout.candidates)
    choices = [maker.make(i, o.text, o.token_ids, o.logprobs, o) for i, o in enumerate(outs)]
    return JSONResponse(
        {**head, **maker.prompt_part(outs[0]), "choices": choices, "usage": gen.usage()}
    )


async def events(
    gen: Generation,
    request: Request,
    head: dict,
    maker: ChoiceMaker,
    opening: tuple[dict, ...],
    include_usage: bool,
    every_chunk: bool,
) -> AsyncIterator[str]:
    """`gen` as server-sent events; an engine failure mid-stream is told in-band."""
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
                c = maker.make(index, out.new_text, ids, entries, out)
                usage = {"usage": gen.usage()} if every_chunk else {}
                yield sse({**head, **maker.prompt_part(out), "choices": [c], **usage})
        if include_usage and not gen.open:
            yield sse({**head, "choices": [], "usage": gen.usage()})
    except APIError as e:
        yield sse(e.body())
    finally:
        watcher.cancel()
        gen.abort()
        gen.close()
    yield "data: [DONE]\n\n"


async def start(
    state: ServerState, engine: EngineLoop, kind: str, fanout: convert.Fanout
) -> Generation:
    """The fanout's engine requests, submitted as one Generation (APIError if refused); logged
    with their sizes and their end when the server logs requests."""
    gen = Generation(
        engine, state.metrics, fanout, state.admission, state.options.request_timeout_s, state.live
    )
    await gen.start()
    if state.log_requests:
        log.info(
            "request %s: %s, %d prompt(s) of %s tokens, %s",
            gen.ids[0][:24],
            kind,
            len(fanout.prompts) // fanout.candidates,
            ",".join(str(len(p)) for p in fanout.prompts[:: fanout.candidates]),
            fanout.params[0],
        )
        gen.on_finish = lambda summary: log.info(
            "request %s finished: %s", gen.ids[0][:24], summary
        )
    return gen
