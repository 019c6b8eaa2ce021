"""The one object the HTTP handlers share: the tracker, stored on the app at creation."""

from __future__ import annotations

from fastapi import Request

from meshnet.tracker.service import Tracker


def tracker_of(request: Request) -> Tracker:
    return request.app.state.tracker  # type: ignore[no-any-return]
