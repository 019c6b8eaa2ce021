"""The work ledger in the tracker's database: written once per attempt, billed by status."""

from pathlib import Path

from meshnet.tracker.accounting.ledger import AttemptStatus, LedgerRecord
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.storage.database import SQLiteDatabase


def record(node: str, epoch: int, start: int, end: int, status: AttemptStatus) -> LedgerRecord:
    kind = "" if status is AttemptStatus.COMPLETED else "worker-death"
    return LedgerRecord("g1", epoch, node, 0, 15, start, end, status, kind)


def test_attempts_are_recorded_once_and_only_completed_work_bills(tmp_path: Path) -> None:
    store = Store(SQLiteDatabase(tmp_path / "t.db"))
    first = [
        record("a", 1, 0, 40, AttemptStatus.FAILED),
        record("b", 2, 0, 60, AttemptStatus.COMPLETED),
    ]
    store.record_attempts(first, now=1.0)
    # The same attempt written again (a retried write) changes nothing.
    store.record_attempts([record("a", 1, 0, 99, AttemptStatus.COMPLETED)], now=2.0)
    assert store.ledger("g1") == first
    assert store.ledger(node_id="b") == first[1:]
    totals = store.ledger_totals("g1")
    assert totals["a"]["billable_layer_tokens"] == 0
    assert totals["a"]["failed_tokens"] == 40
    assert totals["b"]["billable_layer_tokens"] == 60 * 15
    store.close()
    # It is durable: a restarted tracker reads the same records.
    assert Store(SQLiteDatabase(tmp_path / "t.db")).ledger("g1") == first
