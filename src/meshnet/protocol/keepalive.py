"""Keepalives: how a dead or half-open peer is found out on a link that carries nothing.

A peer that vanishes without closing its connections (its host lost, its network
cut, its process frozen) leaves each of them open at this end for as long as the
operating system keeps an idle TCP connection, which is forever: every stream,
slot and thread it held stays held. Both ends of every long-lived link therefore
probe: gRPC servers and clients send HTTP/2 pings (``Keepalive.server_options``,
``CLIENT_OPTIONS``) and close a connection whose ping goes unanswered, failing
its calls (a node frees their streams), and raw TCP links (the relay port) turn
on TCP keepalive (``tcp_keepalive``).
"""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass

# A client pings an idle connection every 30 s and gives it 10 s to answer; a
# server (below) allows pings this often.
CLIENT_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),  # what gRPC core waits for an answer (else 60 s)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass(frozen=True)
class Keepalive:
    """A server's (or a raw link's) probing of its peers."""

    interval_s: float = 20.0  # a probe after this long without one
    timeout_s: float = 10.0  # a probe unanswered this long: the peer is gone

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.timeout_s <= 0:
            raise ValueError(f"keepalive needs positive times, not {self}")

    @property
    def bound_s(self) -> float:
        """At most how long a vanished peer's connection stays open."""
        return self.interval_s + self.timeout_s

    def server_options(self) -> list[tuple[str, int]]:
        """gRPC server options: ping each connection, idle or not, and take clients'
        pings as often as ``CLIENT_OPTIONS`` sends them."""
        return [
            ("grpc.keepalive_time_ms", int(self.interval_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
            ("grpc.http2.ping_timeout_ms", int(self.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
            ("grpc.http2.min_ping_interval_without_data_ms", int(self.interval_s * 1000)),
        ]


def tcp_keepalive(sock: socket.socket, keepalive: Keepalive) -> None:
    """Have the kernel probe ``sock``'s peer after ``interval_s`` of silence, then
    every second, and fail the connection once ``timeout_s`` of probes go unanswered
    (where the platform lets them be set; Linux does)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    probes = max(1, int(keepalive.timeout_s))
    for name, value in (
        ("TCP_KEEPIDLE", max(1, int(keepalive.interval_s))),
        ("TCP_KEEPINTVL", 1),
        ("TCP_KEEPCNT", probes),
        ("TCP_USER_TIMEOUT", int(keepalive.bound_s * 1000)),
    ):
        option = getattr(socket, name, None)
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
