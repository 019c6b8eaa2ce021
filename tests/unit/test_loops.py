"""The tracker's background loops outlive a failed pass: each counts the failure in its
``LoopHealth`` and runs its next pass. Failures are injected into fakes (or, for
retention, into a real store) that fail once and then work."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from meshnet.api.app import sweep_forever
from meshnet.errors import DatabaseUnavailable
from meshnet.tracker.loops import LoopHealth
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshots import SnapshotStore
from meshnet.tracker.sessions.outbox import Outbox, OutboxConfig
from meshnet.tracker.sessions.retention import Retention, RetentionPolicy
from meshnet.tracker.sessions.sessions import SessionPolicy, Sessions
from meshnet.tracker.storage.database import open_database

FAILURES: list[Exception] = [
    sqlite3.OperationalError("database is locked"),
    DatabaseUnavailable("the database went away"),
    RuntimeError("a bug"),
]


class FailsFirst:
    """A call that raises ``error`` the first time and returns ``value`` after; counts calls."""

    def __init__(self, error: Exception, value: Any) -> None:
        self.error, self.value, self.calls = error, value, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return self.value


def run_until(loop: Awaitable[None], done: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Run ``loop`` as a task until ``done()`` holds (or the timeout), then cancel it."""

    async def scenario() -> None:
        task = asyncio.ensure_future(loop)
        for _ in range(int(timeout_s / 0.01)):
            if done() or task.done():
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())


def _failed_once_then_passed(health: LoopHealth, error: Exception) -> None:
    assert health.failures == 1 and health.failing == 0
    assert health.passes >= 1
    assert health.last_failure == f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("error", FAILURES, ids=lambda e: type(e).__name__)
def test_the_outbox_polls_on_after_a_failed_pass(error: Exception) -> None:
    deliverable = FailsFirst(error, [])
    store = SimpleNamespace(deliverable=deliverable)
    outbox = Outbox(store, None, None, OutboxConfig(poll_s=0.01))  # type: ignore[arg-type]
    run_until(outbox.run_forever(), lambda: outbox.health.passes >= 2)
    assert deliverable.calls >= 3
    _failed_once_then_passed(outbox.health, error)


@pytest.mark.parametrize("error", FAILURES, ids=lambda e: type(e).__name__)
def test_the_session_policy_runs_on_after_a_failed_pass(error: Exception) -> None:
    idle = FailsFirst(error, [])
    tracker = SimpleNamespace(store=SimpleNamespace(nodes=lambda: []))
    store = SimpleNamespace(sessions=idle)
    policy = SessionPolicy(interval_s=0.01)
    sessions = Sessions(tracker, store, None, None, policy)  # type: ignore[arg-type]
    run_until(sessions.run_policy_forever(), lambda: sessions.policy_health.passes >= 2)
    _failed_once_then_passed(sessions.policy_health, error)


@pytest.mark.parametrize("error", FAILURES, ids=lambda e: type(e).__name__)
def test_the_heartbeat_sweeper_sweeps_on_after_a_failed_pass(error: Exception) -> None:
    sweep = FailsFirst(error, None)

    async def sweep_async() -> list[str]:
        sweep()
        return ["node-9"]

    tracker = SimpleNamespace(config=SimpleNamespace(sweep_interval_s=0.01), sweep=sweep_async)
    health = LoopHealth("heartbeat sweeper")
    run_until(sweep_forever(tracker, health), lambda: health.passes >= 2)  # type: ignore[arg-type]
    _failed_once_then_passed(health, error)


@pytest.mark.parametrize("error", FAILURES, ids=lambda e: type(e).__name__)
def test_retention_runs_on_after_a_failed_pass(error: Exception, tmp_path: Path) -> None:
    db = open_database(tmp_path / "t.db")
    store = Store(db)
    retention = Retention(
        store,
        SessionStore(db),
        SnapshotStore(db, tmp_path / "snapshots"),
        RetentionPolicy(interval_s=0.01),
    )
    purge = FailsFirst(error, 0)
    retention.store = SimpleNamespace(purge_ledger=purge, purge_dead_nodes=lambda *_: 0)  # type: ignore[assignment]
    try:
        run_until(retention.run_forever(), lambda: retention.health.passes >= 2)
    finally:
        db.close()
    assert purge.calls >= 3
    _failed_once_then_passed(retention.health, error)
