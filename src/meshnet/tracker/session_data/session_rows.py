"""The sessions table: a session's row, its state and its epochs, in the tracker's database.

A session row holds everything needed to rebuild its KV anywhere: the steps
the nodes were fed (the token history), the route and epoch that hold the
KV now, and the snapshot that holds it when evicted. ``SessionRows`` also
creates the tables of its turns (turn_rows.py) and snapshots
(snapshot_index.py), which are written in the same transactions as it.
"""

from __future__ import annotations

import json

from meshnet.errors import NotFound, SessionGone
from meshnet.tracker.session_data.records import (
    ENDED,
    EPOCH_STRIDE,
    SESSION_COLUMNS,
    SessionRecord,
    SessionState,
    TurnStatus,
    parse_session,
)
from meshnet.tracker.storage.database import Database, Tx, parse_rows

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


class SessionRows:
    """Reads and writes of the sessions table.

    The purges for retention (retention.py decides when), here and in the turns and
    snapshot tables, are each one short statement or transaction over at most
    ``limit`` rows: the caller repeats them while they return ``limit``.
    """

    def __init__(self, db: Database) -> None:
        self._db = db
        db.create_schema(_SCHEMA)

    def create(self, session_id: str, system: str | None, now: float) -> SessionRecord:
        self._db.run(
            f"INSERT INTO sessions ({SESSION_COLUMNS}, created) "
            "VALUES (?, ?, ?, 0, 0, '[]', '[]', '[]', 1, 0, NULL, ?, ?)",
            (session_id, SessionState.IDLE.value, system, now, now),
        )
        return self.get(session_id)

    def find(self, session_id: str, tx: Tx | None = None) -> SessionRecord | None:
        rows = (tx or self._db).query(
            f"SELECT {SESSION_COLUMNS} FROM sessions WHERE id = ?", (session_id,)
        )
        return parse_session(rows[0]) if rows else None

    def get(self, session_id: str, tx: Tx | None = None) -> SessionRecord:
        found = self.find(session_id, tx)
        if found is None:
            raise NotFound(f"no session {session_id!r}")
        return found

    def sessions(self, states: tuple[SessionState, ...]) -> list[SessionRecord]:
        marks = ", ".join("?" for _ in states)
        rows = self._db.query(
            f"SELECT {SESSION_COLUMNS} FROM sessions WHERE state IN ({marks}) ORDER BY last_used",
            [s.value for s in states],
        )
        return parse_rows(rows, parse_session, "session")

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

    def purge_ended_sessions(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` sessions that ended before ``before`` and have no turns
        left (``purge_ended_turns`` first); how many. Live sessions are never touched."""
        return self._db.run(
            "DELETE FROM sessions WHERE id IN (SELECT id FROM sessions s "
            "WHERE s.state IN (?, ?) AND s.last_used < ? "
            "AND NOT EXISTS (SELECT 1 FROM turns t WHERE t.session_id = s.id) LIMIT ?)",
            (*ENDED, before, limit),
        )

    def live_sessions(self, session_ids: list[str]) -> set[str]:
        """Those of ``session_ids`` that exist and have not ended."""
        if not session_ids:
            return set()
        marks = ", ".join("?" for _ in session_ids)
        rows = self._db.query(
            f"SELECT id FROM sessions WHERE id IN ({marks}) AND state NOT IN (?, ?)",
            (*session_ids, *ENDED),
        )
        return {str(r[0]) for r in rows}
