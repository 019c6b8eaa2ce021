"""Live configuration of real nodes through POST /admin/nodes/{id}/configure (tiny model):
T1 and T2 applied under a running stream and between a session's turns, T3 swapping a
node's layers with its sessions handed to snapshots, refusals that change nothing; every
output equal to the same request run alone in one process."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MeshFactory
from faults import info, nodes
from session_client import TURNS, new_session, turn
from solo import solo_chat_ids
from streams import Streamed, at, serving, stream_completion

from meshnet.engine.generate import generate
from meshnet.engine.local import LocalModel, load_local_model
from meshnet.local_mesh import LocalMesh
from meshnet.model.sampling import SamplingParams

# No policy moves during these tests: every move is asked for.
QUIET = ["--park-after", "0", "--evict-after", "0", "--policy-interval", "3600"]
PROMPT = [5, 17, 42, 99, 3, 64, 128, 7]
STREAM = {"prompt": PROMPT, "max_tokens": 120, "temperature": 0.7, "seed": 3}


@pytest.fixture(scope="module")
def model_path(tiny_factory: Any) -> Path:
    return Path(tiny_factory("conf.gguf", context_length=1024))


@pytest.fixture(scope="module")
def solo(model_path: Path) -> LocalModel:
    return load_local_model(model_path)


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, model_path: Path) -> LocalMesh:
    """node-0 and node-1 serve [0, 2), node-2 serves [2, 4)."""
    return mesh_factory("0:2,0:2,2:4", model=model_path, tracker_args=QUIET)


@pytest.fixture(scope="module")
def model_name(mesh: LocalMesh) -> str:
    r = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers, timeout=10)
    return str(r.json()["data"][0]["id"])


@pytest.fixture(scope="module")
def reference(mesh: LocalMesh) -> list[list[int]]:
    """Every turn's ids in a session that stays hot, taken before any change."""
    sid = new_session(mesh)
    return [turn(mesh, sid, content)["ids"] for content in TURNS]


def configure(mesh: LocalMesh, node_id: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{mesh.url}/admin/nodes/{node_id}/configure",
        json=body,
        headers=mesh.admin_headers,
        timeout=120,
    )


def applied(mesh: LocalMesh, node_id: str, body: dict[str, Any]) -> dict[str, Any]:
    r = configure(mesh, node_id, body)
    assert r.status_code == 200, r.text
    result = dict(r.json())
    assert result["applied"], result
    return result


def settings(mesh: LocalMesh, node_id: str) -> dict[str, Any]:
    """What the node runs with, asked by a check that changes nothing."""
    r = configure(mesh, node_id, {"t1": {}, "check_only": True})
    assert r.status_code == 200, r.text
    return dict(r.json()["settings"])


def solo_completion(model: LocalModel, body: dict[str, Any]) -> list[int]:
    params = SamplingParams(
        max_tokens=body["max_tokens"], temperature=body["temperature"], seed=body["seed"]
    )
    return generate(model.chain, model.tokenizer, body["prompt"], params).ids


def chat(mesh: LocalMesh, body: dict[str, Any]) -> list[int]:
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions", json=body, headers=mesh.api_headers, timeout=120
    )
    assert r.status_code == 200, r.text
    return list(r.json()["meshnet"]["ids"])


def test_t1_and_t2_under_a_running_stream_and_between_turns(
    mesh: LocalMesh, model_name: str, solo: LocalModel, reference: list[list[int]]
) -> None:
    sid = new_session(mesh)
    first = turn(mesh, sid, TURNS[0])
    assert first["ids"] == reference[0]
    changes: list[dict[str, Any]] = []

    def limits(s: Streamed) -> None:
        node = serving(s, (0, 2))
        t1 = {"max_streams": 8, "max_queued_steps": 100, "log_level": "DEBUG"}
        changes.append(applied(mesh, node, {"t1": t1}))

    def batching(s: Streamed) -> None:
        t2 = {"prefill_chunk": 3, "max_batch_tokens": 64, "kv_budget_bytes": 1 << 30}
        changes.append(applied(mesh, "node-2", {"t2": t2}))

    def hook(n: int, s: Streamed) -> None:
        at(10, limits)(n, s)
        at(20, batching)(n, s)

    body = {"model": model_name, **STREAM}
    streamed = stream_completion(mesh, body, hook)
    assert streamed.error is None, streamed.error
    assert len(changes) == 2, "the stream ended before both changes"
    assert streamed.ids == solo_completion(solo, STREAM)
    t1, t2 = changes
    assert (t1["tier"], t1["settings"]["max_streams"], t1["settings"]["log_level"]) == (
        "t1",
        8,
        "DEBUG",
    )
    assert t1["settings"]["max_queued_steps"] == 100
    assert (t2["tier"], t2["settings"]["prefill_chunk"], t2["settings"]["max_batch_tokens"]) == (
        "t2",
        3,
        64,
    )
    assert settings(mesh, "node-2")["kv_budget_bytes"] == 1 << 30
    # The heartbeat carries the new stream limit to the tracker's admission.
    deadline = time.monotonic() + 10
    while nodes(mesh)[t1["node_id"]]["load"]["max_streams"] != 8:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    second = turn(mesh, sid, TURNS[1])
    assert (second["resume_path"], second["ids"]) == ("hot", reference[1])
    # A prompt now cut into 3-row chunks on node-2 still gives the solo tokens.
    question = {
        "model": model_name,
        "messages": [{"role": "user", "content": "a longer question, chunked anew " * 3}],
        "max_tokens": 16,
        "temperature": 0.8,
        "seed": 5,
    }
    assert chat(mesh, question) == solo_chat_ids(solo, question)


@pytest.mark.parametrize(
    ("t2", "words"),
    [
        ({"max_batch_tokens": 0}, "max_batch_tokens must be in"),
        ({"prefill_chunk": 0}, "prefill_chunk must be in"),
        ({"prefill_chunk": -4}, "t2.prefill_chunk"),
        ({"max_batch_tokens": 1 << 20}, "max_batch_tokens must be in"),
        ({"prefill_chunk": 4096, "max_batch_tokens": 4000}, "larger than max_batch_tokens"),
        ({"kv_budget_bytes": 1 << 62}, "kv_budget_bytes must be in"),
        ({"kv_budget_bytes": 1}, "below the"),
    ],
)
def test_bad_t2_values_are_refused_with_the_reason_and_change_nothing(
    mesh: LocalMesh, reference: list[list[int]], t2: dict[str, Any], words: str
) -> None:
    sid = new_session(mesh)
    turn(mesh, sid, TURNS[0])  # KV held on node-2: a budget of 1 byte is below it
    before = settings(mesh, "node-2")
    r = configure(mesh, "node-2", {"t2": t2})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"]
    assert settings(mesh, "node-2") == before
    assert turn(mesh, sid, TURNS[1])["resume_path"] == "hot"


def test_a_failed_t3_changes_nothing(
    mesh: LocalMesh, model_path: Path, reference: list[list[int]]
) -> None:
    sid = new_session(mesh)
    first = turn(mesh, sid, TURNS[0])
    node = next(h["node_id"] for h in first["route"] if h["layers"] == [0, 2])
    held = info(mesh, node)
    missing = str(model_path.parent / "missing.gguf")
    r = configure(mesh, node, {"t3": {"model_path": missing, "layer_start": 0, "layer_end": 4}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "model-file-invalid"
    assert "no such model file" in r.json()["error"]["message"]
    r = configure(mesh, node, {"t3": {"layer_start": 2, "layer_end": 9}})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "layer-range-invalid")
    after = info(mesh, node)
    assert (after.layer_start, after.layer_end, after.sessions, after.kv_bytes) == (
        0,
        2,
        held.sessions,
        held.kv_bytes,
    )
    assert nodes(mesh)[node]["layers"] == [0, 2]
    second = turn(mesh, sid, TURNS[1])
    assert (second["resume_path"], second["ids"]) == ("hot", reference[1])


def test_t3_swaps_a_nodes_layers_and_its_sessions_resume_exactly(
    mesh: LocalMesh, model_name: str, solo: LocalModel, reference: list[list[int]]
) -> None:
    sid = new_session(mesh)
    first = turn(mesh, sid, TURNS[0])
    node = next(h["node_id"] for h in first["route"] if h["layers"] == [0, 2])
    assert info(mesh, node).sessions >= 1
    result = applied(mesh, node, {"t3": {"layer_start": 0, "layer_end": 4}})
    assert (result["tier"], result["layers"]) == ("t3", [0, 4])
    assert sid in result["handed_off"] and result["handoff_failures"] == []
    assert info(mesh, node).sessions == 0 and info(mesh, node).layer_end == 4
    assert nodes(mesh)[node]["layers"] == [0, 4]
    # The session's KV went to a snapshot: the other [0, 2) node takes it.
    second = turn(mesh, sid, TURNS[1])
    assert (second["resume_path"], second["ids"]) == ("snapshot", reference[1])
    assert node not in {h["node_id"] for h in second["route"]}
    # The same shard again reloads it, and the KV it held stays, parked on the node.
    routes = f"{mesh.url}/admin/routes"
    pin = httpx.post(routes, json={"node_ids": [node]}, headers=mesh.admin_headers, timeout=10)
    assert pin.status_code == 200, pin.text
    try:
        parked = new_session(mesh)
        assert [h["node_id"] for h in turn(mesh, parked, TURNS[0])["route"]] == [node]
        again = applied(mesh, node, {"t3": {"layer_start": 0, "layer_end": 4}})
        assert (again["keeps_kv"], again["handed_off"], again["sessions_ended"]) == (True, [], 0)
        assert info(mesh, node).parked >= 1
        resumed = turn(mesh, parked, TURNS[1])
        assert (resumed["resume_path"], resumed["ids"]) == ("parked", reference[1])
    finally:
        httpx.delete(routes, headers=mesh.admin_headers, timeout=10)
    # The node serves its new layers alone, exactly.
    question = {
        "model": model_name,
        "messages": [{"role": "user", "content": "one node now"}],
        "max_tokens": 12,
        "temperature": 0,
    }
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions",
        json={**question, "meshnet": {"route": [node]}},
        headers=mesh.admin_headers,
        timeout=120,
    )
    assert r.status_code == 200, r.text
    assert r.json()["meshnet"]["ids"] == solo_chat_ids(solo, question)
    # Without a handoff, a session on a node whose layers change is re-prefilled, exactly.
    other = new_session(mesh)
    hop = turn(mesh, other, TURNS[0])["route"][0]
    layers = [0, 2] if hop["layers"] == [0, 4] else [0, 4]
    t3 = {"layer_start": layers[0], "layer_end": layers[1], "handoff": "none"}
    assert applied(mesh, hop["node_id"], {"t3": t3})["sessions_ended"] >= 1
    later = turn(mesh, other, TURNS[1])
    assert (later["resume_path"], later["ids"]) == ("reprefill", reference[1])
