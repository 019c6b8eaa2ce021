"""Ports for test servers come from below the kernel's ephemeral range, so no outgoing
connection (nor a node connecting to itself) can take one before its server binds it."""

from __future__ import annotations

import socket
from pathlib import Path

from meshnet.local_mesh import ephemeral_ports, free_port, free_ports


def test_ports_lie_below_the_ephemeral_range_and_are_distinct() -> None:
    ephemeral = ephemeral_ports()
    ports = free_ports(20)
    assert len(set(ports)) == 20
    assert all(1024 <= p < ephemeral.start for p in ports)
    assert free_port() < ephemeral.start


def test_a_port_in_use_is_never_handed_out() -> None:
    ephemeral = range(10_100, 60_000)  # leaves exactly 10000..10099 below it
    held = []
    try:
        for port in range(10_000, 10_100, 2):  # hold every other port of the pool
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
                s.listen()
            except OSError:
                s.close()
                continue
            held.append(s)
        busy = {s.getsockname()[1] for s in held}
        ports = free_ports(10, ephemeral)
        assert not busy & set(ports)
        assert all(10_000 <= p < 10_100 for p in ports)
    finally:
        for s in held:
            s.close()


def test_the_range_is_read_from_the_kernel_setting(tmp_path: Path) -> None:
    setting = tmp_path / "ip_local_port_range"
    setting.write_text("40000\t50000\n")
    assert ephemeral_ports(setting) == range(40_000, 50_001)
    assert ephemeral_ports(tmp_path / "absent") == range(32_768, 61_000)
