"""The failure matrix of docs/failures.md: each scenario's client outcome and ledger records.

Route A -> B over the tiny model (layers 0:2, 2:4); B' a replica of B, E an
empty node. Every generation that survives must give the tokens of an
uninterrupted run with the same seed, and its completed ledger records must
cover each layer's positions exactly once.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from conftest import MeshFactory, SoloIds
from faults import address, assert_billed_once, raw_forward, signed, wait_ledger
from streams import Streamed, at, serving, stream_completion
from tcp_proxy import TcpProxy
from tiny_requests import PROMPT, long_completion

from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh, free_port
from meshnet.model.gguf_file import sha256_file
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc

BODY = long_completion(seed=3, max_tokens=300)  # no eos: every event lands mid-stream
Ledger = set[tuple[str, int, str, str]]  # (node, epoch, status, kind)


@pytest.fixture(scope="module")
def model(long_tiny: Path) -> Path:
    return long_tiny


@pytest.fixture(scope="module")
def expected(model: Path, solo_ids: SoloIds) -> list[int]:
    ids = solo_ids(model, BODY)
    assert len(ids) == 300
    return ids


@pytest.fixture(scope="module")
def pair(mesh_factory: MeshFactory, model: Path) -> LocalMesh:
    """A -> B, no replica: the scenarios that kill no node share it. Each reads only its
    own generation's ledger records, and leaves A and B serving what they served."""
    return mesh_factory("0:2,2:4", model=model)


def _b(s: Streamed) -> str:
    return serving(s, (2, 4))


def _ledger(mesh: LocalMesh, s: Streamed, hops: int = 2) -> tuple[list[dict[str, Any]], Ledger]:
    records = wait_ledger(mesh, s.generation_id, hops)
    return records, {(r["node_id"], r["epoch"], r["status"], r["kind"]) for r in records}


def _survived(s: Streamed, expected: list[int], kind: str) -> dict[str, Any]:
    assert s.error is None, s.error
    assert s.ids == expected
    assert s.final is not None
    (recovery,) = s.final["recoveries"]
    assert recovery["kind"] == kind
    return dict(recovery)


def _failed_over(
    mesh: LocalMesh, s: Streamed, expected: list[int], kind: str, b: str, b2: str
) -> None:
    recovery = _survived(s, expected, kind)
    assert recovery["method"] == "replay"
    records, ledger = _ledger(mesh, s)
    assert ledger == {
        ("node-0", 1, "completed", ""),
        (b, 1, "failed", kind),
        ("node-0", 2, "completed", ""),
        (b2, 2, "completed", ""),
    }
    assert_billed_once(records, 4, len(PROMPT) + len(expected) - 1)


def test_clean(pair: LocalMesh, expected: list[int]) -> None:
    mesh = pair
    s = stream_completion(mesh, BODY)
    assert s.ids == expected and s.final is not None and s.final["recoveries"] == []
    records, ledger = _ledger(mesh, s)
    assert ledger == {("node-0", 1, "completed", ""), ("node-1", 1, "completed", "")}
    assert_billed_once(records, 4, len(PROMPT) + len(expected) - 1)


@pytest.mark.parametrize(
    ("kind", "step_timeout", "heartbeat_timeout"),
    [("deadline-exceeded", 1.0, 30.0), ("heartbeat-lost", 30.0, 1.0)],
)
def test_a_frozen_node(
    mesh_factory: MeshFactory,
    model: Path,
    expected: list[int],
    kind: str,
    step_timeout: float,
    heartbeat_timeout: float,
) -> None:
    mesh = mesh_factory(
        "0:2,2:4,2:4",
        model=model,
        tracker_args=["--step-timeout", str(step_timeout)],
        heartbeat_s=0.25,
        heartbeat_timeout_s=heartbeat_timeout,
    )
    frozen: list[str] = []

    def freeze(s: Streamed) -> None:
        frozen.append(_b(s))
        mesh.kill_node(frozen[0], signal.SIGSTOP)

    s = stream_completion(mesh, BODY, at(10, freeze))
    mesh.kill_node(frozen[0], signal.SIGCONT)
    other = "node-2" if frozen[0] == "node-1" else "node-1"
    _failed_over(mesh, s, expected, kind, frozen[0], other)


def test_cancel(pair: LocalMesh) -> None:
    mesh = pair

    def cancel(s: Streamed) -> None:
        httpx.post(
            f"{mesh.url}/admin/generations/{s.generation_id}/cancel", headers=mesh.admin_headers
        ).raise_for_status()

    s = stream_completion(mesh, BODY, at(10, cancel))
    assert s.final is None and s.error is not None and s.error["code"] == "cancelled"
    records, ledger = _ledger(mesh, s)
    assert ledger == {
        ("node-0", 1, "cancelled", "cancelled"),
        ("node-1", 1, "cancelled", "cancelled"),
    }
    assert not any(r["billable"] for r in records)


def test_worker_death(mesh_factory: MeshFactory, model: Path, expected: list[int]) -> None:
    mesh = mesh_factory("0:2,2:4,2:4", model=model)
    killed: list[str] = []

    def kill(s: Streamed) -> None:
        killed.append(_b(s))
        mesh.kill_node(killed[0])

    s = stream_completion(mesh, BODY, at(10, kill))
    other = "node-2" if killed[0] == "node-1" else "node-1"
    _failed_over(mesh, s, expected, "worker-death", killed[0], other)


@pytest.fixture
def proxy_mesh(mesh_factory: MeshFactory, model: Path) -> Iterator[tuple[LocalMesh, TcpProxy]]:
    """A -> B where B is reached through a relay that can reset its connections."""
    mesh = mesh_factory("0:2", model=model, need_route=False)
    port = free_port()
    proxy = TcpProxy(port)
    mesh.start_node(
        "node-1",
        LayerRange(2, 4),
        listen=f"127.0.0.1:{port}",
        extra=["--advertise-port", str(proxy.port)],
    )
    mesh.wait_ready(expected_nodes=2, timeout_s=60)
    yield mesh, proxy
    proxy.close()


def test_stream_reset(proxy_mesh: tuple[LocalMesh, TcpProxy], expected: list[int]) -> None:
    mesh, proxy = proxy_mesh
    s = stream_completion(mesh, BODY, at(10, lambda _: proxy.reset()))
    _failed_over(mesh, s, expected, "stream-reset", "node-1", "node-1")  # B is alive: reused


def test_stale_epoch(pair: LocalMesh, model: Path, expected: list[int]) -> None:
    mesh = pair
    fingerprint = sha256_file(model)
    answers: list[pb.ForwardResponse] = []

    def late_message(s: Streamed) -> None:
        old = pb.Open(
            session_id=s.generation_id,
            epoch=0,  # older than the generation's epoch 1
            fingerprint=fingerprint,
            layer_start=2,
            layer_end=4,
        )
        answers.extend(raw_forward(mesh, "node-1", old, []))

    s = stream_completion(mesh, BODY, at(10, late_message))
    assert [a.failure.kind for a in answers] == ["stale-epoch"]
    assert s.ids == expected and s.final is not None and s.final["recoveries"] == []
    _, ledger = _ledger(mesh, s)
    assert ledger == {("node-0", 1, "completed", ""), ("node-1", 1, "completed", "")}


def test_cache_miss(pair: LocalMesh, expected: list[int]) -> None:
    """B reloads its shard mid-stream (its KV is gone); it then serves 2:4 as before."""
    mesh = pair

    def reload_b(s: Streamed) -> None:
        load = pb.ConfigureRequest(load=pb.LoadShard(layer_start=2, layer_end=4))
        with grpc.insecure_channel(address(mesh, "node-1")) as channel:
            configure = signed(mesh, "node-1", "Configure")
            reply = pb_grpc.NodeStub(channel).Configure(load, timeout=30, metadata=configure)
        assert reply.applied

    s = stream_completion(mesh, BODY, at(10, reload_b))
    _failed_over(mesh, s, expected, "cache-miss", "node-1", "node-1")


def test_failover_heals_an_empty_node(
    mesh_factory: MeshFactory, model: Path, expected: list[int]
) -> None:
    mesh = mesh_factory("0:2,2:4,empty", model=model)
    s = stream_completion(mesh, BODY, at(10, lambda _: mesh.kill_node("node-1")))
    recovery = _survived(s, expected, "worker-death")
    assert recovery["healed"] == "node-2"
    _failed_over(mesh, s, expected, "worker-death", "node-1", "node-2")
