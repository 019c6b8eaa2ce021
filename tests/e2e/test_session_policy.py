"""The ladder by policy (tiny model, real processes): idle sessions are parked, then evicted,
and parked early when a node's KV runs short; the next turn is the same either way."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from conftest import MeshFactory
from session_client import TURNS, describe, new_session, reference_turns, turn

from meshnet.local_mesh import LocalMesh


@pytest.fixture(scope="module")
def chat_tiny(tiny_factory: Any) -> Path:
    return Path(tiny_factory("chat.gguf", context_length=1024))


def _wait_state(mesh: LocalMesh, sid: str, state: str, timeout_s: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    seen = describe(mesh, sid)
    while time.monotonic() < deadline:
        seen = describe(mesh, sid)
        if seen["state"] == state:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"session {sid} stayed {seen['state']}, not {state}")


def test_idle_sessions_are_parked_then_evicted_by_time(
    mesh_factory: MeshFactory, chat_tiny: Path
) -> None:
    policy = ["--park-after", "1", "--evict-after", "3", "--policy-interval", "0.2"]
    mesh = mesh_factory("0:2,2:4", model=chat_tiny, tracker_args=policy)
    sid = new_session(mesh)
    first = turn(mesh, sid, TURNS[0])
    _wait_state(mesh, sid, "parked")
    evicted = _wait_state(mesh, sid, "evicted")
    assert len(evicted["snapshot"]["files"]) == 2
    second = turn(mesh, sid, TURNS[1])
    assert second["resume_path"] == "snapshot"
    # A session that stays hot throughout gives the same turns (run after, so the
    # policy does not move it between its turns).
    fresh = new_session(mesh)
    assert turn(mesh, fresh, TURNS[0])["ids"] == first["ids"]
    assert turn(mesh, fresh, TURNS[1])["ids"] == second["ids"]


def test_kv_pressure_parks_the_least_recently_used_idle_session(
    mesh_factory: MeshFactory, chat_tiny: Path
) -> None:
    # One tiny session's first turn holds 64 KiB of KV per node (128 positions):
    # with a 200 KiB budget and pressure at 50%, a second session presses the node.
    policy = ["--park-after", "0", "--evict-after", "0", "--policy-interval", "0.2"]
    policy += ["--kv-pressure", "0.5"]
    mesh = mesh_factory(
        "0:2,2:4",
        model=chat_tiny,
        tracker_args=policy,
        node_args=["--kv-budget-mb", str(200 / 1024)],
    )
    want = reference_turns(mesh, TURNS[:1])  # its KV must go before the next two fit
    older, newer = new_session(mesh), new_session(mesh)
    assert turn(mesh, older, TURNS[0])["ids"] == want[0]
    assert turn(mesh, newer, TURNS[0])["ids"] == want[0]
    _wait_state(mesh, older, "parked")
    assert describe(mesh, newer)["state"] == "idle"
    assert turn(mesh, older, TURNS[1])["resume_path"] == "parked"
