"""One SQL interface over SQLite (the default) and PostgreSQL (shared by tracker replicas).

Queries are written once, in the subset both accept: ``?`` placeholders
(rewritten to ``%s`` for psycopg), ``INSERT ... ON CONFLICT``, ``BIGINT`` and
``DOUBLE PRECISION``. The one difference a schema needs, an auto-numbered key,
is the ``{serial}`` token. Every call is short and serialised per connection;
``transaction()`` groups statements so they commit together or not at all.

Faults are typed here, once: a database that cannot be reached, is busy, or
whose disk is full or failing raises ``DatabaseUnavailable`` (retryable, a
503 at the API), never the driver's own exception; a constraint violation or a
bad statement (a bug) keeps the driver's. A PostgreSQL connection that breaks
is replaced on the next call; a read (``SELECT``) that finds it broken is run
again once on the new one. A write is never repeated here: whether it
committed is unknown, so the caller, who knows whether it is idempotent,
decides. A failed ``COMMIT`` always leaves the connection out of the
transaction, so one full disk cannot wedge every later call.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sqlite3
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from meshnet.errors import DatabaseUnavailable

log = logging.getLogger(__name__)

Row = tuple[Any, ...]
T = TypeVar("T")

# Errors of the disk under a database or a snapshot: full (ENOSPC), over quota
# (EDQUOT), over the process's file-size limit (EFBIG, ``ulimit -f``), failing (EIO).
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})

_SQLITE_BUSY, _SQLITE_LOCKED, _SQLITE_IOERR, _SQLITE_FULL = 5, 6, 10, 13
# The primary result codes that are the database's state, not the statement's fault:
# busy, locked, out of memory, read-only, I/O error, corrupt, full, cannot open,
# lock protocol, not a database. Any other (a syntax error, a missing table) is a bug.
_SQLITE_UNAVAILABLE = frozenset({5, 6, 7, 8, 10, 11, 13, 14, 15, 26})
STATEMENT_TIMEOUT_S = 10.0  # a PostgreSQL statement running longer is cancelled (typed)
_RECONNECT_TIMEOUT_S = 2  # a reconnect blocks its caller no longer than this
_RECONNECT_EVERY_S = 0.5  # and is not tried again sooner: calls fail fast meanwhile


class Tx(ABC):
    """Statements inside one transaction (or, outside one, each on its own)."""

    @abstractmethod
    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]: ...

    @abstractmethod
    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        """Execute; the number of rows changed."""


class Database(Tx):
    """A connection shared by the tracker's threads; each call holds it alone.

    ``query``, ``run`` and ``transaction`` raise ``DatabaseUnavailable`` when the
    database cannot serve the call (see the module docstring)."""

    dialect: str
    _lock: threading.RLock

    def query(self, sql: str, args: Sequence[Any] = ()) -> list[Row]:
        with self._lock:
            return self._statement(lambda tx: tx.query(sql, args), _is_read(sql))

    def run(self, sql: str, args: Sequence[Any] = ()) -> int:
        with self._lock:
            return self._statement(lambda tx: tx.run(sql, args), False)

    @abstractmethod
    def _statement(self, call: Callable[[Tx], T], read: bool) -> T:
        """``call`` on the connection, its driver errors typed; ``read``: safe to repeat."""

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


def unavailable(e: BaseException) -> DatabaseUnavailable | None:
    """The typed error for a fault of the database or its disk; None for anything else
    (a constraint violation, a bad statement, a bug), which keeps its own type."""
    if isinstance(e, DatabaseUnavailable):
        return e
    if isinstance(e, sqlite3.Error):
        return _sqlite_unavailable(e)
    if isinstance(e, OSError):
        if e.errno in DISK_ERRNOS:
            return DatabaseUnavailable(f"the tracker's disk refused a write: {e}")
        return None
    psycopg = sys.modules.get("psycopg")  # only loaded where a tracker uses PostgreSQL
    if psycopg is not None and isinstance(e, psycopg.OperationalError | psycopg.InterfaceError):
        return DatabaseUnavailable(f"PostgreSQL: {_first_line(e)}")
    return None


def parse_rows(rows: Iterable[Row], parse: Callable[[Row], T], what: str) -> list[T]:
    """Each row that parses; one that does not (a value written by an older or buggy
    version, a corrupt field) is logged with its first column and skipped, so one bad
    row never fails every read of its table."""
    parsed: list[T] = []
    for row in rows:
        try:
            parsed.append(parse(row))
        except Exception as e:  # any parse failure: the row, not the read, is bad
            key = row[0] if row else "?"
            log.error("skipped a %s row that does not parse (%r): %s", what, key, e)
    return parsed


def _is_read(sql: str) -> bool:
    return sql.lstrip().upper().startswith("SELECT")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _sqlite_unavailable(e: sqlite3.Error) -> DatabaseUnavailable | None:
    if isinstance(e, sqlite3.IntegrityError | sqlite3.ProgrammingError | sqlite3.InterfaceError):
        return None  # a constraint or a bad statement: the caller's to handle
    code = getattr(e, "sqlite_errorcode", 0) & 0xFF
    if code and code not in _SQLITE_UNAVAILABLE:
        return None
    if code == _SQLITE_FULL:
        what = "the database's disk is full"
    elif code == _SQLITE_IOERR:
        what = "the database's disk failed a read or write (full, over a limit, or failing)"
    elif code in (_SQLITE_BUSY, _SQLITE_LOCKED):
        what = "the database is busy"
    else:
        what = "the database failed"
    return DatabaseUnavailable(f"SQLite: {what}: {e}")


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
        try:
            self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.execute("PRAGMA busy_timeout=5000")
        except sqlite3.Error as e:
            raise _as_unavailable(e) from e
        self._tx = _SQLiteTx(self._db)
        self._lock = threading.RLock()

    def _statement(self, call: Callable[[Tx], T], read: bool) -> T:
        try:
            return call(self._tx)
        except sqlite3.Error as e:
            if (typed := unavailable(e)) is None:
                raise
            raise typed from e

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self._lock:
            try:
                self._db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as e:
                raise _as_unavailable(e) from e
            try:
                yield self._tx
                self._db.execute("COMMIT")
            except sqlite3.Error as e:
                self._rollback()
                if (typed := unavailable(e)) is None:
                    raise
                raise typed from e
            except BaseException:
                self._rollback()
                raise

    def _rollback(self) -> None:
        # A failed COMMIT (a full disk) may or may not have ended the transaction
        # already; either way the connection must leave it, or every later BEGIN fails.
        if self._db.in_transaction:
            try:
                self._db.execute("ROLLBACK")
            except sqlite3.Error as e:
                log.error("SQLite: rollback failed: %s", e)

    def close(self) -> None:
        with self._lock:
            self._db.close()


def _as_unavailable(e: BaseException) -> DatabaseUnavailable:
    """``e`` typed; a database that cannot even be opened is unavailable whatever the cause."""
    return unavailable(e) or DatabaseUnavailable(f"the database cannot be opened: {e}")


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
    """One connection, replaced when it breaks (a restarted server, a terminated
    backend); while the server cannot be reached, calls fail fast between tries."""

    dialect = "postgresql"

    def __init__(self, url: str, statement_timeout_s: float = STATEMENT_TIMEOUT_S) -> None:
        import psycopg  # only trackers on PostgreSQL need the driver loaded

        self._psycopg = psycopg
        self._url = url
        # The server cancels a statement that runs longer (a lock held elsewhere, an
        # overloaded server): it would hold the one connection, and every caller behind it.
        self._options = f"-c statement_timeout={max(1, int(statement_timeout_s * 1000))}"
        self._lock = threading.RLock()
        self._conn: Any = None
        self._next_try = 0.0
        self._connect(timeout_s=10)

    def _connect(self, timeout_s: int) -> None:
        try:
            conn = self._psycopg.connect(
                self._url, autocommit=True, connect_timeout=timeout_s, options=self._options
            )
        except self._psycopg.Error as e:
            self._next_try = time.monotonic() + _RECONNECT_EVERY_S
            raise DatabaseUnavailable(f"cannot connect to PostgreSQL: {_first_line(e)}") from None
        if self._conn is not None:
            log.warning("PostgreSQL: connected again")
        self._conn = conn
        self._tx = _PostgresTx(conn)

    def _open(self) -> Tx:
        """The connection's statements, connecting again first if it broke."""
        if self._conn is not None and not self._conn.closed:
            return self._tx
        if time.monotonic() < self._next_try:
            raise DatabaseUnavailable("PostgreSQL is unreachable (tried a moment ago)")
        self._connect(timeout_s=_RECONNECT_TIMEOUT_S)
        return self._tx

    def _fault(self, e: BaseException) -> DatabaseUnavailable | None:
        """``e`` typed (None: not a fault of the database); a broken connection is
        closed, so the next call connects again."""
        typed = unavailable(e)
        if typed is not None and self._conn is not None and self._conn.broken:
            log.warning("PostgreSQL connection lost (%s): connecting again", typed.message)
            with contextlib.suppress(Exception):
                self._conn.close()
        return typed

    def _statement(self, call: Callable[[Tx], T], read: bool) -> T:
        tx = self._open()
        try:
            return call(tx)
        except self._psycopg.Error as e:
            if (typed := self._fault(e)) is None:
                raise
            if not (read and self._conn.closed):
                raise typed from e
        # A read that found the connection broken (the server restarted, the backend
        # was terminated) runs once more on a new one: it changes nothing.
        tx = self._open()
        try:
            return call(tx)
        except self._psycopg.Error as e:
            if (typed := self._fault(e)) is None:
                raise
            raise typed from e

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Tx]:
        with self._lock:
            tx = self._open()
            try:
                with self._conn.transaction():
                    yield tx
            except self._psycopg.Error as e:
                if (typed := self._fault(e)) is None:
                    raise
                raise typed from e

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()


def open_database(target: str | Path) -> Database:
    """``postgresql://...`` opens PostgreSQL; anything else is an SQLite file path."""
    text = str(target)
    if text.startswith(("postgresql://", "postgres://")):
        return PostgresDatabase(text)
    return SQLiteDatabase(Path(text))
