"""The objects the HTTP handlers share, stored on the app at creation.

Starlette's ``app.state`` is untyped: each accessor here names the type of what it
reads, hence their ``no-any-return`` ignores.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from meshnet.errors import ModelNotFound
from meshnet.tracker.service import Tracker
from meshnet.tracker.serving.model_admin import ModelAdmin
from meshnet.tracker.serving.served import ServedModels
from meshnet.tracker.session_data.session_models import SessionModels
from meshnet.tracker.sessions.model_turns import ModelTurns
from meshnet.tracker.sessions.outbox import Outbox
from meshnet.tracker.sessions.sessions import Sessions


@dataclass(frozen=True)
class SessionServices:
    sessions: Sessions
    outbox: Outbox


def tracker_of(request: Request) -> Tracker:
    """The first served model's tracker (or what replaced it): the registry, channels
    and whole-tracker views are shared by every model's."""
    try:
        return models_of(request).first.tracker
    except ModelNotFound:
        return request.app.state.tracker  # type: ignore[no-any-return]


def tracker_serving(request: Request, fingerprint: str) -> Tracker:
    """The tracker of the served model a node's fingerprint names (its calibration and
    trust are that model's); the first model's for an empty node or one of no model
    served (routed for none)."""
    for served in models_of(request):
        if served.tracker.model.fingerprint == fingerprint:
            return served.tracker
    return tracker_of(request)


def models_of(request: Request) -> ServedModels:
    return request.app.state.models  # type: ignore[no-any-return]


def model_admin_of(request: Request) -> ModelAdmin:
    return request.app.state.model_admin  # type: ignore[no-any-return]


def sessions_of(request: Request) -> Sessions:
    return request.app.state.sessions.sessions  # type: ignore[no-any-return]


def outbox_of(request: Request) -> Outbox:
    return request.app.state.sessions.outbox  # type: ignore[no-any-return]


def session_models_of(request: Request) -> SessionModels | None:
    """Where sessions' models are recorded; None when the outbox runs turns on one model."""
    runner = outbox_of(request).runner
    return runner.bound if isinstance(runner, ModelTurns) else None
