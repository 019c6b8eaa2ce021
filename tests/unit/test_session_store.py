"""Sessions and the turn outbox in the database, on SQLite and on PostgreSQL alike."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnet.errors import IdempotencyConflict, NotFound, SessionGone
from meshnet.layer_range import LayerRange
from meshnet.tracker.nodes.routes import Hop
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.session_data.records import (
    EPOCH_STRIDE,
    SessionState,
    SnapshotFile,
    TurnStatus,
)
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.sessions.outbox import OutboxConfig, backoff_s
from meshnet.tracker.storage.database import Database, open_database

REQUEST = {"content": "hi", "max_tokens": 4, "temperature": 0.0}


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        database = open_database(tmp_path / "t.db")
    else:
        database = open_database(request.getfixturevalue("fresh_postgres"))
    Store(database)  # the mesh tables live beside the session tables
    yield database
    database.close()


def test_a_turn_is_accepted_once_per_idempotency_key(db: Database) -> None:
    store = SessionStore(db)
    s = store.create("s1", "sys", 1.0)
    a = store.accept_turn(s.id, "t1", "key", "h1", REQUEST, 2.0)
    again = store.accept_turn(s.id, "t2", "key", "h1", REQUEST, 3.0)
    assert again.id == a.id and a.seq == 1 and a.status is TurnStatus.PENDING
    with pytest.raises(IdempotencyConflict):
        store.accept_turn(s.id, "t3", "key", "other-body", REQUEST, 3.0)
    assert store.get(s.id).turns == 1  # the refused and repeated accepts changed nothing
    b = store.accept_turn(s.id, "t4", None, "h2", REQUEST, 4.0)
    assert b.seq == 2 and store.get(s.id).state is SessionState.ACTIVE
    with pytest.raises(NotFound):
        store.accept_turn("nobody", "t5", None, "h", REQUEST, 4.0)


@pytest.mark.parametrize(("kind", "again_new"), [("no-route", True), ("bad-request", False)])
def test_a_key_whose_turn_failed_retryably_takes_the_request_again(
    db: Database, kind: str, again_new: bool
) -> None:
    store = SessionStore(db)
    store.create("s", "sys", 0.0)
    first = store.accept_turn("s", "t1", "key", "h", REQUEST, 1.0)
    assert store.claim(first, "A", 10.0, 1.0)
    store.fail_turn("t1", "A", {"kind": kind, "message": "x"})
    again = store.accept_turn("s", "t2", "key", "h", REQUEST, 2.0)
    if again_new:  # the mesh had no route then: the client's retry is a new turn
        assert again.id == "t2" and again.status is TurnStatus.PENDING
        assert store.accept_turn("s", "t3", "key", "h", REQUEST, 3.0).id == "t2"
        assert store.turn("t1").status is TurnStatus.FAILED  # the first stays, keyless
    else:  # a request that can never succeed keeps its answer
        assert again.id == "t1" and again.status is TurnStatus.FAILED


def test_turns_are_delivered_in_order_under_one_lease(db: Database) -> None:
    store = SessionStore(db)
    store.create("s", None, 0.0)
    first = store.accept_turn("s", "t1", None, "h", REQUEST, 1.0)
    second = store.accept_turn("s", "t2", None, "h", REQUEST, 1.0)
    assert [t.id for t in store.deliverable(2.0)] == ["t1"]
    assert not store.claim(second, "A", 100.0, 2.0)  # the earlier turn comes first
    assert store.claim(first, "A", 100.0, 2.0)
    assert not store.claim(first, "B", 100.0, 2.0)  # one tracker holds it
    assert store.deliverable(50.0) == []
    # A tracker that died lets its lease lapse: another claims the turn, attempt 2.
    assert [t.id for t in store.deliverable(101.0)] == ["t1"]
    assert store.claim(store.turn("t1"), "B", 300.0, 101.0)
    assert store.turn("t1").attempts == 2
    session = store.get("s")
    after = session.__class__(**{**session.__dict__, "history": [[1, 2], [3]], "tail": [4]})
    assert not store.complete_turn("t1", "A", {"ids": [9]}, after, 102.0)  # A lost its lease
    assert store.complete_turn("t1", "B", {"ids": [3, 4]}, after, 102.0)
    assert not store.complete_turn("t1", "B", {"ids": [3, 4]}, after, 103.0)  # once only
    done = store.get("s")
    assert (done.history, done.tail, done.kv_tokens, done.steps) == ([[1, 2], [3]], [4], 3, 2)
    assert done.state is SessionState.ACTIVE  # t2 still waits
    assert [t.id for t in store.deliverable(104.0)] == ["t2"]


def test_retries_wait_their_backoff_and_failures_are_final(db: Database) -> None:
    store = SessionStore(db)
    store.create("s", None, 0.0)
    t = store.accept_turn("s", "t", None, "h", REQUEST, 0.0)
    assert store.claim(t, "A", 10.0, 0.0)
    store.retry_later("t", "A", 5.0, {"kind": "no-route", "message": "x"})
    assert store.deliverable(4.0) == []
    pending = store.turn("t")
    assert pending.status is TurnStatus.PENDING and pending.error == {
        "kind": "no-route",
        "message": "x",
    }
    assert store.claim(pending, "A", 20.0, 5.0)
    store.fail_turn("t", "A", {"kind": "bad-request", "message": "y"})
    assert store.turn("t").status is TurnStatus.FAILED
    assert store.get("s").state is SessionState.IDLE


def test_ending_a_session_drops_its_pending_turns(db: Database) -> None:
    store = SessionStore(db)
    store.create("s", None, 0.0)
    store.accept_turn("s", "t1", None, "h", REQUEST, 0.0)
    store.end("s", SessionState.COMPLETED)
    assert store.turn("t1").status is TurnStatus.DROPPED
    assert store.deliverable(10.0) == []
    with pytest.raises(SessionGone):
        store.accept_turn("s", "t2", None, "h", REQUEST, 1.0)


def test_each_delivery_attempt_reserves_its_own_epochs(db: Database) -> None:
    store = SessionStore(db)
    store.create("s", None, 0.0)
    assert store.next_epoch("s") == 1
    assert store.next_epoch("s") == 1 + EPOCH_STRIDE


def test_the_snapshot_index_names_only_a_session_that_did_not_move(db: Database) -> None:
    store = SessionStore(db)
    store.create("s", None, 0.0)
    s = store.get("s")
    hop = Hop("n", "a:1", LayerRange(0, 2))
    moved = s.__class__(**{**s.__dict__, "history": [[1, 2]], "route": (hop,), "kv_epoch": 3})
    store.accept_turn("s", "t", None, "h", REQUEST, 0.0)
    assert store.claim(store.turn("t"), "A", 10.0, 0.0)
    store.complete_turn("t", "A", {}, moved, 1.0)
    f = SnapshotFile("snap", "s", LayerRange(0, 2), 3, 2, 1, "/x", 10, "f" * 64, "r" * 64, "p")
    stale = SnapshotFile("snap", "s", LayerRange(0, 2), 3, 1, 1, "/x", 10, "f", "r", "p")
    assert not store.index_snapshot(store.get("s"), [stale], 2.0)
    assert store.get("s").snapshot_id is None
    assert store.index_snapshot(store.get("s"), [f], 2.0)
    evicted = store.get("s")
    assert (evicted.state, evicted.snapshot_id) == (SessionState.EVICTED, "snap")
    assert store.snapshot("snap") == [f]


def test_full_jitter_backoff_stays_within_its_cap() -> None:
    config = OutboxConfig(backoff_base_s=0.5, backoff_cap_s=4.0)
    rng = random.Random(1)
    for attempts in range(1, 10):
        waits = [backoff_s(attempts, config, rng) for _ in range(200)]
        limit = min(4.0, 0.5 * 2**attempts)
        assert all(0.0 <= w <= limit for w in waits)
        assert max(waits) > limit * 0.8  # jittered over the whole range


def test_concurrent_accepts_through_two_connections_get_distinct_turns(
    db: Database, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """Two trackers accepting turns of one session at once: each gets its own place."""
    target = (
        tmp_path / "t.db" if db.dialect == "sqlite" else request.getfixturevalue("fresh_postgres")
    )
    first, second = open_database(target), open_database(target)
    try:
        SessionStore(first).create("s", None, 0.0)
        stores = [SessionStore(first), SessionStore(second)]
        seqs: list[int] = []

        def accept(i: int) -> None:
            for j in range(10):
                turn = stores[i % 2].accept_turn("s", f"t{i}-{j}", None, "h", REQUEST, 1.0)
                seqs.append(turn.seq)

        threads = [threading.Thread(target=accept, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(seqs) == list(range(1, 41))
        assert SessionStore(first).get("s").turns == 40
    finally:
        first.close()
        second.close()
