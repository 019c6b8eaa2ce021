"""No peer holds a node's connection slot forever (a real node process, real sockets).

The node runs with short bounds (relay idle 1.5 s, a frame 1 s, keepalive 1 s) so each
case ends quickly: relay-port connections that go idle, one whose frame trickles in,
one whose peer stops reading the node's answers, and one closed abruptly all end and
give back their slot; a gRPC client that vanishes (frozen: it answers no ping) while
it holds the node's one Forward stream is cut by the keepalive, and the stream is
free again.
"""

from __future__ import annotations

import re
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import MeshFactory
from faults import address, signed

from meshnet.auth.signing import METADATA_KEY
from meshnet.local_mesh import LocalMesh
from meshnet.node import relay_wire as wire
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc

BOUNDS = ["--relay-idle-timeout", "1.5", "--relay-frame-timeout", "1", "--keepalive", "1"]
SLOTS = 8  # the relay connections a node holds at once (node/main.py)
WAIT_S = 60.0  # far past every bound: a connection still open by then is held for good


@pytest.fixture(scope="module")
def mesh(mesh_factory: MeshFactory, tiny_factory: Any) -> LocalMesh:
    model = Path(tiny_factory("links.gguf"))
    return mesh_factory("0:4", model=model, node_args=[*BOUNDS, "--max-streams", "1"])


@pytest.fixture(scope="module")
def relay_port(mesh: LocalMesh) -> int:
    text = (mesh.data_dir / "logs" / "node-0.log").read_text()
    found = re.search(r"takes relayed inputs on port (\d+)", text)
    assert found, "node-0 offers no relay port"
    return int(found.group(1))


def _token(mesh: LocalMesh) -> str:
    return str(dict(signed(mesh, "node-0", "RelayStream"))[METADATA_KEY])


def _let_in(
    mesh: LocalMesh, port: int, rcvbuf: int = 0, wait_for_slot: bool = True
) -> socket.socket:
    """A connection that showed a good token and was let in. A connection the peer
    closed gives its slot back once the node's thread sees the close, a moment later:
    with ``wait_for_slot``, a refusal for want of a slot is tried again until one is
    free (``WAIT_S`` at most), so a case does not race the one before it."""
    deadline = time.monotonic() + WAIT_S
    while True:
        sock = socket.socket()
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(WAIT_S)
        sock.connect(("127.0.0.1", port))
        sock.sendall(wire.hello(_token(mesh)))
        status, n = wire.VERDICT.unpack(_exactly(sock, wire.VERDICT.size))
        reason = _exactly(sock, n).decode()
        if status == 0:
            return sock
        sock.close()
        if not (wait_for_slot and "overloaded" in reason and time.monotonic() < deadline):
            raise ConnectionRefusedError(reason)
        time.sleep(0.05)


def _exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        part = sock.recv(n - len(data))
        assert part, "closed mid-answer"
        data += part
    return data


def _closed_by_node(sock: socket.socket) -> bool:
    """Whether the node ends the connection (within ``WAIT_S``)."""
    try:
        while sock.recv(4096):
            pass  # answers before the end
    except (ConnectionResetError, BrokenPipeError):
        pass
    except TimeoutError:
        return False
    return True


def test_idle_connections_are_closed_and_give_back_their_slots(
    mesh: LocalMesh, relay_port: int
) -> None:
    held = [_let_in(mesh, relay_port) for _ in range(SLOTS)]
    with pytest.raises(ConnectionRefusedError, match="overloaded"):
        _let_in(mesh, relay_port, wait_for_slot=False)  # every slot is held
    try:
        assert all(_closed_by_node(s) for s in held)
    finally:
        for s in held:
            s.close()
    again = [_let_in(mesh, relay_port) for _ in range(SLOTS)]  # every slot is free
    for s in again:
        s.close()


def test_a_trickling_frame_is_cut(mesh: LocalMesh, relay_port: int) -> None:
    sock = _let_in(mesh, relay_port)
    frame = b"".join(wire.input_frame("trickle", 1, 0, np.ones((1, 64), np.float32)))
    sent = 0
    try:
        for byte in frame:  # a byte every 0.3 s: never idle, never a whole frame
            sock.sendall(bytes([byte]))
            sent += 1
            time.sleep(0.3)
    except (BrokenPipeError, ConnectionResetError):
        pass
    sock.settimeout(WAIT_S)
    assert _closed_by_node(sock)
    assert sent < len(frame)
    sock.close()


def test_a_peer_that_stops_reading_is_cut(mesh: LocalMesh, relay_port: int) -> None:
    """Inputs the node refuses (a width its shard does not take), each answered with a
    refusal this peer never reads: once the buffers are full the node's answer waits,
    and the connection is cut instead of holding its thread."""
    sock = _let_in(mesh, relay_port, rcvbuf=4096)
    refused = b"".join(wire.input_frame("s", 1, 0, np.ones((1, 3), np.float32)))
    burst = refused * 256
    deadline = time.monotonic() + WAIT_S
    cut = False
    while time.monotonic() < deadline and not cut:
        try:
            sock.sendall(burst)
        except (BrokenPipeError, ConnectionResetError):
            cut = True
        except TimeoutError:
            break  # neither side reads: the node did not cut it
    sock.close()
    assert cut
    _let_in(mesh, relay_port).close()


def test_an_abruptly_closed_connection_gives_back_its_slot(
    mesh: LocalMesh, relay_port: int
) -> None:
    for _ in range(2 * SLOTS):  # more than the slots: each went back at once
        sock = _let_in(mesh, relay_port)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()  # a reset, no goodbye
    _let_in(mesh, relay_port).close()


_HOLDER = """
import sys, threading, grpc
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc
address, metadata = sys.argv[1], tuple(tuple(p.split("=", 1)) for p in sys.argv[2:])
channel = grpc.insecure_channel(address)  # no keepalive of its own
hold = threading.Event()
def requests():
    hold.wait()
    yield from ()
call = pb_grpc.NodeStub(channel).Forward(requests(), metadata=metadata)
print("holding", flush=True)
hold.wait()
"""


def _forward_answer(mesh: LocalMesh) -> pb.ForwardResponse:
    """The first answer to a Forward stream that sends nothing."""
    with grpc.insecure_channel(address(mesh, "node-0")) as channel:
        stub = pb_grpc.NodeStub(channel)
        md = signed(mesh, "node-0", "Forward")
        return next(iter(stub.Forward(iter(()), metadata=md, timeout=10)))


@pytest.fixture
def frozen_holder(mesh: LocalMesh) -> Iterator[subprocess.Popen[str]]:
    md = [f"{k}={v}" for k, v in signed(mesh, "node-0", "Forward")]
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, address(mesh, "node-0"), *md],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
        yield proc
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_a_vanished_grpc_peer_gives_back_its_stream(
    mesh: LocalMesh, frozen_holder: subprocess.Popen[str]
) -> None:
    deadline = time.monotonic() + WAIT_S
    while _forward_answer(mesh).failure.kind != "overloaded":  # the holder's call is up
        assert time.monotonic() < deadline, "the holder never took the node's stream"
        time.sleep(0.1)
    frozen_holder.send_signal(signal.SIGSTOP)  # its pings go unanswered from now on
    while _forward_answer(mesh).failure.kind == "overloaded":
        assert time.monotonic() < deadline, "the frozen peer still holds the stream"
        time.sleep(0.2)
    answer = _forward_answer(mesh)
    assert answer.failure.kind == "malformed-bundle"  # let in: it just sent no Open
