"""The relay port: a raw TCP connection per previous hop, for a ring's inputs.

Over gRPC a relayed input costs its sender a thread hop and an answer to read,
and its receiver a thread hop and an answer to write: about half a millisecond
a hop, paid on every token. Here the sender writes each frame with one
``sendall`` from the thread that computed it, and the receiver's thread, blocked
in ``recv``, files it at once (a step waiting for it starts on that thread).
Nothing answers a filed input; only a refusal is answered, so a ring hop never
reads an answer it does not need. Frames are laid out in node/relay_wire.py.

- **Listener** (``RelayListener``): each connection first shows the same token a
  ``RelayStream`` call carries, checked the same way, and is told whether it was
  let in; at most ``max_connections`` at once (a thread each; one more is refused
  in its verdict, and its sender keeps to gRPC). A frame it cannot read closes only
  that connection, after a ``closing`` refusal saying why; an input it cannot
  file (checked as a ``RelayFrame``'s would be) is refused and changes nothing.
  No peer holds a connection (its slot, its thread) past a bound
  (``RelayTimeouts``): the hello and each frame, once begun, must arrive whole
  within ``frame_s``; a connection that sends nothing for ``idle_s`` is closed;
  a peer that does not take an answer within ``frame_s`` (it stopped reading)
  is cut; and TCP keepalive finds a peer that vanished without closing.
- **Link** (``SocketLink``): the sender's side of one connection. Whoever relays
  over it names what to call when an input of that (session, epoch) is refused
  or the connection breaks: the next hop's failure, as a refused or broken
  ``RelayStream`` is. A sender closes a link it has not used for
  ``SENDER_IDLE_S``, before the listener's idle cut could meet a send, and
  relays over the stream until a new link is let in.
- **Head link** (``HeadLink``): a connection whose hello asks for head parts
  instead; the listener answers each ask in order, on the connection's thread,
  through ``AnswerHead`` (its refusal answered, the connection kept).
"""

from __future__ import annotations

import contextlib
import logging
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from meshnet.errors import (
    MalformedBundle,
    MeshnetError,
    Overloaded,
    ShardMismatch,
    StreamReset,
    error_for_kind,
)
from meshnet.node import relay_wire as wire
from meshnet.node.relay_reads import Readable, Reads, buffered_reader, read_by, read_exactly
from meshnet.protocol.keepalive import Keepalive, tcp_keepalive

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # a connection that shows no token by then is closed
CONNECT_TIMEOUT_S = 2.0
SEND_TIMEOUT_S = 5.0  # a next hop that takes no bytes for this long is broken
SENDER_IDLE_S = 60.0  # a link unused this long is closed by its sender


@dataclass(frozen=True)
class RelayTimeouts:
    """How long the listener lets a peer hold a connection without progress."""

    idle_s: float = 300.0  # no frame begun for this long: closed (its sender reconnects)
    frame_s: float = 10.0  # a frame (or the hello), once begun, and each answer's send
    keepalive: Keepalive = field(default_factory=Keepalive)  # finds a vanished peer


# Checks a hello's token; raises the typed refusal.
CheckToken = Callable[[str], None]
# Files one input (session, epoch, step, array); the refusal, or None when filed.
FileInput = Callable[[str, int, int, np.ndarray], MeshnetError | None]
# Told of an input of its (session, epoch) that did not reach the next hop.
OnFailure = Callable[[MeshnetError], None]
# Multiplies an ask's rows by its head rows; raises the typed refusal.
AnswerHead = Callable[[wire.Ask, np.ndarray], np.ndarray]


class RelayListener:
    """The relay port: accepts previous hops and files what they send."""

    def __init__(
        self,
        host: str,
        port: int,
        check: CheckToken,
        file: FileInput,
        max_connections: int,
        head: AnswerHead | None = None,
        timeouts: RelayTimeouts | None = None,
    ) -> None:
        self.timeouts = timeouts or RelayTimeouts()
        self._listener = socket.create_server((host, port))
        self.port: int = self._listener.getsockname()[1]
        self._check = check
        self._file = file
        self._head = head
        self._slots = threading.BoundedSemaphore(max_connections)
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def close(self) -> None:
        """Stop listening and close every connection (their senders see them break)."""
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            conns, self._open = list(self._open), set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(
                target=self._serve_one, args=(conn,), name="relay-in", daemon=True
            ).start()

    def _serve_one(self, conn: socket.socket) -> None:
        with conn, buffered_reader(conn, 1 << 16) as reader:
            if not self._slots.acquire(blocking=False):
                self._refuse_hello(conn, Overloaded("this node holds its relay connections"))
                return
            with self._lock:
                self._open.add(conn)
            try:
                self._serve(conn, reader)
            except TimeoutError as e:
                log.info("a relay connection was cut: %s", e or "its peer made no progress")
            except (OSError, MeshnetError) as e:
                log.info("a relay connection ended: %s", e)
            finally:
                with self._lock:
                    self._open.discard(conn)
                self._slots.release()

    def _refuse_hello(self, conn: socket.socket, error: MeshnetError) -> None:
        with contextlib.suppress(OSError):
            conn.settimeout(HELLO_TIMEOUT_S)
            conn.sendall(wire.verdict(f"{error.kind}: {error.message}"))

    def _serve(self, conn: socket.socket, reader: Readable) -> None:
        hello_by = time.monotonic() + min(HELLO_TIMEOUT_S, self.timeouts.frame_s)
        magic, n = wire.read_hello(read_by(conn, reader, wire.HELLO.size, hello_by))
        token = read_by(conn, reader, n, hello_by).decode(errors="replace")
        try:
            self._check(token)
            if magic == wire.HEAD_MAGIC and self._head is None:
                raise ShardMismatch("this node answers no head parts")
        except MeshnetError as e:
            self._refuse_hello(conn, e)
            return
        conn.settimeout(self.timeouts.frame_s)
        conn.sendall(wire.verdict(None))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tcp_keepalive(conn, self.timeouts.keepalive)
        if magic == wire.HEAD_MAGIC:
            self._serve_head(conn, reader)
            return
        while (deadline := self._next_frame(conn, reader)) is not None:
            head = read_by(conn, reader, wire.INPUT_HEADER.size, deadline)
            self._take(conn, reader, head, deadline)

    def _next_frame(self, conn: socket.socket, reader: Readable) -> float | None:
        """Wait (up to ``idle_s``: a hop between runs sends nothing) for a frame to
        begin; the deadline for the whole of it, or None when the sender closed.
        ``TimeoutError`` when the connection stayed idle too long."""
        conn.settimeout(self.timeouts.idle_s)
        try:
            begun = reader.peek(1)
        except TimeoutError:
            raise TimeoutError(f"idle for {self.timeouts.idle_s:.0f}s") from None
        if not begun:
            return None
        return time.monotonic() + self.timeouts.frame_s

    def _send(self, conn: socket.socket, data: bytes) -> None:
        """An answer the peer must take within ``frame_s`` (``TimeoutError`` if not)."""
        conn.settimeout(self.timeouts.frame_s)
        conn.sendall(data)

    def _take(self, conn: socket.socket, reader: Readable, head: bytes, deadline: float) -> None:
        """Read one input and file it, answering only a refusal; a frame that breaks
        the format is answered ``closing`` and ends the connection."""
        try:
            h = wire.read_input_header(head)
            # One read: both come at once.
            rest = read_by(conn, reader, h.session_bytes + h.data_bytes, deadline)
            session_id = rest[: h.session_bytes].decode()
            data = memoryview(rest)[h.session_bytes :]
        except (MalformedBundle, UnicodeDecodeError) as e:
            error = e if isinstance(e, MalformedBundle) else MalformedBundle("a bad session id")
            self._send(conn, wire.refusal(True, "", 0, 0, error.kind, error.message))
            raise error from None
        refused = self._file(session_id, h.epoch, h.step, wire.as_array(h, data))
        if refused is not None:
            self._send(
                conn,
                wire.refusal(False, session_id, h.epoch, h.step, refused.kind, refused.message),
            )

    def _serve_head(self, conn: socket.socket, reader: Readable) -> None:
        """Answer each ask in order; a frame that breaks the format ends the connection
        (its sender sees it close)."""
        assert self._head is not None
        while (deadline := self._next_frame(conn, reader)) is not None:
            ask = wire.read_ask(read_by(conn, reader, wire.ASK_HEADER.size, deadline))
            x = np.frombuffer(read_by(conn, reader, wire.ask_bytes(ask), deadline), "<f4")
            try:
                parts = wire.part_frame(ask.number, self._head(ask, x.reshape(ask.rows, -1)))
            except MeshnetError as e:
                parts = wire.part_frame(ask.number, None, f"{e.kind}: {e.message}")
            self._send(conn, b"".join(parts))


class SocketLink:
    """The sending side of one connection to a next hop's relay port; thread-safe."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.address = address
        self.broken: MeshnetError | None = None
        self._sock = sock
        self._watchers: dict[tuple[str, int], OnFailure] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._used = time.monotonic()  # when an input was last sent
        tcp_keepalive(sock, Keepalive())
        threading.Thread(target=self._read, name="relay-out", daemon=True).start()

    @classmethod
    def connect(cls, host: str, port: int, token: str, address: str) -> SocketLink:
        """Connect and show ``token``; ``MeshnetError`` (typed, the receiver's reason)
        or ``OSError`` when the connection is not let in."""
        return cls(_let_in(host, port, token, address, wire.HELLO_MAGIC), address)

    def send(
        self, session_id: str, epoch: int, step: int, x: np.ndarray, on_failure: OnFailure
    ) -> None:
        """Relay one input; ``on_failure`` is told (on another thread, or on this one
        when the connection breaks now) if an input of its (session, epoch) is refused
        or the connection breaks before the run ``forget``s it."""
        frame = b"".join(wire.input_frame(session_id, epoch, step, x))
        with self._lock:
            broken = self.broken
            if broken is None:
                self._watchers[(session_id, epoch)] = on_failure
        if broken is not None:
            on_failure(broken)
            return
        self._used = time.monotonic()
        try:
            with self._send_lock:
                self._sock.sendall(frame)
        except OSError as e:
            self._break(StreamReset(f"the relay connection to {self.address} broke: {e}"))

    def forget(self, session_id: str, epoch: int) -> None:
        """The run of (session, epoch) is over: tell it nothing more."""
        with self._lock:
            self._watchers.pop((session_id, epoch), None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def idle_s(self) -> float:
        """Seconds since an input was last sent over it."""
        return time.monotonic() - self._used

    def retire(self) -> None:
        """Close a link no run uses (idle): nobody is told of its end."""
        with self._lock:
            self._watchers.clear()
            if self.broken is None:
                self.broken = StreamReset(f"the relay link to {self.address} was idle")
        self.close()

    def _read(self) -> None:
        error: MeshnetError = StreamReset(f"the relay connection to {self.address} ended")
        try:
            with buffered_reader(self._sock, 1 << 12) as reader:
                error = self._refusals(reader, error)
        except (OSError, MeshnetError) as e:
            error = StreamReset(f"the relay connection to {self.address} broke: {e}")
        self._break(error)
        with contextlib.suppress(OSError):
            self._sock.close()

    def _refusals(self, reader: Reads, error: MeshnetError) -> MeshnetError:
        """Tell each refusal to its run until the connection ends; the failure that
        ended it."""
        while True:
            head = reader.read(wire.REFUSAL_HEADER.size)
            if head is None or len(head) != wire.REFUSAL_HEADER.size:
                return error
            fields = wire.read_refusal_header(head)
            refusal = wire.read_refusal(fields, read_exactly(reader, sum(fields[1:4])))
            failure = error_for_kind(refusal.kind, f"{self.address}: {refusal.message}")
            if refusal.closing:
                return failure
            with self._lock:
                watcher = self._watchers.get((refusal.session_id, refusal.epoch))
            if watcher is not None:
                watcher(failure)

    def _break(self, error: MeshnetError) -> None:
        with self._lock:
            if self.broken is not None:
                return
            self.broken = error
            watchers, self._watchers = list(self._watchers.values()), {}
        for watcher in watchers:
            watcher(error)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)


class HeadLink:
    """The asking side of one head-parts connection: one ask at a time, answered in
    order. Not thread-safe: its user holds it while an ask is out."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.address = address
        self._sock = sock
        self._number = 0

    @classmethod
    def connect(cls, host: str, port: int, token: str, address: str) -> HeadLink:
        """As ``SocketLink.connect``, for head parts."""
        return cls(_let_in(host, port, token, address, wire.HEAD_MAGIC), address)

    def ask(self, x: np.ndarray, stop: int, fingerprint: str, backend: str) -> wire.Ask:
        """Send an ask for ``x`` times the head's rows ``[0, stop)``; ``OSError`` when
        the connection broke."""
        self._number += 1
        frame = wire.ask_frame(self._number, x, stop, fingerprint, backend)
        self._sock.settimeout(SEND_TIMEOUT_S)  # not the last answer's wait
        self._sock.sendall(frame)
        return wire.read_ask(frame[: wire.ASK_HEADER.size])

    def part(self, ask: wire.Ask, timeout_s: float) -> np.ndarray:
        """The logits [rows, stop] answering ``ask``. ``TimeoutError`` when they do not
        come within ``timeout_s`` (the link is then out of step: close it), the typed
        refusal, ``MalformedBundle`` or ``OSError`` when the connection broke."""
        self._sock.settimeout(timeout_s)
        refused, n = wire.read_part(self._exactly(wire.PART_HEADER.size), ask)
        data = self._exactly(n)
        if refused:
            kind, _, message = bytes(data).decode(errors="replace").partition(": ")
            raise error_for_kind(kind, f"{self.address} head parts: {message}")
        return np.frombuffer(data, "<f4").reshape(ask.rows, ask.stop)

    def ready(self) -> bool:
        """Whether an answer's first bytes have come (reading would not wait)."""
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
        except (OSError, ValueError):
            return True  # a closed socket: reading fails at once
        return bool(readable)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def _exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        view, got = memoryview(buf), 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if k == 0:
                raise MalformedBundle(f"{self.address} closed the head connection")
            got += k
        return buf


def _let_in(host: str, port: int, token: str, address: str, magic: bytes) -> socket.socket:
    """A connection to a relay port that has shown ``token`` and been let in."""
    sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(wire.hello(token, magic))
        with sock.makefile("rb", buffering=0) as reader:  # reads no byte past the verdict
            status, n = wire.VERDICT.unpack(read_exactly(reader, wire.VERDICT.size))
            reason = read_exactly(reader, min(n, wire.MAX_MESSAGE_BYTES)).decode(errors="replace")
        if status != 0:
            kind, _, message = reason.partition(": ")
            raise error_for_kind(kind, f"{address} relay port: {message}")
        sock.settimeout(None)  # the reader blocks; a send gives up after SEND_TIMEOUT_S
        with contextlib.suppress(OSError):  # a struct timeval, as Linux lays it out
            timeval = struct.pack("ll", int(SEND_TIMEOUT_S), 0)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    except BaseException:
        sock.close()
        raise
    return sock
