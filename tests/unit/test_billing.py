"""Billing only checked work (tracker/accounting/billing.py, work_checks.py, ledger.py):
settlement of unverified work against the verifier's checks, usage per tenant and earnings
per node, on a real SQLite database."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnet.tracker.accounting import billing
from meshnet.tracker.accounting.ledger import AttemptStatus, LedgerRecord, LedgerSpool
from meshnet.tracker.accounting.work_checks import SpanCheck
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.storage.database import Database, open_database
from meshnet.tracker.storage.migrations import migrate

NOW = 1_000_000.0
WINDOW = 60.0
U = AttemptStatus.UNVERIFIED


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """The queries are written once for both databases: each test runs on both."""
    if request.param == "postgresql":
        database = open_database(request.getfixturevalue("fresh_postgres"))
    else:
        database = open_database(tmp_path / "tracker.db")
    yield database
    database.close()


@pytest.fixture
def store(db: Database) -> Store:
    return Store(db)


def work(gen: str, node: str, layers: tuple[int, int], tokens: tuple[int, int]) -> LedgerRecord:
    return LedgerRecord(gen, 1, node, *layers, *tokens, status=U, commitments=b"\x01\x02")


def check(gen: str, node: str, tokens: tuple[int, int], passed: bool) -> SpanCheck:
    return SpanCheck(node, gen, 0, 4, *tokens, passed=passed, detail="test")


def statuses(store: Store) -> dict[tuple[str, str], str]:
    return {(r.generation_id, r.node_id): r.status.value for r in store.ledger()}


def test_a_passing_check_verifies_the_attempt_it_covers_and_only_that(store: Store) -> None:
    store.record_attempts([work("g1", "a", (0, 4), (0, 64)), work("g2", "a", (0, 4), (0, 64))], NOW)
    store.record_check(check("g1", "a", (32, 64), passed=True), NOW)
    billing.settle(store.db, NOW + 1, WINDOW)
    assert statuses(store) == {("g1", "a"): "verified", ("g2", "a"): "unverified"}


def test_a_failed_check_rejects_its_nodes_open_window_now_and_what_is_written_after(
    store: Store,
) -> None:
    store.record_attempts(
        [work("g1", "bad", (0, 4), (0, 64)), work("g1", "b", (4, 8), (0, 64))], NOW
    )
    store.record_attempts([work("g0", "bad", (0, 4), (0, 9))], NOW - 10 * WINDOW)
    billing.settle(store.db, NOW - 10 * WINDOW + WINDOW + 1, WINDOW)  # g0's window closed
    store.record_check(check("g1", "bad", (0, 32), passed=False), NOW + 1)
    assert statuses(store)[("g1", "bad")] == "rejected"  # at once, before any settlement
    # An attempt of the same node written after the check, within the window.
    store.record_attempts([work("g2", "bad", (0, 4), (0, 16))], NOW + 2)
    billing.settle(store.db, NOW + 3, WINDOW)
    assert statuses(store) == {
        ("g0", "bad"): "completed",  # settled before the failure: stays billable
        ("g1", "bad"): "rejected",
        ("g2", "bad"): "rejected",
        ("g1", "b"): "unverified",  # another node's work is not touched
    }
    assert {r.kind for r in store.ledger(node_id="bad") if r.status.value == "rejected"} == {
        "verification-failed"
    }


def test_unverified_work_becomes_billable_when_its_window_closes_clean(store: Store) -> None:
    store.record_attempts([work("g1", "a", (0, 4), (0, 10))], NOW)
    assert billing.settle(store.db, NOW + WINDOW - 1, WINDOW).completed == 0
    assert billing.settle(store.db, NOW + WINDOW + 1, WINDOW).completed == 1
    assert statuses(store) == {("g1", "a"): "completed"}
    assert store.ledger()[0].commitments == b"\x01\x02"


def test_usage_counts_billable_work_per_tenant_and_per_node(store: Store) -> None:
    billing.attribute(store.db, "g1", "acme", NOW)
    billing.attribute(store.db, "g1", "other", NOW)  # a repeat changes nothing
    billing.attribute(store.db, "g2", "zed", NOW)
    done = AttemptStatus.COMPLETED
    store.record_attempts(
        [
            LedgerRecord("g1", 1, "a", 0, 4, 0, 10, done),
            LedgerRecord("g1", 1, "b", 4, 8, 0, 10, done),
            LedgerRecord("g1", 2, "a", 0, 4, 10, 12, AttemptStatus.FAILED, "worker-death"),
            LedgerRecord("g2", 1, "a", 0, 4, 0, 5, AttemptStatus.VERIFIED),
            LedgerRecord("g2", 1, "b", 4, 8, 0, 5, AttemptStatus.REJECTED),
            LedgerRecord("g3", 1, "a", 0, 4, 0, 7, U),
        ],
        NOW,
    )
    got = billing.usage(store.db)
    tenants = {t["tenant"]: t for t in got["tenants"]}
    assert tenants["acme"]["billable_tokens"] == 10  # positions once, not once per hop
    assert tenants["acme"]["billable_layer_tokens"] == 80
    assert tenants["acme"]["billable_generations"] == 1
    assert tenants["zed"]["billable_tokens"] == 5 and tenants["zed"]["rejected_layer_tokens"] == 20
    assert tenants["(unattributed)"]["unverified_layer_tokens"] == 28
    nodes = {n["node_id"]: n for n in got["nodes"]}
    assert nodes["a"]["billable_layer_tokens"] == 40 + 20 and nodes["a"]["billable_attempts"] == 2
    assert nodes["b"]["billable_layer_tokens"] == 40 and nodes["b"]["rejected_layer_tokens"] == 20


def test_while_verifying_the_spool_writes_completed_work_unverified() -> None:
    written: list[LedgerRecord] = []
    spool = LedgerSpool(lambda records, now: written.extend(records), verifying=True)
    done = LedgerRecord("g", 1, "a", 0, 4, 0, 3, AttemptStatus.COMPLETED)
    failed = LedgerRecord("g", 2, "a", 0, 4, 3, 4, AttemptStatus.FAILED, "worker-death")
    spool.submit([done, failed])
    assert [r.status for r in written] == [U, AttemptStatus.FAILED]


def test_a_ledger_made_by_an_older_version_gains_the_commitments_column(tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute(
            "CREATE TABLE ledger (id INTEGER PRIMARY KEY AUTOINCREMENT, generation_id TEXT NOT "
            "NULL, epoch INTEGER NOT NULL, node_id TEXT NOT NULL, layer_start INTEGER NOT NULL, "
            "layer_end INTEGER NOT NULL, token_start INTEGER NOT NULL, token_end INTEGER NOT "
            "NULL, status TEXT NOT NULL, kind TEXT NOT NULL, recorded DOUBLE PRECISION NOT "
            "NULL, UNIQUE (generation_id, epoch, node_id, layer_start))"
        )
        conn.execute(
            "INSERT INTO ledger (generation_id, epoch, node_id, layer_start, layer_end, "
            "token_start, token_end, status, kind, recorded) "
            "VALUES ('old', 1, 'a', 0, 4, 0, 3, 'completed', '', 1.0)"
        )
    db = open_database(path)
    try:
        assert 1 in migrate(db)  # the commitments column, with every later migration
        store = Store(db)
        assert migrate(db) == []  # a second start finds the column there
        store.record_attempts([work("new", "a", (0, 4), (0, 2))], NOW)
        assert [(r.generation_id, r.commitments) for r in store.ledger()] == [
            ("old", b""),
            ("new", b"\x01\x02"),
        ]
    finally:
        db.close()
