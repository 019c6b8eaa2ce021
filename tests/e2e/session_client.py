"""A small client of the sessions API for tests, and the snapshot corruptions they make (on a
stream taken out of the tracker's database as a file, then put back)."""

from __future__ import annotations

import contextlib
import sqlite3
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import httpx

from meshnet.local_mesh import LocalMesh
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.session_data.snapshot_rows import ROW_BYTES

TURNS = ["hello there", "tell me more", "and then?", "thanks"]


class Api(Protocol):
    """A tracker's API and what its caller sends (a ``LocalMesh`` is one)."""

    @property
    def url(self) -> str: ...

    @property
    def api_headers(self) -> dict[str, str]: ...


@dataclass(frozen=True)
class TrackerApi:
    """Another tracker of a mesh (sharing its database), called with the mesh's API key."""

    url: str
    api_headers: dict[str, str]


def turn_body(content: str, max_tokens: int = 24, **extra: Any) -> dict[str, Any]:
    return {"content": content, "max_tokens": max_tokens, "temperature": 0.7, "seed": 11, **extra}


def new_session(api: Api, system: str | None = "be brief") -> str:
    r = httpx.post(
        f"{api.url}/v1/sessions", json={"system": system}, headers=api.api_headers, timeout=30
    )
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


def turn(api: Api, sid: str, content: str, key: str | None = None, **extra: Any) -> dict[str, Any]:
    headers = {**api.api_headers, **({"Idempotency-Key": key} if key else {})}
    r = httpx.post(
        f"{api.url}/v1/sessions/{sid}/turns",
        json=turn_body(content, **extra),
        headers=headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def wait_kv_growing(mesh: LocalMesh, timeout_s: float = 30) -> None:
    """Until a turn is visibly running: the nodes' steps rise (as their heartbeats say,
    which lag: a test that must cut a turn short watches its streamed tokens instead)."""
    deadline = time.monotonic() + timeout_s
    first: int | None = None
    while time.monotonic() < deadline:
        r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=5)
        steps = sum(n["load"]["steps"] for n in r.json()["nodes"])
        if first is None:
            first = steps
        elif steps > first + 20:
            return
        time.sleep(0.02)
    raise AssertionError("the turn never started")


def op(api: Api, sid: str, what: str) -> dict[str, Any]:
    r = httpx.post(f"{api.url}/v1/sessions/{sid}/{what}", headers=api.api_headers, timeout=120)
    assert r.status_code == 200, r.text
    return dict(r.json())


def describe(api: Api, sid: str) -> dict[str, Any]:
    r = httpx.get(f"{api.url}/v1/sessions/{sid}", headers=api.api_headers, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def reference_turns(api: Api, contents: list[str] = TURNS) -> list[list[int]]:
    """Every turn's ids in a session that stays hot throughout."""
    sid = new_session(api)
    out = []
    for content in contents:
        result = turn(api, sid, content)
        assert result["resume_path"] == "hot"
        out.append(result["ids"])
    return out


# --- snapshots: length-prefixed KV frames in rows of the tracker's database ---------

_LENGTH = struct.Struct(">I")


@contextlib.contextmanager
def tracker_db(mesh: LocalMesh) -> Iterator[sqlite3.Connection]:
    """The mesh's tracker's own SQLite database (its default), beside the tracker."""
    db = sqlite3.connect(mesh.data_dir / "tracker.db", timeout=30, isolation_level=None)
    try:
        yield db
    finally:
        db.close()


def export_snapshots(mesh: LocalMesh, sid: str, into: Path) -> list[Path]:
    """Each of the session's snapshot streams kept in the database, as a file in ``into``
    named ``SNAPSHOT.LAYER_START.snap``, by first layer; [] when it has none."""
    paths = []
    with tracker_db(mesh) as db:
        keys = db.execute(
            "SELECT DISTINCT snapshot_id, layer_start FROM snapshot_chunks "
            "WHERE session_id = ? ORDER BY layer_start",
            (sid,),
        ).fetchall()
        for snapshot_id, start in keys:
            rows = db.execute(
                "SELECT data FROM snapshot_chunks WHERE snapshot_id = ? AND layer_start = ? "
                "ORDER BY seq",
                (snapshot_id, start),
            )
            paths.append(into / f"{snapshot_id}.{start}.snap")
            paths[-1].write_bytes(b"".join(bytes(r[0]) for r in rows))
    return paths


def put_snapshot_back(mesh: LocalMesh, path: Path) -> None:
    """Replace the stream ``path`` was exported from with the file's bytes, rows and count."""
    snapshot_id, start, _ = path.name.split(".")
    data = path.read_bytes()
    rows = [data[at : at + ROW_BYTES] for at in range(0, len(data), ROW_BYTES)]
    with tracker_db(mesh) as db:
        db.execute("BEGIN IMMEDIATE")
        session_id, created = db.execute(
            "SELECT session_id, created FROM snapshot_chunks "
            "WHERE snapshot_id = ? AND layer_start = ? LIMIT 1",
            (snapshot_id, int(start)),
        ).fetchone()
        key = (snapshot_id, int(start))
        db.execute("DELETE FROM snapshot_chunks WHERE snapshot_id = ? AND layer_start = ?", key)
        for seq, row in enumerate(rows):
            db.execute(
                "INSERT INTO snapshot_chunks VALUES (?, ?, ?, ?, ?, ?)",
                (*key, seq, session_id, created, row),
            )
        db.execute(
            "UPDATE snapshots SET chunks = ? WHERE snapshot_id = ? AND layer_start = ?",
            (len(rows), *key),
        )
        db.execute("COMMIT")


def lose_snapshots(mesh: LocalMesh, sid: str) -> None:
    """Delete the session's snapshot streams, leaving the index naming them."""
    with tracker_db(mesh) as db:
        db.execute("DELETE FROM snapshot_chunks WHERE session_id = ?", (sid,))


def read_frames(path: Path) -> list[bytes]:
    data, frames, at = path.read_bytes(), [], 0
    while at < len(data):
        (n,) = _LENGTH.unpack_from(data, at)
        frames.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return frames


def write_frames(path: Path, frames: list[bytes]) -> None:
    path.write_bytes(b"".join(_LENGTH.pack(len(f)) + f for f in frames))


def rewrite_header(path: Path, **fields: Any) -> None:
    frames = read_frames(path)
    frame = pb.KVFrame.FromString(frames[0])
    for name, value in fields.items():
        setattr(frame.header, name, value)
    frames[0] = frame.SerializeToString()
    write_frames(path, frames)


def flip_bit(path: Path) -> None:
    frames = read_frames(path)
    chunk = bytearray(frames[1])
    chunk[len(chunk) // 2] ^= 0x10  # inside the chunk's KV bytes
    frames[1] = bytes(chunk)
    write_frames(path, frames)


def truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def inflate_length(path: Path) -> None:
    data = bytearray(path.read_bytes())
    first = _LENGTH.unpack_from(data, 0)[0]
    _LENGTH.pack_into(data, 4 + first, 0x7FFFFFF0)  # the chunk frame's length field
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "bit-flip": (flip_bit, "chunk-hash"),
    "truncation": (truncate, "truncated"),
    "wrong-version": (lambda p: rewrite_header(p, version=99), "version"),
    "inflated-length": (inflate_length, "size-limit"),
    "wrong-model": (lambda p: rewrite_header(p, fingerprint="0" * 64), "wrong-model"),
}
