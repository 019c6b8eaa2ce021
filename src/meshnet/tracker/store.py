"""The tracker's durable state in SQLite: the node registry and the pinned route.

All truth lives here, not in process memory, so a restarted tracker (or,
later, a replica on PostgreSQL) sees the same mesh. Calls are short and
serialised by one lock; the connection is shared by the event loop's threads.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Sequence
from pathlib import Path

from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import Heartbeat, NodeAnnouncement, NodeLoad
from meshnet.tracker.registry import NodeId, NodeRecord, NodeState, is_stale

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    address TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    layer_start INTEGER NOT NULL,
    layer_end INTEGER NOT NULL,
    backend TEXT NOT NULL,
    kv_budget_bytes INTEGER NOT NULL,
    pid INTEGER NOT NULL,
    state TEXT NOT NULL,
    last_seen REAL NOT NULL,
    load TEXT NOT NULL,
    down_reason TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS pinned_route (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    node_ids TEXT NOT NULL
);
"""


class Store:
    """SQLite-backed registry; one file under the tracker's data dir."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def register(self, a: NodeAnnouncement, now: float) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '')",
                (
                    a.node_id,
                    a.address,
                    a.fingerprint,
                    a.layer_start,
                    a.layer_end,
                    a.backend,
                    a.kv_budget_bytes,
                    a.pid,
                    NodeState.UP.value,
                    now,
                    a.load.model_dump_json(),
                ),
            )

    def heartbeat(self, node_id: NodeId, hb: Heartbeat, now: float) -> bool:
        """Record a heartbeat; False when the node is unknown or was marked down."""
        with self._lock:
            cur = self._db.execute(
                "UPDATE nodes SET last_seen = ?, load = ?, fingerprint = ?, layer_start = ?, "
                "layer_end = ? WHERE node_id = ? AND state = ?",
                (
                    now,
                    hb.load.model_dump_json(),
                    hb.fingerprint,
                    hb.layer_start,
                    hb.layer_end,
                    node_id,
                    NodeState.UP.value,
                ),
            )
            return cur.rowcount == 1

    def mark_down(self, node_id: NodeId, reason: str) -> None:
        with self._lock:
            self._db.execute(
                "UPDATE nodes SET state = ?, down_reason = ? WHERE node_id = ?",
                (NodeState.DOWN.value, reason, node_id),
            )

    def sweep(self, now: float, timeout_s: float) -> list[NodeId]:
        """Mark down every up node silent for ``timeout_s``; return their ids."""
        stale = [n.node_id for n in self.nodes() if is_stale(n, now, timeout_s)]
        for node_id in stale:
            self.mark_down(node_id, "heartbeat-lost")
        return stale

    def nodes(self) -> list[NodeRecord]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM nodes ORDER BY node_id").fetchall()
        return [_record(r) for r in rows]

    def pinned(self) -> list[NodeId] | None:
        with self._lock:
            row = self._db.execute("SELECT node_ids FROM pinned_route WHERE id = 1").fetchone()
        return list(json.loads(row[0])) if row else None

    def pin(self, node_ids: Sequence[NodeId]) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO pinned_route VALUES (1, ?)", (json.dumps(list(node_ids)),)
            )

    def unpin(self) -> None:
        with self._lock:
            self._db.execute("DELETE FROM pinned_route")


def _record(r: tuple) -> NodeRecord:  # type: ignore[type-arg]
    (
        node_id,
        address,
        fingerprint,
        start,
        end,
        backend,
        budget,
        pid,
        state,
        last_seen,
        load,
        reason,
    ) = r
    return NodeRecord(
        node_id=node_id,
        address=address,
        fingerprint=fingerprint,
        layers=LayerRange(start, end) if end > start else None,
        backend=backend,
        kv_budget_bytes=budget,
        pid=pid,
        state=NodeState(state),
        last_seen=last_seen,
        load=NodeLoad.model_validate_json(load),
        down_reason=reason,
    )
