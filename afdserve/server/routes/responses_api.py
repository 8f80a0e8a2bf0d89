"""/v1/responses: OpenAI's Responses API, text in and text out. The input (a string, or
messages whose content is text) goes through the chat template as a chat's would, with
`instructions` as a system turn; the answer is one assistant message of `output_text`, whole or
streamed as the API's typed events. Tools, stored conversations (previous_response_id),
reasoning settings and non-text formats are refused by name."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from afdserve.server import convert
from afdserve.server import protocol as api
from afdserve.server.engine_loop import Generation
from afdserve.server.limits import check_messages
from afdserve.server.protocol import APIError, bad_request
from afdserve.server.state import ServerState
from afdserve.server.streams import CLIENT_CLOSED, GenerationStream, start

# Field -> its harmless values; anything else would change the answer in a way not served.
REFUSED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "previous_response_id": (None,),
    "reasoning": (None,),
    "background": (None, False),
    "include": (None, []),
    "conversation": (None,),
    "prompt": (None,),
    "truncation": (None, "disabled"),
}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    text: dict[str, Any] | None = None


def messages_of(body: ResponsesRequest) -> list[api.ChatMessage]:
    """The input as chat turns: text content parts (input_text / output_text) only."""
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    turns = [api.ChatMessage(role="system", content=body.instructions)] if body.instructions else []
    for i, item in enumerate(items):
        if item.get("type", "message") != "message" or "role" not in item:
            raise bad_request(
                f"input.{i}: only messages with a role are served, not {item.get('type')!r} items",
                "input",
            )
        content = item.get("content")
        if isinstance(content, list):
            if any(p.get("type") not in ("input_text", "output_text", "text") for p in content):
                raise bad_request(f"input.{i}.content: only text parts are served", "input")
            content = "".join(p.get("text", "") for p in content)
        turns.append(api.ChatMessage(role=item["role"], content=content))
    return turns


def check(body: ResponsesRequest) -> None:
    extra = body.model_extra or {}
    for name, harmless in REFUSED.items():
        if name in extra and extra[name] not in harmless:
            raise bad_request(f"{name}: {extra[name]!r} is not supported by this server", name)
    kind = ((body.text or {}).get("format") or {}).get("type", "text")
    if kind != "text":
        raise bad_request(f"text.format: type {kind!r}; allowed: text", "text")


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        engine, view = state.ready()
        state.check_model(body.model)
        check(body)
        turns = messages_of(body)
        check_messages(turns, state.max_prompt_chars(view))
        state.admission.check(1)
        prompt = await asyncio.to_thread(
            convert.chat_prompt, view, turns, chat_template=state.chat_template
        )
        fields = api.SamplingFields(temperature=body.temperature, top_p=body.top_p)
        default = view.defaults.get("max_tokens")
        max_tokens = convert.max_tokens_for(
            body.max_output_tokens, default, [prompt], view.max_model_len
        )
        params = convert.sampling_params(
            fields, max_tokens, None, view.vocab_size, view.model_dir, view.defaults
        )
        gen = await start(state, engine, "responses", convert.fan_out([prompt], params))
        shell = Shell(f"resp_{uuid.uuid4().hex}", state.model_name, body)
        if not body.stream:
            outs = await gen.collect(request.receive)
            if outs is None:
                return Response(status_code=CLIENT_CLOSED)
            out = outs[0]
            return JSONResponse(shell.response(out.text, out.finish_reason, gen))
        return GenerationStream(gen, shell.events(gen, request), media_type="text/event-stream")

    return routes


class Shell:
    """The Response object around one answer, and its stream of events."""

    def __init__(self, response_id: str, model: str, body: ResponsesRequest) -> None:
        self.id, self.model, self.body = response_id, model, body
        self.created = int(time.time())
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.sequence = 0

    def item(self, text: str, status: str) -> dict:
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}],
        }

    def response(self, text: str | None, finish: str | None, gen: Generation | None) -> dict:
        status = (
            "in_progress" if text is None else ("incomplete" if finish == "length" else "completed")
        )
        usage = None
        if gen is not None:
            used = gen.usage()
            usage = {
                "input_tokens": used["prompt_tokens"],
                "output_tokens": used["completion_tokens"],
                "total_tokens": used["total_tokens"],
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.model,
            "status": status,
            "output": [] if text is None else [self.item(text, "completed")],
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "instructions": self.body.instructions,
            "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature,
            "top_p": self.body.top_p,
            "parallel_tool_calls": False,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "error": None,
            "usage": usage,
            "metadata": {},
        }

    def event(self, kind: str, **fields: Any) -> str:
        self.sequence += 1
        data = {"type": kind, "sequence_number": self.sequence - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    async def events(self, gen: Generation, request: Request) -> AsyncIterator[str]:
        watcher = asyncio.ensure_future(gen.watch_disconnect(request.receive))
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        text, finish = "", None
        try:
            yield self.event("response.created", response=self.response(None, None, None))
            yield self.event(
                "response.output_item.added",
                output_index=0,
                item={**self.item("", "in_progress"), "content": []},
            )
            yield self.event(
                "response.content_part.added",
                **where,
                part={"type": "output_text", "text": "", "annotations": []},
            )
            async for _, out in gen.events():
                if out.new_text:
                    text += out.new_text
                    yield self.event("response.output_text.delta", **where, delta=out.new_text)
                finish = out.finish_reason
            yield self.event("response.output_text.done", **where, text=text)
            yield self.event(
                "response.content_part.done",
                **where,
                part={"type": "output_text", "text": text, "annotations": []},
            )
            yield self.event(
                "response.output_item.done", output_index=0, item=self.item(text, "completed")
            )
            final = self.response(text, finish, gen)
            ended = "incomplete" if final["status"] == "incomplete" else "completed"
            yield self.event(f"response.{ended}", response=final)
        except APIError as e:  # the engine failed mid-stream
            yield self.event("error", message=e.message, code=e.code, param=e.param)
        finally:
            watcher.cancel()
            gen.abort()
            gen.close()
