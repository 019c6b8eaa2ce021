"""The relay port on loopback: only a shown token lets a connection in; inputs arrive
exactly; a refusal reaches its run and leaves the connection up; a frame that breaks
the format, or any bytes before the hello, close only that connection and file
nothing; a broken connection is every watching run's failure."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Iterator

import numpy as np
import pytest

from meshnet.errors import (
    MalformedBundle,
    MeshnetError,
    Overloaded,
    StreamReset,
    Unauthenticated,
)
from meshnet.node import relay_wire as wire
from meshnet.node.relay_socket import RelayListener, SocketLink
from meshnet.protocol import codec

TOKEN = "p1.good-token"
LIMITS = codec.TensorLimits("f32", 2, 64, 4)


class Receiver:
    """What the listener files into: the inputs taken, or a refusal to answer."""

    def __init__(self) -> None:
        self.filed: list[tuple[str, int, int, np.ndarray]] = []
        self.refuse: MeshnetError | None = None
        self.event = threading.Event()

    def check(self, token: str) -> None:
        if token != TOKEN:
            raise Unauthenticated("the peer token does not check out")

    def file(self, sid: str, epoch: int, step: int, x: np.ndarray) -> MeshnetError | None:
        if self.refuse is not None:
            return self.refuse
        try:
            self.filed.append((sid, epoch, step, codec.checked(x, LIMITS)))
        except MeshnetError as e:
            return e
        self.event.set()
        return None

    def wait(self) -> None:
        """Until an input is filed."""
        assert self.event.wait(5.0)
        self.event.clear()


@pytest.fixture
def port() -> Iterator[tuple[RelayListener, Receiver]]:
    receiver = Receiver()
    listener = RelayListener("127.0.0.1", 0, receiver.check, receiver.file, max_connections=2)
    yield listener, receiver
    listener.close()


class Failures:
    def __init__(self) -> None:
        self.seen: list[MeshnetError] = []
        self.event = threading.Event()

    def __call__(self, e: MeshnetError) -> None:
        self.seen.append(e)
        self.event.set()

    def wait(self) -> MeshnetError:
        assert self.event.wait(5.0), "no failure was told"
        self.event.clear()
        return self.seen[-1]


def link(listener: RelayListener, token: str = TOKEN) -> SocketLink:
    return SocketLink.connect("127.0.0.1", listener.port, token, "hop-b")


def raw_connection(listener: RelayListener) -> socket.socket:
    """A connection let in by hand, to send what a ``SocketLink`` never would."""
    sock = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
    sock.sendall(wire.hello(TOKEN))
    assert sock.recv(wire.VERDICT.size) == wire.verdict(None)
    return sock


def test_an_input_arrives_exactly_and_a_refusal_leaves_the_connection_up(
    port: tuple[RelayListener, Receiver],
) -> None:
    listener, receiver = port
    out = link(listener)
    failures = Failures()
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    out.send("s", 3, 7, x, failures)
    receiver.wait()
    sid, epoch, step, got = receiver.filed[0]
    assert (sid, epoch, step) == ("s", 3, 7)
    np.testing.assert_array_equal(got, x)
    receiver.refuse = Overloaded("relay mailbox full")
    out.send("s", 3, 8, x, failures)
    assert isinstance(failures.wait(), Overloaded)
    receiver.refuse = None
    out.send("s", 3, 9, x, failures)  # the same connection takes the next one
    receiver.wait()
    assert [f[2] for f in receiver.filed] == [7, 9]
    assert out.broken is None
    out.close()


def test_a_wrong_token_or_bytes_before_the_hello_let_nothing_in(
    port: tuple[RelayListener, Receiver],
) -> None:
    listener, receiver = port
    with pytest.raises(Unauthenticated):
        link(listener, token="p1.forged")
    sock = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
    frame = b"".join(wire.input_frame("s", 1, 0, np.ones((1, 4), dtype=np.float32)))
    sock.sendall(frame)  # no hello: an input straight away
    assert sock.recv(100) == b""  # closed without a byte
    sock.close()
    assert receiver.filed == []
    link(listener).close()  # the port still lets a good token in


@pytest.mark.parametrize(
    "frame",
    [
        wire.INPUT_HEADER.pack(9, 2, 1, 1, 0, 1, 4) + b"s",  # not an input
        wire.INPUT_HEADER.pack(wire.INPUT, 7, 1, 1, 0, 1, 4) + b"s",  # no such dtype
        wire.INPUT_HEADER.pack(wire.INPUT, 2, 0, 1, 0, 1, 4),  # no session id
        wire.INPUT_HEADER.pack(wire.INPUT, 2, 5000, 1, 0, 1, 4),  # a session id too long
        wire.INPUT_HEADER.pack(wire.INPUT, 2, 1, 1, 0, 1 << 30, 4) + b"s",  # too many rows
        wire.INPUT_HEADER.pack(wire.INPUT, 2, 1, 1, 0, 1 << 19, 1 << 16) + b"s",  # too big
        wire.INPUT_HEADER.pack(wire.INPUT, 2, 1, 1, 0, 1, 4) + b"\xff" + bytes(16),  # not utf-8
    ],
)
def test_a_hostile_frame_closes_only_its_connection_and_files_nothing(
    port: tuple[RelayListener, Receiver], frame: bytes
) -> None:
    listener, receiver = port
    bystander, failures = link(listener), Failures()
    sock = raw_connection(listener)
    sock.sendall(frame)
    head = sock.recv(wire.REFUSAL_HEADER.size, socket.MSG_WAITALL)
    closing, *_ = wire.read_refusal_header(head)
    assert closing
    sock.settimeout(5)
    while sock.recv(4096):  # the rest of the refusal, then the end
        pass
    sock.close()
    assert receiver.filed == []
    bystander.send("s", 1, 0, np.ones((1, 4), dtype=np.float32), failures)
    receiver.wait()
    assert len(receiver.filed) == 1 and bystander.broken is None
    bystander.close()


def test_an_input_its_receiver_cannot_take_is_refused_as_a_relay_frame_would_be(
    port: tuple[RelayListener, Receiver],
) -> None:
    listener, receiver = port
    out, failures = link(listener), Failures()
    out.send("s", 1, 0, np.full((1, 4), np.nan, dtype=np.float32), failures)
    assert isinstance(failures.wait(), MalformedBundle)
    out.send("s", 1, 0, np.ones((1, 5), dtype=np.float32), failures)  # the wrong width
    assert isinstance(failures.wait(), MalformedBundle)
    assert receiver.filed == [] and out.broken is None
    out.close()


def test_a_broken_connection_is_every_watching_runs_failure_once(
    port: tuple[RelayListener, Receiver],
) -> None:
    listener, _ = port
    out = link(listener)
    a, b, gone = Failures(), Failures(), Failures()
    x = np.ones((1, 4), dtype=np.float32)
    out.send("a", 1, 0, x, a)
    out.send("b", 2, 0, x, b)
    out.send("c", 1, 0, x, gone)
    out.forget("c", 1)  # its run ended: told nothing
    listener.close()  # the receiver goes away
    assert isinstance(a.wait(), StreamReset) and isinstance(b.wait(), StreamReset)
    assert out.broken is not None and gone.seen == []
    late = Failures()
    out.send("a", 1, 1, x, late)  # on a broken link: told at once
    assert isinstance(late.wait(), StreamReset)
    assert len(a.seen) == 1


def test_connections_past_the_limit_are_refused_and_keep_to_grpc(
    port: tuple[RelayListener, Receiver],
) -> None:
    listener, _ = port
    held = [link(listener), link(listener)]
    with pytest.raises(Overloaded):
        link(listener)
    held[0].close()
    for _ in range(50):  # the closed one's slot comes back once its thread sees the end
        try:
            link(listener).close()
            break
        except Overloaded:
            threading.Event().wait(0.05)
    else:
        pytest.fail("a freed connection's slot was not given back")
    held[1].close()


def test_a_truncated_refusal_or_an_unknown_answer_breaks_the_link() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    failures = Failures()

    def serve() -> None:
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(wire.verdict(None))
        conn.recv(4096)
        conn.sendall(struct.pack("<B", 9) + bytes(wire.REFUSAL_HEADER.size - 1))
        conn.close()

    threading.Thread(target=serve, daemon=True).start()
    out = SocketLink.connect("127.0.0.1", server.getsockname()[1], TOKEN, "hop-b")
    out.send("s", 1, 0, np.ones((1, 4), dtype=np.float32), failures)
    assert isinstance(failures.wait(), StreamReset)
    server.close()


def test_a_frame_carries_little_endian_bytes_whatever_the_arrays_byte_order() -> None:
    x = np.arange(6, dtype=">f4").reshape(2, 3)
    frame = b"".join(wire.input_frame("s", 1, 2, x))
    h = wire.read_input_header(frame[: wire.INPUT_HEADER.size])
    array = wire.as_array(h, frame[wire.INPUT_HEADER.size + h.session_bytes :])
    got = codec.checked(array, codec.TensorLimits("f32", 2, 8, 3))
    np.testing.assert_array_equal(got, x)
    with pytest.raises(MalformedBundle):
        wire.input_frame("s", 1, 2, np.ones((2, 3), dtype=np.float16))
