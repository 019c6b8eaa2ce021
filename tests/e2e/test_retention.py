"""Retention in a real tracker (tiny model, two nodes): with short keeps set by flag, an
ended session and snapshot rows it left behind disappear, while a live evicted
session keeps its snapshot and resumes from it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from session_client import TURNS, tracker_db, turn_body

from meshnet.local_mesh import LocalMesh


@pytest.fixture(scope="module")
def chat_tiny(tiny_factory: Any) -> Path:
    return Path(tiny_factory("chat.gguf", context_length=1024))


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_an_ended_session_and_its_orphaned_snapshot_go_a_live_one_stays(
    mesh_factory: MeshFactory, chat_tiny: Path
) -> None:
    keep = ["--keep-sessions", "2s", "--keep-orphans", "2s", "--retention-interval", "0.2"]
    mesh = mesh_factory("0:2,2:4", model=chat_tiny, tracker_args=keep)
    with httpx.Client(base_url=mesh.url, headers=mesh.api_headers, timeout=120) as api:
        live = _ok(api.post("/v1/sessions", json={"system": "be brief"}))["id"]
        _ok(api.post(f"/v1/sessions/{live}/turns", json=turn_body(TURNS[0])))
        files = _ok(api.post(f"/v1/sessions/{live}/evict"))["snapshot"]["files"]
        assert len(files) == 2
        kept = _streams(mesh, live)
        assert len(kept) == 2

        ended = _ok(api.post("/v1/sessions", json={"system": "be brief"}))["id"]
        _ok(api.post(f"/v1/sessions/{ended}/turns", json=turn_body(TURNS[0])))
        assert _ok(api.delete(f"/v1/sessions/{ended}"))["state"] == "completed"
        # What a tracker killed between writing a snapshot's rows and indexing them
        # leaves behind: rows of an ended session; and a live session's rows not yet
        # indexed (an eviction under way), which the grace keeps.
        orphan, writing = ("00000000deadbeef", 0), ("00000000feedf00d", 0)
        with tracker_db(mesh) as db:
            for (snapshot_id, start), sid in ((orphan, ended), (writing, live)):
                db.execute(
                    "INSERT INTO snapshot_chunks VALUES (?, ?, 0, ?, ?, ?)",
                    (snapshot_id, start, sid, time.time(), b"kv"),
                )

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            gone = orphan not in _streams(mesh, ended)
            if api.get(f"/v1/sessions/{ended}").status_code == 404 and gone:
                break
            time.sleep(0.2)
        assert api.get(f"/v1/sessions/{ended}").status_code == 404
        assert _streams(mesh, ended) == set()

        assert _ok(api.get(f"/v1/sessions/{live}"))["state"] == "evicted"
        assert _streams(mesh, live) == {*kept, writing}
        again = _ok(api.post(f"/v1/sessions/{live}/turns", json=turn_body(TURNS[1])))
        assert again["resume_path"] == "snapshot"


def _streams(mesh: LocalMesh, sid: str) -> set[tuple[str, int]]:
    """The session's snapshot streams in the tracker's database: (snapshot, first layer)."""
    with tracker_db(mesh) as db:
        rows = db.execute(
            "SELECT DISTINCT snapshot_id, layer_start FROM snapshot_chunks WHERE session_id = ?",
            (sid,),
        ).fetchall()
    return {(str(a), int(b)) for a, b in rows}
