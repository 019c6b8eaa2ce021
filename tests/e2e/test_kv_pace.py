"""A KV import's deadline is sized to its bytes (real node process, tiny model, 10 ms link).

The node is started with a small pace (a base of 0.5 s, a minimum rate of 20 KiB/s) so
that a session of the tiny model exercises what a large one does on a real link: a
stream sent well above the rate is imported although it takes longer than the base
(a fixed deadline of that base would have cut it), and one trickled below the rate is
cut before its end and leaves the node holding nothing of it. Both go through the delay
proxy at 10 ms each way.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import MeshFactory
from faults import address, info, signed
from session_client import TURNS, new_session, turn

from meshnet.auth.signing import PREFIX_KEY
from meshnet.benchmark.delay_proxy import DelayProxy
from meshnet.kv.transfer import export_frames
from meshnet.local_mesh import LocalMesh, free_port
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc

BASE_S = 0.5
RATE = 20 << 10  # bytes per second
QUIET = ["--park-after", "0", "--evict-after", "0", "--policy-interval", "3600"]
PACE = ["--kv-transfer-base", str(BASE_S), "--kv-transfer-rate", str(RATE / (1 << 20))]
CHUNK = 2048  # small chunks, so that pacing them is smooth


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, tiny_factory: Any) -> LocalMesh:
    model = Path(tiny_factory("chat.gguf", context_length=1024))
    return mesh_factory("0:4", model=model, tracker_args=QUIET, node_args=PACE)


@pytest.fixture(scope="module")
def linked(mesh: LocalMesh) -> Iterator[str]:
    """node-0's gRPC port behind a 10 ms delay each way: the address to dial."""
    port = int(address(mesh, "node-0").rsplit(":", 1)[1])
    listen = free_port()
    proxy = DelayProxy([(listen, port)])
    proxy.set_delay(10)
    yield f"127.0.0.1:{listen}"
    proxy.close()


@pytest.fixture(scope="module")
def session_kv(mesh: LocalMesh) -> tuple[pb.KVHeader, bytes]:
    """A session's KV as node-0 exports it (header and payload), a few turns long."""
    sid = new_session(mesh)
    for content in TURNS[:3]:
        turn(mesh, sid, content, max_tokens=48)
    with grpc.insecure_channel(address(mesh, "node-0")) as channel:
        frames = list(
            pb_grpc.NodeStub(channel).StateGet(
                pb.StateGetRequest(session_id=sid, token_prefix_hash="vouched"),
                timeout=30,
                metadata=signed(mesh, "node-0", "StateGet"),
            )
        )
    payload = b"".join(f.chunk.data for f in frames if f.WhichOneof("kind") == "chunk")
    return frames[0].header, payload


def _put(
    mesh: LocalMesh, target: str, kv: tuple[pb.KVHeader, bytes], bytes_per_s: float
) -> tuple[pb.StatePutResponse | grpc.RpcError, int, int]:
    """Import ``kv`` into node-0 through ``target``, sending at ``bytes_per_s``; the
    answer (or the error the call ended with), and the frames sent of how many."""
    header = pb.KVHeader()
    header.CopyFrom(kv[0])
    frames = list(export_frames(header, kv[1], CHUNK))
    sent = [0]

    def paced() -> Iterator[pb.KVFrame]:
        for frame in frames:
            time.sleep(len(frame.chunk.data) / bytes_per_s)
            sent[0] += 1
            yield frame

    vouched = (*signed(mesh, "node-0", "StatePut"), (PREFIX_KEY, header.token_prefix_hash))
    with grpc.insecure_channel(target) as channel:
        try:
            reply = pb_grpc.NodeStub(channel).StatePut(paced(), metadata=vouched, timeout=120)
        except grpc.RpcError as e:
            return e, sent[0], len(frames)
    return reply, sent[0], len(frames)


def test_a_stream_above_the_rate_is_imported_though_it_outlasts_the_base(
    mesh: LocalMesh, linked: str, session_kv: tuple[pb.KVHeader, bytes]
) -> None:
    nbytes = len(session_kv[1])
    fast = 4 * RATE
    assert nbytes / fast > 2 * BASE_S, f"{nbytes} bytes: too few to outlast the base"
    reply, sent, total = _put(mesh, linked, session_kv, fast)
    assert isinstance(reply, pb.StatePutResponse), reply
    assert reply.imported, reply
    assert reply.tokens == session_kv[0].tokens and sent == total


def test_a_trickle_below_the_rate_is_cut_and_leaves_nothing(
    mesh: LocalMesh, linked: str, session_kv: tuple[pb.KVHeader, bytes]
) -> None:
    before = info(mesh, "node-0")
    reply, sent, total = _put(mesh, linked, session_kv, RATE / 4)
    if isinstance(reply, pb.StatePutResponse):
        assert (reply.imported, reply.reason) == (False, "deadline"), reply
    else:  # the node cancelled the call at its deadline while the sender slept
        assert reply.code() == grpc.StatusCode.CANCELLED, reply  # type: ignore[attr-defined]
    assert sent < total  # cut before its end
    after = info(mesh, "node-0")
    # The import's session was quarantined: it holds no KV for it any more.
    assert after.sessions == before.sessions - 1
