"""Faults of the tracker's database are typed once, in tracker/storage/database.py: a full or
failing disk, a busy or unreachable server are ``DatabaseUnavailable`` (a 503), never
the driver's exception; a full disk never leaves the connection wedged inside a
transaction; a lost PostgreSQL connection is replaced; a row that does not parse is
skipped, not a failure of every read of its table."""

from __future__ import annotations

import errno
import logging
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from meshnet.errors import DatabaseUnavailable
from meshnet.local_mesh import free_port
from meshnet.tracker.storage.database import (
    PostgresDatabase,
    SQLiteDatabase,
    open_database,
    parse_rows,
    unavailable,
)

SCHEMA = "CREATE TABLE IF NOT EXISTS t (id INTEGER PRIMARY KEY, v TEXT NOT NULL)"
BIG = "x" * 20_000  # a few pages per row


def fill_up(db: SQLiteDatabase) -> None:
    """Cap the file at its size now (SQLite's own page limit: a full disk, for SQLite)."""
    pages = db.query("PRAGMA page_count")[0][0]
    db.query(f"PRAGMA max_page_count = {pages}")


def test_a_full_sqlite_disk_is_typed_and_the_connection_recovers(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "t.db")
    db.run(SCHEMA)
    db.run("INSERT INTO t (v) VALUES (?)", ("a",))
    fill_up(db)
    with pytest.raises(DatabaseUnavailable, match="disk is full"):
        db.run("INSERT INTO t (v) VALUES (?)", (BIG,))
    with pytest.raises(DatabaseUnavailable, match="disk is full"), db.transaction() as tx:
        tx.run("UPDATE t SET v = 'changed'")
        tx.run("INSERT INTO t (v) VALUES (?)", (BIG,))
    # Nothing of the failed transaction stays, and the connection is out of it.
    assert db.query("SELECT v FROM t") == [("a",)]
    db.query("PRAGMA max_page_count = 1000000")  # space again
    with db.transaction() as tx:
        tx.run("INSERT INTO t (v) VALUES (?)", (BIG,))
    assert db.query("SELECT COUNT(*) FROM t") == [(2,)]
    db.close()


def test_a_file_size_limit_fails_writes_typed_and_they_work_once_it_is_lifted(
    tmp_path: Path,
) -> None:
    """``ulimit -f`` (RLIMIT_FSIZE): the kernel refuses writes past the limit (EFBIG),
    with no root and no special filesystem. In a child process, not in pytest's."""
    script = textwrap.dedent(
        f"""
        import resource
        from pathlib import Path
        from meshnet.errors import DatabaseUnavailable
        from meshnet.tracker.storage.database import SQLiteDatabase
        db = SQLiteDatabase(Path({str(tmp_path / "t.db")!r}))
        db.run({SCHEMA!r})
        db.run("INSERT INTO t (v) VALUES ('a')")
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, hard))
        outcomes = []
        for i in range(20):
            try:
                with db.transaction() as tx:
                    tx.run("INSERT INTO t (v) VALUES (?)", ("x" * 20000,))
            except DatabaseUnavailable as e:
                outcomes.append("refused")
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        db.run("INSERT INTO t (v) VALUES ('after')")
        print(outcomes.count("refused"), db.query("SELECT v FROM t WHERE v = 'after'"))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    refused, rows = done.stdout.split(" ", 1)
    assert int(refused) > 0
    assert rows.strip() == "[('after',)]"


def test_a_constraint_violation_keeps_its_type(tmp_path: Path) -> None:
    db = SQLiteDatabase(tmp_path / "t.db")
    db.run(SCHEMA)
    db.run("INSERT INTO t (id, v) VALUES (1, 'a')")
    with pytest.raises(sqlite3.IntegrityError):
        db.run("INSERT INTO t (id, v) VALUES (1, 'b')")
    with pytest.raises(sqlite3.OperationalError, match="no such table"):
        unavailable_or_raise(db)
    db.close()


def unavailable_or_raise(db: SQLiteDatabase) -> None:
    """A bad statement is a bug: the driver's error, not a 503."""
    try:
        db.query("SELECT * FROM missing")
    except DatabaseUnavailable:
        pytest.fail("a bad statement is not the database being unavailable")


@pytest.mark.parametrize(
    ("error", "typed"),
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), True),
        (OSError(errno.EFBIG, "File too large"), True),
        (OSError(errno.EIO, "Input/output error"), True),
        (OSError(errno.ENOENT, "No such file"), False),
        (sqlite3.OperationalError("database is locked"), True),
        (sqlite3.IntegrityError("UNIQUE constraint failed"), False),
        (ValueError("a bug"), False),
    ],
)
def test_which_errors_are_the_storage_being_unavailable(error: Exception, typed: bool) -> None:
    found = unavailable(error)
    assert (found is not None) is typed
    if found is not None:
        assert found.http_status == 503 and found.retryable


def test_a_row_that_does_not_parse_is_skipped_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rows = [("a", "1"), ("b", "NaN?"), ("c", "3")]
    with caplog.at_level(logging.ERROR):
        assert parse_rows(rows, lambda r: (r[0], int(r[1])), "test") == [("a", 1), ("c", 3)]
    assert "skipped a test row that does not parse ('b')" in caplog.text


# --- PostgreSQL ---------------------------------------------------------------------


def terminate_others(url: str) -> int:
    """Terminate every other backend of this database: the server's admin killing ours."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    return len(rows)


def test_a_terminated_postgresql_backend_is_replaced(fresh_postgres: str) -> None:
    db = open_database(fresh_postgres)
    assert isinstance(db, PostgresDatabase)
    db.run(SCHEMA.replace("INTEGER PRIMARY KEY", "BIGSERIAL PRIMARY KEY"))
    db.run("INSERT INTO t (v) VALUES ('a')")
    assert terminate_others(fresh_postgres) == 1
    assert db.query("SELECT v FROM t") == [("a",)]  # a read runs again on a new connection
    assert terminate_others(fresh_postgres) == 1
    with pytest.raises(DatabaseUnavailable):  # a write is not repeated: its caller decides
        db.run("INSERT INTO t (v) VALUES ('b')")
    db.run("INSERT INTO t (v) VALUES ('c')")
    assert terminate_others(fresh_postgres) == 1
    with pytest.raises(DatabaseUnavailable), db.transaction() as tx:
        tx.run("INSERT INTO t (v) VALUES ('d')")
    with db.transaction() as tx:
        tx.run("INSERT INTO t (v) VALUES ('e')")
    assert [v for (v,) in db.query("SELECT v FROM t ORDER BY id")] == ["a", "c", "e"]
    db.close()


def test_an_unreachable_postgresql_is_typed() -> None:
    with pytest.raises(DatabaseUnavailable, match="cannot connect"):
        open_database(f"postgresql://meshnet@127.0.0.1:{free_port()}/postgres")


def test_a_postgresql_statement_past_its_time_is_typed_and_the_connection_stays(
    fresh_postgres: str,
) -> None:
    """A stuck statement (a lock held elsewhere, an overloaded server) would hold the
    tracker's one connection, and every request behind it: the server cancels it."""
    db = PostgresDatabase(fresh_postgres, statement_timeout_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(DatabaseUnavailable, match="statement timeout"):
        db.query("SELECT pg_sleep(10)")
    assert time.monotonic() - t0 < 5
    assert db.query("SELECT 1") == [(1,)]
    db.close()
