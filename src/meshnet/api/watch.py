"""Operators watch the mesh: sessions listed by page, and its state changes as a stream.

``GET /admin/sessions`` lists sessions by state, model and tenant, a page at a
time. ``GET /admin/events`` is a server-sent event stream of every session's
and node's state change (tracker/watch/events.py), resumed from the last id seen
(``Last-Event-ID`` or ``?after=``); a watcher too far behind first gets a
``reset`` event, its cue to list afresh. Both are the admin's. Streams are
bounded: past ``max_streams`` at once a new one is 429.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import StreamingResponse

from meshnet.api.auth import require_admin
from meshnet.api.state import sessions_of
from meshnet.errors import NotFound, Overloaded, RequestError
from meshnet.tracker.session_data.records import SessionState
from meshnet.tracker.session_data.session_list import MAX_PAGE, SessionFilter, SessionList
from meshnet.tracker.watch.events import EventLog

router = APIRouter(dependencies=[Depends(require_admin)])

KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing a quiet stream


@dataclass
class Watching:
    """What the watch endpoints share: the event log, the listing, the open streams."""

    events: EventLog
    sessions: SessionList
    max_streams: int = 32
    streams: int = field(default=0, init=False)  # open now; changed on the event loop only


def _watching(request: Request) -> Watching:
    return request.app.state.watching  # type: ignore[no-any-return]  # app.state is untyped


@router.get("/admin/sessions")
async def list_sessions(
    request: Request,
    state: Annotated[list[str] | None, Query()] = None,
    model: str | None = None,
    tenant: str | None = None,
    after: str = "",
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
) -> dict[str, Any]:
    """A page of sessions, in id order; ``next`` is the ``after`` of the next page.
    ``state`` may be given several times, or as a comma-separated list."""
    try:
        states = tuple(SessionState(s) for v in state or () for s in v.split(","))
    except ValueError:
        known = ", ".join(s.value for s in SessionState)
        raise RequestError(f"state must be one of {known}") from None
    f = SessionFilter(states, model, tenant)
    page = await run_in_threadpool(_watching(request).sessions.page, f, after, limit)
    sessions = sessions_of(request)

    def described() -> list[dict[str, Any]]:
        out = []
        for s in page.sessions:
            try:
                record = sessions.store.get(s.id)
            except NotFound:  # purged between the page and now
                continue
            out.append({**sessions.describe(record), "model": s.model, "tenant": s.tenant})
        return out

    return {"sessions": await run_in_threadpool(described), "next": page.next}


@router.get("/admin/events", response_model=None)
async def events(
    request: Request, after: Annotated[int | None, Query(ge=0)] = None
) -> StreamingResponse:
    """State changes from the one after ``after`` (or ``Last-Event-ID``; else from now on),
    as server-sent events, until the watcher hangs up."""
    watching = _watching(request)
    last = after if after is not None else _last_event_id(request)
    if last is None:
        last = watching.events.last_id
    if watching.streams >= watching.max_streams:
        raise Overloaded(f"{watching.max_streams} event streams are open", retry_after_s=5)
    return StreamingResponse(
        _stream(request, watching, last),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def _last_event_id(request: Request) -> int | None:
    raw = request.headers.get("last-event-id")
    if raw is None:
        return None
    if not raw.isdigit() or len(raw) > 19:
        raise RequestError("Last-Event-ID must be an event id")
    return int(raw)


async def _stream(request: Request, watching: Watching, last: int) -> AsyncIterator[str]:
    # Counted from the body's first read: a stream whose client left before it began
    # never runs its ``finally``, and must not hold a slot.
    watching.streams += 1
    try:
        yield ": meshnet events\n\n"  # the stream is open: headers and a first line now
        while not await request.is_disconnected():
            since = watching.events.since(last)
            if since.missed:
                oldest = since.events[0].id if since.events else watching.events.last_id + 1
                yield _frame(None, "reset", {"oldest": oldest})
            for e in since.events:
                yield _frame(e.id, e.kind, e.json())
                last = e.id
            if since.missed and not since.events:
                last = watching.events.last_id
            await watching.events.wait(last, KEEPALIVE_S)
            if watching.events.last_id <= last:
                yield ": keep-alive\n\n"
    finally:
        watching.streams -= 1


def _frame(event_id: int | None, name: str, data: dict[str, Any]) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    return f"{head}event: {name}\ndata: {json.dumps(data)}\n\n"
