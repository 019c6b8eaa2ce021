"""Metrics without processes: each tracker and node owns its registry, meters count what
passes, collectors read state at scrape time, the node's metrics server lets only the
tracker in and holds a bounded number of clients, and HTTP answers are counted by route
template."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from node_records import node_record
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from meshnet.api.metrics import CountRequests
from meshnet.auth.keys import node_key
from meshnet.auth.signing import METADATA_KEY, sign_tracker_call
from meshnet.layer_range import LayerRange
from meshnet.node.engine import EngineStats
from meshnet.node.metrics import NodeMetrics
from meshnet.node.metrics_http import MAX_CLIENTS, METRICS_METHOD, MetricsServer
from meshnet.tracker.nodes.registry import NodeRecord
from meshnet.tracker.watch.metrics import (
    NodeScrapeTargets,
    TrackerMetrics,
    counter_total,
    layer_replicas,
)

FP = "f" * 64
KEY = node_key("00" * 32, "node-a")


def samples(registry: object) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def record(node_id: str, start: int, end: int, up: bool = True, fp: str = FP) -> NodeRecord:
    layers = f"{start}:{end}" if end > start else None
    return node_record(node_id, layers, up=up, fingerprint=fp, address="127.0.0.1:1")


def stats(**changes: object) -> EngineStats:
    base: dict[str, object] = {
        "loaded": True,
        "layers": LayerRange(2, 5),
        "fingerprint": FP,
        "sessions": 2,
        "parked": 1,
        "kv_bytes": 4096,
        "kv_peak_bytes": 8192,
        "kv_budget_bytes": 1 << 20,
        "queue_depth": 3,
        "steps": 17,
        "last_batch": 2,
        "max_batch": 4,
        "tokens_per_s": 12.5,
        "max_streams": 64,
        "relayed": 9,
    }
    return EngineStats(**{**base, **changes})  # type: ignore[arg-type]


def test_every_tracker_owns_its_registry_and_the_global_one_stays_empty() -> None:
    a, b = TrackerMetrics(), TrackerMetrics()
    a.generation("completion", 5, time.monotonic()).token()
    assert counter_total(a.generated_tokens) == 1
    assert counter_total(b.generated_tokens) == 0
    assert not any(name.startswith("meshnet") for name in REGISTRY._names_to_collectors)


def test_a_generation_meter_times_the_first_token_apart_from_the_rest() -> None:
    m = TrackerMetrics()
    meter = m.generation("turn", prompt_tokens=7, t0=time.monotonic())
    for _ in range(4):
        meter.token()
    meter.ended("completed", [("replay", 0.3)])
    s = samples(m.registry)
    turn = frozenset({("kind", "turn")})
    assert s[("meshnet_prompt_tokens_total", turn)] == 7
    assert s[("meshnet_generated_tokens_total", turn)] == 4
    assert s[("meshnet_time_to_first_token_seconds_count", turn)] == 1
    assert s[("meshnet_inter_token_seconds_count", turn)] == 3
    done = frozenset({("kind", "turn"), ("outcome", "completed")})
    assert s[("meshnet_generations_finished_total", done)] == 1
    assert s[("meshnet_failover_recovery_seconds_count", frozenset({("method", "replay")}))] == 1


def test_failovers_and_nodes_down_are_counted_and_listed_newest_first() -> None:
    m = TrackerMetrics(recent_events=2)
    m.failover("a", "worker-death", "now b")
    m.node_down("a", "worker-death")
    m.node_down("c", "heartbeat-lost")
    assert [(e.what, e.node_id) for e in m.events()] == [("node-down", "c"), ("node-down", "a")]
    assert counter_total(m.failovers) == 1
    assert counter_total(m.nodes_down) == 2


def test_layer_replicas_count_routable_nodes_of_the_model_only() -> None:
    nodes = [
        record("a", 0, 2),
        record("b", 1, 4),
        record("down", 0, 4, up=False),
        record("empty", 0, 0),
        record("other", 0, 4, fp="0" * 64),
    ]
    assert layer_replicas(FP, 4, nodes) == [1, 2, 1, 1]


def test_scrape_targets_are_bounded() -> None:
    targets = NodeScrapeTargets(limit=1)
    assert targets.set("a", 9100)
    assert not targets.set("b", 9101)
    assert targets.set("a", 9102)  # a known node may move
    assert targets.port("a") == 9102
    assert targets.port("b") is None


def test_node_metrics_read_the_engine_at_scrape_time() -> None:
    m = NodeMetrics("node-a")
    current = [stats()]
    m.watch(lambda: current[0])
    m.forward(rows=12, seconds=0.004, sessions=3)
    s = samples(m.registry)
    node = frozenset({("node", "node-a")})
    assert s[("meshnet_node_steps_total", node)] == 17
    assert s[("meshnet_node_relayed_inputs_total", node)] == 9
    assert s[("meshnet_node_parked_sessions", node)] == 1
    assert s[("meshnet_node_kv_budget_bytes", node)] == 1 << 20
    assert s[("meshnet_node_rows_total", node)] == 12
    assert s[("meshnet_node_batch_sessions_sum", node)] == 3
    assert s[("meshnet_node_forward_seconds_count", node)] == 1
    shard = frozenset({("node", "node-a"), ("layers", "2:5"), ("fingerprint", FP[:16])})
    assert s[("meshnet_node_shard", shard)] == 1
    current[0] = stats(steps=20, loaded=False, layers=None, fingerprint="")
    s = samples(m.registry)
    assert s[("meshnet_node_steps_total", node)] == 20
    assert s[("meshnet_node_loaded", node)] == 0


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    m = NodeMetrics("node-a")
    m.watch(stats)
    srv = MetricsServer("127.0.0.1", 0, KEY, m.registry)
    srv.start()
    yield srv
    srv.stop()


def _get(srv: MetricsServer, credential: str | None, path: str = "/metrics") -> httpx.Response:
    headers = {METADATA_KEY: credential} if credential else {}
    return httpx.get(f"http://127.0.0.1:{srv.port}{path}", headers=headers, timeout=5)


def test_the_node_metrics_server_lets_only_the_tracker_in(server: MetricsServer) -> None:
    assert _get(server, None).status_code == 401
    assert _get(server, "t1.0.abc").status_code == 401
    assert _get(server, sign_tracker_call(KEY, "GET /other")).status_code == 401
    other_key = node_key("00" * 32, "node-b")
    assert _get(server, sign_tracker_call(other_key, METRICS_METHOD)).status_code == 401
    good = sign_tracker_call(KEY, METRICS_METHOD)
    assert _get(server, good, "/").status_code == 404
    r = _get(server, good)
    assert r.status_code == 200
    assert ("meshnet_node_steps_total", frozenset({("node", "node-a")})) in {
        (s.name, frozenset(s.labels.items()))
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
    }


def test_the_node_metrics_server_holds_a_bounded_number_of_clients(
    server: MetricsServer,
) -> None:
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(MAX_CLIENTS)]
    time.sleep(0.2)  # each now holds a handler thread, waiting for its request line
    good = sign_tracker_call(KEY, METRICS_METHOD)
    with pytest.raises(httpx.TransportError):
        _get(server, good)  # one more is closed at once, not queued behind them
    for s in idle:
        s.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            assert _get(server, good).status_code == 200
            return
        except httpx.TransportError:
            time.sleep(0.1)
    raise AssertionError("the server never took a client again")


def test_http_answers_are_counted_by_route_template() -> None:
    app = FastAPI()
    metrics = TrackerMetrics()
    app.add_middleware(CountRequests, metrics=metrics)

    @app.get("/things/{thing_id}")
    async def thing(thing_id: str) -> dict[str, str]:
        return {"id": thing_id}

    client = TestClient(app)
    for i in range(3):
        assert client.get(f"/things/{i}").status_code == 200
    assert client.get("/nowhere/at/all").status_code == 404
    assert client.request("BREW", "/things/1").status_code == 405
    s = samples(metrics.registry)
    key = frozenset({("method", "GET"), ("route", "/things/{thing_id}"), ("status", "200")})
    assert s[("meshnet_http_requests_total", key)] == 3
    missing = frozenset({("method", "GET"), ("route", "unmatched"), ("status", "404")})
    assert s[("meshnet_http_requests_total", missing)] == 1
    assert _labels_with(s, "method") <= {"GET", "other"}


def _labels_with(s: dict[tuple[str, frozenset[tuple[str, str]]], float], label: str) -> set[str]:
    return {
        dict(labels)[label]
        for name, labels in s
        if name == "meshnet_http_requests_total" and label in dict(labels)
    }
