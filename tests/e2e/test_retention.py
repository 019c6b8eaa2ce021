"""Retention in a real tracker (tiny model, two nodes): with short keeps set by flag, an
ended session and a snapshot file it left behind disappear, while a live evicted
session keeps its snapshot and resumes from it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from session_client import TURNS, turn_body


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
    snapshots = mesh.data_dir / "snapshots"
    with httpx.Client(base_url=mesh.url, headers=mesh.api_headers, timeout=120) as api:
        live = _ok(api.post("/v1/sessions", json={"system": "be brief"}))["id"]
        _ok(api.post(f"/v1/sessions/{live}/turns", json=turn_body(TURNS[0])))
        files = _ok(api.post(f"/v1/sessions/{live}/evict"))["snapshot"]["files"]
        assert len(files) == 2
        kept = sorted(snapshots.glob(f"{live}.*.snap"))

        ended = _ok(api.post("/v1/sessions", json={"system": "be brief"}))["id"]
        _ok(api.post(f"/v1/sessions/{ended}/turns", json=turn_body(TURNS[0])))
        assert _ok(api.delete(f"/v1/sessions/{ended}"))["state"] == "completed"
        # What a tracker killed between dropping an ended session's snapshot rows and
        # removing their files leaves behind; and a live session's file not yet indexed
        # (an eviction under way), which the grace keeps.
        orphan = snapshots / f"{ended}.00000000deadbeef.0-2.snap"
        writing = snapshots / f"{live}.00000000feedf00d.0-2.snap"
        for path in (orphan, writing):
            path.write_bytes(kept[0].read_bytes())

        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if api.get(f"/v1/sessions/{ended}").status_code == 404 and not orphan.exists():
                break
            time.sleep(0.2)
        assert api.get(f"/v1/sessions/{ended}").status_code == 404
        assert not orphan.exists()

        assert _ok(api.get(f"/v1/sessions/{live}"))["state"] == "evicted"
        assert all(p.exists() for p in [*kept, writing])
        again = _ok(api.post(f"/v1/sessions/{live}/turns", json=turn_body(TURNS[1])))
        assert again["resume_path"] == "snapshot"
