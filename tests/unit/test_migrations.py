"""Schema migrations: a database of every earlier meshnet is brought to today's shape with
its rows kept, each version once and recorded; a failing migration changes nothing; a
database newer than this tracker is refused. On SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnet.api.tenants import TenantStore
from meshnet.errors import SchemaTooNew
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.serving.bench_store import BenchStore
from meshnet.tracker.serving.served_store import ServedStore
from meshnet.tracker.session_data.session_models import SessionModels
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshot_rows import SnapshotRows
from meshnet.tracker.storage.database import Database, open_database
from meshnet.tracker.storage.leader_lease import Lease
from meshnet.tracker.storage.migrations import MIGRATIONS, Migration, columns, migrate

# The tables as the first tracker made them (425744a).
FIRST = """
CREATE TABLE nodes (
    node_id TEXT PRIMARY KEY, address TEXT NOT NULL, fingerprint TEXT NOT NULL,
    layer_start INTEGER NOT NULL, layer_end INTEGER NOT NULL, backend TEXT NOT NULL,
    kv_budget_bytes INTEGER NOT NULL, pid INTEGER NOT NULL, state TEXT NOT NULL,
    last_seen REAL NOT NULL, load TEXT NOT NULL, down_reason TEXT NOT NULL DEFAULT ''
);
CREATE TABLE pinned_route (id INTEGER PRIMARY KEY CHECK (id = 1), node_ids TEXT NOT NULL)
"""
# The ledger before it kept each attempt's commitments (0ded7b8^).
LEDGER_BEFORE_COMMITMENTS = """
CREATE TABLE ledger (
    id {serial}, generation_id TEXT NOT NULL, epoch INTEGER NOT NULL,
    node_id TEXT NOT NULL, layer_start INTEGER NOT NULL, layer_end INTEGER NOT NULL,
    token_start INTEGER NOT NULL, token_end INTEGER NOT NULL, status TEXT NOT NULL,
    kind TEXT NOT NULL, recorded DOUBLE PRECISION NOT NULL,
    UNIQUE (generation_id, epoch, node_id, layer_start)
);
CREATE INDEX ledger_node ON ledger (node_id)
"""
# The snapshot index while snapshots were files on one tracker's disk (before migration 2).
SNAPSHOTS_AS_FILES = """
CREATE TABLE snapshots (
    snapshot_id TEXT NOT NULL, session_id TEXT NOT NULL, layer_start INTEGER NOT NULL,
    layer_end INTEGER NOT NULL, epoch BIGINT NOT NULL, tokens BIGINT NOT NULL,
    steps BIGINT NOT NULL, path TEXT NOT NULL, bytes BIGINT NOT NULL,
    file_sha256 TEXT NOT NULL, root_hash TEXT NOT NULL, prefix_hash TEXT NOT NULL,
    created DOUBLE PRECISION NOT NULL, PRIMARY KEY (snapshot_id, layer_start)
)
"""
EARLIER = {
    "first": [FIRST],
    "before-commitments": [FIRST, LEDGER_BEFORE_COMMITMENTS],
    "snapshots-as-files": [FIRST, SNAPSHOTS_AS_FILES],
}


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """Where a database is opened: a file, or a new PostgreSQL database."""
    if request.param == "postgresql":
        yield request.getfixturevalue("fresh_postgres")
    else:
        yield str(tmp_path / "tracker.db")


def _open(target: str) -> Database:
    return open_database(target if "://" in target else Path(target))


def _start(db: Database) -> None:
    """What a tracker does at start: migrate, then open every table."""
    migrate(db)
    for make in (Store, SessionStore, SessionModels, TenantStore, BenchStore, ServedStore):
        make(db)
    SnapshotRows(db)
    Lease(db, "placement", "tracker-a", 10.0)


def _shape(db: Database) -> dict[str, set[str]]:
    if db.dialect == "postgresql":
        rows = db.query(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()"
        )
    else:
        rows = db.query("SELECT name FROM sqlite_master WHERE type = 'table'")
    tables = {str(r[0]) for r in rows} - {"sqlite_sequence"}
    with db.transaction() as tx:
        return {t: columns(tx, db.dialect, t) for t in tables}


def _today(tmp_path: Path) -> dict[str, set[str]]:
    db = open_database(tmp_path / "today.db")
    try:
        _start(db)
        return _shape(db)
    finally:
        db.close()


@pytest.mark.parametrize("earlier", sorted(EARLIER))
def test_a_database_of_every_earlier_schema_reaches_todays_shape_with_its_rows(
    target: str, tmp_path: Path, earlier: str
) -> None:
    db = _open(target)
    try:
        for schema in EARLIER[earlier]:
            db.create_schema(schema.replace("CREATE TABLE", "CREATE TABLE IF NOT EXISTS"))
        db.run(
            "INSERT INTO nodes VALUES ('n0', 'h:1', 'f', 0, 4, 'fast', 1, 7, 'up', 1.0, '{}', '')"
        )
        if "snapshots" in _shape(db):
            db.run(
                "INSERT INTO snapshots VALUES "
                "('s', 'sess', 0, 2, 1, 9, 2, '/d/sess.s.0-2.snap', 4, 'f', 'r', 'p', 1.0)"
            )
        _start(db)
        assert _shape(db) == _today(tmp_path)
        assert [r[0] for r in db.query("SELECT node_id FROM nodes")] == ["n0"]
        if earlier == "snapshots-as-files":  # an older snapshot: still named, as a file
            (old,) = SessionStore(db).snapshot("s")
            assert (old.path, old.chunks) == ("/d/sess.s.0-2.snap", 0)
        recorded = db.query("SELECT version, name FROM schema_migrations ORDER BY version")
        assert [(int(v), n) for v, n in recorded] == [(m.version, m.name) for m in MIGRATIONS]
        assert migrate(db) == []  # a second start: nothing left to do
    finally:
        db.close()


def test_a_new_database_records_every_version_and_needs_no_change(target: str) -> None:
    db = _open(target)
    try:
        assert migrate(db) == [m.version for m in MIGRATIONS]
        _start(db)
        assert migrate(db) == []
    finally:
        db.close()


def test_a_failing_migration_changes_nothing(target: str) -> None:
    db = _open(target)
    try:
        migrate(db)

        def adds_then_fails(tx: object, dialect: str) -> None:
            tx.run("CREATE TABLE half_done (x INTEGER)")  # type: ignore[attr-defined]
            tx.run("SELECT no_such_column FROM schema_migrations")  # type: ignore[attr-defined]

        broken = (*MIGRATIONS, Migration(len(MIGRATIONS) + 1, "broken", adds_then_fails))
        with pytest.raises(Exception):  # noqa: B017 - the driver's own error for a bad statement
            migrate(db, broken)
        assert "half_done" not in _shape(db)
        versions = [int(r[0]) for r in db.query("SELECT version FROM schema_migrations")]
        assert versions == [m.version for m in MIGRATIONS]
    finally:
        db.close()


def test_a_database_newer_than_this_tracker_is_refused_and_left_alone(target: str) -> None:
    db = _open(target)
    try:
        newer = (*MIGRATIONS, Migration(99, "from the future", lambda tx, dialect: None))
        migrate(db, newer)
        before = _shape(db)
        with pytest.raises(SchemaTooNew, match="version 99"):
            migrate(db)
        assert _shape(db) == before
    finally:
        db.close()
