"""Routing on the tiny model: replicas, dead nodes, pinned routes, errors with reasons."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import NO_ROOM, MeshFactory

from meshnet.auth.node_http import NodeAuth
from meshnet.local_mesh import LocalMesh


@pytest.fixture(scope="module")
def tiny_mesh(mesh_factory: MeshFactory, tiny_path: Path) -> LocalMesh:
    return mesh_factory("0:4", model=tiny_path)


def _chat(mesh: LocalMesh, **extra: Any) -> httpx.Response:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "temperature": 0,
        "max_tokens": 6,
        **extra,
    }
    return httpx.post(
        f"{mesh.url}/v1/chat/completions", json=body, headers=mesh.api_headers, timeout=60
    )


def _nodes(mesh: LocalMesh) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers)
    return {n["node_id"]: n for n in r.json()["nodes"]}


def _wait_idle(mesh: LocalMesh) -> None:
    """Until every node's heartbeat reports no sessions (so loads tie)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all(n["load"]["sessions"] == 0 for n in _nodes(mesh).values()):
            return
        time.sleep(0.1)


def _route_ids(r: httpx.Response) -> list[str]:
    return [h["node_id"] for h in r.json()["meshnet"]["route"]]


def test_dead_node_is_routed_around_then_503_with_reason(
    mesh_factory: MeshFactory, tiny_path: Path
) -> None:
    # A request waits --route-wait for a complete route before its 503 (tests/e2e/test_churn.py)
    # The nodes offer no memory for more layers: node-2 is not widened over layers 0:2.
    wait = ["--route-wait", "1"]
    mesh = mesh_factory("0:2,0:2,2:4", model=tiny_path, tracker_args=wait, node_args=NO_ROOM)
    first = _chat(mesh)
    assert first.status_code == 200, first.text
    _wait_idle(mesh)  # equal loads: the planner picks node-0 again
    used, spare = "node-0", "node-1"
    mesh.kill_node(used)  # between requests, before any heartbeat is missed
    second = _chat(mesh)
    assert second.status_code == 200, second.text
    assert _route_ids(second) == [spare, "node-2"]
    assert second.json()["meshnet"]["ids"] == first.json()["meshnet"]["ids"]
    assert _nodes(mesh)[used]["state"] == "down"  # the failed open marked it at once
    assert _nodes(mesh)[used]["down_reason"] == "worker-death"
    mesh.kill_node(spare)
    third = _chat(mesh)
    assert third.status_code == 503
    err = third.json()["error"]
    assert err["code"] == "no-route" and "layer 0" in err["message"]


def test_silent_node_is_marked_down_by_missed_heartbeats(
    mesh_factory: MeshFactory, tiny_path: Path
) -> None:
    mesh = mesh_factory("0:4,0:4", model=tiny_path)
    mesh.kill_node("node-1", signal.SIGSTOP)  # alive but silent
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _nodes(mesh)["node-1"]["state"] == "up":
        time.sleep(0.2)
    node = _nodes(mesh)["node-1"]
    assert (node["state"], node["down_reason"]) == ("down", "heartbeat-lost")
    r = _chat(mesh)
    assert r.status_code == 200 and _route_ids(r) == ["node-0"]
    mesh.nodes["node-1"].send_signal(signal.SIGCONT)


def test_pinned_routes(mesh_factory: MeshFactory, tiny_path: Path) -> None:
    mesh = mesh_factory("0:2,0:2,2:4,0:4", model=tiny_path)
    admin, token = f"{mesh.url}/admin/routes", mesh.admin_headers
    assert httpx.post(admin, json={"node_ids": ["node-9"]}, headers=token).status_code == 400
    bad = httpx.post(admin, json={"node_ids": ["node-0", "node-1"]}, headers=token)
    assert bad.status_code == 400 and "cover" in bad.json()["error"]["message"]
    assert httpx.post(admin, json={"node_ids": []}, headers=token).status_code == 400
    ok = httpx.post(admin, json={"node_ids": ["node-1", "node-2"]}, headers=token)
    assert ok.status_code == 200
    assert _route_ids(_chat(mesh)) == ["node-1", "node-2"]
    whole = _chat(mesh).json()["meshnet"]["ids"]
    httpx.post(admin, json={"node_ids": ["node-3"]}, headers=token)
    assert _route_ids(_chat(mesh)) == ["node-3"]
    assert _chat(mesh).json()["meshnet"]["ids"] == whole  # any split, same tokens
    httpx.delete(admin, headers=token)
    assert httpx.get(admin, headers=token).json()["pinned"] is None


def test_admin_nodes_lists_what_a_operator_needs(
    mesh_factory: MeshFactory, tiny_path: Path
) -> None:
    mesh = mesh_factory("0:2,2:4,empty", model=tiny_path)
    nodes = _nodes(mesh)
    assert set(nodes) == {"node-0", "node-1", "node-2"}
    for n in nodes.values():
        assert {"node_id", "address", "layers", "state", "pid", "load"} <= set(n)
        assert n["state"] == "up" and n["pid"] > 0
    assert nodes["node-0"]["layers"] == [0, 2] and nodes["node-2"]["layers"] is None
    assert httpx.get(f"{mesh.url}/healthz").json()["route_complete"] is True


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, 400, "bad-request"),
        ({"model": "tiny", "messages": "nope"}, 400, "bad-request"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 17},
            400,
            "bad-request",
        ),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
            400,
            "context-too-long",
        ),
        (
            {"model": "other", "messages": [{"role": "user", "content": "x"}]},
            404,
            "model-not-found",
        ),
    ],
)
def test_bad_requests_get_openai_errors_not_500(
    tiny_mesh: LocalMesh, body: dict[str, Any], status: int, code: str
) -> None:
    mesh = tiny_mesh
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions", json=body, headers=mesh.api_headers, timeout=30
    )
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions",
        content=b"{not json",
        timeout=30,
        headers={**mesh.api_headers, "content-type": "application/json"},
    )
    assert r.status_code == 400


def test_meshnet_chat_one_turn(tiny_mesh: LocalMesh) -> None:
    import subprocess
    import sys

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshnet.cli.main",
            "chat",
            "--url",
            tiny_mesh.url,
            "--data-dir",  # its credentials.json holds the API key
            str(tiny_mesh.data_dir),
            "--message",
            "hello",
            "--max-tokens",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    expected = httpx.post(
        f"{tiny_mesh.url}/v1/chat/completions",
        headers=tiny_mesh.api_headers,
        timeout=30,
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "hello"}],
            "temperature": 0,
            "max_tokens": 5,
        },
    ).json()["choices"][0]["message"]["content"]
    assert done.stdout == expected + "\n"


def test_no_capacity_is_429_and_the_mesh_keeps_serving(
    mesh_factory: MeshFactory, tiny_path: Path
) -> None:
    mesh = mesh_factory("0:4", model=tiny_path, tracker_args=["--max-in-flight", "1"])
    body = {"model": "tiny", "prompt": "the", "max_tokens": 200, "stream": True}
    with httpx.stream(
        "POST", f"{mesh.url}/v1/completions", json=body, headers=mesh.api_headers, timeout=60
    ) as first:
        lines = first.iter_lines()
        assert next(lines).startswith("data: ")  # the generation is in flight
        mesh.kill_node("node-0", signal.SIGSTOP)  # ...and stays so
        try:
            r = _chat(mesh)
            assert r.status_code == 429 and r.json()["error"]["code"] == "overloaded"
        finally:
            mesh.nodes["node-0"].send_signal(signal.SIGCONT)
        for _ in lines:
            pass
    assert _chat(mesh).status_code == 200


def test_full_kv_budget_is_429_and_the_mesh_keeps_serving(
    mesh_factory: MeshFactory, tiny_path: Path
) -> None:
    # The tiny model's 4 layers hold 1 KiB of KV per position: 100 KiB is about 100 positions.
    mesh = mesh_factory("0:4", model=tiny_path, node_args=["--kv-budget-mb", "0.1"])
    long_prompt = list(range(3, 153))
    for stream in (False, True):
        r = httpx.post(
            f"{mesh.url}/v1/completions",
            headers=mesh.api_headers,
            timeout=30,
            json={"model": "tiny", "prompt": long_prompt, "max_tokens": 4, "stream": stream},
        )
        assert r.status_code == 429, r.text
        assert r.json()["error"]["code"] == "kv-budget-exhausted"
    assert _chat(mesh).status_code == 200


def test_a_heartbeat_with_non_finite_numbers_is_400_and_poisons_nothing(
    tiny_mesh: LocalMesh,
) -> None:
    load = {"sessions": 0, "kv_bytes": 0, "queue_depth": 0, "steps": 0}
    beat = '{"load": {%s, "tokens_per_s": %s}, "fingerprint": "", "layer_start": 0, "layer_end": 0}'
    fields = ", ".join(f'"{k}": {v}' for k, v in load.items())
    signed = NodeAuth("node-0", tiny_mesh.node_key("node-0"))  # as node-0 itself sends it
    for bad in ("Infinity", "NaN", "-Infinity"):
        r = httpx.post(
            f"{tiny_mesh.url}/mesh/nodes/node-0/heartbeat",
            content=beat % (fields, bad),
            headers={"content-type": "application/json"},
            auth=signed,
        )
        assert r.status_code == 400, r.text
    listed = httpx.get(f"{tiny_mesh.url}/admin/nodes", headers=tiny_mesh.admin_headers)
    assert listed.status_code == 200
    assert httpx.get(f"{tiny_mesh.url}/healthz").status_code == 200
    assert _chat(tiny_mesh).status_code == 200


def test_a_body_past_the_limit_is_413_before_it_is_parsed(tiny_mesh: LocalMesh) -> None:
    big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (10 << 20)}]}
    t0 = time.monotonic()
    r = httpx.post(
        f"{tiny_mesh.url}/v1/chat/completions", json=big, headers=tiny_mesh.api_headers, timeout=60
    )
    assert r.status_code == 413, r.text[:200]
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert time.monotonic() - t0 < 10
    chunks = iter(
        [b'{"model": "tiny", "messages": [{"role": "user", "content": "'] + [b"x" * 65536] * 160
    )
    r = httpx.post(  # no Content-Length: counted as it streams in
        f"{tiny_mesh.url}/v1/chat/completions",
        content=chunks,
        headers={**tiny_mesh.api_headers, "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413, r.text[:200]
    assert _chat(tiny_mesh).status_code == 200
