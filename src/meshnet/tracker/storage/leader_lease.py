"""One placement leader among the trackers on a database: a lease row, renewed by its holder.

Trackers sharing a PostgreSQL database each run a placement controller
(tracker/serving/placement.py); left alone, two would see one gap at once and load it twice.
The lease makes one of them the leader: a row of ``leases`` names its holder
(one tracker process) and when it expires. The holder renews it every
``ttl_s / 3``; another tracker takes it only once it has expired (its holder
stopped, or lost the database), in one conditional upsert, so two never take
it at once. Expiry is judged on the database's clock, not on each machine's.

A holder counts on its lease for ``ttl_s`` less a margin from the moment it
*asked* for the renewal, on its own monotonic clock: it stops acting before
any other tracker may take over, also while its renewals fail. Renewal runs
on its own task, beside the placement loop, so a long load (a node fetching
and loading a span) does not let the lease lapse under it. A tracker that
stops cleanly hands the lease back (``release``): the next takes it at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from meshnet.tracker.loops import LoopHealth
from meshnet.tracker.storage.database import Database

log = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    name TEXT PRIMARY KEY,
    holder TEXT NOT NULL,
    expires DOUBLE PRECISION NOT NULL,
    term BIGINT NOT NULL
)
"""
_NOW = {  # the database's clock, in seconds since the epoch
    "postgresql": "SELECT EXTRACT(EPOCH FROM clock_timestamp())",
    "sqlite": "SELECT (julianday('now') - 2440587.5) * 86400.0",
}
_MARGIN = 0.2  # share of the lease a holder does not count on (clock rates, a slow answer)
PLACEMENT = "placement"  # the lease of the placement controllers


def holder_id() -> str:
    """This tracker process, as a lease names it."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class LeaseRow:
    holder: str
    expires: float
    term: int  # how many times the lease changed hands, plus one


class Lease:
    """The row of one named lease, as seen by one would-be holder."""

    def __init__(
        self,
        db: Database,
        name: str,
        holder: str,
        ttl_s: float,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``clock``: the time leases are judged by (default: the database's)."""
        self.db = db
        self.name = name
        self.holder = holder
        self.ttl_s = ttl_s
        self._clock = clock
        db.create_schema(_SCHEMA)

    def now(self) -> float:
        if self._clock is not None:
            return self._clock()
        return float(self.db.query(_NOW[self.db.dialect])[0][0])

    def hold(self) -> bool:
        """Take the lease if it is free or expired, or renew it if it is ours; whether
        we hold it now. One statement: of two trackers asking at once, one wins."""
        now = self.now()
        changed = self.db.run(
            "INSERT INTO leases (name, holder, expires, term) VALUES (?, ?, ?, 1) "
            "ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, "
            "expires = excluded.expires, term = CASE WHEN leases.holder = excluded.holder "
            "THEN leases.term ELSE leases.term + 1 END "
            "WHERE leases.holder = excluded.holder OR leases.expires <= ?",
            (self.name, self.holder, now + self.ttl_s, now),
        )
        return changed == 1

    def release(self) -> None:
        """Let the lease expire now, if it is ours."""
        self.db.run(
            "UPDATE leases SET expires = 0 WHERE name = ? AND holder = ?", (self.name, self.holder)
        )

    def row(self) -> LeaseRow | None:
        rows = self.db.query(
            "SELECT holder, expires, term FROM leases WHERE name = ?", (self.name,)
        )
        if not rows:
            return None
        holder, expires, term = rows[0]
        return LeaseRow(str(holder), float(expires), int(term))


@dataclass
class LeaseHealth(LoopHealth):
    """The renewal loop's record (``/admin/loops``). Written by the loop only."""

    holder: str = ""  # this tracker, as the lease names it
    leader: bool = False  # whether this tracker's placement acts now
    terms: int = 0  # times this tracker took the lease


class Leadership:
    """Keeps one tracker's claim on a lease; ``leads`` says whether it may act now."""

    def __init__(self, lease: Lease, monotonic: Callable[[], float] = time.monotonic) -> None:
        self.lease = lease
        self.health = LeaseHealth(f"{lease.name} lease", holder=lease.holder)
        self._monotonic = monotonic
        self._until = 0.0  # monotonic time up to which the lease is surely ours

    def leads(self) -> bool:
        return self._monotonic() < self._until

    def renew(self) -> bool:
        """Take or renew the lease (blocking); whether this tracker leads now. A failed
        call (``DatabaseUnavailable``) leaves the lease to run out on its own."""
        asked = self._monotonic()
        leading = self.leads()
        held = self.lease.hold()
        if held:
            self._until = asked + self.lease.ttl_s * (1 - _MARGIN)
            if not leading:
                self.health.terms += 1
                log.info("%s lease taken: this tracker leads", self.lease.name)
        else:
            self._until = 0.0
            if leading:
                log.warning("%s lease lost to another tracker", self.lease.name)
        self.health.leader = held
        return held

    async def run_forever(self) -> None:
        """Renew every third of the lease until cancelled, then hand it back."""
        try:
            while True:
                try:
                    await asyncio.to_thread(self.renew)
                except Exception as e:  # a database gone for a moment: the lease runs out
                    self.health.failed(e)
                else:
                    self.health.passed()
                self.health.leader = self.leads()
                await asyncio.sleep(self.lease.ttl_s / 3)
        finally:
            if self.leads():
                self._until = 0.0
                with contextlib.suppress(Exception):  # it runs out on its own otherwise
                    self.lease.release()
            self.health.leader = False
