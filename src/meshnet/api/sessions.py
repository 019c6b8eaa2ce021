"""The sessions API: stateful conversations whose KV the mesh keeps between turns.

``POST /v1/sessions`` starts one; ``POST /v1/sessions/{id}/turns`` adds a
user turn and answers the reply (``Idempotency-Key`` makes a retried request
return the first turn's result); ``park`` and ``evict`` move its KV down the
ladder; ``GET`` describes it; ``DELETE`` ends it, after which turns get 410.

A session is on the model it was opened on (``model``; default the tracker's
first model). A turn may name its model too: another model than the session's
is a 400. When the session's model is replaced, its next turn runs on the
replacement, re-prefilled from the conversation (``tracker/sessions/model_turns.py``).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from meshnet.api.auth import CallingTenant, auth_of, require_owner
from meshnet.api.errors import error_body
from meshnet.api.quotas import Slot, check_kv, check_sessions
from meshnet.api.schemas import DEFAULT_MAX_TOKENS, MAX_PROMPT_CHARS
from meshnet.api.state import models_of, outbox_of, session_models_of, sessions_of, tracker_of
from meshnet.api.tenants import Tenant
from meshnet.errors import MeshnetError, NotFound, RequestError, SessionGone, error_for_kind
from meshnet.model.sampling import MAX_STOP_STRINGS
from meshnet.tracker.accounting import billing
from meshnet.tracker.routing.driver import TokenEvent
from meshnet.tracker.session_data.records import TurnRecord, TurnStatus
from meshnet.tracker.sessions.outbox import Outbox
from meshnet.tracker.sessions.parking import park_json

router = APIRouter()

_MAX_KEY = 256
_TURN_WAIT_S = 900.0  # a turn not final by then is answered 202 with its id


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_ModelName = Field(default=None, min_length=1, max_length=256)


class NewSession(_Strict):
    system: str | None = Field(default=None, max_length=MAX_PROMPT_CHARS)
    model: str | None = _ModelName  # None: the tracker's first model


class TurnRequest(_Strict):
    content: str = Field(min_length=1, max_length=MAX_PROMPT_CHARS)
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    model: str | None = _ModelName  # when given: the session's model (or a name of it)


def _usage(request: Request, tenant: Tenant) -> tuple[int, int]:
    """The tenant's sessions not ended, and the bytes of KV they hold."""
    store = sessions_of(request).store
    spec = tracker_of(request).model.spec
    per_layer = 2 * spec.kv_width * 4  # one position's keys and values in a layer, float32
    windows = [spec.layer_window(layer) for layer in range(spec.n_layers)]
    owned = (store.find(s) for s in auth_of(request).tenants.owned(tenant.id))
    live = [s for s in owned if s is not None and not s.state.terminal]
    held = (min(s.kv_tokens, w) if w else s.kv_tokens for s in live for w in windows)
    return len(live), sum(held) * per_layer  # a windowed layer keeps its window only


@router.post("/v1/sessions")
async def create_session(
    request: Request, tenant: CallingTenant, body: NewSession | None = None
) -> dict[str, Any]:
    if tenant.quotas.max_sessions:
        check_sessions(tenant, _usage(request, tenant)[0])
    models = models_of(request)
    model = models.for_request(body.model) if body and body.model else models.first
    auth_of(request).quotas.admit(tenant, stream=False)
    session = sessions_of(request).create(body.system if body else None)
    bound = session_models_of(request)
    if bound is not None:
        bound.bind(session.id, model.name)
    auth_of(request).tenants.own(session.id, tenant.id)
    return {"id": session.id, "state": session.state.value, "model": model.name}


def _model_of(request: Request, session_id: str) -> str:
    """The model the session is on (as recorded)."""
    bound = session_models_of(request)
    recorded = bound.model_of(session_id) if bound is not None else None
    return recorded or models_of(request).first_name


def _check_model(request: Request, session_id: str, named: str | None) -> None:
    """``RequestError`` when a turn names a model other than its session's."""
    if named is None:
        return
    models, on = models_of(request), _model_of(request, session_id)
    if models.for_request(named).name != models.for_request(on).name:
        raise RequestError(f"session {session_id} is on model {on!r}, not {named!r}")


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request, tenant: CallingTenant) -> dict[str, Any]:
    require_owner(request, tenant, session_id)
    sessions = sessions_of(request)
    described = sessions.describe(sessions.store.get(session_id))
    return {**described, "model": _model_of(request, session_id)}


@router.delete("/v1/sessions/{session_id}")
async def delete_session(
    session_id: str, request: Request, tenant: CallingTenant
) -> dict[str, Any]:
    require_owner(request, tenant, session_id)
    session = await sessions_of(request).end(session_id)
    return {"id": session.id, "state": session.state.value}


@router.post("/v1/sessions/{session_id}/park")
async def park_session(session_id: str, request: Request, tenant: CallingTenant) -> dict[str, Any]:
    require_owner(request, tenant, session_id)
    sessions = sessions_of(request)
    session, hops = await sessions.park(session_id)
    return {**sessions.describe(session), "park": park_json(hops)}


@router.post("/v1/sessions/{session_id}/evict")
async def evict_session(session_id: str, request: Request, tenant: CallingTenant) -> dict[str, Any]:
    require_owner(request, tenant, session_id)
    sessions = sessions_of(request)
    return sessions.describe(await sessions.evict(session_id))


@router.get("/v1/sessions/{session_id}/turns/{turn_id}", response_model=None)
async def get_turn(
    session_id: str, turn_id: str, request: Request, tenant: CallingTenant
) -> JSONResponse:
    require_owner(request, tenant, session_id)
    turn = sessions_of(request).store.turn(turn_id)
    if turn.session_id != session_id:
        raise NotFound(f"no turn {turn_id!r} in session {session_id!r}")
    return _answer(turn)


@router.post("/v1/sessions/{session_id}/turns", response_model=None)
async def add_turn(
    session_id: str,
    body: TurnRequest,
    request: Request,
    tenant: CallingTenant,
    idempotency_key: str | None = Header(default=None, max_length=_MAX_KEY),
) -> JSONResponse | StreamingResponse:
    require_owner(request, tenant, session_id)
    _check_model(request, session_id, body.model)
    if tenant.quotas.max_kv_bytes:
        check_kv(tenant, _usage(request, tenant)[1])
    # Counted as a request (and its tokens as they come); the turn, once accepted, runs
    # to its end whatever the client does, so it holds no stream of the tenant's.
    slot = auth_of(request).quotas.admit(tenant, stream=False)
    outbox = outbox_of(request)
    fields = body.model_dump(exclude={"stream", "model"})
    turn = outbox.accept(session_id, idempotency_key, fields)
    billing.attribute(tracker_of(request).store.db, turn.id, tenant.id)  # its generation id
    if turn.status.final:  # a repeated Idempotency-Key: the first turn's outcome
        return _answer(turn)
    if body.stream:
        # The delivery starts here, before this handler yields: the outbox's loop, woken
        # by the accept, would otherwise take the turn first, without its token callback,
        # and the stream would send the result but none of its tokens.
        tokens: asyncio.Queue[TokenEvent | None] = asyncio.Queue()
        delivering = _deliver_streamed(outbox, turn, slot, tokens)
        return StreamingResponse(
            _stream(outbox, turn, tokens, delivering),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    outbox.start_delivery(turn)
    final = await outbox.wait(turn.id, _TURN_WAIT_S)
    if final.status is TurnStatus.DONE and final.result is not None:
        slot.charge(len(final.result.get("ids", ())))
    return _answer(final)


def _answer(turn: TurnRecord) -> JSONResponse:
    """A final turn's result (or its typed error); a turn still pending is 202."""
    if turn.status is TurnStatus.DONE and turn.result is not None:
        return JSONResponse({**turn.result, "attempts": turn.attempts})
    if turn.status.final:
        raise _turn_error(turn)
    body = {"turn_id": turn.id, "status": turn.status.value, "attempts": turn.attempts}
    return JSONResponse(body, status_code=202)


def _turn_error(turn: TurnRecord) -> MeshnetError:
    error = turn.error or {}
    if turn.status is TurnStatus.DROPPED:
        return SessionGone(error.get("message", "the session ended before this turn ran"))
    kind, message = error.get("kind", "internal"), error.get("message", "the turn failed")
    e = error_for_kind(kind, message)
    return e if type(e) is not MeshnetError else RequestError(message)


def _deliver_streamed(
    outbox: Outbox, turn: TurnRecord, slot: Slot, tokens: asyncio.Queue[TokenEvent | None]
) -> asyncio.Task[bool] | None:
    """Start delivering ``turn``, its tokens put on ``tokens`` and then None; None (and
    None put) where this tracker delivers it already (a repeated Idempotency-Key)."""

    async def on_token(event: TokenEvent) -> None:
        slot.charge(1)
        await tokens.put(event)

    # A client that hangs up does not cancel the turn: it was accepted, it completes.
    task = outbox.start_delivery(turn, on_token)
    if task is None:
        tokens.put_nowait(None)
    else:
        task.add_done_callback(lambda _: tokens.put_nowait(None))
    return task


async def _stream(
    outbox: Outbox,
    turn: TurnRecord,
    tokens: asyncio.Queue[TokenEvent | None],
    delivering: asyncio.Task[bool] | None,
) -> AsyncIterator[str]:
    """Tokens as the delivering attempt makes them, then the turn's result."""
    while (event := await tokens.get()) is not None:
        yield _data({"type": "token", "id": event.token_id, "text": event.text})
    if delivering is not None:
        await asyncio.wait({delivering})  # its end, whatever it raised (the turn says)
    final = await outbox.wait(turn.id, _TURN_WAIT_S)
    if final.status is TurnStatus.DONE and final.result is not None:
        yield _data({"type": "done", **final.result})
    elif final.status.final:
        yield _data(error_body(_turn_error(final)))
    else:
        yield _data({"type": "pending", "turn_id": final.id, "attempts": final.attempts})
    yield "data: [DONE]\n\n"


def _data(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
