"""The turns table: the prompt outbox, in the tracker's database.

A turn row is an outbox entry: written with the session update in one
transaction when accepted, claimed under a lease by whichever tracker delivers
it, retried with backoff, and completed together with the session's new
history in one transaction, so a turn is applied to a session exactly once
however often it is delivered.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from meshnet.errors import IdempotencyConflict, NotFound, SessionGone, error_for_kind
from meshnet.tracker.session_data.records import (
    ENDED,
    FINAL,
    TURN_COLUMNS,
    SessionRecord,
    SessionState,
    TurnRecord,
    TurnStatus,
    parse_turn,
    route_json,
)
from meshnet.tracker.session_data.session_rows import SessionRows
from meshnet.tracker.storage.database import parse_rows


class _Rollback(Exception):
    def __init__(self, value: object) -> None:
        self.value = value


class TurnRows(SessionRows):
    """Reads and writes of the turns table (with the sessions they move)."""

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
                        f"SELECT {TURN_COLUMNS}, body_hash FROM turns "
                        "WHERE session_id = ? AND idempotency_key = ?",
                        (session_id, key),
                    )
                    if rows:
                        if rows[0][-1] != body_hash:
                            raise IdempotencyConflict(
                                "this Idempotency-Key was used with a different request"
                            )
                        first = parse_turn(rows[0][:-1])
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
        rows = self._db.query(f"SELECT {TURN_COLUMNS} FROM turns WHERE id = ?", (turn_id,))
        if not rows:
            raise NotFound(f"no turn {turn_id!r}")
        return parse_turn(rows[0])

    def deliverable(self, now: float, limit: int = 16) -> list[TurnRecord]:
        """Turns due for delivery: pending and due, or running under a lapsed lease;
        only each session's earliest unfinished turn (turns run in order)."""
        rows = self._db.query(
            f"SELECT {TURN_COLUMNS} FROM turns t WHERE "
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
        return parse_rows(rows, parse_turn, "turn")

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
                    route_json(session.route),
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

    def purge_ended_turns(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` final turns of sessions that ended before ``before``
        (their ``last_used``); how many. ``end`` dropped their undelivered turns, and
        one still pending or running would be kept all the same."""
        return self._db.run(
            "DELETE FROM turns WHERE id IN (SELECT t.id FROM turns t "
            "JOIN sessions s ON s.id = t.session_id "
            "WHERE s.state IN (?, ?) AND s.last_used < ? AND t.status IN (?, ?, ?) LIMIT ?)",
            (*ENDED, before, *FINAL, limit),
        )


def _failed_for_now(turn: TurnRecord) -> bool:
    """A turn that failed with a kind that may succeed later (no route, overload...)."""
    if turn.status is not TurnStatus.FAILED:
        return False
    kind = (turn.error or {}).get("kind", "")
    return bool(kind) and error_for_kind(str(kind), "").retryable
