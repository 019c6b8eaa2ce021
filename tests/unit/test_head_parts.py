"""Head parts over the relay port (a ring's last hop asking its first to multiply part
of a tied head): asks and answers laid out and checked before anything is allocated;
only a shown token lets a head connection in, and only where the node answers head
parts; a refusal is answered and keeps the connection; a frame that breaks the format
closes it."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import numpy as np
import pytest

from meshnet.errors import MalformedBundle, ShardMismatch, Unauthenticated
from meshnet.node import relay_wire as wire
from meshnet.node.relay_socket import HeadLink, RelayListener

TOKEN = "p1.good-token"
SHA = "ab" * 32
HEAD = np.arange(64 * 8, dtype=np.float32).reshape(64, 8) / 100  # [vocab, d]


def _answer(ask: wire.Ask, x: np.ndarray) -> np.ndarray:
    if ask.fingerprint != SHA or ask.backend != "q8":
        raise ShardMismatch("this node serves another model file or backend")
    return x @ HEAD[: ask.stop].T


def _check(token: str) -> None:
    if token != TOKEN:
        raise Unauthenticated("the peer token does not check out")


def _refuse_input(*_: object) -> None:
    raise AssertionError("no input is relayed in these tests")


@pytest.fixture
def port() -> Iterator[RelayListener]:
    listener = RelayListener("127.0.0.1", 0, _check, _refuse_input, 2, head=_answer)  # type: ignore[arg-type]
    yield listener
    listener.close()


def _x(rows: int = 1) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)


def test_an_ask_and_its_part_round_trip_through_the_wire() -> None:
    x = _x(2)
    frame = wire.ask_frame(7, x, 48, SHA, "q8")
    ask = wire.read_ask(frame[: wire.ASK_HEADER.size])
    assert ask == wire.Ask(7, 2, 8, 48, SHA, "q8")
    assert frame[wire.ASK_HEADER.size :] == x.tobytes()
    logits = x @ HEAD[:48].T
    part = b"".join(wire.part_frame(7, logits))
    refused, n = wire.read_part(part[: wire.PART_HEADER.size], ask)
    assert (refused, n) == (False, logits.nbytes)
    assert part[wire.PART_HEADER.size :] == logits.tobytes()


@pytest.mark.parametrize(
    "fields, why",
    [
        ((wire.INPUT, 1, 1, 8, 16), "kind"),
        ((wire.ASK, 1, 0, 8, 16), "rows"),
        ((wire.ASK, 1, wire.MAX_ASK_ROWS + 1, 8, 16), "rows"),
        ((wire.ASK, 1, 1, 0, 16), "width"),
        ((wire.ASK, 1, 1, 8, 0), "stop"),
        ((wire.ASK, 1, 1, 8, wire.MAX_HEAD_ROWS + 1), "stop"),
        ((wire.ASK, 1, 16, 8, wire.MAX_HEAD_ROWS), "stop"),  # its answer would pass the limit
    ],
)
def test_an_ask_past_its_limits_is_refused_before_its_rows_are_read(
    fields: tuple[int, ...], why: str
) -> None:
    raw = wire.ASK_HEADER.pack(*fields, bytes(32), b"q8")
    with pytest.raises(MalformedBundle):
        wire.read_ask(raw)


def test_a_part_of_another_ask_or_shape_is_refused() -> None:
    ask = wire.Ask(3, 1, 8, 32, SHA, "q8")
    with pytest.raises(MalformedBundle):  # another ask's number
        wire.read_part(wire.PART_HEADER.pack(wire.PART, 2, 0, 1, 32, 0), ask)
    with pytest.raises(MalformedBundle):  # another shape
        wire.read_part(wire.PART_HEADER.pack(wire.PART, 3, 0, 1, 48, 0), ask)
    with pytest.raises(MalformedBundle):  # a refusal past its limit
        wire.read_part(wire.PART_HEADER.pack(wire.PART, 3, 1, 0, 0, 5000), ask)


def test_a_head_link_gets_the_peers_part_and_keeps_the_connection_after_a_refusal(
    port: RelayListener,
) -> None:
    link = HeadLink.connect("127.0.0.1", port.port, TOKEN, "peer")
    try:
        x = _x()
        ask = link.ask(x, 32, SHA, "q8")
        np.testing.assert_array_equal(link.part(ask, timeout_s=5), x @ HEAD[:32].T)
        refused = link.ask(x, 32, SHA, "fast")  # another backend: not this node's logits
        with pytest.raises(ShardMismatch):
            link.part(refused, timeout_s=5)
        ask = link.ask(x, 64, SHA, "q8")  # the same connection answers on
        np.testing.assert_array_equal(link.part(ask, timeout_s=5), x @ HEAD.T)
    finally:
        link.close()


def test_a_head_connection_needs_the_token_and_a_node_that_answers_head_parts(
    port: RelayListener,
) -> None:
    with pytest.raises(Unauthenticated):
        HeadLink.connect("127.0.0.1", port.port, "p1.forged", "peer")
    silent = RelayListener("127.0.0.1", 0, _check, _refuse_input, 2)  # type: ignore[arg-type]
    try:
        with pytest.raises(ShardMismatch):
            HeadLink.connect("127.0.0.1", silent.port, TOKEN, "peer")
    finally:
        silent.close()


def test_an_ask_that_breaks_the_format_closes_only_its_connection(port: RelayListener) -> None:
    with socket.create_connection(("127.0.0.1", port.port), timeout=5) as sock:
        sock.sendall(wire.hello(TOKEN, wire.HEAD_MAGIC))
        status, _ = struct.unpack("<BH", sock.recv(3))
        assert status == 0
        sock.sendall(wire.ASK_HEADER.pack(wire.ASK, 1, 0, 8, 16, bytes(32), b"q8"))  # 0 rows
        assert sock.recv(1) == b""  # closed, nothing answered
    link = HeadLink.connect("127.0.0.1", port.port, TOKEN, "peer")  # others are let in
    try:
        ask = link.ask(_x(), 16, SHA, "q8")
        np.testing.assert_array_equal(link.part(ask, timeout_s=5), _x() @ HEAD[:16].T)
    finally:
        link.close()
