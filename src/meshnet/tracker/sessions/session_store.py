"""Sessions, their turns (the prompt outbox) and the snapshot index, in the tracker's database.

A session row holds everything needed to rebuild its KV anywhere: the steps
the nodes were fed (the token history), the route and epoch that hold the
KV now, and the snapshot that holds it when evicted. A turn row is an outbox
entry: written with the session update in one transaction when accepted,
claimed under a lease by whichever tracker delivers it, retried with backoff,
and completed together with the session's new history in one transaction, so
a turn is applied to a session exactly once however often it is delivered.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from meshnet.errors import IdempotencyConflict, NotFound, SessionGone, error_for_kind
from meshnet.layer_range import LayerRange
from meshnet.tracker.nodes.routes import Hop, Route
from meshnet.tracker.storage.database import Database, Row, Tx, parse_rows

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    state TEXT NOT NULL,
    system_prompt TEXT,
    epoch BIGINT NOT NULL,
    kv_epoch BIGINT NOT NULL,
    route TEXT NOT NULL,
    history TEXT NOT NULL,
    tail TEXT NOT NULL,
    closed INTEGER NOT NULL,
    turns BIGINT NOT NULL,
    snapshot_id TEXT,
    created DOUBLE PRECISION NOT NULL,
    last_used DOUBLE PRECISION NOT NULL
);
CREATE TABLE IF NOT EXISTS turns (
    id TEXT PRIMARY KEY,
    session_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    idempotency_key TEXT,
    body_hash TEXT NOT NULL,
    request TEXT NOT NULL,
    status TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    next_at DOUBLE PRECISION NOT NULL,
    owner TEXT,
    lease_until DOUBLE PRECISION,
    result TEXT,
    error TEXT,
    created DOUBLE PRECISION NOT NULL,
    UNIQUE (session_id, seq),
    UNIQUE (session_id, idempotency_key)
);
CREATE INDEX IF NOT EXISTS turns_status ON turns (status, next_at);
CREATE TABLE IF NOT EXISTS snapshots (
    snapshot_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    layer_start INTEGER NOT NULL,
    layer_end INTEGER NOT NULL,
    epoch BIGINT NOT NULL,
    tokens BIGINT NOT NULL,
    steps BIGINT NOT NULL,
    path TEXT NOT NULL,
    bytes BIGINT NOT NULL,
    file_sha256 TEXT NOT NULL,
    root_hash TEXT NOT NULL,
    prefix_hash TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL,
    chunks BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (snapshot_id, layer_start)
)
"""

# Epochs one delivery attempt may use (its opening one plus failovers); attempts never share.
EPOCH_STRIDE = 100


class SessionState(StrEnum):
    IDLE = "idle"  # KV hot on its route
    ACTIVE = "active"  # a turn is accepted and not yet delivered
    PARKED = "parked"  # KV on the nodes' local disks, out of their hot budgets
    EVICTED = "evicted"  # KV in the snapshot store only
    COMPLETED = "completed"  # ended by the client
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (SessionState.COMPLETED, SessionState.FAILED)


_ENDED = (SessionState.COMPLETED.value, SessionState.FAILED.value)  # terminal states, as stored


class TurnStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"  # claimed by a tracker under a lease
    DONE = "done"
    FAILED = "failed"
    DROPPED = "dropped"  # its session ended before it was delivered

    @property
    def final(self) -> bool:
        return self in (TurnStatus.DONE, TurnStatus.FAILED, TurnStatus.DROPPED)


_FINAL = tuple(s.value for s in TurnStatus if s.final)  # final turn states, as stored


@dataclass(frozen=True)
class SessionRecord:
    id: str
    state: SessionState
    system: str | None
    epoch: int  # the highest epoch reserved by a delivery attempt
    kv_epoch: int  # the epoch the route holds the KV at (of the last completed turn)
    route: Route
    history: list[list[int]]  # every step the nodes were fed: prompts and decoded tokens
    tail: list[int]  # generated, not yet fed (the last reply's final token)
    closed: bool  # the last reply ended with the end-of-turn token (or there was none)
    turns: int
    snapshot_id: str | None
    last_used: float

    @property
    def kv_tokens(self) -> int:
        return sum(len(step) for step in self.history)

    @property
    def steps(self) -> int:
        return len(self.history)


@dataclass(frozen=True)
class TurnRecord:
    id: str
    session_id: str
    seq: int
    status: TurnStatus
    attempts: int
    request: dict[str, Any]
    result: dict[str, Any] | None
    error: dict[str, Any] | None


@dataclass(frozen=True)
class SnapshotFile:
    """One shard's snapshot, as indexed: its KV stream is ``chunks`` rows of the
    database (tracker/sessions/snapshot_rows.py), or, written by a meshnet before snapshots
    moved there (``chunks`` 0), the file at ``path`` on one tracker's disk."""

    snapshot_id: str
    session_id: str
    layers: LayerRange
    epoch: int
    tokens: int
    steps: int
    path: str  # "" for a snapshot in the database
    nbytes: int  # the length-prefixed stream's bytes
    file_sha256: str  # of the stream
    root_hash: str
    prefix_hash: str
    chunks: int = 0  # rows holding the stream; 0: a file at ``path``


_SESSION_COLUMNS = (
    "id, state, system_prompt, epoch, kv_epoch, route, history, tail, closed, turns, "
    "snapshot_id, last_used"
)
_TURN_COLUMNS = "id, session_id, seq, status, attempts, request, result, error"
_SNAPSHOT_COLUMNS = (
    "snapshot_id, session_id, layer_start, layer_end, epoch, tokens, steps, path, bytes, "
    "file_sha256, root_hash, prefix_hash, chunks"
)


class _Rollback(Exception):
    def __init__(self, value: object) -> None:
        self.value = value


class SessionStore:
    def __init__(self, db: Database) -> None:
        self._db = db
        db.create_schema(_SCHEMA)

    # --- sessions -----------------------------------------------------------------

    def create(self, session_id: str, system: str | None, now: float) -> SessionRecord:
        self._db.run(
            f"INSERT INTO sessions ({_SESSION_COLUMNS}, created) "
            "VALUES (?, ?, ?, 0, 0, '[]', '[]', '[]', 1, 0, NULL, ?, ?)",
            (session_id, SessionState.IDLE.value, system, now, now),
        )
        return self.get(session_id)

    def find(self, session_id: str, tx: Tx | None = None) -> SessionRecord | None:
        rows = (tx or self._db).query(
            f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE id = ?", (session_id,)
        )
        return _session(rows[0]) if rows else None

    def get(self, session_id: str, tx: Tx | None = None) -> SessionRecord:
        found = self.find(session_id, tx)
        if found is None:
            raise NotFound(f"no session {session_id!r}")
        return found

    def sessions(self, states: tuple[SessionState, ...]) -> list[SessionRecord]:
        marks = ", ".join("?" for _ in states)
        rows = self._db.query(
            f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE state IN ({marks}) ORDER BY last_used",
            [s.value for s in states],
        )
        return parse_rows(rows, _session, "session")

    def states(self) -> dict[str, str]:
        """Every session's state by id (ended ones too, until retention purges them)."""
        return {str(r[0]): str(r[1]) for r in self._db.query("SELECT id, state FROM sessions")}

    def set_state(
        self, session_id: str, state: SessionState, when: tuple[SessionState, ...]
    ) -> bool:
        """Move a session to ``state`` if it is in one of ``when``; whether it moved."""
        marks = ", ".join("?" for _ in when)
        return (
            self._db.run(
                f"UPDATE sessions SET state = ? WHERE id = ? AND state IN ({marks})",
                (state.value, session_id, *[s.value for s in when]),
            )
            == 1
        )

    def end(self, session_id: str, state: SessionState, now: float | None = None) -> SessionRecord:
        """Make a session terminal and drop its undelivered turns, in one transaction;
        ``now`` (when given) becomes its ``last_used``, the time retention counts from."""
        with self._db.transaction() as tx:
            session = self.get(session_id, tx)
            if session.state.terminal:
                return session
            tx.run(
                "UPDATE sessions SET state = ?, last_used = ? WHERE id = ?",
                (state.value, session.last_used if now is None else now, session_id),
            )
            tx.run(
                "UPDATE turns SET status = ?, error = ? WHERE session_id = ? AND status IN (?, ?)",
                (
                    TurnStatus.DROPPED.value,
                    json.dumps({"kind": SessionGone.kind, "message": "the session ended"}),
                    session_id,
                    TurnStatus.PENDING.value,
                    TurnStatus.RUNNING.value,
                ),
            )
            return self.get(session_id, tx)

    def next_epoch(self, session_id: str) -> int:
        """Reserve the epochs of one delivery attempt; the first of them."""
        with self._db.transaction() as tx:
            tx.run("UPDATE sessions SET epoch = epoch + ? WHERE id = ?", (EPOCH_STRIDE, session_id))
            rows = tx.query("SELECT epoch FROM sessions WHERE id = ?", (session_id,))
        return int(rows[0][0]) - EPOCH_STRIDE + 1

    # --- turns (the outbox) ---------------------------------------------------------

    def accept_turn(
        self,
        session_id: str,
        turn_id: str,
        key: str | None,
        body_hash: str,
        request: dict[str, Any],
        now: float,
        validate: Callable[[SessionRecord], object] | None = None,
    ) -> TurnRecord:
        """Write a turn and the session's update in one transaction; the first turn of
        an ``Idempotency-Key`` again when the key was used (``IdempotencyConflict`` when
        with another body); ``SessionGone`` when the session has ended. A new turn is
        first given to ``validate`` with the session as it stands: what it raises
        refuses the turn and writes nothing."""
        try:
            with self._db.transaction() as tx:
                # Taking the row first serialises accepts of one session across trackers;
                # what is read after it is what the previous accept committed.
                if not tx.run("UPDATE sessions SET turns = turns + 1 WHERE id = ?", (session_id,)):
                    raise NotFound(f"no session {session_id!r}")
                session = self.get(session_id, tx)
                if session.state.terminal:
                    raise SessionGone(f"session {session_id} has ended ({session.state.value})")
                if key is not None:
                    rows = tx.query(
                        f"SELECT {_TURN_COLUMNS}, body_hash FROM turns "
                        "WHERE session_id = ? AND idempotency_key = ?",
                        (session_id, key),
                    )
                    if rows:
                        if rows[0][-1] != body_hash:
                            raise IdempotencyConflict(
                                "this Idempotency-Key was used with a different request"
                            )
                        first = _turn(rows[0][:-1])
                        if not _failed_for_now(first):
                            raise _Rollback(first)
                        # It failed for want of capacity or a route: the key takes the
                        # request again as a new turn, the failed one kept without it.
                        tx.run("UPDATE turns SET idempotency_key = NULL WHERE id = ?", (first.id,))
                if validate is not None:
                    validate(session)
                tx.run(
                    "INSERT INTO turns (id, session_id, seq, idempotency_key, body_hash, request, "
                    "status, attempts, next_at, created) VALUES (?, ?, ?, ?, ?, ?, ?, 0, ?, ?)",
                    (
                        turn_id,
                        session_id,
                        session.turns,
                        key,
                        body_hash,
                        json.dumps(request),
                        TurnStatus.PENDING.value,
                        now,
                        now,
                    ),
                )
                tx.run(
                    "UPDATE sessions SET state = ?, last_used = ? WHERE id = ?",
                    (SessionState.ACTIVE.value, now, session_id),
                )
        except _Rollback as r:
            assert isinstance(r.value, TurnRecord)
            return r.value
        return self.turn(turn_id)

    def turn(self, turn_id: str) -> TurnRecord:
        rows = self._db.query(f"SELECT {_TURN_COLUMNS} FROM turns WHERE id = ?", (turn_id,))
        if not rows:
            raise NotFound(f"no turn {turn_id!r}")
        return _turn(rows[0])

    def deliverable(self, now: float, limit: int = 16) -> list[TurnRecord]:
        """Turns due for delivery: pending and due, or running under a lapsed lease;
        only each session's earliest unfinished turn (turns run in order)."""
        rows = self._db.query(
            f"SELECT {_TURN_COLUMNS} FROM turns t WHERE "
            "((status = ? AND next_at <= ?) OR (status = ? AND lease_until < ?)) "
            "AND NOT EXISTS (SELECT 1 FROM turns e WHERE e.session_id = t.session_id "
            "AND e.seq < t.seq AND e.status IN (?, ?)) ORDER BY next_at LIMIT ?",
            (
                TurnStatus.PENDING.value,
                now,
                TurnStatus.RUNNING.value,
                now,
                TurnStatus.PENDING.value,
                TurnStatus.RUNNING.value,
                limit,
            ),
        )
        return parse_rows(rows, _turn, "turn")

    def claim(self, turn: TurnRecord, owner: str, lease_until: float, now: float) -> bool:
        """Take a turn for delivery (one attempt, counted now); False if another has it."""
        return (
            self._db.run(
                "UPDATE turns SET status = ?, owner = ?, lease_until = ?, "
                "attempts = attempts + 1 WHERE id = ? "
                "AND ((status = ? AND next_at <= ?) OR (status = ? AND lease_until < ?)) "
                "AND NOT EXISTS (SELECT 1 FROM turns e WHERE e.session_id = ? "
                "AND e.seq < ? AND e.status IN (?, ?))",
                (
                    TurnStatus.RUNNING.value,
                    owner,
                    lease_until,
                    turn.id,
                    TurnStatus.PENDING.value,
                    now,
                    TurnStatus.RUNNING.value,
                    now,
                    turn.session_id,
                    turn.seq,
                    TurnStatus.PENDING.value,
                    TurnStatus.RUNNING.value,
                ),
            )
            == 1
        )

    def renew(self, turn_id: str, owner: str, lease_until: float) -> bool:
        return (
            self._db.run(
                "UPDATE turns SET lease_until = ? WHERE id = ? AND owner = ? AND status = ?",
                (lease_until, turn_id, owner, TurnStatus.RUNNING.value),
            )
            == 1
        )

    def retry_later(self, turn_id: str, owner: str, next_at: float, error: dict[str, Any]) -> None:
        self._db.run(
            "UPDATE turns SET status = ?, next_at = ?, error = ?, owner = NULL "
            "WHERE id = ? AND owner = ? AND status = ?",
            (
                TurnStatus.PENDING.value,
                next_at,
                json.dumps(error),
                turn_id,
                owner,
                TurnStatus.RUNNING.value,
            ),
        )

    def fail_turn(self, turn_id: str, owner: str, error: dict[str, Any]) -> None:
        """A turn that cannot succeed: failed; the session goes back to its last state."""
        with self._db.transaction() as tx:
            changed = tx.run(
                "UPDATE turns SET status = ?, error = ? WHERE id = ? AND owner = ? AND status = ?",
                (
                    TurnStatus.FAILED.value,
                    json.dumps(error),
                    turn_id,
                    owner,
                    TurnStatus.RUNNING.value,
                ),
            )
            if changed:
                tx.run(
                    "UPDATE sessions SET state = ? WHERE id = "
                    "(SELECT session_id FROM turns WHERE id = ?) AND state = ? AND NOT EXISTS "
                    "(SELECT 1 FROM turns WHERE session_id = sessions.id AND status IN (?, ?))",
                    (
                        SessionState.IDLE.value,
                        turn_id,
                        SessionState.ACTIVE.value,
                        TurnStatus.PENDING.value,
                        TurnStatus.RUNNING.value,
                    ),
                )

    def complete_turn(
        self,
        turn_id: str,
        owner: str,
        result: dict[str, Any],
        session: SessionRecord,
        now: float,
    ) -> bool:
        """Record a delivered turn and the session it left, together; False (and nothing
        written) when this tracker no longer holds the turn or the session ended."""
        with self._db.transaction() as tx:
            changed = tx.run(
                "UPDATE turns SET status = ?, result = ?, error = NULL "
                "WHERE id = ? AND owner = ? AND status = ?",
                (
                    TurnStatus.DONE.value,
                    json.dumps(result),
                    turn_id,
                    owner,
                    TurnStatus.RUNNING.value,
                ),
            )
            if changed != 1:
                return False
            pending = tx.query(
                "SELECT COUNT(*) FROM turns WHERE session_id = ? AND status IN (?, ?)",
                (session.id, TurnStatus.PENDING.value, TurnStatus.RUNNING.value),
            )[0][0]
            state = SessionState.ACTIVE if pending else SessionState.IDLE
            tx.run(
                "UPDATE sessions SET state = ?, kv_epoch = ?, route = ?, history = ?, tail = ?, "
                "closed = ?, snapshot_id = NULL, last_used = ? "
                "WHERE id = ? AND state NOT IN (?, ?)",
                (
                    state.value,
                    session.kv_epoch,
                    _route_json(session.route),
                    json.dumps(session.history),
                    json.dumps(session.tail),
                    int(session.closed),
                    now,
                    session.id,
                    SessionState.COMPLETED.value,
                    SessionState.FAILED.value,
                ),
            )
        return True

    # --- snapshots ------------------------------------------------------------------

    def index_snapshot(self, before: SessionRecord, files: list[SnapshotFile], now: float) -> bool:
        """Name fully written snapshots in the index and mark the session evicted,
        in one transaction; False when the session moved on since ``before``."""
        session_id = before.id
        with self._db.transaction() as tx:
            session = self.get(session_id, tx)
            if session.state not in (SessionState.IDLE, SessionState.PARKED):
                return False
            if (session.kv_epoch, session.steps) != (before.kv_epoch, before.steps):
                return False
            if any((f.tokens, f.steps) != (session.kv_tokens, session.steps) for f in files):
                return False
            for f in files:
                tx.run(
                    f"INSERT INTO snapshots ({_SNAPSHOT_COLUMNS}, created) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (
                        f.snapshot_id,
                        f.session_id,
                        f.layers.start,
                        f.layers.end,
                        f.epoch,
                        f.tokens,
                        f.steps,
                        f.path,
                        f.nbytes,
                        f.file_sha256,
                        f.root_hash,
                        f.prefix_hash,
                        f.chunks,
                        now,
                    ),
                )
            tx.run(
                "UPDATE sessions SET state = ?, snapshot_id = ? WHERE id = ?",
                (SessionState.EVICTED.value, files[0].snapshot_id if files else None, session_id),
            )
        return True

    def snapshot(self, snapshot_id: str) -> list[SnapshotFile]:
        rows = self._db.query(
            f"SELECT {_SNAPSHOT_COLUMNS} FROM snapshots WHERE snapshot_id = ? ORDER BY layer_start",
            (snapshot_id,),
        )
        return [_snapshot(r) for r in rows]

    def snapshots_of(self, session_id: str) -> list[SnapshotFile]:
        rows = self._db.query(
            f"SELECT {_SNAPSHOT_COLUMNS} FROM snapshots WHERE session_id = ?", (session_id,)
        )
        return [_snapshot(r) for r in rows]

    def forget_snapshots(self, session_id: str) -> None:
        """Drop a session's snapshots from the index (before their files are removed)."""
        self._db.run("DELETE FROM snapshots WHERE session_id = ?", (session_id,))

    # --- retention (tracker/sessions/retention.py decides when) ------------------------------
    # Each call is one short statement or transaction over at most ``limit`` rows:
    # the caller repeats it while it returns ``limit``.

    def purge_ended_turns(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` final turns of sessions that ended before ``before``
        (their ``last_used``); how many. ``end`` dropped their undelivered turns, and
        one still pending or running would be kept all the same."""
        return self._db.run(
            "DELETE FROM turns WHERE id IN (SELECT t.id FROM turns t "
            "JOIN sessions s ON s.id = t.session_id "
            "WHERE s.state IN (?, ?) AND s.last_used < ? AND t.status IN (?, ?, ?) LIMIT ?)",
            (*_ENDED, before, *_FINAL, limit),
        )

    def purge_ended_sessions(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` sessions that ended before ``before`` and have no turns
        left (``purge_ended_turns`` first); how many. Live sessions are never touched."""
        return self._db.run(
            "DELETE FROM sessions WHERE id IN (SELECT id FROM sessions s "
            "WHERE s.state IN (?, ?) AND s.last_used < ? "
            "AND NOT EXISTS (SELECT 1 FROM turns t WHERE t.session_id = s.id) LIMIT ?)",
            (*_ENDED, before, limit),
        )

    def stale_snapshots(self, before: float, limit: int) -> list[SnapshotFile]:
        """Up to ``limit`` index rows written before ``before`` that no live session can
        resume from: their session ended before ``before`` or is gone, or it holds
        another snapshot (or none) now. A row and the session's ``snapshot_id`` are
        written in one transaction (``index_snapshot``), so a row being written is
        never among them."""
        columns = ", ".join(f"sn.{c}" for c in _SNAPSHOT_COLUMNS.split(", "))
        rows = self._db.query(
            f"SELECT {columns} FROM snapshots sn LEFT JOIN sessions s ON s.id = sn.session_id "
            "WHERE sn.created < ? AND (s.id IS NULL "
            "OR (s.state IN (?, ?) AND s.last_used < ?) "
            "OR (s.state NOT IN (?, ?) "
            "AND (s.snapshot_id IS NULL OR s.snapshot_id <> sn.snapshot_id))) "
            "ORDER BY sn.created LIMIT ?",
            (before, *_ENDED, before, *_ENDED, limit),
        )
        return [_snapshot(r) for r in rows]

    def forget_snapshot_files(self, files: list[SnapshotFile]) -> None:
        """Drop these files' rows from the index, in one transaction (before the files
        themselves are removed, so that the index never names a missing file)."""
        with self._db.transaction() as tx:
            for f in files:
                tx.run(
                    "DELETE FROM snapshots WHERE snapshot_id = ? AND layer_start = ?",
                    (f.snapshot_id, f.layers.start),
                )

    def live_sessions(self, session_ids: list[str]) -> set[str]:
        """Those of ``session_ids`` that exist and have not ended."""
        if not session_ids:
            return set()
        marks = ", ".join("?" for _ in session_ids)
        rows = self._db.query(
            f"SELECT id FROM sessions WHERE id IN ({marks}) AND state NOT IN (?, ?)",
            (*session_ids, *_ENDED),
        )
        return {str(r[0]) for r in rows}

    def snapshot_paths(self, session_ids: list[str]) -> set[str]:
        """The file paths the index names for ``session_ids``, as they were written
        (snapshots kept as files, before they moved to the database)."""
        if not session_ids:
            return set()
        marks = ", ".join("?" for _ in session_ids)
        rows = self._db.query(
            f"SELECT path FROM snapshots WHERE session_id IN ({marks})", session_ids
        )
        return {str(r[0]) for r in rows}


def _route_json(route: Route) -> str:
    return json.dumps([[h.node_id, h.address, h.layers.start, h.layers.end] for h in route])


def _session(r: Row) -> SessionRecord:
    sid, state, system, epoch, kv_epoch, route, history, tail, closed, turns, snapshot_id, used = r
    hops = tuple(Hop(n, a, LayerRange(s, e)) for n, a, s, e in json.loads(route))
    return SessionRecord(
        id=sid,
        state=SessionState(state),
        system=system,
        epoch=int(epoch),
        kv_epoch=int(kv_epoch),
        route=hops,
        history=json.loads(history),
        tail=json.loads(tail),
        closed=bool(closed),
        turns=int(turns),
        snapshot_id=snapshot_id,
        last_used=float(used),
    )


def _failed_for_now(turn: TurnRecord) -> bool:
    """A turn that failed with a kind that may succeed later (no route, overload...)."""
    if turn.status is not TurnStatus.FAILED:
        return False
    kind = (turn.error or {}).get("kind", "")
    return bool(kind) and error_for_kind(str(kind), "").retryable


def _turn(r: Row) -> TurnRecord:
    tid, sid, seq, status, attempts, request, result, error = r
    return TurnRecord(
        id=tid,
        session_id=sid,
        seq=int(seq),
        status=TurnStatus(status),
        attempts=int(attempts),
        request=json.loads(request),
        result=json.loads(result) if result else None,
        error=json.loads(error) if error else None,
    )


def _snapshot(r: Row) -> SnapshotFile:
    sid, session, start, end, epoch, tokens, steps, path, nbytes, fsha, root, prefix, chunks = r
    return SnapshotFile(
        sid,
        session,
        LayerRange(start, end),
        int(epoch),
        int(tokens),
        int(steps),
        path,
        int(nbytes),
        fsha,
        root,
        prefix,
        int(chunks),
    )
