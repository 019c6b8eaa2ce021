"""Delayed links between this host and network namespaces, with ``tc netem``.

The layout: one Linux bridge in the host namespace holding the host's address
(where the trackers listen), and one namespace per node, joined to the bridge
by a veth pair. ``netem`` sits on two kinds of egress, so that every message
between any two mesh processes leaves through exactly one delayed queue:

- the namespace end of each veth: everything a node sends (to another node, or
  to the tracker) is delayed once; the bridge forwards node-to-node frames
  port to port without another queue;
- the bridge device itself: what the host's processes (the trackers) send to
  the nodes is delayed once. Frames the bridge forwards between ports do not
  pass the bridge device's own queue.

So each one-way link carries the delay once, whichever pair talks. The client
talks to the trackers over the host's own stack, undelayed. Needs root and a
kernel with ``sch_netem``; ``unavailable()`` says why not, before anything is
made. ``close()`` removes every link, bridge and namespace it made.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from dataclasses import dataclass, field


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


def _tc(namespace: str | None, *args: str) -> None:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    subprocess.run([*prefix, "tc", *args], check=True, capture_output=True, timeout=10)


def unavailable() -> str | None:
    """Why namespaces with netem cannot be made here; None when they can."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    probe = f"mnq{os.getpid() % 100000}"
    try:
        _ip("link", "add", probe, "type", "veth", "peer", "name", f"{probe}p")
    except FileNotFoundError:
        return "the ip command is missing (iproute2)"
    except subprocess.CalledProcessError as e:
        return f"cannot make a veth pair: {e.stderr.decode(errors='replace').strip()}"
    try:
        _tc(None, "qdisc", "add", "dev", probe, "root", "netem", "delay", "1ms")
    except FileNotFoundError:
        return "the tc command is missing (iproute2)"
    except subprocess.CalledProcessError as e:
        reason = e.stderr.decode(errors="replace").strip()
        return f"tc netem is not available in this kernel ({reason})"
    finally:
        subprocess.run(["ip", "link", "del", probe], capture_output=True, timeout=10)
    return None


@dataclass
class NetemLinks:
    """``count`` namespaces behind delayed links; ``open()`` makes them."""

    count: int
    tag: str = field(default_factory=lambda: f"mnd{os.getpid() % 100000}")
    subnet: str = field(default_factory=lambda: f"10.232.{100 + os.getpid() % 150}")
    made: list[tuple[str, str]] = field(default_factory=list)  # (kind, name) to remove

    @property
    def bridge(self) -> str:
        return f"{self.tag}b"

    @property
    def host_ip(self) -> str:
        """The host's address on the bridge: trackers listen here."""
        return f"{self.subnet}.1"

    def namespace(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def node_ip(self, i: int) -> str:
        return f"{self.subnet}.{10 + i}"

    def _veth(self, i: int) -> tuple[str, str]:
        return f"{self.tag}h{i}", f"{self.tag}v{i}"  # host end, namespace end

    def open(self) -> None:
        """Make the bridge, the namespaces and their links (no delay yet); on failure
        whatever was made is removed."""
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self.made.append(("link", self.bridge))
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            _tc(None, "qdisc", "add", "dev", self.bridge, "root", "netem", "delay", "0ms")
            for i in range(self.count):
                self._join(i)
        except BaseException:
            self.close()
            raise

    def _join(self, i: int) -> None:
        ns, (host_end, ns_end) = self.namespace(i), self._veth(i)
        _ip("netns", "add", ns)
        self.made.append(("netns", ns))
        _ip("link", "add", host_end, "type", "veth", "peer", "name", ns_end)
        self.made.append(("link", host_end))
        _ip("link", "set", ns_end, "netns", ns)
        _ip("link", "set", host_end, "master", self.bridge)
        _ip("link", "set", host_end, "up")
        inside = ["netns", "exec", ns, "ip"]
        _ip(*inside, "addr", "add", f"{self.node_ip(i)}/24", "dev", ns_end)
        _ip(*inside, "link", "set", ns_end, "up")
        _ip(*inside, "link", "set", "lo", "up")
        _tc(ns, "qdisc", "add", "dev", ns_end, "root", "netem", "delay", "0ms")

    def set_delay(self, delay_ms: float) -> None:
        """Every one-way link's added delay from now on (``0``: none)."""
        delay = f"{delay_ms:g}ms"
        _tc(None, "qdisc", "change", "dev", self.bridge, "root", "netem", "delay", delay)
        for i in range(self.count):
            _tc(
                self.namespace(i),
                "qdisc",
                "change",
                "dev",
                self._veth(i)[1],
                "root",
                "netem",
                "delay",
                delay,
            )

    def prefix(self, i: int) -> list[str]:
        """The command prefix that runs a process in namespace ``i``."""
        return ["ip", "netns", "exec", self.namespace(i)]

    def close(self) -> None:
        """Remove every link, bridge and namespace made, newest first (idempotent)."""
        while self.made:
            kind, name = self.made.pop()
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                subprocess.run(["ip", kind, "del", name], capture_output=True, timeout=10)
