"""KV stream throughput between two node processes, against raw loopback TCP.

Two nodes of the whole model run as separate processes. A session of
``tokens`` positions is put on node A (its KV filled with random values
through ``StatePut``, which hashes and verifies them like any import), then
moved A -> B two ways: node to node (B's ``StatePull`` reads A's
``StateGet``: every byte exported, hashed, sent once, verified and loaded),
and through the client, which pipes A's ``StateGet`` frames into B's
``StatePut`` (every byte crosses loopback twice). The peer figure is a plain
TCP socket moving the same number of bytes over loopback in the same run.
"""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import numpy as np

from meshnet.auth.mesh_keys import MeshKeys, Metadata
from meshnet.auth.signing import PREFIX_KEY
from meshnet.kv.transfer import export_frames
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh
from meshnet.model.info import ModelInfo, load_model_info
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc
from meshnet.protocol.codec import MESSAGE_OPTIONS

PREFIX = "bench-prefix"  # the token prefix hash the benchmark vouches for, as the tracker does


@dataclass(frozen=True)
class KVStreamThroughput:
    tokens: int
    nbytes: int
    move_s: list[float]  # A -> client -> B through StateGet | StatePut, per round
    pull_s: list[float]  # A -> B directly: B pulls (StatePull), per round
    tcp_s: list[float]  # the same bytes over a raw loopback socket, per round

    @property
    def kv_mb_s(self) -> float:
        return self.nbytes / min(self.move_s) / 1e6

    @property
    def pull_mb_s(self) -> float:
        return self.nbytes / min(self.pull_s) / 1e6

    @property
    def tcp_mb_s(self) -> float:
        return self.nbytes / min(self.tcp_s) / 1e6


def whole_model_header(info: ModelInfo, session_id: str, tokens: int) -> pb.KVHeader:
    """The header of a float32 KV stream of every layer of ``info``'s model, one step of
    ``tokens`` positions, under the prefix hash the benchmarks vouch for."""
    spec = info.spec
    return pb.KVHeader(
        fingerprint=info.fingerprint,
        layer_start=0,
        layer_end=spec.n_layers,
        session_id=session_id,
        epoch=1,
        tokens=tokens,
        steps=1,
        token_prefix_hash=PREFIX,
        dtype="float32",
        n_kv_heads=spec.n_kv_heads,
        head_dim=spec.head_dim,
    )


def measure_kv_stream(model: str | None, tokens: int, rounds: int) -> KVStreamThroughput:
    info = load_model_info(model)
    spec = info.spec
    whole = LayerRange(0, spec.n_layers)
    header = whole_model_header(info, "bench", tokens)
    nbytes = 2 * spec.n_layers * spec.n_kv_heads * tokens * spec.head_dim * 4
    payload = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32).tobytes()
    with tempfile.TemporaryDirectory(prefix="meshnet-kv-") as tmp:
        mesh = LocalMesh(Path(tmp), model=model)
        try:
            mesh.start([whole, whole])
            r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers)
            nodes = sorted(r.json()["nodes"], key=lambda n: n["node_id"])
            (id_a, a), (id_b, b) = ((n["node_id"], n["address"]) for n in nodes)
            # The benchmark calls the nodes as the tracker does: signed with the mesh
            # secret, imports vouched for, B's pull carrying a token for A.
            keys = MeshKeys(mesh.mesh_secret)
            token = keys.peer(id_a, id_b, "pull", "bench")
            pull = pb.StatePullRequest(
                source=a, session_id="bench", token_prefix_hash=PREFIX, source_token=token
            )
            get = pb.StateGetRequest(session_id="bench", token_prefix_hash=PREFIX)
            with (
                grpc.insecure_channel(a, options=MESSAGE_OPTIONS) as ca,
                grpc.insecure_channel(b, options=MESSAGE_OPTIONS) as cb,
            ):
                to_a, to_b = pb_grpc.NodeStub(ca), pb_grpc.NodeStub(cb)
                frames = export_frames(header, payload)
                put = to_a.StatePut(frames, timeout=120, metadata=_put_metadata(keys, id_a))
                if not put.imported:
                    raise RuntimeError(f"could not seed node A: {put.failure}")
                move_s, pull_s, tcp_s = [], [], []
                for _ in range(rounds):
                    signed = keys.call(id_b, "StatePull")  # signatures made before the clock
                    t0 = time.perf_counter()
                    pulled = to_b.StatePull(pull, timeout=120, metadata=signed)
                    pull_s.append(time.perf_counter() - t0)
                    if not pulled.imported:
                        raise RuntimeError(f"B could not pull from A: {pulled.failure}")
                    signed, put_b = keys.call(id_a, "StateGet"), _put_metadata(keys, id_b)
                    t0 = time.perf_counter()
                    frames = to_a.StateGet(get, timeout=120, metadata=signed)
                    moved = to_b.StatePut(frames, timeout=120, metadata=put_b)
                    move_s.append(time.perf_counter() - t0)
                    if not moved.imported:
                        raise RuntimeError(f"A -> B failed: {moved.failure}")
                    tcp_s.append(_tcp_seconds(payload))
        finally:
            mesh.stop()
    return KVStreamThroughput(tokens, nbytes, move_s, pull_s, tcp_s)


def _put_metadata(keys: MeshKeys, node_id: str) -> Metadata:
    """The tracker's ``StatePut`` call on ``node_id``: signed (now), the prefix vouched for."""
    return (*keys.call(node_id, "StatePut"), (PREFIX_KEY, PREFIX))


def _tcp_seconds(payload: bytes) -> float:
    """Seconds to push ``payload`` through a loopback TCP connection and read it all."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    received = 0

    def sink() -> None:
        nonlocal received
        conn, _ = server.accept()
        with conn:
            while chunk := conn.recv(1 << 20):
                received += len(chunk)

    reader = threading.Thread(target=sink)
    reader.start()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.sendall(payload)
    reader.join()
    seconds = time.perf_counter() - t0
    server.close()
    if received != len(payload):
        raise RuntimeError("the TCP peer lost bytes")
    return seconds
