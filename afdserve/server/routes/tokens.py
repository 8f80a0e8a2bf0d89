"""vLLM's /tokenize (a prompt, or chat messages through the chat template) and /detokenize.
The tokenizer runs in a worker thread: a long input must not stall the other requests."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from afdserve.server import convert
from afdserve.server import protocol as api
from afdserve.server.limits import check_messages, check_prompt_chars, check_text
from afdserve.server.protocol import bad_request
from afdserve.server.state import ServerState


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/tokenize")
    async def tokenize(body: api.TokenizeRequest) -> Response:
        _, view = state.ready()
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt: give either prompt or messages", "prompt")
        if body.messages is not None:
            check_messages(body.messages, state.max_prompt_chars(view))
            tokens = await asyncio.to_thread(
                convert.chat_prompt,
                view,
                body.messages,
                body.add_generation_prompt,
                state.chat_template,
            )
        else:
            text = body.prompt or ""
            check_text(text, "prompt")
            check_prompt_chars(text, state.max_prompt_chars(view), "prompt")
            special = body.add_special_tokens
            tokens = await asyncio.to_thread(
                view.tokenizer.encode, text, add_special_tokens=special
            )
        return JSONResponse(
            {"count": len(tokens), "max_model_len": view.max_model_len, "tokens": tokens}
        )

    @routes.post("/detokenize")
    async def detokenize(body: api.DetokenizeRequest) -> Response:
        _, view = state.ready()
        state.check_model(body.model)
        outside = [t for t in body.tokens if not 0 <= t < view.vocab_size]
        if outside:
            message = f"tokens: {outside[0]} is outside the vocabulary [0, {view.vocab_size})"
            raise bad_request(message, "tokens")
        text = await asyncio.to_thread(view.tokenizer.decode, body.tokens)
        return JSONResponse({"prompt": text})

    return routes
