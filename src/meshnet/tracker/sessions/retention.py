"""Retention: how long the tracker keeps what it no longer needs, and the sweeper that
enforces it.

Without it the database and the snapshot directory only grow: every ended
session with its turns, every ledger row, every node that ever went down,
and snapshot rows (or an older meshnet's files) left behind by a crash. A
retention pass deletes what is past its time:

- an ended session (``completed`` / ``failed``) and its turns, ``sessions_s``
  after it ended;
- a ledger row, ``ledger_s`` after it was recorded;
- a node that is down, ``dead_nodes_s`` after it was last heard from;
- a snapshot index row no live session can resume from (its session ended
  or holds another snapshot) and its stream's rows (or file), ``orphans_s``
  after both were written and the session ended; a snapshot row the index
  does not name, or a snapshot or temp file, ``orphans_s`` after it was
  written (and, for a live session's, which an eviction may still be about
  to index, ``WRITING_GRACE_S``).

It never touches a live session, a pending or running turn, a node that is
up, or a snapshot a live session would resume from. Every delete is one short
statement over at most ``batch`` rows, repeated until none is left, so the
pass never holds the database for long; the pass runs in a worker thread, so
the event loop only waits for one batch at a time. Several trackers on one
database may run passes at once: each delete re-checks its conditions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

from meshnet.tracker.accounting.billing import purge_owners
from meshnet.tracker.accounting.work_checks import purge_checks
from meshnet.tracker.loops import LoopHealth
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.serving.bench_store import BenchStore
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshots import SnapshotStore

log = logging.getLogger(__name__)

HOUR = 3600.0
DAY = 24 * HOUR
# A live session's snapshot rows not yet indexed may belong to an eviction still
# exporting its other hops (up to a minute each): kept at least this long.
WRITING_GRACE_S = HOUR

# The indexes the purge queries use (each one is a range or join on these columns).
_INDEXES = """
CREATE INDEX IF NOT EXISTS sessions_state_used ON sessions (state, last_used);
CREATE INDEX IF NOT EXISTS ledger_recorded ON ledger (recorded);
CREATE INDEX IF NOT EXISTS snapshots_session ON snapshots (session_id);
CREATE INDEX IF NOT EXISTS snapshots_created ON snapshots (created)
"""


@dataclass(frozen=True)
class RetentionPolicy:
    """How long each kind of leftover is kept, in seconds; 0 keeps it forever."""

    sessions_s: float = 7 * DAY  # an ended session and its turns, from when it ended
    ledger_s: float = 30 * DAY  # a ledger row, from when it was recorded
    dead_nodes_s: float = DAY  # a node that is down, from when it was last heard from
    orphans_s: float = HOUR  # a snapshot file or row no live session needs
    interval_s: float = 60.0  # between the ends of two passes
    batch: int = 500  # rows per delete statement (and files per index lookup)


@dataclass(frozen=True)
class Purged:
    """What one pass deleted."""

    sessions: int = 0
    turns: int = 0
    ledger_rows: int = 0
    dead_nodes: int = 0
    snapshot_rows: int = 0  # index rows, with their streams
    unindexed_chunks: int = 0  # stream rows no index row names
    unindexed_files: int = 0  # files of older meshnets' snapshots
    owner_rows: int = 0  # who owned a session no longer kept
    check_rows: int = 0  # the verifier's checks, kept as long as the ledger
    attribution_rows: int = 0  # whom a generation was billed to, as long as the ledger
    benchmark_rows: int = 0  # route benchmarks' figures, as long as the ledger

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))


class Retention:
    """Runs retention passes over one tracker's database and snapshot directory."""

    def __init__(
        self,
        store: Store,
        sessions: SessionStore,
        snapshots: SnapshotStore,
        policy: RetentionPolicy = RetentionPolicy(),
        owners: Callable[[int], int] | None = None,
    ) -> None:
        """``owners(limit)`` deletes up to ``limit`` ownership rows of sessions no longer
        kept (the tenancy tables'), the number deleted."""
        self.store = store
        self.db = store.db  # the verifier's checks and billing attributions live there too
        self.benchmarks = BenchStore(store.db)
        self.owners = owners
        self.sessions = sessions
        self.snapshots = snapshots
        self.policy = policy
        self.health = LoopHealth("retention")
        store.db.create_schema(_INDEXES)

    def run_once(self, now: float) -> Purged:
        """One pass: delete everything past its time at ``now``. Blocking; call it from
        a worker thread (``run_forever`` does)."""
        p, batch = self.policy, self.policy.batch
        purged: dict[str, int] = {}
        if p.sessions_s > 0:
            before = now - p.sessions_s
            purged["turns"] = _drain(lambda n: self.sessions.purge_ended_turns(before, n), batch)
            purged["sessions"] = _drain(
                lambda n: self.sessions.purge_ended_sessions(before, n), batch
            )
            if self.owners is not None:
                purged["owner_rows"] = _drain(self.owners, batch)
        if p.ledger_s > 0:
            before = now - p.ledger_s
            purged["ledger_rows"] = _drain(lambda n: self.store.purge_ledger(before, n), batch)
            purged["check_rows"] = _drain(lambda n: purge_checks(self.db, before, n), batch)
            purged["attribution_rows"] = _drain(lambda n: purge_owners(self.db, before, n), batch)
            purged["benchmark_rows"] = _drain(lambda n: self.benchmarks.purge(before, n), batch)
        if p.dead_nodes_s > 0:
            before = now - p.dead_nodes_s
            purged["dead_nodes"] = _drain(lambda n: self.store.purge_dead_nodes(before, n), batch)
        if p.orphans_s > 0:
            before = now - p.orphans_s
            purged["snapshot_rows"] = _drain(
                lambda n: self.snapshots.purge_stale(self.sessions, before, n), batch
            )
            purged["unindexed_chunks"] = _drain(
                lambda n: self.snapshots.purge_unindexed_rows(now, p.orphans_s, WRITING_GRACE_S, n),
                batch,
            )
            purged["unindexed_files"] = self.snapshots.purge_unindexed(
                self.sessions, now, p.orphans_s, WRITING_GRACE_S, batch
            )
        return Purged(**purged)

    @property
    def enabled(self) -> bool:
        p = self.policy
        return any(s > 0 for s in (p.sessions_s, p.ledger_s, p.dead_nodes_s, p.orphans_s))

    async def run_forever(self) -> None:
        """A pass every ``interval_s`` (the first at once); a failed pass is logged and
        counted in ``health``, and the next one runs as usual."""
        if not self.enabled:
            log.info("retention: everything is kept forever")
            return
        while True:
            try:
                purged = await asyncio.to_thread(self.run_once, time.time())
            except Exception as e:  # a database gone for a moment, a full disk, a bug
                self.health.failed(e)
            else:
                self.health.passed()
                if purged.total:
                    log.info("retention: deleted %s", purged)
            await asyncio.sleep(self.policy.interval_s)


def _drain(purge: Callable[[int], int], batch: int) -> int:
    """Call ``purge(batch)`` until it deletes fewer than ``batch``; the total deleted."""
    total = 0
    while True:
        n = purge(batch)
        total += n
        if n < batch:
            return total
