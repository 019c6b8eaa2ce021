"""KV offered for fetching over the node's bulk TCP port, each behind a single-use ticket.

A node asked to ``StateOffer`` a session copies its KV and files it here under
a random ticket; the fetching node connects to the bulk port, sends the
ticket and reads the stream (``kv.bulk``). A ticket works once, for a minute;
a connection that sends no valid ticket is closed without a byte. A connection
that sends ``model_source.peers.MAGIC`` instead asks for shard bytes: it is handed to
the ``shards`` handler (``NodeModels.serve_peer``), which checks its peer token.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from meshnet.kv.bulk import send_stream
from meshnet.model_source.peers import MAGIC
from meshnet.protocol import meshnet_pb2 as pb

log = logging.getLogger(__name__)

TICKET_BYTES = 16
_TICKET_TIMEOUT_S = 5.0
_SEND_TIMEOUT_S = 60.0
_OFFER_TTL_S = 60.0
_MAX_OFFERS = 64
MAX_CONNECTIONS = 8  # fetches served at once; more are closed at once (a thread each)


@dataclass(frozen=True)
class _Offer:
    header: pb.KVHeader
    payload: memoryview
    expires: float


class KVOffers:
    """The bulk port's listener and the offers waiting on it."""

    def __init__(
        self,
        host: str,
        advertise_host: str,
        shards: Callable[[socket.socket], None] | None = None,
    ) -> None:
        self._shards = shards  # answers a peer's request for shard bytes (None: refused)
        self._listener = socket.create_server((host, 0))
        self.address = f"{advertise_host}:{self._listener.getsockname()[1]}"
        self._offers: dict[bytes, _Offer] = {}
        self._lock = threading.Lock()
        self._connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._thread = threading.Thread(target=self._accept, name="kv-bulk", daemon=True)
        self._thread.start()

    def offer(self, header: pb.KVHeader, payload: memoryview) -> bytes:
        """File a copy of a session's KV; the ticket that fetches it once."""
        ticket = secrets.token_bytes(TICKET_BYTES)
        now = time.monotonic()
        with self._lock:
            for key in [k for k, o in self._offers.items() if o.expires < now]:
                del self._offers[key]
            if len(self._offers) >= _MAX_OFFERS:  # the oldest unfetched one goes
                del self._offers[next(iter(self._offers))]
            self._offers[ticket] = _Offer(header, payload, now + _OFFER_TTL_S)
        return ticket

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._connections.acquire(blocking=False):
                conn.close()  # the fetcher reads a closed stream: source-missing, try later
                continue
            threading.Thread(target=self._serve_one, args=(conn,), daemon=True).start()

    def _serve_one(self, conn: socket.socket) -> None:
        try:
            self._serve(conn)
        finally:
            self._connections.release()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(_TICKET_TIMEOUT_S)
                ticket = _read_ticket(conn)
                if ticket == MAGIC:
                    if self._shards is not None:
                        conn.settimeout(_SEND_TIMEOUT_S)
                        self._shards(conn)
                    return
                with self._lock:
                    offer = self._offers.pop(ticket, None)
                if offer is None or offer.expires < time.monotonic():
                    return
                conn.settimeout(_SEND_TIMEOUT_S)
                send_stream(conn, offer.header, offer.payload)
            except OSError as e:
                log.info("bulk transfer ended early: %s", e)


def _read_ticket(conn: socket.socket) -> bytes:
    buf = b""
    while len(buf) < TICKET_BYTES:
        part = conn.recv(TICKET_BYTES - len(buf))
        if not part:
            break
        buf += part
    return buf
