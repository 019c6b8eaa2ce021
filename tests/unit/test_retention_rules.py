"""Retention on a real database (SQLite and PostgreSQL): what is past its time goes, in
batches; a live session, an unfinished turn, a node that is up and a snapshot a live
session would resume from stay, however old."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshnet.cli.main import build_parser
from meshnet.cli.options import duration
from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import NodeAnnouncement, NodeLoad
from meshnet.tracker.accounting import billing
from meshnet.tracker.accounting.ledger import AttemptStatus, LedgerRecord
from meshnet.tracker.accounting.work_checks import SpanCheck, checks
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.serving.bench_store import BenchStore, RouteFigures
from meshnet.tracker.session_data.records import SessionState, SnapshotFile, TurnStatus
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshots import SnapshotStore
from meshnet.tracker.sessions.retention import (
    DAY,
    HOUR,
    WRITING_GRACE_S,
    Purged,
    Retention,
    RetentionPolicy,
)
from meshnet.tracker.storage.database import Database, open_database

REQUEST = {"content": "hi", "max_tokens": 4, "temperature": 0.0}
NOW = 100 * DAY  # the pass's clock; everything below is placed relative to it
OLD = NOW - 8 * DAY  # past every default keep but the ledger's
POLICY = RetentionPolicy(batch=2)  # small batches: every purge takes several


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        database = open_database(tmp_path / "t.db")
    else:
        database = open_database(request.getfixturevalue("fresh_postgres"))
    yield database
    database.close()


class Mesh:
    """The tracker's stores on one database, a snapshot directory, and retention over them."""

    def __init__(self, db: Database, directory: Path, policy: RetentionPolicy = POLICY) -> None:
        self.store = Store(db)
        self.sessions = SessionStore(db)
        self.snapshots = SnapshotStore(db, directory)
        self.retention = Retention(self.store, self.sessions, self.snapshots, policy)

    def session(self, sid: str, state: SessionState, used: float, turns: int = 0) -> None:
        """A session last used (or ended) at ``used`` with ``turns`` delivered turns."""
        self.sessions.create(sid, None, used)
        for i in range(turns):
            turn = self.sessions.accept_turn(sid, f"{sid}-t{i}", None, "h", REQUEST, used)
            assert self.sessions.claim(turn, "A", used + 10, used)
            self.sessions.fail_turn(turn.id, "A", {"kind": "bad-request", "message": "x"})
        if state.terminal:
            self.sessions.end(sid, state, used)
        elif state is not SessionState.IDLE:
            assert self.sessions.set_state(sid, state, (SessionState.IDLE,))
        self._set_last_used(sid, used)

    def _set_last_used(self, sid: str, used: float) -> None:
        self.sessions._db.run("UPDATE sessions SET last_used = ? WHERE id = ?", (used, sid))

    def evicted(self, sid: str, used: float, hops: int = 2) -> list[Path]:
        """A session evicted at ``used`` to ``hops`` indexed snapshot files; their paths."""
        self.sessions.create(sid, None, used)
        files = [self.snapshot_file(sid, f"snap-{sid}", LayerRange(h, h + 1)) for h in range(hops)]
        assert self.sessions.index_snapshot(self.sessions.get(sid), files, used)
        self._set_last_used(sid, used)
        return [Path(f.path) for f in files]

    def snapshot_file(self, sid: str, snapshot_id: str, layers: LayerRange) -> SnapshotFile:
        """A snapshot kept as a file, as meshnets before migration 2 wrote them."""
        path = self.snapshots.directory / f"{sid}.{snapshot_id}.{layers.start}-{layers.end}.snap"
        _write(path, OLD)
        return SnapshotFile(snapshot_id, sid, layers, 1, 0, 0, str(path), 4, "f", "r", "p")

    def states(self) -> dict[str, str]:
        rows = self.sessions._db.query("SELECT id, state FROM sessions")
        return {r[0]: r[1] for r in rows}

    def turn_ids(self) -> set[str]:
        return {r[0] for r in self.sessions._db.query("SELECT id FROM turns")}


def _write(path: Path, mtime: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"kv..")
    os.utime(path, (mtime, mtime))


def test_ended_sessions_and_their_turns_go_after_their_time_live_ones_never(
    db: Database, tmp_path: Path
) -> None:
    m = Mesh(db, tmp_path / "snapshots")
    for i in range(5):  # more than a batch of sessions, and of turns
        m.session(f"ended-{i}", SessionState.COMPLETED, OLD, turns=2)
    m.session("failed", SessionState.FAILED, OLD, turns=1)
    m.session("ended-lately", SessionState.COMPLETED, NOW - HOUR, turns=1)
    for state in (SessionState.IDLE, SessionState.PARKED, SessionState.EVICTED):
        m.session(f"live-{state.value}", state, OLD - 30 * DAY, turns=1)
    m.session("active", SessionState.IDLE, OLD - 30 * DAY)  # a turn still pending
    pending = m.sessions.accept_turn("active", "pending", None, "h", REQUEST, OLD)

    purged = m.retention.run_once(NOW)

    assert (purged.sessions, purged.turns) == (6, 11)
    assert set(m.states()) == {
        "ended-lately",
        "live-idle",
        "live-parked",
        "live-evicted",
        "active",
    }
    assert m.states()["active"] == SessionState.ACTIVE.value
    assert m.sessions.turn(pending.id).status is TurnStatus.PENDING
    assert m.turn_ids() == {"ended-lately-t0", "live-idle-t0", "live-parked-t0"} | {
        "live-evicted-t0",
        "pending",
    }
    assert m.retention.run_once(NOW).total == 0  # nothing left past its time


def test_ending_a_session_starts_its_time(db: Database, tmp_path: Path) -> None:
    m = Mesh(db, tmp_path / "snapshots")
    m.sessions.create("s", None, OLD - 30 * DAY)  # unused for long, ended only now
    m.sessions.end("s", SessionState.COMPLETED, NOW - 60)
    assert m.retention.run_once(NOW).sessions == 0
    assert m.retention.run_once(NOW + 7 * DAY).sessions == 1


def test_ledger_rows_go_after_their_time(db: Database, tmp_path: Path) -> None:
    m = Mesh(db, tmp_path / "snapshots")
    old = [LedgerRecord(f"g{i}", 1, "n", 0, 2, 0, 5, AttemptStatus.COMPLETED) for i in range(5)]
    m.store.record_attempts(old, NOW - 31 * DAY)
    recent = LedgerRecord("recent", 1, "n", 0, 2, 0, 5, AttemptStatus.COMPLETED)
    m.store.record_attempts([recent], NOW - 29 * DAY)
    assert m.retention.run_once(NOW).ledger_rows == 5
    assert m.store.ledger() == [recent]


def test_checks_attributions_and_route_benchmarks_go_with_the_ledger(
    db: Database, tmp_path: Path
) -> None:
    m = Mesh(db, tmp_path / "snapshots")
    for when, gen in ((NOW - 31 * DAY, "old"), (NOW - 29 * DAY, "recent")):
        m.store.record_check(SpanCheck("n", gen, 0, 2, 0, 32, passed=True), when)
        billing.attribute(db, gen, "acme", when)
        BenchStore(db).record([_figures(gen, when)])
    purged = m.retention.run_once(NOW)
    assert (purged.check_rows, purged.attribution_rows, purged.benchmark_rows) == (1, 1, 1)
    assert [c.generation_id for c, _ in checks(db)] == ["recent"]
    assert [f.run_id for f in BenchStore(db).latest()] == ["recent"]
    assert m.retention.run_once(NOW).total == 0


def _figures(run_id: str, when: float) -> RouteFigures:
    return RouteFigures(
        run_id, 0, when, "m", "f", (("n", LayerRange(0, 2)),), 4, 4, 1, 4, 1.0, 1.0, 1.0, 9.0, True
    )


def _announce(node_id: str) -> NodeAnnouncement:
    load = NodeLoad(sessions=0, kv_bytes=0, queue_depth=0, steps=0)
    return NodeAnnouncement(
        node_id=node_id,
        address="127.0.0.1:1",
        fingerprint="f",
        layer_start=0,
        layer_end=2,
        backend="numpy",
        kv_budget_bytes=0,
        pid=1,
        load=load,
    )


def test_nodes_down_past_their_time_go_nodes_up_stay(db: Database, tmp_path: Path) -> None:
    m = Mesh(db, tmp_path / "snapshots")
    for i in range(3):
        m.store.register(_announce(f"dead-{i}"), NOW - 2 * DAY)
        m.store.mark_down(f"dead-{i}", "heartbeat-lost")
    m.store.register(_announce("down-lately"), NOW - HOUR)
    m.store.mark_down("down-lately", "heartbeat-lost")
    m.store.register(_announce("silent-but-up"), NOW - 9 * DAY)  # the sweeper's to judge
    m.store.register(_announce("back"), NOW - 9 * DAY)
    m.store.mark_down("back", "heartbeat-lost")
    m.store.register(_announce("back"), NOW)  # registered again: up, seen now
    assert m.retention.run_once(NOW).dead_nodes == 3
    assert [n.node_id for n in m.store.nodes()] == ["back", "down-lately", "silent-but-up"]


def test_snapshots_no_live_session_needs_go_with_their_rows(db: Database, tmp_path: Path) -> None:
    m = Mesh(db, tmp_path / "snapshots")
    live = m.evicted("live", OLD)
    ended = m.evicted("ended", OLD)
    m.sessions.end("ended", SessionState.COMPLETED, OLD)  # as if its files outlived a crash
    gone = m.evicted("gone", OLD, hops=1)
    m.sessions._db.run("DELETE FROM sessions WHERE id = 'gone'")
    # A live session that holds another snapshot now: its older rows are stale.
    stale = m.snapshot_file("live", "older", LayerRange(0, 1))
    m.sessions._db.run(
        "INSERT INTO snapshots (snapshot_id, session_id, layer_start, layer_end, epoch, tokens, "
        "steps, path, bytes, file_sha256, root_hash, prefix_hash, created) "
        "VALUES ('older', 'live', 0, 1, 1, 0, 0, ?, 4, 'f', 'r', 'p', ?)",
        (stale.path, OLD),
    )

    purged = m.retention.run_once(NOW)

    assert purged.snapshot_rows == 4  # two of "ended", one of "gone", "live"'s older one
    assert [f.path for f in m.sessions.snapshots_of("live")] == [str(p) for p in live]
    assert all(p.exists() for p in live)
    assert not any(p.exists() for p in [*ended, *gone, Path(stale.path)])
    assert m.sessions.snapshots_of("ended") == [] and m.sessions.snapshots_of("gone") == []


def test_unindexed_files_go_after_their_time_a_live_sessions_after_the_grace(
    db: Database, tmp_path: Path
) -> None:
    directory = tmp_path / "snapshots"
    m = Mesh(db, directory)
    m.session("live", SessionState.IDLE, NOW)
    m.session("ended", SessionState.COMPLETED, NOW)
    files = {
        "ended": (directory / "ended.a.0-1.snap", NOW - 2 * HOUR),
        "unknown": (directory / "nobody.b.0-1.snap", NOW - 2 * HOUR),
        "young": (directory / "nobody.c.0-1.snap", NOW - 60),
        "writing": (directory / "live.d.0-1.snap", NOW - WRITING_GRACE_S + 60),
        "writing-tmp": (directory / "ended.e.0-1.tmp", NOW - WRITING_GRACE_S + 60),
        "abandoned": (directory / "live.f.0-1.snap", NOW - WRITING_GRACE_S - 60),
        "abandoned-tmp": (directory / "live.g.0-1.tmp", NOW - WRITING_GRACE_S - 60),
        "not-ours": (directory / "README", NOW - 9 * DAY),
    }
    for path, mtime in files.values():
        _write(path, mtime)
    policy = RetentionPolicy(orphans_s=WRITING_GRACE_S / 2, batch=2)
    assert Mesh(db, directory, policy).retention.run_once(NOW).unindexed_files == 4
    left = {name for name, (path, _) in files.items() if path.exists()}
    assert left == {"young", "writing", "writing-tmp", "not-ours"}


def test_zero_keeps_forever(db: Database, tmp_path: Path) -> None:
    forever = RetentionPolicy(sessions_s=0, ledger_s=0, dead_nodes_s=0, orphans_s=0)
    m = Mesh(db, tmp_path / "snapshots", forever)
    m.session("ended", SessionState.COMPLETED, 0.0, turns=1)
    m.store.record_attempts([LedgerRecord("g", 1, "n", 0, 2, 0, 5, AttemptStatus.COMPLETED)], 0.0)
    m.store.register(_announce("dead"), 0.0)
    m.store.mark_down("dead", "heartbeat-lost")
    _write(tmp_path / "snapshots" / "nobody.a.0-1.snap", 0.0)
    assert m.retention.run_once(NOW) == Purged()
    assert not m.retention.enabled


def test_purges_delete_at_most_a_batch_per_call(db: Database, tmp_path: Path) -> None:
    m = Mesh(db, tmp_path / "snapshots")
    for i in range(3):
        m.session(f"e{i}", SessionState.COMPLETED, OLD, turns=2)
    assert m.sessions.purge_ended_sessions(NOW, 2) == 0  # not while they have turns
    assert [m.sessions.purge_ended_turns(NOW, 4) for _ in range(3)] == [4, 2, 0]
    assert [m.sessions.purge_ended_sessions(NOW, 2) for _ in range(3)] == [2, 1, 0]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("1.5", 1.5), ("30s", 30.0), ("15m", 900.0), ("2h", 7200.0), ("7d", 7 * DAY)],
)
def test_retention_flags_take_seconds_or_a_unit(text: str, seconds: float) -> None:
    args = build_parser().parse_args(["tracker", "--keep-sessions", text])
    assert args.keep_sessions == seconds
    assert duration(str(seconds)) == seconds  # as `meshnet up` passes it on


def test_retention_flag_defaults_are_the_policys() -> None:
    args = build_parser().parse_args(["tracker"])
    policy = RetentionPolicy()
    assert (args.keep_sessions, args.keep_ledger) == (policy.sessions_s, policy.ledger_s)
    assert (args.keep_dead_nodes, args.keep_orphans) == (policy.dead_nodes_s, policy.orphans_s)
    assert args.retention_interval == policy.interval_s


@pytest.mark.parametrize(
    ("flag", "bad"),
    [("--keep-ledger", "-1d"), ("--keep-orphans", "soon"), ("--retention-interval", "0")],
)
def test_a_bad_duration_is_refused(flag: str, bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tracker", flag, bad])
    assert flag in capsys.readouterr().err
