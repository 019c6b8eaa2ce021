"""Durable sessions on real processes (tiny model): every resume path gives the same turns,
corrupt snapshots fall back to re-prefill, whole-mesh restarts keep sessions, 410 and
idempotency at the API."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from conftest import MeshFactory
from faults import address, info, ledger, signed, wait_until_up
from session_client import (
    CORRUPTIONS,
    TURNS,
    describe,
    export_snapshots,
    new_session,
    op,
    put_snapshot_back,
    read_frames,
    reference_turns,
    turn,
    turn_body,
)

from meshnet.auth.signing import PREFIX_KEY
from meshnet.local_mesh import LocalMesh, parse_layout
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc

# No policy moves during these tests: every move is asked for.
QUIET = ["--park-after", "0", "--evict-after", "0", "--policy-interval", "3600"]


@pytest.fixture(scope="module")
def chat_tiny(tiny_factory: Any) -> Path:
    return Path(tiny_factory("chat.gguf", context_length=1024))


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, chat_tiny: Path) -> LocalMesh:
    """Two replicas of each half: node-0, node-1 serve [0,2); node-2, node-3 serve [2,4)."""
    return mesh_factory("0:2,0:2,2:4,2:4", model=chat_tiny, tracker_args=QUIET)


@pytest.fixture(scope="module")
def reference(mesh: LocalMesh) -> list[list[int]]:
    return reference_turns(mesh)


def test_turns_are_identical_hot_parked_and_from_a_snapshot_on_other_nodes(
    mesh: LocalMesh, reference: list[list[int]], tmp_path: Path
) -> None:
    sid = new_session(mesh)
    first = turn(mesh, sid, TURNS[0])
    assert first["ids"] == reference[0]
    used = {hop["node_id"] for hop in first["route"]}

    assert op(mesh, sid, "park")["state"] == "parked"
    infos = [info(mesh, n) for n in used]
    assert all(i.parked == 1 and i.kv_bytes == 0 for i in infos if i.sessions == 0)
    second = turn(mesh, sid, TURNS[1])
    assert (second["resume_path"], second["ids"]) == ("parked", reference[1])

    hot = {n: info(mesh, n).sessions for n in used}  # with others' sessions
    evicted = op(mesh, sid, "evict")
    assert evicted["state"] == "evicted"
    assert len(evicted["snapshot"]["files"]) == 2
    assert all(len(f["sha256"]) == 64 for f in evicted["snapshot"]["files"])
    for node in used:  # the snapshot is the only copy left
        assert info(mesh, node).sessions == hot[node] - 1
    # Make the snapshot's nodes unroutable: it must be imported onto the replicas.
    for node in used:
        mesh.kill_node(node, signal.SIGSTOP)
    try:
        _wait_down(mesh, used)
        third = turn(mesh, sid, TURNS[2])
    finally:
        for node in used:
            mesh.kill_node(node, signal.SIGCONT)
    assert third["resume_path"] == "snapshot", third
    assert {hop["node_id"] for hop in third["route"]}.isdisjoint(used)
    assert third["ids"] == reference[2]
    assert export_snapshots(mesh, sid, tmp_path) == []  # stale once the session moved on
    assert describe(mesh, sid)["snapshot"] is None

    fourth = turn(mesh, sid, TURNS[3])
    assert (fourth["resume_path"], fourth["ids"]) == ("hot", reference[3])
    assert describe(mesh, sid)["turns"] == 4
    # A hot turn's nodes are billed for its new positions only, once per layer span.
    records = ledger(mesh, fourth["turn_id"])
    assert {r["status"] for r in records} == {"completed"} and len(records) == 2
    start = describe(mesh, sid)["tokens"] - len(fourth["ids"]) + 1
    assert {(r["token_start"], r["token_end"]) for r in records} == {
        (start - fourth["usage"]["prompt_tokens"], start + len(fourth["ids"]) - 1)
    }
    _revive(mesh, used)


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_a_corrupt_snapshot_is_refused_with_its_reason_and_the_turn_reprefills(
    mesh: LocalMesh, reference: list[list[int]], corruption: str, tmp_path: Path
) -> None:
    corrupt, reason = CORRUPTIONS[corruption]
    sid = new_session(mesh)
    turn(mesh, sid, TURNS[0])
    op(mesh, sid, "evict")
    _, second = export_snapshots(mesh, sid, tmp_path)
    corrupt(second)
    put_snapshot_back(mesh, second)
    result = turn(mesh, sid, TURNS[1])
    assert result["resume_path"] == "reprefill"
    assert [f["reason"] for f in result["resume_failures"]] == [reason]
    assert result["ids"] == reference[1]
    # The nodes serve other sessions normally afterwards, hot.
    other = new_session(mesh)
    assert turn(mesh, other, TURNS[0])["ids"] == reference[0]
    assert turn(mesh, other, TURNS[1])["resume_path"] == "hot"


def test_an_import_cut_off_halfway_leaves_no_kv(mesh: LocalMesh, tmp_path: Path) -> None:
    sid = new_session(mesh)
    result = turn(mesh, sid, TURNS[0])
    op(mesh, sid, "evict")
    path = export_snapshots(mesh, sid, tmp_path)[0]
    frames = [pb.KVFrame.FromString(f) for f in read_frames(path)]
    node = result["route"][0]["node_id"]
    before = info(mesh, node)
    # Sent as the tracker would: signed, vouching for the snapshot's own token prefix.
    vouched = (*signed(mesh, node, "StatePut"), (PREFIX_KEY, frames[0].header.token_prefix_hash))
    with grpc.insecure_channel(address(mesh, node)) as channel:
        stub = pb_grpc.NodeStub(channel)
        reply = stub.StatePut(iter(frames[:-1]), timeout=30, metadata=vouched)
    assert (reply.imported, reply.reason) == (False, "truncated")
    after = info(mesh, node)
    assert (after.sessions, after.kv_bytes) == (before.sessions, before.kv_bytes)
    # The session itself is untouched: its snapshot still resumes it.
    assert turn(mesh, sid, TURNS[1])["resume_path"] == "snapshot"


def test_a_deleted_session_is_gone(mesh: LocalMesh) -> None:
    sid = new_session(mesh)
    turn(mesh, sid, TURNS[0])
    r = httpx.delete(f"{mesh.url}/v1/sessions/{sid}", headers=mesh.api_headers, timeout=30)
    assert r.status_code == 200 and r.json()["state"] == "completed"
    r = httpx.post(
        f"{mesh.url}/v1/sessions/{sid}/turns",
        json=turn_body("again"),
        headers=mesh.api_headers,
        timeout=30,
    )
    assert r.status_code == 410 and r.json()["error"]["code"] == "session-gone"
    for what in ("park", "evict"):
        r = httpx.post(f"{mesh.url}/v1/sessions/{sid}/{what}", headers=mesh.api_headers, timeout=30)
        assert r.status_code == 410
    r = httpx.get(f"{mesh.url}/v1/sessions/nobody", headers=mesh.api_headers, timeout=30)
    assert r.status_code == 404


def test_an_idempotency_key_returns_the_first_turn(
    mesh: LocalMesh, reference: list[list[int]]
) -> None:
    sid = new_session(mesh)
    first = turn(mesh, sid, TURNS[0], key="k-1")
    again = turn(mesh, sid, TURNS[0], key="k-1")
    assert again == first
    r = httpx.post(
        f"{mesh.url}/v1/sessions/{sid}/turns",
        json=turn_body("something else"),
        headers={**mesh.api_headers, "Idempotency-Key": "k-1"},
        timeout=30,
    )
    assert r.status_code == 422 and r.json()["error"]["code"] == "idempotency-conflict"
    assert describe(mesh, sid)["turns"] == 1
    assert turn(mesh, sid, TURNS[1], key="k-2")["ids"] == reference[1]


def test_bad_session_requests_are_refused_and_change_nothing(mesh: LocalMesh) -> None:
    sid = new_session(mesh)
    bad = [
        {"content": ""},
        {"content": "x", "max_tokens": 0},
        {"content": "x", "temperature": -1},
        {"content": "x", "surprise": 1},
        {"content": "x", "max_tokens": 100_000},  # past the context length
    ]
    for body in bad:
        r = httpx.post(
            f"{mesh.url}/v1/sessions/{sid}/turns", json=body, headers=mesh.api_headers, timeout=60
        )
        assert r.status_code == 400, (body, r.text)
    state = describe(mesh, sid)
    assert (state["tokens"], state["state"], state["turns"]) == (0, "idle", 0)
    evict = f"{mesh.url}/v1/sessions/{sid}/evict"
    r = httpx.post(evict, headers=mesh.api_headers, timeout=30)  # nothing to evict
    assert r.status_code == 400


def test_streamed_turn_sends_tokens_then_the_result(
    mesh: LocalMesh, reference: list[list[int]]
) -> None:
    sid = new_session(mesh)
    events = []
    with httpx.stream(
        "POST",
        f"{mesh.url}/v1/sessions/{sid}/turns",
        json=turn_body(TURNS[0], stream=True),
        headers=mesh.api_headers,
        timeout=60,
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(httpx.Response(200, content=line[6:]).json())
    tokens = [e["id"] for e in events if e["type"] == "token"]
    done = events[-1]
    assert done["type"] == "done" and tokens == done["ids"] == reference[0]


def test_the_whole_mesh_restarted_on_its_data_dir_keeps_its_sessions(
    mesh_factory: MeshFactory, chat_tiny: Path
) -> None:
    mesh = mesh_factory("0:2,2:4", model=chat_tiny, tracker_args=QUIET)
    want = reference_turns(mesh, TURNS[:2])
    hot, evicted = new_session(mesh), new_session(mesh)
    for sid in (hot, evicted):
        assert turn(mesh, sid, TURNS[0])["ids"] == want[0]
    op(mesh, evicted, "evict")
    mesh.stop()
    mesh.start(parse_layout("0:2,2:4"))
    a = turn(mesh, hot, TURNS[1])
    b = turn(mesh, evicted, TURNS[1])
    assert (a["resume_path"], a["ids"]) == ("reprefill", want[1])  # the nodes lost the KV
    assert (b["resume_path"], b["ids"]) == ("snapshot", want[1]), b["resume_failures"]


def test_a_restarted_tracker_lists_no_node_up_that_is_not_there(
    mesh_factory: MeshFactory, chat_tiny: Path
) -> None:
    """Its database says who was up when it stopped; before it serves, a node that does
    not answer is down (the heartbeat timeout is long here, so no sweep does it)."""
    mesh = mesh_factory("0:2,2:4", model=chat_tiny, tracker_args=QUIET, heartbeat_timeout_s=600)
    mesh.stop()
    mesh.start_tracker()
    health = mesh.wait_ready(expected_nodes=0, timeout_s=60, need_route=False)
    assert (health["nodes_up"], health["route_complete"]) == (0, False), health
    for node_id, layers in zip(("node-0", "node-1"), parse_layout("0:2,2:4"), strict=True):
        mesh.start_node(node_id, layers)
    assert mesh.wait_ready(expected_nodes=2, timeout_s=120)["nodes_up"] == 2


def _wait_down(mesh: LocalMesh, node_ids: set[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers, timeout=5)
        nodes = r.json()["nodes"]
        if all(n["state"] == "down" for n in nodes if n["node_id"] in node_ids):
            return
        time.sleep(0.1)
    raise AssertionError(f"{node_ids} not marked down")


def _revive(mesh: LocalMesh, node_ids: set[str]) -> None:
    """Nodes marked down re-register on their next heartbeat; wait for it."""
    for node in node_ids:
        wait_until_up(mesh, node)
