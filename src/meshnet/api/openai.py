"""OpenAI-compatible endpoints: chat completions, completions (SSE when streamed).

A request runs on the model its ``model`` names (``api/models.py`` lists them;
one not served is 404 ``model-not-found``).

Every response carries an extra ``meshnet`` object (route, epoch, generated
ids; recoveries on the final one); OpenAI clients ignore it. A request may send
one too: ``{"meshnet": {"route": [node ids]}}`` runs it on exactly those nodes
(admin token only, ``api/caller.py``); the response's route says which served it. Log-probabilities
(``logprobs`` / ``top_logprobs``) are computed by the route's last node from
the raw logits and shaped here as each API shapes them.

Which request fields are honoured and which refused is ``api/fields.py``'s
contract. ``n`` choices are ``n`` generations run together (``api/choices.py``
says how each one's seed derives from the request's); each choice carries its
own ``meshnet`` object, and the response's is choice 0's. ``echo`` (completions)
starts each choice's text with the prompt.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from meshnet.api.caller import AnyCaller, Caller, Meter
from meshnet.api.choices import Choice, choice_params, finish_all, merged, open_choices
from meshnet.api.errors import error_body
from meshnet.api.logprobs import LogprobShape
from meshnet.api.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from meshnet.api.state import models_of
from meshnet.errors import MeshnetError, RequestError
from meshnet.model.chat import ChatMessage
from meshnet.model.info import ModelInfo
from meshnet.tracker.driver import DoneEvent, TokenEvent
from meshnet.tracker.routes import Route, route_json
from meshnet.tracker.service import Tracker

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
    meters = _admit(caller, request, len(prompt_ids), body.n)
    return await _complete(tracker, body, prompt_ids, "chat", meters, named, caller.billed_to)


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
    meters = _admit(caller, request, len(prompt_ids), body.n)
    return await _complete(tracker, body, prompt_ids, "text", meters, named, caller.billed_to)


def _admit(caller: Caller, request: Request, prompt_tokens: int, n: int) -> list[Meter]:
    """A quota slot per choice (each is a generation); none held when one is refused."""
    meters: list[Meter] = []
    try:
        for _ in range(n):
            meters.append(caller.admit(request, prompt_tokens))
    except BaseException:
        for meter in meters:
            meter.end()
        raise
    return meters


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
    slots: Sequence[Meter],
    named: Route | None,
    tenant: str,
) -> JSONResponse | StreamingResponse:
    """Run the request's choices (on the ``named`` route, if any), each under its
    ``slots`` entry, which ends with it however it ends; their work is billed to ``tenant``."""
    try:
        params = choice_params(body.sampling(tracker.model.spec.vocab_size), body.n)
        echo = await _echo(tracker, body, prompt_ids)
    except BaseException:
        for slot in slots:
            slot.end()
        raise
    # The prefills run before the response starts, so their failures (a full KV
    # budget, a dead node) still get their own HTTP status, not a 200 and an error.
    top = body.top_logprobs_wanted
    choices = await open_choices(tracker, prompt_ids, params, top, named, slots, tenant)
    shape = LogprobShape(kind, tracker.model.tokenizer)
    reply = _Reply(kind, tracker.model.name, choices, shape, echo)
    if body.stream:
        return StreamingResponse(
            _sse(reply, merged(choices), body.include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    dones = await finish_all(choices)
    if any(done is None for done in dones):
        raise MeshnetError("the generation ended without a result")
    return JSONResponse(reply.whole([d for d in dones if d is not None]))


async def _echo(tracker: Tracker, body: _Sampling, prompt_ids: list[int]) -> str:
    """The text each choice starts with: the prompt when ``echo`` asks, else nothing."""
    if not body.echo_prompt:
        return ""
    prompt = getattr(body, "prompt", None)
    if isinstance(prompt, str):
        return prompt
    return await run_in_threadpool(tracker.model.tokenizer.decode, prompt_ids)


class _Reply:
    """Shapes the output of a request's choices as OpenAI objects."""

    def __init__(
        self, kind: Kind, model: str, choices: Sequence[Choice], shape: LogprobShape, echo: str
    ) -> None:
        self.kind = kind
        self.shape = shape
        self.model = model
        self.echo = echo  # what each choice's text starts with
        self.started = {c.index: c.started for c in choices}
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        self.id = f"{prefix}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

    def _meta(self, index: int) -> dict[str, Any]:
        started = self.started[index]
        return {
            "generation_id": started.generation_id,
            "route": route_json(started.route),
            "epoch": started.epoch,
        }

    def _final_meta(self, index: int, done: DoneEvent) -> dict[str, Any]:
        """The route and epoch the choice ended on, and every failover it survived."""
        started = self.started[index]
        return {
            "generation_id": started.generation_id,
            "route": route_json(done.route or started.route),
            "epoch": done.epoch,
            "ids": done.ids,
            "recoveries": [r.as_json() for r in done.recoveries],
        }

    def _envelope(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _choice(self, index: int, done: DoneEvent) -> dict[str, Any]:
        lp = self.shape.of(done.logprobs)
        if self.kind == "chat":
            message = {"role": "assistant", "content": done.text}
            choice = {"index": index, "finish_reason": done.finish_reason, "message": message}
        else:
            text = self.echo + done.text
            choice = {"index": index, "text": text, "finish_reason": done.finish_reason}
        return {**choice, "logprobs": lp}

    def whole(self, dones: Sequence[DoneEvent]) -> dict[str, Any]:
        choices = [self._choice(i, done) for i, done in enumerate(dones)]
        if len(dones) > 1:
            for i, (choice, done) in enumerate(zip(choices, dones, strict=True)):
                choice["meshnet"] = self._final_meta(i, done)
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            **self._envelope(obj),
            "choices": choices,
            "usage": usage(dones),
            "meshnet": self._final_meta(0, dones[0]),
        }

    def chunk(
        self,
        index: int,
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
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": index, "text": text or "", "finish_reason": finish}
        choice["logprobs"] = logprobs
        return {**self._envelope(self.obj), "choices": [choice], "meshnet": meta}

    def first_chunk(self, index: int) -> dict[str, Any]:
        text = self.echo if self.kind == "text" else ""
        return self.chunk(index, text, None, self._meta(index), first=True)

    def token_chunk(self, index: int, event: TokenEvent) -> dict[str, Any]:
        lp = self.shape.of((event.logprobs,)) if event.logprobs is not None else None
        return self.chunk(index, event.text, None, {"ids": [event.token_id]}, logprobs=lp)

    def final_chunk(self, index: int, done: DoneEvent) -> dict[str, Any]:
        return self.chunk(index, None, done.finish_reason, self._final_meta(index, done))

    def usage_chunk(self, dones: Sequence[DoneEvent]) -> dict[str, Any]:
        return {**self._envelope(self.obj), "choices": [], "usage": usage(dones)}


async def _sse(
    reply: _Reply,
    events: AsyncGenerator[tuple[int, TokenEvent | DoneEvent], None],
    include_usage: bool,
) -> AsyncIterator[str]:
    for index in sorted(reply.started):
        yield _data(reply.first_chunk(index))
    dones: dict[int, DoneEvent] = {}
    try:
        async for index, event in events:
            if isinstance(event, TokenEvent):
                yield _data(reply.token_chunk(index, event))
            else:
                dones[index] = event
                yield _data(reply.final_chunk(index, event))
        if include_usage:
            yield _data(reply.usage_chunk([dones[i] for i in sorted(dones)]))
    except MeshnetError as e:
        yield _data(error_body(e))
    except Exception:  # a bug: the client still gets a well-formed end of stream
        log.exception("generations %s failed", [s.generation_id for s in reply.started.values()])
        yield _data(error_body(MeshnetError("internal error; see the tracker's log")))
    finally:
        await events.aclose()  # a client that hung up frees the routes at once
    yield "data: [DONE]\n\n"


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(dones: Sequence[DoneEvent]) -> dict[str, int]:
    """The prompt's tokens (once: every choice has the same prompt) and every choice's."""
    prompt = dones[0].prompt_tokens
    completion = sum(len(done.ids) for done in dones)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
