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
from dataclasses import replace
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from meshnet.api.caller import AnyCaller, Caller, Meter
from meshnet.api.chat_reply import ChatReply
from meshnet.api.choices import Choice, choice_params, finish_all, merged, open_choices
from meshnet.api.errors import error_body
from meshnet.api.logprobs import LogprobShape
from meshnet.api.schemas import ChatCompletionRequest, CompletionRequest, _Sampling
from meshnet.api.state import models_of
from meshnet.api.structured import constraint_of
from meshnet.api.tools import ChatPlan, plan_chat
from meshnet.errors import FieldError, MeshnetError, RequestError
from meshnet.model.info import ModelInfo
from meshnet.model.sampling import SamplingParams
from meshnet.tracker.nodes.routes import Route, route_json
from meshnet.tracker.routing.driver import DoneEvent, TokenEvent
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
    plan = await run_in_threadpool(_plan, tracker.model, body)  # not on the loop
    prompt_ids = await run_in_threadpool(_chat_ids, tracker.model, plan)
    meters = _admit(caller, request, len(prompt_ids), body.n)
    return await _complete(tracker, body, prompt_ids, "chat", meters, named, caller.billed_to, plan)


def _plan(model: ModelInfo, body: ChatCompletionRequest) -> ChatPlan:
    """How the request is rendered and its reply read (tools, reasoning; api/tools.py)."""
    messages = [m.message() for m in body.messages]
    return plan_chat(
        messages,
        body.tools,
        body.tool_choice,
        body.parallel_tool_calls,
        body.reasoning_effort,
        model.template,
        model.tokenizer,
    )


def _chat_ids(model: ModelInfo, plan: ChatPlan) -> list[int]:
    text = model.template.render(plan.messages, add_generation_prompt=True, **plan.variables)
    return model.tokenizer.encode(text)


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
    return None if body.route is None else tracker.planner.requested_route(body.route)


async def _complete(
    tracker: Tracker,
    body: _Sampling,
    prompt_ids: list[int],
    kind: Kind,
    slots: Sequence[Meter],
    named: Route | None,
    tenant: str,
    plan: ChatPlan | None = None,
) -> JSONResponse | StreamingResponse:
    """Run the request's choices (on the ``named`` route, if any), each under its
    ``slots`` entry, which ends with it however it ends; their work is billed to ``tenant``.
    A chat's ``plan`` says how its reply is read (tool calls, reasoning) and what it
    forces."""
    try:
        forced = plan.grammar if plan is not None else None
        sampling = body.sampling(tracker.model.spec.vocab_size)
        sampling = await _constrained(tracker, body, sampling, len(prompt_ids), forced)
        params = choice_params(sampling, body.n)
        echo = await _echo(tracker, body, prompt_ids)
    except BaseException:
        for slot in slots:
            slot.end()
        raise
    # The prefills run before the response starts, so their failures (a full KV
    # budget, a dead node) still get their own HTTP status, not a 200 and an error.
    top = body.top_logprobs_wanted
    # The prompt's prefix-cache scope: its tenant's, narrowed by a cache_salt.
    scope = tracker.prefix_scope(tenant, body.cache_salt or "")
    choices = await open_choices(tracker, prompt_ids, params, top, named, slots, tenant, scope)
    shape = LogprobShape(kind, tracker.model.tokenizer)
    shaped = plan if plan is not None and plan.shapes_reply else None
    reply = _Reply(kind, tracker.model.name, choices, shape, echo)
    if shaped is not None:
        constrained = sampling.constraint is not None
        reply.parts = {c.index: ChatReply(shaped, constrained) for c in choices}
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


async def _constrained(
    tracker: Tracker, body: _Sampling, params: SamplingParams, start: int, forced: str | None
) -> SamplingParams:
    """``params`` with the grammar the request's ``response_format`` asks for, or the
    ``forced`` calls' grammar, over the ids sampled after the prompt's ``start`` ids
    (compiled off the event loop)."""
    grammar = body.response_format.grammar() if body.response_format is not None else None
    if grammar is not None and forced is not None:
        raise FieldError("response_format", "cannot be combined with a forced tool_choice")
    param = "response_format" if grammar is not None else "tools"
    grammar = grammar or forced
    if grammar is None:
        return params
    tokenizer = await run_in_threadpool(lambda: tracker.model.grammar_tokenizer)
    constraint = await run_in_threadpool(constraint_of, grammar, tokenizer, start, param)
    return replace(params, constraint=constraint)


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
        # a chat reply split into content, reasoning and calls, per choice (else all content)
        self.parts: dict[int, ChatReply] = {}

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
            message: dict[str, Any] = {"role": "assistant", "content": done.text}
            finish: str = done.finish_reason
            if index in self.parts:
                message, called = self.parts[index].message(done.text)
                finish = "tool_calls" if called else finish
            choice = {"index": index, "finish_reason": finish, "message": message}
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
        parts: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if parts is not None:
                delta.update(parts)
            elif text is not None:
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
        part = self.parts.get(index)
        parts = _merged(part.grow(event.text)) if part is not None else None
        meta = {"ids": [event.token_id]}
        return self.chunk(index, event.text, None, meta, logprobs=lp, parts=parts)

    def final_chunks(self, index: int, done: DoneEvent) -> list[dict[str, Any]]:
        """A choice's last chunks: what its end settles (calls), then the finish."""
        part = self.parts.get(index)
        if part is None:
            return [self.chunk(index, None, done.finish_reason, self._final_meta(index, done))]
        deltas, called = part.end(done.text)
        out = [self.chunk(index, None, None, {}, parts=d) for d in deltas]
        finish = "tool_calls" if called else done.finish_reason
        return [*out, self.chunk(index, None, finish, self._final_meta(index, done), parts={})]

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
                for chunk in reply.final_chunks(index, event):
                    yield _data(chunk)
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


def _merged(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Deltas of different parts as one (a chunk's delta may carry several)."""
    out: dict[str, Any] = {}
    for d in deltas:
        for key, value in d.items():
            out[key] = out.get(key, "") + value
    return out


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def usage(dones: Sequence[DoneEvent]) -> dict[str, Any]:
    """The prompt's tokens (once: every choice has the same prompt) and every choice's."""
    prompt = dones[0].prompt_tokens
    completion = sum(len(done.ids) for done in dones)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        # OpenAI's field: prompt tokens whose KV came from the nodes' prefix caches.
        "prompt_tokens_details": {"cached_tokens": dones[0].cached_tokens},
    }
