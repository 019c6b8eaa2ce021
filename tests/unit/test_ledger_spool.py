"""Ledger records wait for a database that refuses them and are written, once, when it
takes them again (tracker/accounting/ledger.py ``LedgerSpool``), on the real ledger table."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

from meshnet.errors import DatabaseUnavailable
from meshnet.tracker.accounting.ledger import AttemptStatus, LedgerRecord, LedgerSpool
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.storage.database import SQLiteDatabase


def record(generation: str, epoch: int = 1) -> LedgerRecord:
    return LedgerRecord(generation, epoch, "node-0", 0, 2, 0, 10, AttemptStatus.COMPLETED)


class Switch:
    """Writes through to ``store`` while ``up``; refuses like a database gone away when not."""

    def __init__(self, store: Store) -> None:
        self.store, self.up, self.calls = store, True, 0

    def __call__(self, records: Sequence[LedgerRecord], now: float) -> None:
        self.calls += 1
        if not self.up:
            raise DatabaseUnavailable("SQLite: the database's disk is full")
        self.store.record_attempts(records, now)


def test_records_wait_while_the_database_refuses_then_are_written_in_order_once(
    tmp_path: Path,
) -> None:
    store = Store(SQLiteDatabase(tmp_path / "t.db"))
    write = Switch(store)
    spool = LedgerSpool(write)
    spool.submit([record("g1")], now=1.0)
    write.up = False
    spool.submit([record("g2")], now=2.0)  # never raises
    spool.submit([record("g3"), record("g3", 2)], now=3.0)
    assert spool.pending == 3 and not spool.flush()
    write.up = True
    assert spool.flush() and spool.pending == 0 and spool.dropped == 0
    assert [r.generation_id for r in store.ledger()] == ["g1", "g2", "g3", "g3"]
    spool.submit([record("g2")], now=4.0)  # written twice: kept once
    assert len(store.ledger("g2")) == 1
    store.close()


def test_past_its_limit_the_oldest_waiting_records_are_dropped_and_counted() -> None:
    def refuse(records: Sequence[LedgerRecord], now: float) -> None:
        raise DatabaseUnavailable("gone")

    spool = LedgerSpool(refuse, max_pending=3)
    for i in range(5):
        spool.submit([record(f"g{i}")])
    assert (spool.pending, spool.dropped) == (3, 2)


def test_a_batch_that_fails_for_a_bug_does_not_block_the_rest() -> None:
    written: list[str] = []

    def write(records: Sequence[LedgerRecord], now: float) -> None:
        if records[0].generation_id == "bad":
            raise ValueError("a bug")
        written.extend(r.generation_id for r in records)

    spool = LedgerSpool(write)
    spool.submit([record("bad")])
    spool.submit([record("good")])
    assert written == ["good"] and spool.dropped == 1 and spool.pending == 0


def test_run_forever_writes_what_waits(tmp_path: Path) -> None:
    store = Store(SQLiteDatabase(tmp_path / "t.db"))
    write = Switch(store)
    write.up = False
    spool = LedgerSpool(write, retry_s=0.01)
    spool.submit([record("g1")])

    async def scenario() -> None:
        task = asyncio.create_task(spool.run_forever())
        await asyncio.sleep(0.05)
        write.up = True
        for _ in range(100):
            if not spool.pending:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert spool.pending == 0 and len(store.ledger("g1")) == 1
    store.close()
