"""KV moves node to node between real processes and continues bit-identically."""

from __future__ import annotations

import queue
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
from conftest import MeshFactory
from faults import address, signed

from meshnet.auth.mesh_keys import MeshKeys
from meshnet.local_mesh import LocalMesh
from meshnet.model.gguf_file import sha256_file
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc


class Session:
    """A Forward stream on ``node_id`` held open by hand (as the tracker), one request at a
    time."""

    def __init__(self, mesh: LocalMesh, node_id: str, open_msg: pb.Open) -> None:
        self._channel = grpc.insecure_channel(address(mesh, node_id))
        self._requests: queue.Queue[pb.ForwardRequest | None] = queue.Queue()
        stub = pb_grpc.NodeStub(self._channel)
        forward = signed(mesh, node_id, "Forward")
        self._replies = stub.Forward(self._feed(), timeout=60, metadata=forward)
        self.opened = self.send(pb.ForwardRequest(open=open_msg))

    def _feed(self) -> Iterator[pb.ForwardRequest]:
        while (r := self._requests.get()) is not None:
            yield r

    def send(self, request: pb.ForwardRequest) -> pb.ForwardResponse:
        self._requests.put(request)
        return next(self._replies)

    def step(self, n: int, ids: list[int]) -> pb.ForwardResponse:
        x = codec.encode(np.asarray(ids, np.int64))
        return self.send(pb.ForwardRequest(step=pb.Step(step=n, input=x)))

    def close(self) -> None:
        self._requests.put(None)
        self._replies.cancel()
        self._channel.close()


def test_a_session_pulled_to_another_node_continues_identically(
    mesh_factory: MeshFactory, tiny_path: Path
) -> None:
    mesh = mesh_factory("0:4,0:4", model=tiny_path)
    a, b = address(mesh, "node-0"), address(mesh, "node-1")
    keys = MeshKeys(mesh.mesh_secret)
    fingerprint = sha256_file(tiny_path)

    def open_msg() -> pb.Open:
        return pb.Open(
            session_id="moved", epoch=3, fingerprint=fingerprint, layer_start=0, layer_end=4
        )

    def pull(session_id: str) -> pb.StatePutResponse:
        """node-1 pulls ``session_id`` from node-0, with the tracker's token for it."""
        token = keys.peer("node-0", "node-1", "pull", session_id)
        request = pb.StatePullRequest(
            source=a, session_id=session_id, source_token=token, token_prefix_hash="e" * 64
        )
        with grpc.insecure_channel(b) as channel:
            stub = pb_grpc.NodeStub(channel)
            return stub.StatePull(request, timeout=30, metadata=keys.call("node-1", "StatePull"))

    on_a = Session(mesh, "node-0", open_msg())
    try:
        on_a.step(0, [5, 6, 7, 8])
        on_a.step(1, [9])
        pulled = pull("moved")
        assert pulled.imported, pulled.failure
        assert pulled.transport == "tcp"  # over the bulk port, not gRPC frames
        assert pulled.tokens == 5
        on_b = Session(mesh, "node-1", open_msg())  # the same epoch: it keeps the imported KV
        try:
            assert (on_b.opened.opened.kv_tokens, on_b.opened.opened.steps) == (5, 2)
            here, there = on_a.step(2, [10]), on_b.step(2, [10])
            assert here.result.output.data == there.result.output.data  # bit-identical logits
        finally:
            on_b.close()
        # Pulling a session the source does not hold fails cleanly.
        missing = pull("nobody")
        assert not missing.imported and missing.failure.kind == "kv-import-failed"
        assert missing.reason == "source-missing"
    finally:
        on_a.close()
