"""Each kind of fault once more on the bundled model: the ids it gives alone, in-process on
the nodes' backend (the default, q8), survive them all.

One mesh of the bundled model (30 layers): A serves 0:15, B and B' serve 15:30,
E starts empty. The scenarios run in order and change the mesh as they go.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import MeshFactory
from faults import (
    assert_billed_once,
    raw_forward,
    wait_kv_idle,
    wait_ledger,
    wait_until_up,
)
from solo import solo_completion_ids
from streams import Streamed, at, serving, stream_completion

from meshnet.engine.local import LocalModel
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb

pytestmark = pytest.mark.bundled


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory) -> LocalMesh:
    # The step deadline (1.5 s), not the heartbeat limit (10 s), catches a frozen node here.
    return mesh_factory(
        "0:15,15:30,15:30,empty",
        tracker_args=["--step-timeout", "1.5"],
        heartbeat_timeout_s=10.0,
    )


@pytest.fixture(scope="module")
def case(oracle: dict[str, Any], bundled: LocalModel) -> dict[str, Any]:
    """The oracle's raw completion prompt, and ``ids``: what the nodes' backend gives for
    it alone in-process (``bundled``: the default backend, as the nodes here run)."""
    raw = next(c for c in oracle["cases"] if c["name"] == "raw_completion")
    alone = {"prompt": raw["prompt_text"], "temperature": 0, "max_tokens": 48}
    return {**raw, "ids": solo_completion_ids(bundled, alone)}


@pytest.fixture(scope="module")
def body(mesh: LocalMesh, case: dict[str, Any]) -> dict[str, Any]:
    model = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers).json()["data"][0]["id"]
    return {"model": model, "prompt": case["prompt_text"], "temperature": 0, "max_tokens": 48}


def _b(s: Streamed) -> str:
    return serving(s, (15, 30))


def _check(mesh: LocalMesh, s: Streamed, case: dict[str, Any], kind: str) -> dict[str, Any]:
    assert s.error is None, s.error
    assert s.ids == case["ids"]
    assert s.final is not None
    (recovery,) = s.final["recoveries"]
    assert recovery["kind"] == kind
    positions = len(case["prompt_ids"]) + len(s.ids) - 1
    assert_billed_once(wait_ledger(mesh, s.generation_id, hops=2), 30, positions)
    return dict(recovery)


def test_1_kill_9_of_a_replicated_node(
    mesh: LocalMesh, body: dict[str, Any], case: dict[str, Any]
) -> None:
    s = stream_completion(mesh, body, at(10, lambda s: mesh.kill_node(_b(s))))
    assert _check(mesh, s, case, "worker-death")["method"] == "replay"


def test_2_healing_onto_the_empty_node(
    mesh: LocalMesh, body: dict[str, Any], case: dict[str, Any]
) -> None:
    # One server of 15:30 is left; killing it leaves only E to heal.
    s = stream_completion(mesh, body, at(5, lambda s: mesh.kill_node(_b(s))))
    assert _check(mesh, s, case, "worker-death")["healed"] == "node-3"


def test_3_a_frozen_node_meets_its_deadline(
    mesh: LocalMesh, body: dict[str, Any], case: dict[str, Any]
) -> None:
    mesh.start_node("node-1", LayerRange(15, 30))  # a replica again
    wait_until_up(mesh, "node-1")
    frozen: list[str] = []

    def freeze(s: Streamed) -> None:
        frozen.append(_b(s))
        mesh.kill_node(frozen[0], signal.SIGSTOP)

    s = stream_completion(mesh, body, at(5, freeze))
    mesh.kill_node(frozen[0], signal.SIGCONT)
    _check(mesh, s, case, "deadline-exceeded")


def test_4_a_cancel_frees_every_shard(mesh: LocalMesh, body: dict[str, Any]) -> None:
    def cancel(s: Streamed) -> None:
        httpx.post(
            f"{mesh.url}/admin/generations/{s.generation_id}/cancel", headers=mesh.admin_headers
        ).raise_for_status()

    s = stream_completion(mesh, body, at(3, cancel))
    assert s.error is not None and s.error["code"] == "cancelled"
    live = [n for n in ("node-0", "node-1", "node-3") if n in mesh.nodes]
    wait_kv_idle(mesh, live, within_s=1.0)


def test_5_malformed_bundles_leave_other_sessions_untouched(
    mesh: LocalMesh, body: dict[str, Any], case: dict[str, Any]
) -> None:
    wait_until_up(mesh, "node-1")
    fingerprint = next(
        n["fingerprint"]
        for n in httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers).json()["nodes"]
        if n["node_id"] == "node-0"
    )
    results: list[Streamed] = []
    worker = threading.Thread(target=lambda: results.append(stream_completion(mesh, body)))
    worker.start()
    d = 576  # the bundled model's width
    bad = [
        codec.encode(np.zeros((1, d), np.float32)),  # hidden states to the first shard
        codec.encode(np.asarray([10**7], np.int64)),  # a token id outside the vocabulary
        pb.Tensor(dtype="i64", shape=[3], data=b"\0" * 8),  # data shorter than the shape
        pb.Tensor(dtype="i64", shape=[10**9], data=b""),  # oversize
    ]
    opened = pb.Open(
        session_id="intruder", epoch=1, fingerprint=fingerprint, layer_start=0, layer_end=15
    )
    replies = raw_forward(mesh, "node-0", opened, bad)
    bad_hidden = [
        codec.encode(np.zeros((1, d + 1), np.float32)),  # wrong shape
        codec.encode(np.zeros((1, d), np.int64)),  # wrong dtype
        pb.Tensor(dtype="f32", shape=[1, d], data=np.full(d, np.nan, np.float32).tobytes()),
        pb.Tensor(dtype="f32", shape=[10**6, d], data=b""),  # oversize, never allocated
    ]
    second = pb.Open(
        session_id="intruder", epoch=1, fingerprint=fingerprint, layer_start=15, layer_end=30
    )
    replies += raw_forward(mesh, "node-1", second, bad_hidden)[1:]
    worker.join(timeout=120)
    assert [r.WhichOneof("kind") for r in replies] == ["opened"] + ["failure"] * 8
    assert {r.failure.kind for r in replies[1:]} == {"malformed-bundle"}
    assert results[0].ids == case["ids"]
    assert results[0].final is not None and results[0].final["recoveries"] == []
