"""The placement lease on a real database (SQLite and PostgreSQL): one holder at a time,
renewed by it, taken over only once expired (or handed back), one winner when several
trackers ask at once; a holder stops counting on it before another may take it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from meshnet.errors import DatabaseUnavailable
from meshnet.tracker.storage.database import Database, open_database
from meshnet.tracker.storage.leader_lease import Leadership, Lease

TTL = 10.0


@pytest.fixture(params=["sqlite", "postgresql"])
def target(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "postgresql":
        return str(request.getfixturevalue("fresh_postgres"))
    return str(tmp_path / "t.db")


@pytest.fixture
def connect(target: str) -> Iterator[Callable[[], Database]]:
    """Connections to one database, as several trackers hold them; closed at the end."""
    opened: list[Database] = []

    def open_one() -> Database:
        opened.append(open_database(target if "://" in target else Path(target)))
        return opened[-1]

    yield open_one
    for db in opened:
        db.close()


def test_one_holder_renews_and_another_takes_over_only_once_it_expired(
    connect: Callable[[], Database],
) -> None:
    now = [1000.0]
    a = Lease(connect(), "placement", "tracker-a", TTL, clock=lambda: now[0])
    b = Lease(connect(), "placement", "tracker-b", TTL, clock=lambda: now[0])
    assert a.hold()
    assert not b.hold()
    now[0] += TTL - 1
    assert a.hold()  # renewed: it runs TTL from now
    now[0] += TTL - 1
    assert not b.hold()
    row = a.row()
    assert row is not None and (row.holder, row.expires, row.term) == ("tracker-a", now[0] + 1, 1)
    now[0] += 1  # expired
    assert b.hold()
    assert not a.hold()  # the old holder lost it
    row = b.row()
    assert row is not None and (row.holder, row.term) == ("tracker-b", 2)


def test_a_lease_handed_back_is_taken_at_once(connect: Callable[[], Database]) -> None:
    now = [1000.0]
    a = Lease(connect(), "placement", "tracker-a", TTL, clock=lambda: now[0])
    b = Lease(connect(), "placement", "tracker-b", TTL, clock=lambda: now[0])
    assert a.hold()
    b.release()  # not b's to hand back: nothing changes
    assert not b.hold()
    a.release()
    assert b.hold()


def test_of_trackers_asking_at_once_for_an_expired_lease_one_wins(
    connect: Callable[[], Database],
) -> None:
    leases = [Lease(connect(), "placement", f"tracker-{i}", TTL) for i in range(6)]
    start = threading.Barrier(len(leases))
    won: list[bool] = [False] * len(leases)

    def ask(i: int) -> None:
        start.wait()
        won[i] = leases[i].hold()

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(leases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(won) == 1
    row = leases[0].row()
    assert row is not None and row.holder == f"tracker-{won.index(True)}"


def test_the_database_clock_judges_expiry(connect: Callable[[], Database]) -> None:
    lease = Lease(connect(), "placement", "tracker-a", TTL)
    assert lease.hold()
    row = lease.row()
    assert row is not None and 0 < row.expires - lease.now() <= TTL


def test_a_holder_counts_on_its_lease_for_less_than_it_runs_also_when_renewals_fail(
    connect: Callable[[], Database],
) -> None:
    now, mono = [1000.0], [50.0]
    lease = Lease(connect(), "placement", "tracker-a", TTL, clock=lambda: now[0])
    lead = Leadership(lease, monotonic=lambda: mono[0])
    assert not lead.leads()
    assert lead.renew() and lead.leads()
    assert lead.health.terms == 1

    def unavailable() -> bool:
        raise DatabaseUnavailable("PostgreSQL: gone")

    lease.hold = unavailable  # type: ignore[method-assign]
    mono[0] += TTL / 2
    with pytest.raises(DatabaseUnavailable):
        lead.renew()
    assert lead.leads()  # still within the lease it holds
    mono[0] += TTL / 2 - 0.5  # the lease runs TTL; the holder stops before it ends
    assert not lead.leads()

    other = Leadership(Lease(connect(), "placement", "tracker-b", TTL, clock=lambda: now[0]))
    assert not other.renew()  # not before expiry, on the database's clock
    now[0] += TTL
    assert other.renew() and other.leads()
