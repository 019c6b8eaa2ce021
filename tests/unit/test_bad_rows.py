"""A row that does not parse (written by a buggy or older version, or corrupted) is
skipped and logged; every other row of its table still reads."""

from __future__ import annotations

from pathlib import Path

from meshnet.mesh_messages import NodeAnnouncement, NodeLoad
from meshnet.tracker.accounting.ledger import AttemptStatus, LedgerRecord
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.session_data.records import SessionState
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.storage.database import SQLiteDatabase


def _node(node_id: str) -> NodeAnnouncement:
    load = NodeLoad(sessions=0, kv_bytes=0, queue_depth=0, steps=0)
    return NodeAnnouncement(
        node_id=node_id,
        address="127.0.0.1:1",
        fingerprint="f" * 64,
        layer_start=0,
        layer_end=4,
        backend="fast",
        kv_budget_bytes=1,
        pid=1,
        load=load,
    )


def test_a_bad_node_or_ledger_row_never_poisons_a_read(tmp_path: Path) -> None:
    store = Store(SQLiteDatabase(tmp_path / "t.db"))
    for node_id in ("a", "b", "c"):
        store.register(_node(node_id), 1.0)
    store.db.run("UPDATE nodes SET load = 'not json' WHERE node_id = 'b'")
    assert [n.node_id for n in store.nodes()] == ["a", "c"]
    good = LedgerRecord("g", 1, "a", 0, 4, 0, 10, AttemptStatus.COMPLETED, "")
    bad = LedgerRecord("g", 1, "b", 0, 4, 0, 10, AttemptStatus.COMPLETED, "")
    store.record_attempts([good, bad], now=1.0)
    store.db.run("UPDATE ledger SET status = 'no-such-status' WHERE node_id = 'b'")
    assert store.ledger("g") == [good]


def test_a_bad_session_row_leaves_the_others_listed(tmp_path: Path) -> None:
    sessions = SessionStore(SQLiteDatabase(tmp_path / "s.db"))
    for sid in ("s1", "s2", "s3"):
        sessions.create(sid, None, 1.0)
    sessions._db.run("UPDATE sessions SET history = '{broken' WHERE id = 's2'")
    listed = sessions.sessions((SessionState.IDLE,))
    assert sorted(s.id for s in listed) == ["s1", "s3"]
