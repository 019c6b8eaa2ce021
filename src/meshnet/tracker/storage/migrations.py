"""Numbered migrations of the tracker's database: run at start, in order, once, recorded.

Each table is declared by the module that uses it (``CREATE TABLE IF NOT
EXISTS``), so a table made now has today's shape. What changes a table an
older meshnet made is a numbered migration here, run by ``migrate`` before any
module opens its tables: the pending ones run in one transaction together
with the rows that record them (``schema_migrations``), so a database is at
one version or the next, never between. A migration finds a table absent
when the database is new (its module makes it whole later) and then does
nothing. Trackers sharing a PostgreSQL database take turns (an advisory
lock). A database recorded at a version this tracker does not know was
migrated by a newer meshnet: it is refused (``SchemaTooNew``) and left as it is.

To change a table: change its module's ``CREATE TABLE`` (new databases) and
append a migration that brings an existing table to the same shape.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from meshnet.errors import SchemaTooNew
from meshnet.tracker.storage.database import Database, Tx

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version BIGINT PRIMARY KEY,
    name TEXT NOT NULL,
    applied DOUBLE PRECISION NOT NULL
)
"""
_LOCK = 7150002  # pg_advisory_xact_lock key: one tracker migrates at a time


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    apply: Callable[[Tx, str], None]  # (transaction, dialect)


def table_exists(tx: Tx, dialect: str, table: str) -> bool:
    if dialect == "postgresql":
        rows = tx.query(
            "SELECT 1 FROM information_schema.tables "
            "WHERE table_schema = current_schema() AND table_name = ?",
            (table,),
        )
    else:
        rows = tx.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,))
    return bool(rows)


def columns(tx: Tx, dialect: str, table: str) -> set[str]:
    if dialect == "postgresql":
        rows = tx.query(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = ?",
            (table,),
        )
        return {str(r[0]) for r in rows}
    return {str(r[1]) for r in tx.query(f"PRAGMA table_info({table})")}


def add_column(tx: Tx, dialect: str, table: str, column: str, declaration: str) -> None:
    """Add ``column`` to ``table`` where the table exists without it."""
    if table_exists(tx, dialect, table) and column not in columns(tx, dialect, table):
        tx.run(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")


def _ledger_commitments(tx: Tx, dialect: str) -> None:
    add_column(tx, dialect, "ledger", "commitments", "TEXT NOT NULL DEFAULT ''")


def _snapshots_in_database(tx: Tx, dialect: str) -> None:
    """Snapshots move into the database (``snapshot_chunks``, made by
    tracker/session_data/snapshot_rows.py): an index row says how many chunk rows hold its
    stream. The rows already there keep 0 and their ``path``: a file on the disk
    of the tracker that wrote it, still read from there (snapshots.py)."""
    add_column(tx, dialect, "snapshots", "chunks", "BIGINT NOT NULL DEFAULT 0")


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "ledger.commitments: the KV commitments of each attempt", _ledger_commitments),
    Migration(2, "snapshots.chunks: snapshots kept in the database", _snapshots_in_database),
)


def migrate(
    db: Database,
    migrations: Sequence[Migration] = MIGRATIONS,
    clock: Callable[[], float] = time.time,
) -> list[int]:
    """Bring ``db`` to the newest version of ``migrations``; the versions applied now.
    ``SchemaTooNew`` (and nothing changed) when ``db`` is newer than they are."""
    known = max((m.version for m in migrations), default=0)
    db.create_schema(_SCHEMA)
    with db.transaction() as tx:
        if db.dialect == "postgresql":
            tx.run(f"SELECT pg_advisory_xact_lock({_LOCK})")
        applied = {int(r[0]) for r in tx.query("SELECT version FROM schema_migrations")}
        newest = max(applied, default=0)
        if newest > known:
            raise SchemaTooNew(
                f"the database is at schema version {newest}; this meshnet knows up to "
                f"{known}: run the newer meshnet, or a database of this one"
            )
        done = []
        for m in sorted(migrations, key=lambda m: m.version):
            if m.version in applied:
                continue
            m.apply(tx, db.dialect)
            tx.run(
                "INSERT INTO schema_migrations (version, name, applied) VALUES (?, ?, ?)",
                (m.version, m.name, clock()),
            )
            done.append(m.version)
    if done:
        log.info("database migrated to schema version %d (%s)", known, done)
    return done
