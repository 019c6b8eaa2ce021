"""Which way a ring's input goes: over the next hop's relay port once a connection
to it is let in, and over the gRPC relay stream until then, or for good when the
port refuses the connection or cannot be reached."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest

from meshnet.errors import MeshnetError, Overloaded, Unauthenticated
from meshnet.node.relay import RelaySender
from meshnet.node.relay_socket import RelayListener
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb

ADDRESS = "127.0.0.1:1"  # the next hop's gRPC address: only its host is dialled here
X = np.ones((1, 4), dtype=np.float32)


class StreamFake:
    """Stands in for the gRPC relay stream: records frames, answers with ``ack``."""

    def __init__(self) -> None:
        self.frames: list[pb.RelayFrame] = []
        self.ack = pb.RelayAck()

    def post(self, address: str, token: str, frame: pb.RelayFrame) -> Future[pb.RelayAck]:
        self.frames.append(frame)
        answer: Future[pb.RelayAck] = Future()
        answer.set_result(self.ack)
        return answer


class Port:
    """A relay port letting in ``token`` only; what it filed."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.filed: list[int] = []
        self.event = threading.Event()
        self.listener = RelayListener("127.0.0.1", 0, self.check, self.file, max_connections=2)

    def check(self, token: str) -> None:
        if token != self.token:
            raise Unauthenticated("the peer token does not check out")

    def file(self, sid: str, epoch: int, step: int, x: np.ndarray) -> MeshnetError | None:
        codec.checked(x, codec.TensorLimits("f32", 2, 8, 4))
        self.filed.append(step)
        self.event.set()
        return None


@pytest.fixture
def sender() -> Iterator[tuple[RelaySender, StreamFake]]:
    s, stream = RelaySender(), StreamFake()
    s.post = stream.post  # type: ignore[method-assign]
    yield s, stream
    s.close()


def _settled(s: RelaySender) -> None:
    """Until no connection is being made."""
    deadline = time.monotonic() + 5
    while s._connecting and time.monotonic() < deadline:
        time.sleep(0.01)


def test_inputs_go_by_stream_until_the_offered_port_lets_the_sender_in(
    sender: tuple[RelaySender, StreamFake],
) -> None:
    s, stream = sender
    port = Port("good")
    seen: list[MeshnetError] = []
    s.relay(ADDRESS, "good", ("s", 1, 0), X, seen.append)
    assert [f.step for f in stream.frames] == [0] and port.filed == []
    s._offered(ADDRESS, "good", port.listener.port)  # the stream's answer offered it
    _settled(s)
    s.relay(ADDRESS, "good", ("s", 1, 1), X, seen.append)
    assert port.event.wait(5)
    assert port.filed == [1] and len(stream.frames) == 1 and seen == []
    port.listener.close()


def test_a_refused_or_unreachable_port_leaves_the_inputs_on_the_stream(
    sender: tuple[RelaySender, StreamFake],
) -> None:
    s, stream = sender
    port = Port("another")  # the sender's token is not let in
    s._offered(ADDRESS, "good", port.listener.port)
    _settled(s)
    port.listener.close()
    s._offered(ADDRESS, "good", port.listener.port)  # offered again: not tried for a while
    assert not s._connecting
    seen: list[MeshnetError] = []
    s.relay(ADDRESS, "good", ("s", 1, 0), X, seen.append)
    assert [f.step for f in stream.frames] == [0] and port.filed == [] and seen == []


def test_a_refusal_on_the_stream_is_the_runs_failure(
    sender: tuple[RelaySender, StreamFake],
) -> None:
    s, stream = sender
    stream.ack = pb.RelayAck(failure=pb.Failure(kind="overloaded", message="full"))
    seen: list[MeshnetError] = []
    s.relay(ADDRESS, "good", ("s", 1, 0), X, seen.append)
    assert len(seen) == 1 and isinstance(seen[0], Overloaded)
