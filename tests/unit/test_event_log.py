"""The event log and the state watch: numbered changes, resumed from the last id seen,
a watcher too far behind told so; bounded streams."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from meshnet.api import watch
from meshnet.api.auth import require_admin
from meshnet.api.errors import install_error_handlers
from meshnet.tracker.watch.events import EventLog
from meshnet.tracker.watch.state_watch import StateWatch


def test_events_are_numbered_and_read_after_an_id() -> None:
    log = EventLog(capacity=3)
    for i in range(5):
        log.publish(float(i), "session", f"s{i}", "idle", "")
    assert log.last_id == 5
    recent = log.since(3)
    assert [e.id for e in recent.events] == [4, 5] and not recent.missed
    behind = log.since(1)  # ids 2 was dropped: the watcher missed it
    assert [e.id for e in behind.events] == [3, 4, 5] and behind.missed
    assert log.since(5).events == [] and not log.since(5).missed
    reborn = log.since(99)  # an id of a tracker's earlier life
    assert reborn.missed and [e.id for e in reborn.events] == [3, 4, 5]
    with pytest.raises(ValueError):
        EventLog(capacity=0)


def test_a_waiter_wakes_on_the_next_event_or_its_timeout() -> None:
    async def run() -> list[int]:
        log = EventLog()
        woke: list[int] = []

        async def waiter() -> None:
            await log.wait(0, 30.0)
            woke.append(log.last_id)

        task = asyncio.create_task(waiter())
        await asyncio.sleep(0.01)
        log.publish(0.0, "node", "n", "down", "up")
        await asyncio.wait_for(task, 5)
        await log.wait(1, 0.01)  # nothing newer: returns after its timeout
        return woke

    assert asyncio.run(run()) == [1]


class _Sessions:
    def __init__(self) -> None:
        self.now: dict[str, str] = {}

    def states(self) -> dict[str, str]:
        return dict(self.now)


class _Node:
    def __init__(self, node_id: str, state: str) -> None:
        self.node_id = node_id
        self.state = type("S", (), {"value": state})()


class _Nodes:
    def __init__(self) -> None:
        self.now: list[_Node] = []

    def nodes(self) -> list[_Node]:
        return list(self.now)


def test_the_watch_publishes_what_changed_between_readings() -> None:
    sessions, nodes, log = _Sessions(), _Nodes(), EventLog()
    w = StateWatch(sessions, nodes, log, clock=lambda: 7.0)  # type: ignore[arg-type]
    sessions.now = {"a": "idle"}
    nodes.now = [_Node("n0", "up")]
    assert w.publish(w.read()) == 0  # the first reading is the baseline
    sessions.now = {"a": "parked", "b": "idle"}
    nodes.now = []
    assert w.publish(w.read()) == 3
    seen = {(e.kind, e.subject, e.previous, e.state) for e in log.since(0).events}
    assert seen == {
        ("session", "a", "idle", "parked"),
        ("session", "b", "", "idle"),
        ("node", "n0", "up", ""),
    }
    assert w.publish(w.read()) == 0


def _app(events: EventLog, max_streams: int) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.state.watching = watch.Watching(events, None, max_streams)  # type: ignore[arg-type]
    app.dependency_overrides[require_admin] = lambda: None
    app.include_router(watch.router)
    return app


def test_streams_past_the_bound_are_429_with_retry_after() -> None:
    events = EventLog()
    events.publish(1.0, "session", "s", "idle", "")
    app = _app(events, max_streams=1)
    app.state.watching.streams = 1  # one stream open already
    with TestClient(app) as client:
        r = client.get("/admin/events")
        assert r.status_code == 429 and r.headers["retry-after"] == "5"
        app.state.watching.streams = 0
        r = client.get("/admin/events", headers={"Last-Event-ID": "not-a-number"})
        assert r.status_code == 400


def test_a_stream_sends_the_events_after_the_id_it_was_given() -> None:
    events = EventLog()
    for s in ("a", "b", "c"):
        events.publish(1.0, "session", s, "idle", "")
    app = _app(events, max_streams=2)
    with TestClient(app) as client, client.stream("GET", "/admin/events?after=1") as r:
        assert r.status_code == 200
        seen: list[Any] = []
        for line in r.iter_lines():
            if line.startswith("id: "):
                seen.append(int(line[4:]))
            if len(seen) == 2:
                break
    assert seen == [2, 3]
