"""The placement controller on real processes: a range that lost its only node is served
again with no request running, ``--replicas 2`` puts a second node on every range, and a
load that keeps failing is retried with backoff while the mesh serves on."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from conftest import MeshFactory
from solo import solo_chat_ids

from meshnet.engine.local import LocalModel
from meshnet.local_mesh import LocalMesh

BODY: dict[str, Any] = {
    "model": "tiny",
    "messages": [{"role": "user", "content": "where did the cat go"}],
    "temperature": 0.8,
    "seed": 11,
    "max_tokens": 12,
}


def _nodes(mesh: LocalMesh) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=10)
    return {n["node_id"]: n for n in r.json()["nodes"]}


def _placement(mesh: LocalMesh) -> dict[str, Any]:
    r = httpx.get(f"{mesh.url}/admin/loops", headers=mesh.admin_headers, timeout=10)
    return next(loop for loop in r.json()["loops"] if loop["name"] == "placement")


def _wait(mesh: LocalMesh, ok: Callable[[dict[str, dict[str, Any]]], bool]) -> None:
    deadline = time.monotonic() + 60
    while not ok(nodes := _nodes(mesh)):
        assert time.monotonic() < deadline, nodes
        time.sleep(0.2)


def _chat(mesh: LocalMesh) -> dict[str, Any]:
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions", json=BODY, headers=mesh.api_headers, timeout=60
    )
    assert r.status_code == 200, r.text
    return dict(r.json()["meshnet"])


def test_a_range_that_lost_its_only_node_is_served_again_before_any_request(
    mesh_factory: MeshFactory, tiny_path: Path, tiny: LocalModel
) -> None:
    mesh = mesh_factory("0:2,2:4,empty", model=tiny_path)
    assert _nodes(mesh)["node-2"]["layers"] is None  # a covered mesh leaves it idle
    mesh.kill_node("node-1")
    _wait(mesh, lambda n: n["node-1"]["state"] == "down" and n["node-2"]["layers"] == [2, 4])
    health = httpx.get(f"{mesh.url}/healthz", timeout=10).json()
    assert health["route_complete"] is True, health
    assert _placement(mesh)["loads"] == 1
    answer = _chat(mesh)  # the first request after the kill: nothing to fail over
    assert answer["ids"] == solo_chat_ids(tiny, BODY)
    assert [h["node_id"] for h in answer["route"]] == ["node-0", "node-2"]
    assert answer["recoveries"] == []


def test_replicas_2_puts_a_second_node_on_every_range(
    mesh_factory: MeshFactory, tiny_path: Path, tiny: LocalModel
) -> None:
    mesh = mesh_factory("0:2,2:4,empty,empty", model=tiny_path, tracker_args=["--replicas", "2"])
    spares = ("node-2", "node-3")
    _wait(mesh, lambda n: {str(n[i]["layers"]) for i in spares} == {"[0, 2]", "[2, 4]"})
    assert _placement(mesh)["loads"] == 2
    assert _chat(mesh)["ids"] == solo_chat_ids(tiny, BODY)


def test_a_load_that_fails_is_retried_with_backoff_and_the_mesh_serves_on(
    mesh_factory: MeshFactory, tiny_path: Path, tiny: LocalModel, tmp_path: Path
) -> None:
    mesh = mesh_factory("0:4", model=tiny_path, tracker_args=["--replicas", "2"])
    # An empty node whose model file is not there: every load it is told to make fails.
    broken = LocalMesh(data_dir=mesh.data_dir, port=mesh.port, model=str(tmp_path / "gone.gguf"))
    try:
        broken.start_node("broken", None)
        deadline = time.monotonic() + 60
        while _placement(mesh)["load_failures"] < 1:
            assert time.monotonic() < deadline, _placement(mesh)
            time.sleep(0.1)
        first = _placement(mesh)["load_failures"]
        expected = solo_chat_ids(tiny, BODY)
        watched = time.monotonic() + 10.0
        while time.monotonic() < watched:  # the tracker serves while the load is retried
            assert _chat(mesh)["ids"] == expected
            time.sleep(0.5)
        placement = _placement(mesh)
        # Waits of 1, 2, 4 and 8 s: at most 4 more tries in 10 s (a pass a second would
        # have made 10), and at least one (it is retried).
        assert 1 <= placement["load_failures"] - first <= 4, placement
        assert placement["backoff"]["[0, 4)"] >= 4.0, placement
        assert "broken" in placement["last_load_failure"]
        assert placement["loads"] == 0 and placement["failing"] == 0
        assert _nodes(mesh)["broken"]["state"] == "up"
        assert _nodes(mesh)["broken"]["layers"] is None
    finally:
        broken.stop()
