"""Reading a relay connection (node/relay_socket.py): exactly so many bytes, and by a
deadline however the peer spaces them, so a trickling peer cannot hold a connection."""

from __future__ import annotations

import io
import socket
import time
from typing import Protocol

from meshnet.errors import MalformedBundle


class Reads(Protocol):
    """What ``socket.makefile("rb")`` gives, buffered or not."""

    def read(self, n: int, /) -> bytes | None: ...


class Readable(Reads, Protocol):
    """What a buffered ``socket.makefile("rb")`` gives (``buffered_reader``)."""

    def read1(self, n: int, /) -> bytes: ...

    def peek(self, n: int, /) -> bytes: ...


def buffered_reader(conn: socket.socket, size: int) -> io.BufferedReader:
    """``conn.makefile("rb", buffering=size)``, typed as what it is for any ``size`` > 0."""
    reader = conn.makefile("rb", buffering=size)
    assert isinstance(reader, io.BufferedReader)  # typeshed: an IOBase unless size is 1
    return reader


def read_by(conn: socket.socket, reader: Readable, n: int, deadline: float) -> bytes:
    """Exactly ``n`` bytes by ``deadline`` (monotonic), however the peer spaces them:
    ``TimeoutError`` when they do not all come in time, ``MalformedBundle`` when the
    stream ends before."""
    parts, got = [], 0
    while got < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"a frame not whole within its deadline ({got} of {n} bytes)")
        conn.settimeout(left)
        if not reader.peek(1):  # one read of what has come (as much as the buffer takes)
            raise MalformedBundle("a relay connection ended mid-frame")
        part = reader.read1(n - got)
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def read_exactly(reader: Reads, n: int) -> bytes:
    """Exactly ``n`` bytes; ``MalformedBundle`` when the stream ends before."""
    data = b""
    while len(data) < n:
        part = reader.read(n - len(data))
        if not part:
            raise MalformedBundle("a relay connection ended mid-frame")
        data += part
    return data
