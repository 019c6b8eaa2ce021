"""The tracker's durable mesh state: the node registry, the pinned route, the ledger.

All truth lives in the database (SQLite, or PostgreSQL shared by several
trackers), not in process memory, so a restarted tracker or a replica sees
the same mesh.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import Heartbeat, NodeAnnouncement, NodeLoad
from meshnet.tracker.accounting import billing, work_checks
from meshnet.tracker.accounting.ledger import BILLABLE, AttemptStatus, LedgerRecord
from meshnet.tracker.accounting.work_checks import SpanCheck
from meshnet.tracker.nodes.registry import NodeId, NodeRecord, NodeState, is_stale
from meshnet.tracker.storage.database import Database, parse_rows

_SCHEMA = """
CREATE TABLE IF NOT EXISTS nodes (
    node_id TEXT PRIMARY KEY,
    address TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    layer_start INTEGER NOT NULL,
    layer_end INTEGER NOT NULL,
    backend TEXT NOT NULL,
    kv_budget_bytes BIGINT NOT NULL,
    pid INTEGER NOT NULL,
    state TEXT NOT NULL,
    last_seen DOUBLE PRECISION NOT NULL,
    load TEXT NOT NULL,
    down_reason TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS pinned_route (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    node_ids TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger (
    id {serial},
    generation_id TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    node_id TEXT NOT NULL,
    layer_start INTEGER NOT NULL,
    layer_end INTEGER NOT NULL,
    token_start INTEGER NOT NULL,
    token_end INTEGER NOT NULL,
    status TEXT NOT NULL,
    kind TEXT NOT NULL,
    recorded DOUBLE PRECISION NOT NULL,
    commitments TEXT NOT NULL DEFAULT '',
    UNIQUE (generation_id, epoch, node_id, layer_start)
);
CREATE INDEX IF NOT EXISTS ledger_node ON ledger (node_id);
CREATE INDEX IF NOT EXISTS ledger_status ON ledger (status, recorded);
"""

_LEDGER_COLUMNS = (
    "generation_id, epoch, node_id, layer_start, layer_end, token_start, token_end, status, kind, "
    "commitments"
)


_NODE_COLUMNS = (
    "node_id, address, fingerprint, layer_start, layer_end, backend, kv_budget_bytes, pid, "
    "state, last_seen, load, down_reason"
)


class Store:
    """The registry and the ledger in one database."""

    def __init__(self, db: Database) -> None:
        self._db = db
        db.create_schema(_SCHEMA)
        work_checks.create_schema(db)
        billing.create_schema(db)

    @property
    def db(self) -> Database:
        return self._db

    def close(self) -> None:
        self._db.close()

    def register(self, a: NodeAnnouncement, now: float) -> None:
        updates = ", ".join(f"{c} = excluded.{c}" for c in _NODE_COLUMNS.split(", ")[1:])
        self._db.run(
            f"INSERT INTO nodes ({_NODE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, '') "
            f"ON CONFLICT (node_id) DO UPDATE SET {updates}",
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
        """Record a heartbeat; False when the node is unknown or was marked down (a
        calibrating or quarantined node beats on in its state)."""
        changed = self._db.run(
            "UPDATE nodes SET last_seen = ?, load = ?, fingerprint = ?, layer_start = ?, "
            "layer_end = ? WHERE node_id = ? AND state <> ?",
            (
                now,
                hb.load.model_dump_json(),
                hb.fingerprint,
                hb.layer_start,
                hb.layer_end,
                node_id,
                NodeState.DOWN.value,
            ),
        )
        return changed == 1

    def mark_down(
        self,
        node_id: NodeId,
        reason: str,
        address: str | None = None,
        last_seen: float | None = None,
    ) -> bool:
        """Mark a node down; True when it was. ``address`` and ``last_seen`` (from the
        record a verdict was reached on) hold it to that process, and to it unheard from
        since: a node that registered again, or beat, meanwhile is not what was judged."""
        clauses, args = ["node_id = ?"], list[str | float]([node_id])
        for column, value in (("address", address), ("last_seen", last_seen)):
            if value is not None:
                clauses.append(f"{column} = ?")
                args.append(value)
        changed = self._db.run(
            f"UPDATE nodes SET state = ?, down_reason = ? WHERE {' AND '.join(clauses)}",
            (NodeState.DOWN.value, reason, *args),
        )
        return changed == 1

    def set_state(self, node_id: NodeId, state: NodeState, reason: str = "") -> None:
        """Move a node that is not down to ``state`` (calibration and the verifier)."""
        self._db.run(
            "UPDATE nodes SET state = ?, down_reason = ? WHERE node_id = ? AND state <> ?",
            (state.value, reason, node_id, NodeState.DOWN.value),
        )

    def silent(self, now: float, timeout_s: float) -> list[NodeRecord]:
        """Every up node not heard from for ``timeout_s``."""
        return [n for n in self.nodes() if is_stale(n, now, timeout_s)]

    def nodes(self) -> list[NodeRecord]:
        rows = self._db.query(f"SELECT {_NODE_COLUMNS} FROM nodes ORDER BY node_id")
        return parse_rows(rows, _record, "node")

    def node(self, node_id: NodeId) -> NodeRecord | None:
        """The record of the node ``node_id``; None when none registered so."""
        rows = self._db.query(f"SELECT {_NODE_COLUMNS} FROM nodes WHERE node_id = ?", (node_id,))
        found = parse_rows(rows, _record, "node")
        return found[0] if found else None

    def pinned(self) -> list[NodeId] | None:
        rows = self._db.query("SELECT node_ids FROM pinned_route WHERE id = 1")
        return list(json.loads(rows[0][0])) if rows else None

    def pin(self, node_ids: Sequence[NodeId]) -> None:
        self._db.run(
            "INSERT INTO pinned_route (id, node_ids) VALUES (1, ?) "
            "ON CONFLICT (id) DO UPDATE SET node_ids = excluded.node_ids",
            (json.dumps(list(node_ids)),),
        )

    def unpin(self) -> None:
        self._db.run("DELETE FROM pinned_route")

    def set_layers(self, node_id: NodeId, layers: LayerRange | None, fingerprint: str) -> None:
        """A node was told to load ``layers`` (None: to empty itself) and confirmed it:
        routable (or not) before its next beat."""
        start, end = (layers.start, layers.end) if layers is not None else (0, 0)
        self._db.run(
            "UPDATE nodes SET layer_start = ?, layer_end = ?, fingerprint = ? WHERE node_id = ?",
            (start, end, fingerprint if layers is not None else "", node_id),
        )

    def record_attempts(self, records: Sequence[LedgerRecord], now: float) -> None:
        """Write attempts in one transaction; an attempt already recorded is never rewritten."""
        rows = [
            (
                r.generation_id,
                r.epoch,
                r.node_id,
                r.layer_start,
                r.layer_end,
                r.token_start,
                r.token_end,
                r.status.value,
                r.kind,
                r.commitments.hex(),
                now,
            )
            for r in records
        ]
        with self._db.transaction() as tx:
            for row in rows:
                tx.run(
                    f"INSERT INTO ledger ({_LEDGER_COLUMNS}, recorded) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    row,
                )

    def record_check(self, check: SpanCheck, now: float | None = None) -> None:
        """Keep the verifier's verdict on a span (``work_checks.record_check``)."""
        work_checks.record_check(self._db, check, time.time() if now is None else now)

    def ledger(
        self, generation_id: str | None = None, node_id: str | None = None, limit: int = 1000
    ) -> list[LedgerRecord]:
        where, args = _ledger_filter(generation_id, node_id)
        rows = self._db.query(
            f"SELECT {_LEDGER_COLUMNS} FROM ledger{where} ORDER BY id LIMIT ?", (*args, limit)
        )
        return parse_rows(rows, _ledger_record, "ledger")

    def ledger_totals(self, generation_id: str | None = None) -> dict[str, dict[str, int]]:
        """Per node and status: attempts, tokens and layer-tokens."""
        where, args = _ledger_filter(generation_id, None)
        rows = self._db.query(
            "SELECT node_id, status, COUNT(*), SUM(token_end - token_start), "
            "SUM((token_end - token_start) * (layer_end - layer_start)) "
            f"FROM ledger{where} GROUP BY node_id, status ORDER BY node_id, status",
            args,
        )
        totals: dict[str, dict[str, int]] = {}
        for node_id, status, attempts, tokens, layer_tokens in rows:
            node = totals.setdefault(node_id, {"billable_layer_tokens": 0})
            node[f"{status}_attempts"] = int(attempts)
            node[f"{status}_tokens"] = int(tokens)
            if AttemptStatus(status) in BILLABLE:
                node["billable_layer_tokens"] += int(layer_tokens)
        return totals

    # --- retention (tracker/sessions/retention.py decides when) ----------------------------

    def purge_ledger(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` ledger rows recorded before ``before``, oldest first;
        how many. One short statement: call again while it returns ``limit``."""
        return self._db.run(
            "DELETE FROM ledger WHERE id IN "
            "(SELECT id FROM ledger WHERE recorded < ? ORDER BY id LIMIT ?)",
            (before, limit),
        )

    def purge_dead_nodes(self, before: float, limit: int) -> int:
        """Delete up to ``limit`` nodes that are down and were last heard from before
        ``before``; how many. The state is checked by the delete itself, so a node that
        registered again in the meantime (up, seen now) is never touched."""
        return self._db.run(
            "DELETE FROM nodes WHERE node_id IN "
            "(SELECT node_id FROM nodes WHERE state = ? AND last_seen < ? LIMIT ?) "
            "AND state = ? AND last_seen < ?",
            (NodeState.DOWN.value, before, limit, NodeState.DOWN.value, before),
        )


def _ledger_filter(generation_id: str | None, node_id: str | None) -> tuple[str, tuple[str, ...]]:
    clauses, args = [], []
    if generation_id is not None:
        clauses.append("generation_id = ?")
        args.append(generation_id)
    if node_id is not None:
        clauses.append("node_id = ?")
        args.append(node_id)
    return (" WHERE " + " AND ".join(clauses) if clauses else ""), tuple(args)


def _ledger_record(r: tuple[Any, ...]) -> LedgerRecord:
    generation_id, epoch, node_id, start, end, token_start, token_end, status, kind, commits = r
    return LedgerRecord(
        generation_id,
        epoch,
        node_id,
        start,
        end,
        token_start,
        token_end,
        AttemptStatus(status),
        kind,
        bytes.fromhex(commits),
    )


def _record(r: tuple[Any, ...]) -> NodeRecord:
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
