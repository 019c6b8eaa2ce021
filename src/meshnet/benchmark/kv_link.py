"""KV moved over a link held 10 ms each way, at growing sizes, against raw TCP on that link.

Two node processes serve the whole model. Node B's gRPC port and a plain TCP
sink are each reached through the delay proxy (``delay_proxy.py``: every byte
held ``delay_ms`` each way, no bandwidth limit). For each size, a session of
that many positions is imported into B through the link (``StatePut``, as the
tracker resumes a snapshot: every chunk hashed, sent, verified, loaded) under
the nodes' own transfer deadline (``--kv-transfer-base`` plus the bytes at
``--kv-transfer-rate``), then B pulls it back from A through the link
(``StatePull``, node to node, A's port behind the proxy too). The peer figure
is the same bytes pushed through the same proxy over one TCP connection in
the same run: what the link itself carries. The largest size that moved, and
its rates against the link's, are the answer to "how large a KV can cross a
slow link".
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

from meshnet.auth.mesh_keys import MeshKeys
from meshnet.auth.signing import PREFIX_KEY
from meshnet.benchmark.delay_proxy import DelayProxy
from meshnet.benchmark.kv_stream import PREFIX, whole_model_header
from meshnet.kv.transfer import export_frames
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh, free_ports
from meshnet.model.info import load_model_info
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc
from meshnet.protocol.codec import MESSAGE_OPTIONS


@dataclass(frozen=True)
class LinkMove:
    tokens: int
    nbytes: int
    put_s: float | None  # client -> B over the link (StatePut); None: refused or cut
    pull_s: float | None  # A -> B over the link, B pulling (StatePull)
    tcp_s: float  # the same bytes through the same proxy over one TCP connection
    failure: str = ""

    @property
    def tcp_mb_s(self) -> float:
        return self.nbytes / self.tcp_s / 1e6

    def mb_s(self, seconds: float | None) -> float:
        return self.nbytes / seconds / 1e6 if seconds else 0.0


def measure_kv_link(model: str | None, sizes: list[int], delay_ms: float) -> list[LinkMove]:
    """One move per size of ``sizes`` (positions), in order; stops at the first failure."""
    info = load_model_info(model)
    spec = info.spec
    whole = LayerRange(0, spec.n_layers)
    per_token = 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * 4
    rng = np.random.default_rng(0)
    moves: list[LinkMove] = []
    with tempfile.TemporaryDirectory(prefix="meshnet-kv-link-") as tmp:
        mesh = LocalMesh(Path(tmp), model=model, tracker_args=["--replicas", "0"])
        try:
            mesh.start([whole, whole])
            r = httpx.get(f"{mesh.url}/admin/nodes", headers=mesh.admin_headers)
            nodes = sorted(r.json()["nodes"], key=lambda n: n["node_id"])
            (id_a, a), (id_b, b) = ((n["node_id"], n["address"]) for n in nodes)
            keys = MeshKeys(mesh.mesh_secret)
            sink = _Sink()
            far_a, far_b, far_sink = free_ports(3)
            pairs = [(far_a, _port(a)), (far_b, _port(b)), (far_sink, sink.port)]
            proxy = DelayProxy(pairs)
            try:
                proxy.set_delay(delay_ms)
                with (
                    grpc.insecure_channel(a, options=MESSAGE_OPTIONS) as ca,
                    grpc.insecure_channel(f"127.0.0.1:{far_b}", options=MESSAGE_OPTIONS) as cb,
                ):
                    to_a, to_b = pb_grpc.NodeStub(ca), pb_grpc.NodeStub(cb)
                    for i, tokens in enumerate(sizes):
                        nbytes = tokens * per_token
                        payload = rng.standard_normal(nbytes // 4).astype(np.float32).tobytes()
                        header = whole_model_header(info, f"bench-{i}", tokens)
                        put_s, pull_s, failure = _move(
                            keys, (id_a, to_a), (id_b, to_b), header, payload, far_a
                        )
                        tcp_s = sink.seconds_to_push(payload, far_sink)
                        moves.append(LinkMove(tokens, nbytes, put_s, pull_s, tcp_s, failure))
                        del payload
                        if moves[-1].failure:
                            break
            finally:
                proxy.close()
                sink.close()
        finally:
            mesh.stop()
    return moves


def _move(
    keys: MeshKeys,
    a: tuple[str, pb_grpc.NodeStub],
    b: tuple[str, pb_grpc.NodeStub],
    header: pb.KVHeader,
    payload: bytes,
    far_a: int,
) -> tuple[float | None, float | None, str]:
    """Seed A (on loopback), then put on B over the link, then B pulls from A over it."""
    (id_a, to_a), (id_b, to_b) = a, b
    seed = to_a.StatePut(
        export_frames(_copy(header), payload),
        timeout=600,
        metadata=(*keys.call(id_a, "StatePut"), (PREFIX_KEY, PREFIX)),
    )
    if not seed.imported:
        return None, None, f"seeding A: {seed.reason}: {seed.failure.message}"
    frames = list(export_frames(_copy(header), payload))  # hashed beforehand
    signed = (*keys.call(id_b, "StatePut"), (PREFIX_KEY, PREFIX))
    t0 = time.perf_counter()
    try:
        put = to_b.StatePut(iter(frames), timeout=600, metadata=signed)
    except grpc.RpcError as e:
        return None, None, f"StatePut over the link: {e.code().name}"
    put_s = time.perf_counter() - t0
    del frames
    if not put.imported:
        return None, None, f"StatePut over the link: {put.reason}: {put.failure.message}"
    token = keys.peer(id_a, id_b, "pull", header.session_id)
    pull = pb.StatePullRequest(
        source=f"127.0.0.1:{far_a}",
        session_id=header.session_id,
        token_prefix_hash=PREFIX,
        source_token=token,
    )
    signed_pull = keys.call(id_b, "StatePull")
    t0 = time.perf_counter()
    pulled = to_b.StatePull(pull, timeout=600, metadata=signed_pull)
    pull_s = time.perf_counter() - t0
    if not pulled.imported:
        return put_s, None, f"StatePull over the link: {pulled.reason}: {pulled.failure.message}"
    return put_s, pull_s, ""


def _copy(header: pb.KVHeader) -> pb.KVHeader:
    """A fresh header equal to ``header``: each export fills its own sizes in."""
    copy = pb.KVHeader()
    copy.CopyFrom(header)
    return copy


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


class _Sink:
    """A TCP server that reads and counts whatever one connection sends."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])

    def seconds_to_push(self, payload: bytes, via: int) -> float:
        """Seconds to push ``payload`` to the sink through port ``via`` and have it read."""
        received = [0]

        def read() -> None:
            conn, _ = self._server.accept()
            with conn:
                while chunk := conn.recv(1 << 20):
                    received[0] += len(chunk)

        reader = threading.Thread(target=read)
        reader.start()
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", via)) as c:
            c.sendall(payload)
            c.shutdown(socket.SHUT_WR)
            reader.join()
        seconds = time.perf_counter() - t0
        if received[0] != len(payload):
            raise RuntimeError("the TCP peer lost bytes")
        return seconds

    def close(self) -> None:
        self._server.close()
