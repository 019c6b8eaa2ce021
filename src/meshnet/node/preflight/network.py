"""Addresses: the listen address can be bound, and the advertised one leads to it."""

from __future__ import annotations

import ipaddress
import socket
from typing import TYPE_CHECKING

import httpx

from meshnet.node.preflight.result import Check, Scope, fail, ok, skip

if TYPE_CHECKING:
    from meshnet.node.node_config import NodeConfig

_WILDCARDS = frozenset({"", "0.0.0.0", "::"})


def check_addresses(cfg: NodeConfig, timeout_s: float) -> list[Check]:
    """The listen address can be bound, and the advertised one leads to it from this host."""
    try:
        host, port = split_host_port(cfg.listen)
        probe = bind_listen(host, port)
    except (OSError, ValueError) as e:
        fix = "--listen HOST:PORT: an address of this host and a free port (0: any)"
        return [fail("listen", f"cannot listen on {cfg.listen}: {e}", fix), _no_advertise()]
    with probe:
        bound = int(probe.getsockname()[1])
        detail = f"{cfg.listen} can be bound" + (f" (e.g. port {bound})" if port == 0 else "")
        return [ok("listen", detail), check_advertise(probe, cfg, host, bound, timeout_s)]


def _no_advertise() -> Check:
    return skip("advertise", "nothing listens to reach")


def check_advertise(
    probe: socket.socket, cfg: NodeConfig, listen_host: str, bound: int, timeout_s: float
) -> Check:
    """The address the tracker will be told to dial: not a wildcard, not loopback for a
    tracker on another host, and one that, dialled from here, reaches ``probe``."""
    host = cfg.advertise_host or listen_host
    where = f"{host}:{cfg.advertise_port or bound}"
    fix = "--advertise-host HOST (and --advertise-port) the tracker can dial"
    if host in _WILDCARDS:
        return fail("advertise", f"the tracker would be told to dial {where}", fix)
    tracker_host = httpx.URL(cfg.tracker_url).host
    if is_loopback(host) and not on_this_host(tracker_host):
        detail = f"{where} is loopback, and the tracker ({tracker_host}) is on another host"
        return fail("advertise", detail, fix)
    try:
        reached = reaches(probe, host, cfg.advertise_port or bound, timeout_s)
    except OSError as e:
        detail = f"cannot connect to {where} from this host: {e}"
        return fail("advertise", detail, f"{fix}; open the firewall or the forward", Scope.PEER)
    if not reached:
        detail = f"{where} answers but does not lead to --listen {cfg.listen}"
        return fail("advertise", detail, "point the forward at --listen", Scope.PEER)
    return ok("advertise", f"{where} reaches this node from this host", Scope.PEER)


def split_host_port(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT``) -> host, port; ``ValueError`` on anything else."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def bind_listen(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port`` (as the gRPC server would bind it); the caller
    closes it."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    s = socket.socket(family, kind, proto)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT port is free
        s.bind(addr)
        s.listen(4)
    except OSError:
        s.close()
        raise
    return s


def reaches(probe: socket.socket, host: str, port: int, timeout_s: float) -> bool:
    """Whether a connection to ``host:port`` arrives on ``probe`` (directly or forwarded);
    ``OSError`` when nothing answers there."""
    with socket.create_connection((host, port), timeout=timeout_s):
        probe.settimeout(timeout_s)
        try:
            conn, _ = probe.accept()
        except TimeoutError:
            return False
        conn.close()
        return True


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        return all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)
    except (OSError, ValueError):
        return False


def on_this_host(host: str) -> bool:
    """Whether ``host`` is an address of this host: loopback, or one a socket can bind."""
    if is_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except OSError:
        return False
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            try:
                s.bind(addr)
                return True
            except OSError:
                continue
    return False
