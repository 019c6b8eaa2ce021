"""The placement controller on real processes: a range that lost its only node is served
again with no request running, ``--replicas 2`` puts a second node on every range, and a
load that keeps failing is retried with backoff while the mesh serves on."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from conftest import NO_ROOM, MeshFactory
from faults import assert_billed_once, wait_ledger
from solo import solo_chat_ids
from streams import Streamed, stream_completion

from meshnet.engine.local import LocalModel
from meshnet.layer_range import LayerRange
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


def test_a_survivor_covers_its_dead_peer_and_absorbs_its_return(
    mesh_factory: MeshFactory, tiny_path: Path, tiny: LocalModel
) -> None:
    # Two nodes, no spare: each has the memory for every layer (it says so each beat).
    mesh = mesh_factory("0:2,2:4", model=tiny_path)
    expected = solo_chat_ids(tiny, BODY)
    assert _chat(mesh)["ids"] == expected
    died = time.monotonic()
    mesh.kill_node("node-1")
    # No request is sent: the survivor is widened over the dead node's layers.
    _wait(mesh, lambda n: n["node-1"]["state"] == "down" and n["node-0"]["layers"] == [0, 4])
    answer = _chat(mesh)
    print(f"node death to first answer, no spare: {time.monotonic() - died:.2f} s")
    assert answer["ids"] == expected
    assert [h["node_id"] for h in answer["route"]] == ["node-0"]
    assert answer["recoveries"] == []
    # The dead node returns on its old range, which no route can use beside [0, 4): it
    # is absorbed as a replica of [0, 4), never left a second owner of [2, 4).
    mesh.start_node("node-1", LayerRange(2, 4))
    _wait(mesh, lambda n: n["node-1"]["state"] == "up" and n["node-1"]["layers"] == [0, 4])
    assert _nodes(mesh)["node-0"]["layers"] == [0, 4]
    assert _placement(mesh)["loads"] == 2
    assert _chat(mesh)["ids"] == expected
    # Either node now answers alone, exactly: the replica serves at once once node-0 dies.
    mesh.kill_node("node-0")
    _wait(mesh, lambda n: n["node-0"]["state"] == "down")
    answer = _chat(mesh)
    assert answer["ids"] == expected
    assert [h["node_id"] for h in answer["route"]] == ["node-1"]


def test_a_generation_running_when_the_peer_dies_ends_exact_on_the_widened_survivor(
    mesh_factory: MeshFactory, tiny_factory: Any
) -> None:
    long_tiny = Path(tiny_factory("long.gguf", context_length=1024))
    mesh = mesh_factory("0:2,2:4", model=long_tiny)
    body: dict[str, Any] = {
        "model": "long",
        "prompt": [5, 17, 42, 99],
        "max_tokens": 300,
        "temperature": 0.7,
    }
    body["seed"] = 3  # 300 tokens without an eos on the long tiny model
    r = httpx.post(f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=60)
    expected = r.json()["meshnet"]["ids"]
    assert len(expected) == 300  # the kill after token 10 lands mid-stream

    def kill(n: int, s: Streamed) -> None:
        if n == 10:
            mesh.kill_node("node-1")

    # The failover waits for a route (--route-wait) while placement widens node-0 (its
    # T3 drops the generation's KV there), then runs it again exactly on node-0 alone.
    result = stream_completion(mesh, body, kill)
    assert result.error is None, result.error
    assert result.ids == expected
    assert result.final is not None
    assert [h["node_id"] for h in result.final["route"]] == ["node-0"]
    first = result.final["recoveries"][0]
    assert (first["failed_node"], first["kind"]) == ("node-1", "worker-death")
    records = wait_ledger(mesh, result.generation_id, hops=1)
    assert_billed_once(records, 4, len(body["prompt"]) + len(expected) - 1)


def test_a_survivor_whose_memory_does_not_fit_is_never_asked(
    mesh_factory: MeshFactory, tiny_path: Path
) -> None:
    # --memory-mb 1: each node offers no memory beyond what it holds.
    mesh = mesh_factory("0:2,2:4", model=tiny_path, node_args=NO_ROOM)
    assert _nodes(mesh)["node-0"]["load"]["free_memory_bytes"] == 0
    mesh.kill_node("node-1")
    _wait(mesh, lambda n: n["node-1"]["state"] == "down")
    passes = _placement(mesh)["passes"]
    while _placement(mesh)["passes"] < passes + 3:  # three passes saw the gap
        time.sleep(0.2)
    placement = _placement(mesh)
    assert placement["loads"] == 0 and placement["load_failures"] == 0, placement
    assert _nodes(mesh)["node-0"]["layers"] == [0, 2]
    assert httpx.get(f"{mesh.url}/healthz", timeout=10).json()["route_complete"] is False
