"""The objects the HTTP handlers share, stored on the app at creation."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from meshnet.tracker.outbox import Outbox
from meshnet.tracker.service import Tracker
from meshnet.tracker.sessions import Sessions


@dataclass(frozen=True)
class SessionServices:
    sessions: Sessions
    outbox: Outbox


def tracker_of(request: Request) -> Tracker:
    return request.app.state.tracker  # type: ignore[no-any-return]


def sessions_of(request: Request) -> Sessions:
    return request.app.state.sessions.sessions  # type: ignore[no-any-return]


def outbox_of(request: Request) -> Outbox:
    return request.app.state.sessions.outbox  # type: ignore[no-any-return]
