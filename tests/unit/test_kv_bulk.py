"""The KV stream over a raw TCP connection: the same verification as the gRPC frames."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest

from meshnet.errors import KVImportFailed
from meshnet.kv.bulk import recv_stream, send_stream
from meshnet.kv.transfer import KVShape, check_header
from meshnet.protocol import meshnet_pb2 as pb

SHAPE = KVShape(
    "f" * 64, 0, 2, n_kv_heads=2, head_dim=16, dtype="float32", itemsize=4, max_tokens=4096
)
TOKENS = 1000
CHUNK = 64 << 10


def _header(**changes: object) -> pb.KVHeader:
    h = pb.KVHeader(
        fingerprint=SHAPE.fingerprint,
        layer_start=0,
        layer_end=2,
        session_id="s",
        epoch=3,
        tokens=TOKENS,
        steps=7,
        dtype="float32",
        n_kv_heads=2,
        head_dim=16,
    )
    for name, value in changes.items():
        setattr(h, name, value)
    return h


def _payload() -> memoryview:
    data = np.random.default_rng(0).standard_normal(SHAPE.payload_bytes(TOKENS) // 4)
    return memoryview(data.astype(np.float32).tobytes())


def _wire(header: pb.KVHeader, payload: memoryview) -> bytes:
    """Everything send_stream writes, captured."""
    a, b = socket.socketpair()
    out = bytearray()

    def drain() -> None:
        while part := b.recv(1 << 20):
            out.extend(part)

    reader = threading.Thread(target=drain)
    reader.start()
    send_stream(a, header, payload, CHUNK)
    a.close()
    reader.join()
    b.close()
    return bytes(out)


def _receive(wire: bytes, hold_open: bool = False, deadline_s: float = 10) -> bytearray:
    a, b = socket.socketpair()
    threading.Thread(target=_send_quietly, args=(a, wire)).start()
    if not hold_open:
        threading.Timer(0.2, a.close).start()
    try:
        _, payload = recv_stream(
            b, lambda h: check_header(h, SHAPE, None), time.monotonic() + deadline_s
        )
    finally:
        b.close()
        if hold_open:
            a.close()
    return payload


def _send_quietly(sock: socket.socket, wire: bytes) -> None:
    """The receiver may hang up first, having refused the stream."""
    with contextlib.suppress(OSError):
        sock.sendall(wire)


def test_a_stream_arrives_whole_and_verified() -> None:
    payload = _payload()
    assert _receive(_wire(_header(), payload)) == bytes(payload)


def _flip(offset_from_end: int) -> Callable[[bytes], bytes]:
    def corrupt(wire: bytes) -> bytes:
        data = bytearray(wire)
        data[len(data) - offset_from_end] ^= 1
        return bytes(data)

    return corrupt


def _inflate_chunk_length(wire: bytes) -> bytes:
    data = bytearray(wire)
    (header_len,) = struct.unpack_from(">I", data, 4)
    struct.pack_into(">I", data, 8 + header_len + 4, 1 << 30)
    return bytes(data)


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (_flip(1000), "chunk-hash"),  # a bit inside the last chunk's data
        (_flip(1), "root-hash"),
        (lambda w: w[: len(w) // 2], "truncated"),
        (lambda w: b"XKV1" + w[4:], "version"),
        (_inflate_chunk_length, "short-chunk"),
    ],
)
def test_a_corrupt_stream_is_refused_with_its_reason(
    corrupt: Callable[[bytes], bytes], reason: str
) -> None:
    wire = corrupt(_wire(_header(), _payload()))
    with pytest.raises(KVImportFailed) as e:
        _receive(wire)
    assert e.value.reason == reason


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"fingerprint": "0" * 64}, "wrong-model"),
        ({"layer_end": 3}, "wrong-layers"),
        ({"tokens": 10**9}, "size-limit"),
    ],
)
def test_a_header_is_checked_before_anything_is_allocated(
    changes: dict[str, object], reason: str
) -> None:
    wire = _wire(_header(**changes), memoryview(b"\0" * 64))
    with pytest.raises(KVImportFailed) as e:
        _receive(wire)
    assert e.value.reason == reason


def test_a_stalled_sender_is_cut_off_by_the_deadline() -> None:
    wire = _wire(_header(), _payload())
    with pytest.raises(KVImportFailed) as e:
        _receive(wire[: len(wire) // 2], hold_open=True, deadline_s=0.5)
    assert e.value.reason == "deadline"


def test_a_sender_that_stalls_after_its_header_costs_no_payload_memory() -> None:
    """A header for the largest KV the shard holds, then nothing: the receiver gives up at
    its deadline having allocated nothing like the header's size."""
    tokens = SHAPE.max_tokens
    wire = _wire(
        _header(tokens=tokens, steps=tokens), memoryview(bytes(SHAPE.payload_bytes(tokens)))
    )
    (header_len,) = struct.unpack_from(">I", wire, 4)
    tracemalloc.start()
    try:
        with pytest.raises(KVImportFailed) as e:
            _receive(wire[: 8 + header_len], hold_open=True, deadline_s=0.5)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert e.value.reason == "deadline"
    assert peak < SHAPE.payload_bytes(tokens) // 8, peak
