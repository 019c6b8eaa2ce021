"""The changes of sessions' and nodes' states, numbered, for operators to follow.

An operator's dashboard or script watches ``GET /admin/events`` instead of
polling each session by id. Each change is an ``Event`` with an id that grows
by one; a watcher that lost its connection asks again for what came after the
last id it saw. The log keeps the last ``capacity`` events in this tracker's
memory: a watcher further behind is told (``missed``) so it lists afresh, and
events do not survive the tracker (nothing is lost by that: the database holds
the states themselves, and ``GET /admin/sessions`` lists them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Event:
    id: int
    at: float  # the tracker's wall clock when it saw the change
    kind: str  # "session" or "node"
    subject: str  # the session's or the node's id
    state: str  # the state it is in now; "" when it is gone (purged, forgotten)
    previous: str  # the state it was in; "" when it is new

    def json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Since:
    """The events after a watcher's last id, and whether older ones it never saw are gone."""

    events: list[Event]
    missed: bool


class EventLog:
    """The last ``capacity`` events; publish and wait on the tracker's event loop."""

    def __init__(self, capacity: int = 4096) -> None:
        if capacity < 1:
            raise ValueError("an event log holds at least one event")
        self._events: deque[Event] = deque(maxlen=capacity)
        self._last = 0
        self._tick = asyncio.Event()

    @property
    def last_id(self) -> int:
        """The id of the newest event (0 before the first)."""
        return self._last

    def publish(self, at: float, kind: str, subject: str, state: str, previous: str) -> Event:
        self._last += 1
        event = Event(self._last, at, kind, subject, state, previous)
        self._events.append(event)
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()  # every watcher waiting for a newer event wakes
        return event

    def since(self, last_id: int) -> Since:
        """The events after ``last_id`` still held, oldest first."""
        if last_id > self._last:  # an id of this tracker's previous life: start afresh
            return Since(list(self._events), missed=True)
        first = self._events[0].id if self._events else self._last + 1
        events = [e for e in self._events if e.id > last_id]
        return Since(events, missed=last_id + 1 < first)

    async def wait(self, last_id: int, timeout_s: float) -> None:
        """Return once an event newer than ``last_id`` is held, or after ``timeout_s``."""
        if self._last > last_id:
            return
        tick = self._tick
        with contextlib.suppress(TimeoutError):  # asyncio.timeout keeps a caller's cancel
            async with asyncio.timeout(timeout_s):
                await tick.wait()
