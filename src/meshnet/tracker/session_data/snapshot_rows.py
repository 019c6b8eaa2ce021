"""Snapshot streams as rows of the tracker's database, so every tracker on it can read them.

An evicted shard's KV stream (snapshots.py: length-prefixed ``KVFrame``s) is
cut into rows of ``snapshot_chunks`` of at most ``ROW_BYTES`` each, keyed by
snapshot, first layer and sequence number: BYTEA on PostgreSQL, BLOB on
SQLite. Rows are written one short statement at a time, before the index row
that names them (``SessionStore.index_snapshot``, which records how many):
until then no reader looks for them, so a stream cut off halfway is never
read; its writer drops it, or retention does (``purge_unindexed``).

A reader fetches one row at a time, never the whole stream, and a row's bytes
only when the database says it is no longer than ``ROW_BYTES``: a row grown
past it, or one missing before the indexed count, is refused typed
(``KVImportFailed``) without being loaded.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from meshnet.errors import KVImportFailed
from meshnet.tracker.session_data.records import SessionState, SnapshotFile
from meshnet.tracker.storage.database import Database

ROW_BYTES = 1 << 20  # one row's share of a stream: a frame (up to 8 MiB) spans several

_SCHEMA = """
CREATE TABLE IF NOT EXISTS snapshot_chunks (
    snapshot_id TEXT NOT NULL,
    layer_start INTEGER NOT NULL,
    seq BIGINT NOT NULL,
    session_id TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL,
    data {blob} NOT NULL,
    PRIMARY KEY (snapshot_id, layer_start, seq)
);
CREATE INDEX IF NOT EXISTS snapshot_chunks_created ON snapshot_chunks (created)
"""
# ``data`` comes last: SQLite reads a row's columns in order, and a scan for the
# others (retention's) then never walks a row's overflow pages.
_ENDED = (SessionState.COMPLETED.value, SessionState.FAILED.value)


class SnapshotRows:
    """The ``snapshot_chunks`` table: write, read and drop one shard's stream."""

    def __init__(self, db: Database, clock: Callable[[], float] = time.time) -> None:
        self.db = db
        self._clock = clock
        blob = "BYTEA" if db.dialect == "postgresql" else "BLOB"
        db.create_schema(_SCHEMA.replace("{blob}", blob))

    def writer(self, snapshot_id: str, layer_start: int, session_id: str) -> RowWriter:
        return RowWriter(self, (snapshot_id, layer_start, session_id))

    def put(self, key: tuple[str, int, str], seq: int, data: bytes) -> None:
        snapshot_id, layer_start, session_id = key
        self.db.run(
            "INSERT INTO snapshot_chunks "
            "(snapshot_id, layer_start, seq, session_id, created, data) "
            "VALUES (?, ?, ?, ?, ?, ?)",
            (snapshot_id, layer_start, seq, session_id, self._clock(), data),
        )

    def drop(self, snapshot_id: str, layer_start: int) -> None:
        """Delete one shard's rows (after the index stopped naming them, or never did)."""
        self.db.run(
            "DELETE FROM snapshot_chunks WHERE snapshot_id = ? AND layer_start = ?",
            (snapshot_id, layer_start),
        )

    def reader(self, snapshot: SnapshotFile) -> RowReader:
        return RowReader(self.db, snapshot)

    def purge_unindexed(self, now: float, keep_s: float, grace_s: float, limit: int) -> int:
        """Delete up to ``limit`` rows no index row names, written more than ``keep_s``
        ago; how many. A live session's rows may be an eviction under way (its index
        row comes last): those go only after ``grace_s`` as well."""
        return self.db.run(
            "DELETE FROM snapshot_chunks WHERE (snapshot_id, layer_start, seq) IN ("
            "SELECT c.snapshot_id, c.layer_start, c.seq FROM snapshot_chunks c "
            "LEFT JOIN snapshots s "
            "ON s.snapshot_id = c.snapshot_id AND s.layer_start = c.layer_start "
            "LEFT JOIN sessions se ON se.id = c.session_id "
            "WHERE s.snapshot_id IS NULL AND c.created < ? "
            "AND (se.id IS NULL OR se.state IN (?, ?) OR c.created < ?) LIMIT ?)",
            (now - keep_s, *_ENDED, now - max(keep_s, grace_s), limit),
        )


class RowWriter:
    """Appends a stream's bytes, a row each ``ROW_BYTES``; each row is written in a
    worker thread, so a slow database never stalls the event loop."""

    def __init__(self, rows: SnapshotRows, key: tuple[str, int, str]) -> None:
        self._rows = rows
        self._key = key
        self._pending = bytearray()
        self.chunks = 0  # rows written

    async def write(self, data: bytes) -> None:
        self._pending += data
        while len(self._pending) >= ROW_BYTES:
            await self._flush(bytes(self._pending[:ROW_BYTES]))
            del self._pending[:ROW_BYTES]

    async def close(self) -> int:
        """Write what is left; the number of rows the stream took."""
        if self._pending:
            await self._flush(bytes(self._pending))
            self._pending.clear()
        return self.chunks

    async def _flush(self, row: bytes) -> None:
        await asyncio.to_thread(self._rows.put, self._key, self.chunks, row)
        self.chunks += 1


class RowReader:
    """One indexed snapshot's stream, read as a file would be (``read(n)``), one row
    fetched at a time."""

    def __init__(self, db: Database, snapshot: SnapshotFile) -> None:
        self._db = db
        self._snapshot = snapshot
        self._row = b""
        self._at = 0
        self._seq = 0  # the next row to fetch

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes; fewer only where the stream ends."""
        out = bytearray()
        while len(out) < n:
            if self._at == len(self._row):
                if self._seq == self._snapshot.chunks:
                    break
                self._row, self._at = self._fetch(self._seq), 0
                self._seq += 1
            take = self._row[self._at : self._at + n - len(out)]
            out += take
            self._at += len(take)
        return bytes(out)

    def _fetch(self, seq: int) -> bytes:
        s = self._snapshot
        rows = self._db.query(
            "SELECT length(data), CASE WHEN length(data) <= ? THEN data END "
            "FROM snapshot_chunks WHERE snapshot_id = ? AND layer_start = ? AND seq = ?",
            (ROW_BYTES, s.snapshot_id, s.layers.start, seq),
        )
        if not rows:
            raise KVImportFailed(f"the snapshot lacks its row {seq} of {s.chunks}", "truncated")
        size, data = rows[0]
        if data is None:
            raise KVImportFailed(f"a snapshot row claims {size} bytes", "size-limit")
        if not data:
            raise KVImportFailed(f"the snapshot's row {seq} is empty", "truncated")
        return bytes(data)
