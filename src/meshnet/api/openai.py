"""OpenAI-compatible endpoints: chat completions, completions (SSE when streamed).

A request runs on the model its ``model`` names (``api/models.py`` lists them;
one not served is 404 ``model-not-found``).

Every response carries an extra ``meshnet`` object (route, epoch, generated
ids; recoveries on the final one); OpenAI clients ignore it. A request may send
one too: ``{"meshnet": {"route": [node ids]}}`` runs it on exactly those nodes
(admin token only, ``api/caller.py``); the response's route says which served it. Log-probabilities
(``logprobs`` / ``top_logprobs``) are computed by the route's last node from
the raw logits and shaped here as each API shapes them.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from meshnet.api.caller import AnyCaller, Caller, Meter
from meshnet.api.errors import error_body
from meshnet.api.logprobs import LogprobShape
from meshnet.api.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from meshnet.api.state import models_of
from meshnet.errors import MeshnetError, RequestError
from meshnet.model.chat import ChatMessage
from meshnet.model.info import ModelInfo
from meshnet.tracker import billing
from meshnet.tracker.driver import DoneEvent, TokenEvent
from meshnet.tracker.routes import Route, route_json
from meshnet.tracker.service import Started, Tracker

Kind = Literal["chat", "text"]
router = APIRouter()
log = logging.getLogger(__name__)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, caller: AnyCaller
) -> JSONResponse | StreamingResponse:
    tracker = models_of(request).for_request(body.model).tracker  # 404 when not served
    named = _named_route(tracker, body, caller)
    messages = [ChatMessage(m.role, m.content) for m in body.messages]
    prompt_ids = await run_in_threadpool(_chat_ids, tracker.model, messages)  # not on the loop
    meter = caller.admit(request, len(prompt_ids))
    return await _complete(tracker, body, prompt_ids, "chat", meter, named, caller.billed_to)


def _chat_ids(model: ModelInfo, messages: list[ChatMessage]) -> list[int]:
    return model.tokenizer.encode(model.template.render(messages, add_generation_prompt=True))


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, caller: AnyCaller
) -> JSONResponse | StreamingResponse:
    tracker = models_of(request).for_request(body.model).tracker  # 404 when not served
    named = _named_route(tracker, body, caller)
    if isinstance(body.prompt, str):
        prompt_ids = await run_in_threadpool(tracker.model.tokenizer.encode, body.prompt)
    else:
        prompt_ids = list(body.prompt)
    if not prompt_ids:
        raise RequestError("the prompt encodes to no tokens")
    meter = caller.admit(request, len(prompt_ids))
    return await _complete(tracker, body, prompt_ids, "text", meter, named, caller.billed_to)


def _named_route(tracker: Tracker, body: _Sampling, caller: Caller) -> Route | None:
    """The route the request names (``meshnet.route``), once the caller may name one
    (403 otherwise) and it is usable now (400 with the reason otherwise); None when it
    names none."""
    caller.check_route(body.route)
    return None if body.route is None else tracker.requested_route(body.route)


async def _complete(
    tracker: Tracker,
    body: _Sampling,
    prompt_ids: list[int],
    kind: Kind,
    slot: Meter,
    named: Route | None,
    tenant: str,
) -> JSONResponse | StreamingResponse:
    """Run the generation (on the ``named`` route, if any) under the caller's ``slot``,
    which ends with it however it ends; its work is billed to ``tenant``."""
    try:
        params = body.sampling()
        started = await tracker.start(prompt_ids, params, body.top_logprobs_wanted, named)
        billing.attribute(tracker.store.db, started.generation_id, tenant)
        events = _metered(started.events, slot)
        shape = LogprobShape(kind, tracker.model.tokenizer)
        reply = _Reply(kind, tracker.model.name, started, shape)
        if body.stream:
            # The prefill runs before the response starts, so its failures (a full KV
            # budget, a dead node) still get their own HTTP status, not a 200 and an error.
            first = await anext(events)
            return StreamingResponse(
                _sse(reply, _prepend(first, events), body.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        done: DoneEvent | None = None
        async for event in events:
            if isinstance(event, DoneEvent):
                done = event
    except BaseException:
        slot.end()
        raise
    if done is None:
        raise MeshnetError("the generation ended without a result")
    return JSONResponse(reply.whole(done))


async def _metered(
    events: AsyncGenerator[TokenEvent | DoneEvent, None], slot: Meter
) -> AsyncGenerator[TokenEvent | DoneEvent, None]:
    """The generation's events; its tokens are charged to the tenant and its stream freed
    when it ends."""
    try:
        async for event in events:
            if isinstance(event, TokenEvent):
                slot.charge(1)
            yield event
    finally:
        slot.end()
        await events.aclose()


class _Reply:
    """Shapes one generation's output as OpenAI objects."""

    def __init__(self, kind: Kind, model: str, started: Started, shape: LogprobShape) -> None:
        self.kind = kind
        self.shape = shape
        self.model = model
        self.route = started.route
        self.epoch = started.epoch
        self.generation_id = started.generation_id
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())

    def _meta(self, **extra: Any) -> dict[str, Any]:
        return {
            "generation_id": self.generation_id,
            "route": route_json(self.route),
            "epoch": self.epoch,
            **extra,
        }

    def _final_meta(self, done: DoneEvent) -> dict[str, Any]:
        """The route and epoch the generation ended on, and every failover it survived."""
        return {
            "generation_id": self.generation_id,
            "route": route_json(done.route or self.route),
            "epoch": done.epoch,
            "ids": done.ids,
            "recoveries": [r.as_json() for r in done.recoveries],
        }

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, done: DoneEvent) -> dict[str, Any]:
        if self.kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "finish_reason": done.finish_reason,
                "message": {"role": "assistant", "content": done.text},
                "logprobs": self.shape.of(done.logprobs),
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": done.text,
                "finish_reason": done.finish_reason,
                "logprobs": self.shape.of(done.logprobs),
            }
            obj = "text_completion"
        return {
            **self._envelope(obj),
            "choices": [choice],
            "usage": usage(done),
            "meshnet": self._final_meta(done),
        }

    def chunk(
        self,
        text: str | None,
        finish: str | None,
        meta: dict[str, Any],
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": text or "", "finish_reason": finish}
            obj = "text_completion"
        choice["logprobs"] = logprobs
        return {**self._envelope(obj), "choices": [choice], "meshnet": meta}

    def first_chunk(self) -> dict[str, Any]:
        return self.chunk("", None, self._meta(), first=True)

    def token_chunk(self, event: TokenEvent) -> dict[str, Any]:
        lp = self.shape.of((event.logprobs,)) if event.logprobs is not None else None
        return self.chunk(event.text, None, {"ids": [event.token_id]}, logprobs=lp)

    def final_chunk(self, done: DoneEvent) -> dict[str, Any]:
        return self.chunk(None, done.finish_reason, self._final_meta(done))

    def usage_chunk(self, done: DoneEvent) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return {**self._envelope(obj), "choices": [], "usage": usage(done)}


async def _prepend(
    first: TokenEvent | DoneEvent, rest: AsyncGenerator[TokenEvent | DoneEvent, None]
) -> AsyncIterator[TokenEvent | DoneEvent]:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()  # a client that hung up frees the route at once


async def _sse(
    reply: _Reply, events: AsyncIterator[TokenEvent | DoneEvent], include_usage: bool
) -> AsyncIterator[str]:
    yield _data(reply.first_chunk())
    try:
        async for event in events:
            if isinstance(event, TokenEvent):
                yield _data(reply.token_chunk(event))
            else:
                yield _data(reply.final_chunk(event))
                if include_usage:
                    yield _data(reply.usage_chunk(event))
    except MeshnetError as e:
        yield _data(error_body(e))
    except Exception:  # a bug: the client still gets a well-formed end of stream
        log.exception("generation %s failed", reply.generation_id)
        yield _data(error_body(MeshnetError("internal error; see the tracker's log")))
    yield "data: [DONE]\n\n"


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(done: DoneEvent) -> dict[str, int]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": len(done.ids),
        "total_tokens": done.prompt_tokens + len(done.ids),
    }
