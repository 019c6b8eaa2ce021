"""The snapshot index: which snapshot files hold an evicted session's KV, in the database.

A row names one hop span's file, with its sha256 and hashes; it is written
with the session's move to ``evicted`` in one transaction, and dropped before
the file itself is removed, so the index never names a missing file.
"""

from __future__ import annotations

from meshnet.tracker.session_data.records import (
    ENDED,
    SNAPSHOT_COLUMNS,
    SessionRecord,
    SessionState,
    SnapshotFile,
    parse_snapshot,
)
from meshnet.tracker.session_data.session_rows import SessionRows


class SnapshotIndex(SessionRows):
    """Reads and writes of the snapshots table (with the sessions they evict)."""

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
                    f"INSERT INTO snapshots ({SNAPSHOT_COLUMNS}, created) "
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
            f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE snapshot_id = ? ORDER BY layer_start",
            (snapshot_id,),
        )
        return [parse_snapshot(r) for r in rows]

    def snapshots_of(self, session_id: str) -> list[SnapshotFile]:
        rows = self._db.query(
            f"SELECT {SNAPSHOT_COLUMNS} FROM snapshots WHERE session_id = ?", (session_id,)
        )
        return [parse_snapshot(r) for r in rows]

    def forget_snapshots(self, session_id: str) -> None:
        """Drop a session's snapshots from the index (before their files are removed)."""
        self._db.run("DELETE FROM snapshots WHERE session_id = ?", (session_id,))

    def stale_snapshots(self, before: float, limit: int) -> list[SnapshotFile]:
        """Up to ``limit`` index rows written before ``before`` that no live session can
        resume from: their session ended before ``before`` or is gone, or it holds
        another snapshot (or none) now. A row and the session's ``snapshot_id`` are
        written in one transaction (``index_snapshot``), so a row being written is
        never among them."""
        columns = ", ".join(f"sn.{c}" for c in SNAPSHOT_COLUMNS.split(", "))
        rows = self._db.query(
            f"SELECT {columns} FROM snapshots sn LEFT JOIN sessions s ON s.id = sn.session_id "
            "WHERE sn.created < ? AND (s.id IS NULL "
            "OR (s.state IN (?, ?) AND s.last_used < ?) "
            "OR (s.state NOT IN (?, ?) "
            "AND (s.snapshot_id IS NULL OR s.snapshot_id <> sn.snapshot_id))) "
            "ORDER BY sn.created LIMIT ?",
            (before, *ENDED, before, *ENDED, limit),
        )
        return [parse_snapshot(r) for r in rows]

    def forget_snapshot_files(self, files: list[SnapshotFile]) -> None:
        """Drop these files' rows from the index, in one transaction (before the files
        themselves are removed, so that the index never names a missing file)."""
        with self._db.transaction() as tx:
            for f in files:
                tx.run(
                    "DELETE FROM snapshots WHERE snapshot_id = ? AND layer_start = ?",
                    (f.snapshot_id, f.layers.start),
                )

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
