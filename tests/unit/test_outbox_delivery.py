"""The outbox's delivery under leases, waits and database faults, on a real SQLite store
with a scripted runner in place of the mesh (tracker/sessions/outbox.py).

Two ``Outbox`` objects on two connections to one database file are two trackers
(replicas); a ``Flaky`` store in front of the real one makes chosen calls fail with
``DatabaseUnavailable`` the way a database that went away does.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from meshnet.errors import DatabaseUnavailable, NoRoute, RequestError, WorkerDeath
from meshnet.tracker.accounting.ledger import AttemptStatus, LedgerRecord, LedgerSpool
from meshnet.tracker.session_data.records import SessionRecord, TurnRecord, TurnStatus
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshots import SnapshotStore
from meshnet.tracker.sessions.outbox import Outbox, OutboxConfig, after_failure
from meshnet.tracker.sessions.turns import TurnOutcome
from meshnet.tracker.storage.database import open_database

BODY = {"content": "hi", "max_tokens": 4, "temperature": 0.0}
FAST = OutboxConfig(lease_s=0.6, poll_s=0.02, backoff_base_s=0.001, backoff_cap_s=0.005)

Step = Callable[[], Awaitable[None]]


class Runner:
    """Stands in for ``TurnRunner``: each attempt runs the next scripted step (the last
    one repeats); counts attempts, how many ran at once, and those cancelled."""

    def __init__(self, *steps: Step) -> None:
        self.steps = steps
        self.calls = 0
        self.running = 0
        self.most_at_once = 0
        self.cancelled = 0
        self.written: list[LedgerRecord] = []  # the ledger records that reached the database
        self.ledger = LedgerSpool(lambda records, now: self.written.extend(records))

    def check(self, session: SessionRecord, request: dict[str, Any]) -> None:
        return None

    async def run(self, session: SessionRecord, turn: TurnRecord, on_token: Any) -> TurnOutcome:
        step = self.steps[min(self.calls, len(self.steps) - 1)]
        self.calls += 1
        self.running += 1
        self.most_at_once = max(self.most_at_once, self.running)
        # The driver records work as its attempts end, before the turn completes or fails.
        work = LedgerRecord(turn.id, self.calls, "node-0", 0, 4, 0, 3, AttemptStatus.COMPLETED)
        self.ledger.submit([work])
        try:
            await step()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        after = replace(session, history=[*session.history, [1, 2]], tail=[3])
        return TurnOutcome({"turn_id": turn.id, "text": "ok", "ids": [3]}, after)

    async def release(self, route: Any, session_id: str) -> None:
        return None


def sleeps(seconds: float) -> Step:
    async def step() -> None:
        await asyncio.sleep(seconds)

    return step


def raises(error: Exception) -> Step:
    async def step() -> None:
        raise error

    return step


class Flaky:
    """A ``SessionStore`` whose methods named in ``down`` raise ``DatabaseUnavailable``
    (each for its first ``times`` calls, or while ``times`` is None and it is listed)."""

    def __init__(self, store: SessionStore) -> None:
        self._store = store
        self.down: dict[str, int | None] = {}
        self.refused: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._store, name)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            if name in self.down:
                left = self.down[name]
                if left is None or left > 0:
                    if left is not None:
                        self.down[name] = left - 1
                    self.refused[name] = self.refused.get(name, 0) + 1
                    raise DatabaseUnavailable(f"{name}: the database went away")
            return target(*args, **kwargs)

        return call


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "tracker.db"


@pytest.fixture
def stores(db_path: Path) -> Iterator[list[SessionStore]]:
    """Two connections to one database: two trackers' stores."""
    dbs = [open_database(db_path), open_database(db_path)]
    yield [SessionStore(db) for db in dbs]
    for db in dbs:
        db.close()


def outbox(store: Any, runner: Runner, tmp_path: Path, config: OutboxConfig = FAST) -> Outbox:
    db = open_database(tmp_path / "snapshots.db")  # the snapshot store's own (none is written)
    return Outbox(store, runner, SnapshotStore(db, tmp_path / "snapshots"), config)  # type: ignore[arg-type]


def accept(box: Outbox) -> TurnRecord:
    box.store.create("s1", None, time.time())
    return box.accept("s1", None, dict(BODY))


def run(scenario: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario, 20))


async def until_final(store: SessionStore, turn_id: str, timeout_s: float = 10) -> TurnRecord:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        turn = store.turn(turn_id)
        if turn.status.final:
            return turn
        await asyncio.sleep(0.01)
    raise AssertionError(f"turn {turn_id} not final: {store.turn(turn_id)}")


async def looping(*boxes: Outbox) -> list[asyncio.Task[None]]:
    return [asyncio.create_task(box.run_forever()) for box in boxes]


async def stop(tasks: list[asyncio.Task[None]], *boxes: Outbox) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for box in boxes:
        await box.stop()


def test_a_loop_woken_as_it_is_cancelled_stops(stores: list[SessionStore], tmp_path: Path) -> None:
    """A tracker stopping cancels its delivery loop; a turn accepted in the same moment
    wakes it. The cancel must still stop the loop (Python 3.11's ``asyncio.wait_for``
    returned the wake and dropped the cancel, so the loop ran on and the stop hung)."""
    box = outbox(stores[0], Runner(sleeps(0)), tmp_path)

    async def scenario() -> None:
        loop = asyncio.create_task(box.run_forever())
        await asyncio.sleep(FAST.poll_s * 3)  # waiting on its wake, between polls
        accept(box)  # wakes it...
        loop.cancel()  # ...as it is told to stop, in the same tick
        done, _ = await asyncio.wait({loop}, timeout=5)
        assert loop in done and loop.cancelled(), "the loop ran on after its cancel"
        await box.stop()

    run(scenario())


def test_a_delivery_started_with_the_accept_keeps_its_token_callback(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    """A streamed turn's delivery starts, with its token callback, before the API
    handler yields; the loop, woken by the accept, must leave that turn to it (else the
    stream got the result but none of its tokens)."""
    seen: list[Any] = []

    class Recording(Runner):
        async def run(self, session: SessionRecord, turn: TurnRecord, on_token: Any) -> TurnOutcome:
            seen.append(on_token)
            return await super().run(session, turn, on_token)

    box = outbox(stores[0], Recording(sleeps(0)), tmp_path)

    async def on_token(event: Any) -> None:
        return None

    async def scenario() -> TurnRecord:
        loops = await looping(box)
        await asyncio.sleep(FAST.poll_s * 3)  # the loop waits on its wake
        turn = accept(box)  # wakes it
        started = box.start_delivery(turn, on_token)
        assert started is not None and box.start_delivery(turn) is None  # one at a time
        done = await until_final(stores[0], turn.id)
        await stop(loops, box)
        return done

    done = run(scenario())
    assert done.status is TurnStatus.DONE and seen == [on_token]


# --- leases: one attempt at a time (issue 15, item 5) ----------------------------------


def stall_past_the_lease() -> Step:
    async def step() -> None:
        time.sleep(FAST.lease_s * 2)  # the whole process stalls: no renewal runs
        await asyncio.sleep(0.2)

    return step


@pytest.mark.parametrize("streamed", [False, True], ids=["loop-and-client", "streamed"])
def test_one_tracker_never_runs_a_turn_twice_at_once_even_past_its_lease(
    stores: list[SessionStore], tmp_path: Path, streamed: bool
) -> None:
    """The event loop stalls past the lease while the attempt runs (a loaded machine);
    then the delivery loop and a client's retry find the lapsed turn, and (streamed) a
    streaming request delivers it directly. None of them claims it again: within a
    tracker one task delivers a turn."""
    runner = Runner(stall_past_the_lease())
    box = outbox(stores[0], runner, tmp_path)

    async def scenario() -> TurnRecord:
        turn = accept(box)
        box.start_delivery(turn)
        loops = await looping(box)
        await asyncio.sleep(0.05)
        for _ in range(10):  # the lease has lapsed: every way in tries it
            box.start_delivery(turn)
            if streamed:
                assert await box.deliver(turn) is False
            await asyncio.sleep(0.02)
        done = await until_final(stores[0], turn.id)
        await stop(loops, box)
        return done

    done = run(scenario())
    assert done.status is TurnStatus.DONE
    assert (runner.calls, runner.most_at_once, done.attempts) == (1, 1, 1)


def test_a_renewal_the_database_refuses_once_keeps_the_lease(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    """One refused renewal must not let the lease lapse for good: another tracker
    polling the same database never gets the turn while the attempt runs."""
    runner = Runner(sleeps(FAST.lease_s * 4))
    flaky = Flaky(stores[0])
    flaky.down["renew"] = 1
    a, b = outbox(flaky, runner, tmp_path), outbox(stores[1], runner, tmp_path)

    async def scenario() -> TurnRecord:
        turn = accept(a)
        a.start_delivery(turn)
        await asyncio.sleep(0.01)
        loops = await looping(b)  # the other tracker looks for lapsed leases
        done = await until_final(stores[1], turn.id)
        await stop(loops, a, b)
        return done

    done = run(scenario())
    assert flaky.refused["renew"] == 1
    assert done.status is TurnStatus.DONE
    assert (runner.calls, runner.most_at_once, done.attempts) == (1, 1, 1)


def test_an_attempt_whose_turn_another_tracker_took_over_is_stopped(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    """Tracker A cannot renew for longer than the lease; B claims the lapsed turn and
    runs it. As soon as A can tell (its next renewal finds the turn is B's), A's
    attempt is cancelled: the two never run on together to the end."""
    slow = Runner(sleeps(FAST.lease_s * 10))
    quick = Runner(sleeps(FAST.lease_s * 2))
    flaky = Flaky(stores[0])
    a, b = outbox(flaky, slow, tmp_path), outbox(stores[1], quick, tmp_path)

    async def scenario() -> TurnRecord:
        turn = accept(a)
        flaky.down["renew"] = None  # A's renewals are refused from now on
        flaky.down["turn"] = None
        a.start_delivery(turn)
        await asyncio.sleep(FAST.lease_s * 1.5)  # A's lease lapses
        loops = await looping(b)
        while quick.calls == 0:
            await asyncio.sleep(0.01)
        flaky.down.clear()  # A reaches the database again: the turn is B's now
        await asyncio.sleep(FAST.lease_s)
        assert slow.running == 0, "A's attempt should have been stopped"
        done = await until_final(stores[1], turn.id)
        await stop(loops, a, b)
        return done

    done = run(scenario())
    assert slow.cancelled == 1 and quick.calls == 1
    assert done.status is TurnStatus.DONE and done.attempts == 2


def test_a_finished_attempt_another_tracker_delivered_again_is_not_billed(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    """A's attempt finishes but A cannot write the turn, nor renew, until its lease
    lapses; B delivers the turn again. The work of both attempts reaches the ledger,
    and only the delivery that completed the turn is billable: A's is ``superseded``."""
    first, second = Runner(sleeps(0)), Runner(sleeps(0))
    flaky = Flaky(stores[0])
    a, b = outbox(flaky, first, tmp_path), outbox(stores[1], second, tmp_path)

    async def scenario() -> TurnRecord:
        turn = accept(a)
        flaky.down.update({"complete_turn": None, "renew": None, "turn": None})
        a.start_delivery(turn)
        while first.calls == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(FAST.lease_s * 1.5)  # A's lease lapses, its result unwritten
        loops = await looping(b)
        done = await until_final(stores[1], turn.id)
        flaky.down.clear()  # A reaches the database again: the turn is B's
        while a._delivering:
            await asyncio.sleep(0.01)
        await stop(loops, a, b)
        return done

    done = run(scenario())
    assert done.status is TurnStatus.DONE and (first.calls, second.calls) == (1, 1)
    work = first.written + second.written
    assert [r.billable for r in second.written] == [True]
    assert [(r.status, r.kind) for r in first.written] == [(AttemptStatus.CANCELLED, "superseded")]
    assert sum(r.tokens for r in work if r.billable) == 3  # the turn's work, billed once


def test_a_failed_attempts_completed_work_is_not_billed(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    """Work an attempt finished before the attempt failed is redone by the next one,
    which alone bills it."""
    runner = Runner(raises(WorkerDeath("node-1 died", "node-1")), sleeps(0))
    box = outbox(stores[0], runner, tmp_path)

    async def scenario() -> TurnRecord:
        turn = accept(box)
        loops = await looping(box)
        box.start_delivery(turn)
        done = await until_final(stores[0], turn.id)
        await stop(loops, box)
        return done

    done = run(scenario())
    assert done.status is TurnStatus.DONE and runner.calls == 2
    assert [(r.epoch, r.billable) for r in runner.written] == [(1, False), (2, True)]


# --- waits and attempts ----------------------------------------------------------------


def test_a_mesh_without_a_route_is_waited_out_without_using_up_attempts(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    """The only node of a span is down for a while (marked down by a missed heartbeat,
    restarting): attempts fail with no-route, more of them than ``max_attempts``. The
    turn is delivered once the route is back, not failed."""
    no_route = raises(NoRoute("no live node serves layer 2"))
    runner = Runner(*[no_route] * 8, sleeps(0))
    box = outbox(stores[0], runner, tmp_path, replace(FAST, max_attempts=3))

    async def scenario() -> TurnRecord:
        turn = accept(box)
        loops = await looping(box)
        done = await until_final(stores[0], turn.id)
        await stop(loops, box)
        return done

    done = run(scenario())
    assert done.status is TurnStatus.DONE and done.attempts == 9
    assert done.error is None


def test_a_turn_fails_when_the_route_stays_gone_past_max_wait(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    runner = Runner(raises(NoRoute("no live node serves layer 2")))
    box = outbox(stores[0], runner, tmp_path, replace(FAST, max_wait_s=0.2))

    async def scenario() -> TurnRecord:
        turn = accept(box)
        loops = await looping(box)
        done = await until_final(stores[0], turn.id)
        await stop(loops, box)
        return done

    done = run(scenario())
    assert done.status is TurnStatus.FAILED and done.error is not None
    assert done.error["kind"] == "no-route" and done.error["failed_runs"] == 0


def test_failures_of_attempts_that_ran_use_up_attempts(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    runner = Runner(raises(WorkerDeath("node-1 died", "node-1")))
    box = outbox(stores[0], runner, tmp_path, replace(FAST, max_attempts=3))

    async def scenario() -> TurnRecord:
        turn = accept(box)
        loops = await looping(box)
        done = await until_final(stores[0], turn.id)
        await stop(loops, box)
        return done

    done = run(scenario())
    assert done.status is TurnStatus.FAILED and done.attempts == 3
    assert done.error is not None and done.error["kind"] == "worker-death"


def test_after_failure_waits_keep_the_count_and_runs_reset_the_wait() -> None:
    rng = random.Random(0)
    config = OutboxConfig(max_attempts=2, max_wait_s=60)
    wait = after_failure(NoRoute("none"), None, 1, 100.0, config, rng)
    assert wait.in_s is not None and wait.error["waiting_since"] == 100.0
    again = after_failure(NoRoute("none"), wait.error, 2, 150.0, config, rng)
    assert again.in_s is not None and again.error["waiting_since"] == 100.0
    late = after_failure(NoRoute("none"), again.error, 3, 161.0, config, rng)
    assert late.in_s is None  # waited 61 s
    ran = after_failure(WorkerDeath("gone"), again.error, 3, 150.0, config, rng)
    assert ran.in_s is not None and ran.error == {
        "kind": "worker-death",
        "message": "gone",
        "failed_runs": 1,
        "waiting_since": None,
    }
    assert after_failure(WorkerDeath("gone"), ran.error, 4, 150.0, config, rng).in_s is None
    assert after_failure(RequestError("bad"), None, 1, 0.0, config, rng).in_s is None
    bug = after_failure(KeyError("x"), None, 1, 0.0, config, rng)
    assert bug.in_s is not None and bug.error["kind"] == "internal"


# --- database faults: nothing accepted is lost, nothing finished withheld -------------


def test_a_finished_answer_is_served_while_its_write_is_retried(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    """The database goes away as the generation ends: the client waiting on the turn
    gets the finished result at once; the result is written when the database is
    back, exactly once."""
    runner = Runner(sleeps(0.05))
    flaky = Flaky(stores[0])
    box = outbox(flaky, runner, tmp_path)

    async def scenario() -> tuple[TurnRecord, TurnRecord]:
        turn = accept(box)
        flaky.down.update({"complete_turn": None, "turn": None, "renew": None})
        box.start_delivery(turn)
        answered = await box.wait(turn.id, 5)
        assert flaky.refused["complete_turn"] >= 1 and stores[1].turn(turn.id).status is (
            TurnStatus.RUNNING
        )
        flaky.down.clear()
        return answered, await until_final(stores[1], turn.id)

    answered, written = run(scenario())
    assert answered.status is TurnStatus.DONE and answered.result is not None
    assert written.status is TurnStatus.DONE and written.result == answered.result
    assert runner.calls == 1
    assert stores[1].get("s1").history == [[1, 2]]  # applied once


def test_a_failure_the_database_cannot_record_is_delivered_again_after_its_lease(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    runner = Runner(raises(WorkerDeath("node-1 died", "node-1")), sleeps(0))
    flaky = Flaky(stores[0])
    flaky.down["retry_later"] = 1
    box = outbox(flaky, runner, tmp_path)

    async def scenario() -> TurnRecord:
        turn = accept(box)
        assert await box.deliver(turn) is True  # its failure could not be written: no raise
        assert stores[0].turn(turn.id).status is TurnStatus.RUNNING
        loops = await looping(box)
        done = await until_final(stores[0], turn.id)
        await stop(loops, box)
        return done

    done = run(scenario())
    assert done.status is TurnStatus.DONE and done.attempts == 2 and runner.calls == 2


def test_a_client_waiting_on_an_unreadable_database_gets_a_typed_error(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    """Nothing here delivers the turn (another tracker holds it) and the database
    cannot be read: ``DatabaseUnavailable`` (a 503) after the grace, not a hang."""
    flaky = Flaky(stores[0])
    box = outbox(flaky, Runner(sleeps(0)), tmp_path, replace(FAST, db_grace_s=0.1))

    async def scenario() -> None:
        turn = accept(box)
        flaky.down["turn"] = None
        with pytest.raises(DatabaseUnavailable):
            await box.wait(turn.id, 5)

    run(scenario())


def test_a_claim_the_database_refuses_is_not_a_delivery(
    stores: list[SessionStore], tmp_path: Path
) -> None:
    flaky = Flaky(stores[0])
    runner = Runner(sleeps(0))
    box = outbox(flaky, runner, tmp_path)

    async def scenario() -> None:
        turn = accept(box)
        flaky.down["claim"] = 1
        assert await box.deliver(turn) is False
        assert await box.deliver(turn) is True

    run(scenario())
    assert runner.calls == 1
