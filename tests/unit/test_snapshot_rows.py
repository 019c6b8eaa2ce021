"""Snapshots kept in the tracker's database (SQLite and PostgreSQL): a stream is written in
rows and read back frame for frame, one row at a time; a stream cut off keeps no row; a
row missing, grown or rewritten is refused with its typed reason; rows no index names go
with retention; a snapshot an older meshnet kept as a file is still read from it."""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from meshnet.errors import KVImportFailed
from meshnet.layer_range import LayerRange
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.session_data.records import SessionState, SnapshotFile
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshot_rows import ROW_BYTES, RowReader
from meshnet.tracker.session_data.snapshots import SnapshotStore, SnapshotTarget
from meshnet.tracker.storage.database import Database, open_database

SID = "sess-1"
PREFIX = "p" * 64
TARGET = SnapshotTarget("snap-1", SID, LayerRange(0, 2))
CHUNK = 700_000  # three chunks span three rows of ROW_BYTES
HOUR = 3600.0


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    if request.param == "sqlite":
        database = open_database(tmp_path / "t.db")
    else:
        database = open_database(request.getfixturevalue("fresh_postgres"))
    SessionStore(database)  # the index the rows belong to
    yield database
    database.close()


def _stream(chunks: int = 3, session_id: str = SID) -> list[pb.KVFrame]:
    header = pb.KVHeader(
        version=1, session_id=session_id, epoch=3, tokens=9, steps=2, token_prefix_hash=PREFIX
    )
    frames = [pb.KVFrame(header=header)]
    for i in range(chunks):
        data = bytes([i + 1]) * CHUNK
        frames.append(pb.KVFrame(chunk=pb.KVChunk(index=i, data=data, digest=b"d" * 32)))
    frames.append(pb.KVFrame(trailer=pb.KVTrailer(root_hash=b"\x07" * 32)))
    return frames


async def _aiter(frames: list[pb.KVFrame]) -> AsyncIterator[pb.KVFrame]:
    for frame in frames:
        yield frame


def _write(store: SnapshotStore, frames: list[pb.KVFrame]) -> SnapshotFile:
    return asyncio.run(store.write(TARGET, _aiter(frames), PREFIX))


def _rows(db: Database) -> list[tuple[int, int]]:
    rows = db.query("SELECT seq, length(data) FROM snapshot_chunks ORDER BY seq")
    return [(int(seq), int(n)) for seq, n in rows]


def _refusal(store: SnapshotStore, snapshot: SnapshotFile) -> str:
    with pytest.raises(KVImportFailed) as e:
        list(store.frames(snapshot, PREFIX))
    return e.value.reason


def test_a_stream_is_kept_in_rows_and_read_back_frame_for_frame(
    db: Database, tmp_path: Path
) -> None:
    store = SnapshotStore(db, tmp_path / "snapshots")
    frames = _stream()
    snapshot = _write(store, frames)
    size = sum(4 + f.ByteSize() for f in frames)
    assert (snapshot.path, snapshot.nbytes, snapshot.chunks) == ("", size, 3)
    assert (snapshot.epoch, snapshot.tokens, snapshot.steps) == (3, 9, 2)
    assert snapshot.root_hash == (b"\x07" * 32).hex()
    assert [n for _, n in _rows(db)] == [ROW_BYTES, ROW_BYTES, size - 2 * ROW_BYTES]
    assert list(store.frames(snapshot, PREFIX)) == frames
    assert not (tmp_path / "snapshots").exists()  # nothing on this tracker's disk


def test_rows_are_fetched_one_at_a_time_as_the_frames_are_read(
    db: Database, tmp_path: Path
) -> None:
    snapshot = _write(SnapshotStore(db, tmp_path), _stream())
    fetched: list[Any] = []

    class Counting:
        def query(self, sql: str, args: Any = ()) -> Any:
            fetched.append(args[-1])
            return db.query(sql, args)

    reader = RowReader(Counting(), snapshot)  # type: ignore[arg-type]
    reader.read(4)
    assert fetched == [0]  # a frame length: the first row, and no other
    reader.read(ROW_BYTES)
    assert fetched == [0, 1]


def test_a_stream_cut_off_before_its_trailer_is_refused_and_keeps_no_row(
    db: Database, tmp_path: Path
) -> None:
    store = SnapshotStore(db, tmp_path)
    with pytest.raises(KVImportFailed) as e:
        _write(store, _stream()[:-1])
    assert e.value.reason == "truncated"
    assert _rows(db) == []
    with pytest.raises(KVImportFailed, match="another session"):
        _write(store, _stream(session_id="sess-other"))
    assert _rows(db) == []


def _missing_middle(db: Database, s: SnapshotFile) -> None:
    db.run("DELETE FROM snapshot_chunks WHERE seq = 1")


def _missing_last(db: Database, s: SnapshotFile) -> None:
    db.run("DELETE FROM snapshot_chunks WHERE seq = ?", (s.chunks - 1,))


def _grown_row(db: Database, s: SnapshotFile) -> None:
    db.run("UPDATE snapshot_chunks SET data = ? WHERE seq = 1", (b"\0" * (ROW_BYTES + 1),))


def _inflated_length(db: Database, s: SnapshotFile) -> None:
    (row,) = db.query("SELECT data FROM snapshot_chunks WHERE seq = 0")
    data = struct.pack(">I", 0xFFFFFFF0) + bytes(row[0])[4:]
    db.run("UPDATE snapshot_chunks SET data = ? WHERE seq = 0", (data,))


def _garbled_header(db: Database, s: SnapshotFile) -> None:
    (row,) = db.query("SELECT data FROM snapshot_chunks WHERE seq = 0")
    data = bytes(row[0])
    db.run(
        "UPDATE snapshot_chunks SET data = ? WHERE seq = 0", (data[:4] + b"\xff" * 8 + data[12:],)
    )


def _other_root(db: Database, s: SnapshotFile) -> None:
    db.run("UPDATE snapshots SET root_hash = ?", ("ab" * 32,))


CORRUPTIONS = {
    "missing-middle-row": (_missing_middle, "truncated"),
    "missing-last-row": (_missing_last, "truncated"),
    "grown-row": (_grown_row, "size-limit"),
    "inflated-frame-length": (_inflated_length, "size-limit"),
    "garbled-header": (_garbled_header, "invalid"),
    "another-root-hash": (_other_root, "root-hash"),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_snapshot_is_refused_with_its_reason(
    db: Database, tmp_path: Path, corruption: str
) -> None:
    sessions = SessionStore(db)
    sessions.create(SID, None, 1.0)
    store = SnapshotStore(db, tmp_path)
    written = _write(store, _stream())
    indexable = replace(written, tokens=0, steps=0)  # the session's own: it has none yet
    assert sessions.index_snapshot(sessions.get(SID), [indexable], 2.0)
    corrupt, reason = CORRUPTIONS[corruption]
    corrupt(db, written)
    (indexed,) = sessions.snapshot(TARGET.snapshot_id)
    assert _refusal(store, indexed) == reason


def test_another_token_history_is_refused(db: Database, tmp_path: Path) -> None:
    store = SnapshotStore(db, tmp_path)
    snapshot = _write(store, _stream())
    with pytest.raises(KVImportFailed) as e:
        list(store.frames(snapshot, "q" * 64))
    assert e.value.reason == "token-prefix"


def test_rows_no_index_names_go_after_their_time_a_live_sessions_after_the_grace(
    db: Database, tmp_path: Path
) -> None:
    sessions = SessionStore(db)
    sessions.create("live", None, 1.0)
    sessions.create("ended", None, 1.0)
    sessions.end("ended", SessionState.COMPLETED, 1.0)
    now = 10 * HOUR
    clock = [now - 2 * HOUR]
    store = SnapshotStore(db, tmp_path)
    store.rows._clock = lambda: clock[0]
    for sid in ("live", "ended", "nobody"):
        store.rows.put((f"{sid}-snap", 0, sid), 0, b"kv")
    clock[0] = now - 60
    store.rows.put(("young-snap", 0, "nobody"), 0, b"kv")
    left = lambda: {str(r[0]) for r in db.query("SELECT snapshot_id FROM snapshot_chunks")}  # noqa: E731
    assert store.purge_unindexed_rows(now, HOUR, 3 * HOUR, 10) == 2
    assert left() == {"live-snap", "young-snap"}
    assert store.purge_unindexed_rows(now, HOUR, HOUR, 10) == 1  # past the grace too
    assert left() == {"young-snap"}


def test_a_snapshot_an_older_meshnet_kept_as_a_file_is_read_from_it(
    db: Database, tmp_path: Path
) -> None:
    frames = _stream()
    path = tmp_path / f"{SID}.{TARGET.snapshot_id}.0-2.snap"
    path.write_bytes(
        b"".join(struct.pack(">I", f.ByteSize()) + f.SerializeToString() for f in frames)
    )
    root = frames[-1].trailer.root_hash.hex()
    old = SnapshotFile("snap-1", SID, LayerRange(0, 2), 3, 9, 2, str(path), 0, "f", root, PREFIX)
    store = SnapshotStore(db, tmp_path)
    assert list(store.frames(old, PREFIX)) == frames
    store.remove(old)
    assert not path.exists()
    assert _refusal(store, old) == "missing"
