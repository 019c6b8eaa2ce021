"""What fault tests check on a real mesh: the ledger, node state, and raw node streams."""

from __future__ import annotations

import time
from typing import Any

import grpc
import httpx
import numpy as np
from streams import node_info

from meshnet.auth.mesh_keys import MeshKeys, Metadata
from meshnet.local_mesh import LocalMesh
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc


def nodes(mesh: LocalMesh) -> dict[str, dict[str, Any]]:
    r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers)
    return {n["node_id"]: n for n in r.json()["nodes"]}


def address(mesh: LocalMesh, node_id: str) -> str:
    return str(nodes(mesh)[node_id]["address"])


def signed(mesh: LocalMesh, node_id: str, method: str) -> Metadata:
    """The metadata of the tracker's call of ``method`` on ``node_id``: tests speak for it."""
    return MeshKeys(mesh.mesh_secret).call(node_id, method)


def info(mesh: LocalMesh, node_id: str) -> pb.InfoResponse:
    return node_info(address(mesh, node_id), signed(mesh, node_id, "Info"))


def wait_until_up(mesh: LocalMesh, node_id: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        n = nodes(mesh).get(node_id)
        if n is not None and n["state"] == "up" and n["layers"] is not None:
            return
        time.sleep(0.1)
    raise AssertionError(f"{node_id} did not come up: {nodes(mesh).get(node_id)}")


def ledger(mesh: LocalMesh, generation_id: str) -> list[dict[str, Any]]:
    r = httpx.get(
        f"{mesh.url}/admin/ledger",
        params={"generation_id": generation_id},
        headers=mesh.admin_headers,
    )
    return list(r.json()["records"])


def wait_ledger(mesh: LocalMesh, generation_id: str, hops: int) -> list[dict[str, Any]]:
    """The generation's records once its final epoch's ``hops`` attempts are written."""
    deadline = time.monotonic() + 10
    records: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        records = ledger(mesh, generation_id)
        last = max((r["epoch"] for r in records), default=0)
        if sum(r["epoch"] == last for r in records) >= hops:
            return records
        time.sleep(0.05)
    raise AssertionError(f"ledger incomplete: {records}")


def assert_billed_once(records: list[dict[str, Any]], n_layers: int, positions: int) -> None:
    """Completed work covers every layer's token positions [0, positions) exactly once."""
    for layer in range(n_layers):
        spans = sorted(
            (r["token_start"], r["token_end"])
            for r in records
            if r["status"] == "completed" and r["layer_start"] <= layer < r["layer_end"]
        )
        at = 0
        for start, end in spans:
            assert start == at, f"layer {layer}: completed spans {spans} overlap or leave a gap"
            at = end
        assert at == positions, f"layer {layer}: completed spans {spans}, expected {positions}"


def wait_kv_idle(mesh: LocalMesh, node_ids: list[str], within_s: float) -> float:
    """Seconds until every node holds no KV; fails after ``within_s``."""
    addresses = {n: address(mesh, n) for n in node_ids}
    t0 = time.monotonic()
    while True:
        infos = [node_info(addresses[n], signed(mesh, n, "Info")) for n in node_ids]
        if all(i.kv_bytes == 0 and i.sessions == 0 for i in infos):
            return time.monotonic() - t0
        if time.monotonic() - t0 > within_s:
            held = {n: (i.sessions, i.kv_bytes) for n, i in zip(node_ids, infos, strict=True)}
            raise AssertionError(f"KV still held after {within_s}s: {held}")
        time.sleep(0.02)


def raw_forward(
    mesh: LocalMesh, node_id: str, open_msg: pb.Open, steps: list[pb.Tensor]
) -> list[pb.ForwardResponse]:
    """Drive one Forward stream on ``node_id`` by hand, signed as the tracker's (as a stale
    driver, or a tracker sending garbage, would)."""
    requests = [pb.ForwardRequest(open=open_msg)]
    requests += [pb.ForwardRequest(step=pb.Step(step=i, input=t)) for i, t in enumerate(steps)]
    forward = signed(mesh, node_id, "Forward")
    with grpc.insecure_channel(address(mesh, node_id)) as channel:
        stub = pb_grpc.NodeStub(channel)
        return list(stub.Forward(iter(requests), timeout=30, metadata=forward))


def hidden(rows: int, width: int) -> pb.Tensor:
    return codec.encode(np.zeros((rows, width), np.float32))
