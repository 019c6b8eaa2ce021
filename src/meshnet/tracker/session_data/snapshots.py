"""The snapshot store: evicted sessions' KV streams in the tracker's database.

A snapshot is one shard's KV stream exactly as ``StateGet`` sent it —
header, hashed chunks, trailer with the root hash — each frame prefixed by
its length, so resuming streams it to a node's ``StatePut`` unchanged and the
node verifies every hash. The stream is kept in rows of the database
(snapshot_rows.py), so every tracker on a shared PostgreSQL can resume from
it; the rows are written first and only then indexed, together with the
session's move to ``evicted`` (``SessionStore.index_snapshot``): the index
never names a stream that is not whole. Reading checks the frame lengths
against the stream's limits before allocating, and the trailer's root hash
against the one the index recorded; it holds one row and one frame at a time.

Snapshots written by a meshnet before they moved to the database are files
under ``directory`` on the disk of the tracker that wrote them, named by
their index row (``path``, ``chunks`` 0). They stay readable there, by that
tracker, and go as every snapshot goes: stale ones by retention, with their
session's end, or when it moves on.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
from collections.abc import AsyncIterator, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from google.protobuf.message import DecodeError

from meshnet.errors import DatabaseUnavailable, KVImportFailed
from meshnet.kv.pace import TransferPace
from meshnet.kv.transfer import MAX_CHUNK_BYTES
from meshnet.layer_range import LayerRange
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.session_data.records import SnapshotFile
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshot_rows import SnapshotRows
from meshnet.tracker.storage.database import Database

_LENGTH = struct.Struct(">I")
_MAX_FRAME = MAX_CHUNK_BYTES + 4096  # a chunk's data plus its index and hash


@dataclass(frozen=True)
class SnapshotTarget:
    """Where one shard's snapshot of a session goes."""

    snapshot_id: str
    session_id: str
    layers: LayerRange


class _Source(Protocol):
    def read(self, n: int, /) -> bytes: ...


class SnapshotStore:
    """Snapshots in the database's rows; those of older meshnets as files in ``directory``."""

    def __init__(self, db: Database, directory: Path, pace: TransferPace | None = None) -> None:
        self.rows = SnapshotRows(db)
        self.directory = directory  # files of snapshots written before they moved
        self.pace = pace or TransferPace()  # how long moving one snapshot's KV may take

    async def write(
        self, target: SnapshotTarget, frames: AsyncIterator[pb.KVFrame], prefix_hash: str
    ) -> SnapshotFile:
        """Write a KV stream's rows, not yet indexed; ``KVImportFailed`` (and no row
        kept) if it is not one whole stream of the session."""
        writer = self.rows.writer(target.snapshot_id, target.layers.start, target.session_id)
        digest = hashlib.sha256()
        header: pb.KVHeader | None = None
        root = b""
        size = 0
        try:
            async for frame in frames:
                kind = frame.WhichOneof("kind")
                if kind == "header":
                    header = frame.header
                elif kind == "trailer":
                    root = frame.trailer.root_hash
                data = frame.SerializeToString()
                for part in (_LENGTH.pack(len(data)), data):
                    digest.update(part)
                    size += len(part)
                    await writer.write(part)
            if header is None or not root:
                raise KVImportFailed("the KV stream ended before its trailer", "truncated")
            if header.session_id != target.session_id:
                raise KVImportFailed("the KV stream is of another session", "invalid")
            chunks = await writer.close()
        except BaseException:
            # Unindexed, these rows are never read; retention drops them if this cannot.
            with contextlib.suppress(DatabaseUnavailable):
                self.rows.drop(target.snapshot_id, target.layers.start)
            raise
        return SnapshotFile(
            snapshot_id=target.snapshot_id,
            session_id=target.session_id,
            layers=target.layers,
            epoch=header.epoch,
            tokens=header.tokens,
            steps=header.steps,
            path="",
            nbytes=size,
            file_sha256=digest.hexdigest(),
            root_hash=root.hex(),
            prefix_hash=prefix_hash,
            chunks=chunks,
        )

    def frames(self, snapshot: SnapshotFile, prefix_hash: str) -> Generator[pb.KVFrame, None, None]:
        """The snapshot's frames, for a node to import; ``KVImportFailed`` with a reason
        when it is missing, cut short, over a limit, of another session or history, or
        not the stream the index recorded. Blocking: each frame may fetch rows."""
        if snapshot.path:
            yield from _file_frames(snapshot, prefix_hash)
        else:
            yield from _parse(self.rows.reader(snapshot), snapshot, prefix_hash)

    def remove(self, snapshot: SnapshotFile) -> None:
        """Delete a snapshot's rows (or its file) once no index row names it."""
        if snapshot.path:
            Path(snapshot.path).unlink(missing_ok=True)
        else:
            self.rows.drop(snapshot.snapshot_id, snapshot.layers.start)

    def forget(self, index: SessionStore, session_id: str) -> None:
        """Drop a session's snapshots: from the index first, so that it never names a
        missing stream, then the rows (or files)."""
        files = index.snapshots_of(session_id)
        index.forget_snapshots(session_id)
        for f in files:
            self.remove(f)

    # --- retention (tracker/sessions/retention.py decides when) ------------------------------

    def purge_stale(self, index: SessionStore, before: float, limit: int) -> int:
        """Forget up to ``limit`` index rows that no live session can resume from
        (``SessionStore.stale_snapshots``), then remove their streams; how many rows."""
        files = index.stale_snapshots(before, limit)
        if files:
            index.forget_snapshot_files(files)
            for f in files:
                self.remove(f)
        return len(files)

    def purge_unindexed_rows(self, now: float, keep_s: float, grace_s: float, limit: int) -> int:
        """Delete up to ``limit`` stream rows no index row names (an eviction cut off
        before its index row), as ``purge_unindexed`` does files; how many."""
        return self.rows.purge_unindexed(now, keep_s, grace_s, limit)

    def purge_unindexed(
        self, index: SessionStore, now: float, keep_s: float, grace_s: float, limit: int
    ) -> int:
        """Remove the snapshot and temp files here that the index does not name and
        that were last written more than ``keep_s`` ago; how many.

        A file is written before it is indexed (once every hop's file is whole), so
        a live session's file, or a temp file, may be an eviction still under way:
        those go only after ``grace_s`` as well. The index is asked about ``limit``
        files at a time; files of other names are never touched."""
        removed = 0
        candidates = list(self._older_than(now - keep_s))
        for at in range(0, len(candidates), limit):
            chunk = candidates[at : at + limit]
            sessions = sorted({_session_of(path) for path, _ in chunk})
            live = index.live_sessions(sessions)
            indexed = {Path(p).name for p in index.snapshot_paths(sessions)}
            for path, mtime in chunk:
                if path.name in indexed:
                    continue
                in_flight = path.suffix == ".tmp" or _session_of(path) in live
                if in_flight and now - mtime <= max(keep_s, grace_s):
                    continue
                path.unlink(missing_ok=True)
                removed += 1
        return removed

    def _older_than(self, cutoff: float) -> Iterator[tuple[Path, float]]:
        """Snapshot and temp files here last written before ``cutoff``, with that time
        (an older meshnet's, or left by one killed while writing)."""
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:  # nothing was ever evicted here
            return
        for entry in entries:
            if not entry.name.endswith((".snap", ".tmp")):
                continue
            try:
                if not entry.is_file(follow_symlinks=False):
                    continue
                mtime = entry.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:  # removed meanwhile
                continue
            if mtime < cutoff:
                yield Path(entry.path), mtime


def _file_frames(snapshot: SnapshotFile, prefix_hash: str) -> Iterator[pb.KVFrame]:
    """The frames of a snapshot kept as a file (written before snapshots moved)."""
    try:
        f = open(snapshot.path, "rb")  # noqa: SIM115 - closed by the generator's finally
    except OSError as e:
        raise KVImportFailed(f"snapshot file unreadable: {e}", "missing") from None
    with f:
        yield from _parse(f, snapshot, prefix_hash)


def _parse(source: _Source, snapshot: SnapshotFile, prefix_hash: str) -> Iterator[pb.KVFrame]:
    """Length-prefixed frames up to the trailer, each length checked before its bytes
    are read."""
    while True:
        head = source.read(_LENGTH.size)
        if not head:
            raise KVImportFailed("the snapshot ends before its trailer", "truncated")
        if len(head) < _LENGTH.size:
            raise KVImportFailed("the snapshot ends inside a frame length", "truncated")
        (n,) = _LENGTH.unpack(head)
        if n > _MAX_FRAME:
            raise KVImportFailed(f"a snapshot frame claims {n} bytes", "size-limit")
        data = source.read(n)
        if len(data) < n:
            raise KVImportFailed("the snapshot ends inside a frame", "truncated")
        frame = pb.KVFrame()
        try:
            frame.ParseFromString(data)
        except DecodeError:
            raise KVImportFailed("a snapshot frame does not parse", "invalid") from None
        kind = frame.WhichOneof("kind")
        if kind == "header":
            _check_header(frame.header, snapshot, prefix_hash)
        if kind == "trailer" and frame.trailer.root_hash.hex() != snapshot.root_hash:
            raise KVImportFailed("the snapshot is not the one indexed", "root-hash")
        yield frame
        if kind == "trailer":
            return


def _check_header(h: pb.KVHeader, snapshot: SnapshotFile, prefix_hash: str) -> None:
    if h.session_id != snapshot.session_id:
        raise KVImportFailed("the snapshot is of another session", "invalid")
    if h.token_prefix_hash != prefix_hash:
        raise KVImportFailed("the snapshot is of another token history", "token-prefix")


def _session_of(path: Path) -> str:
    """The session a snapshot file belongs to, from its name (``path_for``)."""
    return path.name.split(".", 1)[0]
