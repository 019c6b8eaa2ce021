"""Prometheus metrics of a running 3-node mesh: the tracker's /metrics and each node's
(through the tracker, and refused to anyone the tracker did not sign for), parsed with
prometheus_client's own text parser, moving with load, and closed without credentials."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import NO_ROOM, MeshFactory
from prometheus_client.parser import text_string_to_metric_families

from meshnet.auth.mesh_keys import SERVICE
from meshnet.auth.node_http import NodeAuth
from meshnet.auth.signing import METADATA_KEY, peer_token, sign_tracker_call
from meshnet.local_mesh import LocalMesh
from meshnet.node.metrics_http import METRICS_METHOD

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, tiny_path: Path) -> LocalMesh:
    # The nodes offer no memory for more layers: a dead node's range stays a gap.
    return mesh_factory("0:2,2:3,3:4", model=tiny_path, node_args=NO_ROOM)


def _parse(text: str) -> Samples:
    """Every sample, keyed by name and labels (the parser raises on a malformed text)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def _scrape(mesh: LocalMesh, path: str = "/metrics") -> Samples:
    r = httpx.get(f"{mesh.url}{path}", headers=mesh.admin_headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return _parse(r.text)


def _chat(mesh: LocalMesh, max_tokens: int = 6) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello"}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions", json=body, headers=mesh.api_headers, timeout=60
    )
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def _node_metrics_port(mesh: LocalMesh, node_id: str) -> int:
    """The port the node told the tracker (it says so within a second of starting)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = httpx.get(f"{mesh.url}/admin/dashboard", headers=mesh.admin_headers, timeout=10)
        ports = {n["node_id"]: n["metrics_port"] for n in r.json()["nodes"]}
        if ports.get(node_id):
            return int(ports[node_id])
        time.sleep(0.2)
    raise AssertionError(f"{node_id} never told the tracker its metrics port")


def test_metrics_need_the_admin_token(mesh: LocalMesh) -> None:
    paths = ["/metrics", "/admin/nodes/node-0/metrics", "/admin/dashboard"]
    for path in paths:
        assert httpx.get(f"{mesh.url}{path}").status_code == 401
        # A tenant's API key is not the admin token.
        assert httpx.get(f"{mesh.url}{path}", headers=mesh.api_headers).status_code == 401


def test_tracker_metrics_move_with_load(mesh: LocalMesh) -> None:
    before = _scrape(mesh)
    reply = _chat(mesh)
    after = _scrape(mesh)

    def grew(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    usage = reply["usage"]
    kind = {"kind": "completion"}
    assert grew("meshnet_generations_total", **kind) == 1
    assert grew("meshnet_generations_finished_total", outcome="completed", **kind) == 1
    assert grew("meshnet_prompt_tokens_total", **kind) == usage["prompt_tokens"]
    assert grew("meshnet_generated_tokens_total", **kind) == usage["completion_tokens"]
    assert grew("meshnet_time_to_first_token_seconds_count", **kind) == 1
    tokens = usage["completion_tokens"]
    assert grew("meshnet_inter_token_seconds_count", **kind) == tokens - 1
    route = "/v1/chat/completions"
    assert grew("meshnet_http_requests_total", route=route, status="200") == 1
    # The mesh's state, read at the scrape.
    for node in ("node-0", "node-1", "node-2"):
        assert _value(after, "meshnet_node_up", node=node) == 1
    replicas = [_value(after, "meshnet_layer_replicas", layer=str(i)) for i in range(4)]
    assert replicas == [1, 1, 1, 1]
    for state in ("idle", "active", "parked", "evicted", "completed", "failed"):
        assert ("meshnet_sessions", frozenset({("state", state)})) in after
    assert _value(after, "meshnet_generations_in_flight") == 0


def test_ledger_totals_are_exported(mesh: LocalMesh) -> None:
    _chat(mesh)
    deadline = time.monotonic() + 10  # the ledger is written by a spool, just after
    while time.monotonic() < deadline:
        samples = _scrape(mesh)
        if _value(samples, "meshnet_ledger_attempts", status="completed") >= 3:
            break
        time.sleep(0.2)
    assert _value(samples, "meshnet_ledger_attempts", node="node-0", status="completed") >= 1
    assert _value(samples, "meshnet_ledger_tokens", status="completed") > 0
    assert _value(samples, "meshnet_ledger_billable_layer_tokens") > 0


def test_node_metrics_through_the_tracker_move_with_load(mesh: LocalMesh) -> None:
    _node_metrics_port(mesh, "node-1")
    path = "/admin/nodes/node-1/metrics"
    before = _scrape(mesh, path)
    reply = _chat(mesh, max_tokens=5)
    after = _scrape(mesh, path)

    def grew(name: str) -> float:
        return _value(after, name, node="node-1") - _value(before, name, node="node-1")

    tokens = reply["usage"]["completion_tokens"]
    assert grew("meshnet_node_steps_total") >= tokens  # a prefill step, then one per token
    # The prompt's positions it computed: those its prefix cache held were reused.
    usage = reply["usage"]
    computed = usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"]
    assert grew("meshnet_node_rows_total") >= computed + tokens - 1
    assert grew("meshnet_node_batch_sessions_count") >= 1
    assert grew("meshnet_node_forward_seconds_count") >= 1
    assert _value(after, "meshnet_node_shard", node="node-1", layers="2:3") == 1
    assert _value(after, "meshnet_node_kv_budget_bytes", node="node-1") >= 0


def test_unknown_node_metrics_are_404(mesh: LocalMesh) -> None:
    r = httpx.get(f"{mesh.url}/admin/nodes/nobody/metrics", headers=mesh.admin_headers)
    assert r.status_code == 404


def test_a_node_serves_its_metrics_to_the_tracker_only(mesh: LocalMesh) -> None:
    url = f"http://127.0.0.1:{_node_metrics_port(mesh, 'node-2')}/metrics"
    key = mesh.node_key("node-2")
    refused = {
        "no credential": {},
        "a peer's token": {METADATA_KEY: peer_token(key, "node-1", "relay")},
        "another method's signature": {METADATA_KEY: sign_tracker_call(key, SERVICE + "Info")},
        "another node's key": {
            METADATA_KEY: sign_tracker_call(mesh.node_key("node-1"), METRICS_METHOD)
        },
        "a stale signature": {
            METADATA_KEY: sign_tracker_call(key, METRICS_METHOD, now=time.time() - 600)
        },
        "the admin token": mesh.admin_headers,
    }
    for why, headers in refused.items():
        assert httpx.get(url, headers=headers).status_code == 401, why
    signed = {METADATA_KEY: sign_tracker_call(key, METRICS_METHOD)}
    r = httpx.get(url, headers=signed)
    assert r.status_code == 200
    assert _value(_parse(r.text), "meshnet_node_loaded", node="node-2") == 1
    other = url.replace("/metrics", "/admin")
    assert httpx.get(other, headers=signed).status_code == 404


def test_a_node_tells_only_its_own_metrics_port(mesh: LocalMesh) -> None:
    """The port comes with the node's signed heartbeat: another node cannot set it, and
    a port out of range is refused with nothing recorded."""
    url = f"{mesh.url}/mesh/nodes/node-0/heartbeat"
    load = {"sessions": 0, "kv_bytes": 0, "queue_depth": 0, "steps": 0}
    beat = {"load": load, "fingerprint": "", "layer_start": 0, "layer_end": 0}
    as_node1 = NodeAuth("node-1", mesh.node_key("node-1"))
    assert httpx.post(url, json={**beat, "metrics_port": 9}, auth=as_node1).status_code == 403
    assert httpx.post(url, json={**beat, "metrics_port": 9}).status_code == 401
    as_node0 = NodeAuth("node-0", mesh.node_key("node-0"))
    r = httpx.post(url, json={**beat, "metrics_port": 0}, auth=as_node0)
    assert r.status_code == 400
    assert _node_metrics_port(mesh, "node-0") != 0


def test_a_node_killed_shows_in_the_metrics(mesh: LocalMesh) -> None:
    """Last in this module: it kills node-2."""
    before = _scrape(mesh)
    mesh.kill_node("node-2")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        after = _scrape(mesh)
        if _value(after, "meshnet_node_up", node="node-2") == 0:
            break
        time.sleep(0.3)
    assert _value(after, "meshnet_node_up", node="node-2") == 0
    down = "meshnet_nodes_marked_down_total"
    assert _value(after, down, reason="heartbeat-lost") == _value(before, down) + 1
    assert _value(after, "meshnet_layer_replicas", layer="3") == 0
    r = httpx.get(f"{mesh.url}/admin/nodes/node-2/metrics", headers=mesh.admin_headers)
    assert r.status_code == 502  # the tracker cannot reach it: node-failure
