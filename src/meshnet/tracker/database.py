"""One SQL interface over SQLite (the default) and PostgreSQL (shared by tracker replicas).

Queries are written once, in the subset both accept: ``?`` placeholders
(rewritten to ``%s`` for psycopg), ``INSERT ... ON CONFLICT``, ``BIGINT`` and
``DOUBLE PRECISION``. The one difference a schema needs, an auto-numbered key,
is the ``{serial}`` token. Every call is short and serialised per connection;
``transaction()`` groups statements so they commit together or not at all.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from meshnet.errors import DatabaseUnavailable

Row = tuple[Any, ...]


class Tx(ABC):
    """Statements inside one transaction (or, outside one, each on its own)."""

    @abstractmethod
    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]: ...

    @abstractmethod
    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        """Execute; the number of rows changed."""


class Database(Tx):
    """A connection shared by the tracker's threads; each call holds it alone."""

    dialect: str
    _tx: Tx
    _lock: threading.RLock

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._lock:
            return self._tx.query(sql, args)

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self._lock:
            return self._tx.run(sql, args)

    @abstractmethod
    def transaction(self) -> contextlib.AbstractContextManager[Tx]: ...

    @abstractmethod
    def close(self) -> None: ...

    def create_schema(self, schema: str) -> None:
        serial = (
            "BIGSERIAL PRIMARY KEY"
            if self.dialect == "postgresql"
            else "INTEGER PRIMARY KEY AUTOINCREMENT"
        )
        statements = [s.strip() for s in schema.replace("{serial}", serial).split(";")]
        with self.transaction() as tx:
            if self.dialect == "postgresql":  # two trackers starting at once
                tx.run("SELECT pg_advisory_xact_lock(7150001)")
            for statement in statements:
                if statement:
                    tx.run(statement)


class _SQLiteTx(Tx):
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        return self._db.execute(sql, tuple(args)).fetchall()

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        return self._db.execute(sql, tuple(args)).rowcount


class SQLiteDatabase(Database):
    dialect = "sqlite"

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._tx = _SQLiteTx(self._db)
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._tx
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def close(self) -> None:
        with self._lock:
            self._db.close()


class _PostgresTx(Tx):
    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._conn.cursor() as cur:
            cur.execute(sql.replace("?", "%s"), tuple(args))
            return list(cur.fetchall())

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self._conn.cursor() as cur:
            cur.execute(sql.replace("?", "%s"), tuple(args))
            return int(cur.rowcount)


class PostgresDatabase(Database):
    dialect = "postgresql"

    def __init__(self, url: str) -> None:
        import psycopg  # only trackers on PostgreSQL need the driver loaded

        try:
            self._conn = psycopg.connect(url, autocommit=True, connect_timeout=10)
        except psycopg.Error as e:
            raise DatabaseUnavailable(f"cannot connect to PostgreSQL: {e}") from None
        self._tx = _PostgresTx(self._conn)
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self._lock, self._conn.transaction():
            yield self._tx

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def open_database(target: str | Path) -> Database:
    """``postgresql://...`` opens PostgreSQL; anything else is an SQLite file path."""
    text = str(target)
    if text.startswith(("postgresql://", "postgres://")):
        return PostgresDatabase(text)
    return SQLiteDatabase(Path(text))
