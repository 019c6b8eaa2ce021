"""A whole mesh on this machine: the tracker and N nodes as separate processes on loopback.

Used by ``meshnet up`` and by the end-to-end tests. Every process it starts is
its child, logs to ``DATA_DIR/logs``, runs with one BLAS thread, and is asked
to die with its parent (Linux ``PR_SET_PDEATHSIG``), so nothing outlives
``stop()`` or a killed launcher. Each node gets a number of kernel threads
(its ``--threads``, and ``NUMBA_NUM_THREADS`` as the cap of its pool): one by
default, since the tests run several processes on a few cores; ``meshnet up``
gives each node its share of the cores (``split_threads``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from meshnet.auth.credentials import NODE_KEY_ENV, ensure_user_credentials
from meshnet.auth.keys import ensure_mesh_secret, node_key
from meshnet.errors import MeshnetError
from meshnet.layer_range import LayerRange, split_evenly

_PR_SET_PDEATHSIG = 1


def parse_layout(text: str) -> list[LayerRange | None]:
    """``"0:10,10:20,empty"`` -> ranges, ``None`` for an empty node."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise MeshnetError("the layout is empty")
    return [None if p == "empty" else LayerRange.parse(p) for p in parts]


def even_layout(n_layers: int, nodes: int) -> list[LayerRange | None]:
    return list(split_evenly(n_layers, nodes))


def split_threads(cores: int, nodes: int) -> list[int]:
    """``cores`` kernel threads shared among ``nodes`` nodes, at least one each.

    The first ``cores % nodes`` nodes take one more than the rest; with fewer
    cores than nodes every node still gets one (they share the cores).
    """
    if nodes < 1:
        return []
    share, extra = divmod(max(cores, 1), nodes)
    return [max(1, share + (i < extra)) for i in range(nodes)]


# Where the kernel picks the local ports of outgoing connections, when it cannot say.
_EPHEMERAL_DEFAULT = (32768, 60999)
_LOWEST_PORT = 10000


def ephemeral_ports(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> range:
    """The ports the kernel hands to outgoing connections (Linux's default elsewhere)."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        low, high = _EPHEMERAL_DEFAULT
    return range(low, high + 1)


def free_ports(count: int, ephemeral: range | None = None) -> list[int]:
    """``count`` distinct ports free now on 127.0.0.1, for servers started next.

    They lie below the kernel's ephemeral range. A port taken from that range (what
    binding port 0 returns) can be handed to an outgoing connection before our server
    binds it, and a node retrying its connection to a tracker still starting can even
    connect to itself on it (TCP's simultaneous open): the tracker then finds its
    port in use. Outside the range only a listening server can hold a port.
    """
    ephemeral = ephemeral if ephemeral is not None else ephemeral_ports()
    pool = range(_LOWEST_PORT, ephemeral.start) if ephemeral.start >= _LOWEST_PORT + 100 else None
    if pool is None:  # no room below the range: take the kernel's choice
        return [_bound_port(0) for _ in range(count)]
    chosen: list[int] = []
    for port in random.SystemRandom().sample(pool, min(len(pool), 50 * count + 100)):
        if _bound_port(port) == port:  # sample() draws each port once
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise MeshnetError(f"no {count} free ports between {pool.start} and {pool.stop - 1}")


def free_port() -> int:
    """One port free now on 127.0.0.1 (see ``free_ports``)."""
    return free_ports(1)[0]


def _bound_port(port: int) -> int:
    """``port`` if it can be bound on 127.0.0.1 now (0: the kernel's pick), else -1."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return -1
        return int(s.getsockname()[1])


@dataclass
class LocalMesh:
    """Starts and stops one tracker and its nodes."""

    data_dir: Path
    port: int = 0  # 0: pick a free one
    host: str = "127.0.0.1"  # the tracker's listen address
    model: str | None = None
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 2.0
    node_threads: int = 1  # kernel threads per node, unless start() is given a split
    extra_env: dict[str, str] = field(default_factory=dict)
    tracker_args: list[str] = field(default_factory=list)  # extra `meshnet tracker` flags
    node_args: list[str] = field(default_factory=list)  # extra `meshnet node` flags
    tracker: subprocess.Popen[bytes] | None = None
    nodes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    killed: set[str] = field(default_factory=set)  # nodes stopped on purpose

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        # The tracker reads (or would make) the same files: the mesh's credentials exist
        # before any process starts, so each node can be given its own key.
        self.mesh_secret = ensure_mesh_secret(self.data_dir)
        self.credentials = ensure_user_credentials(self.data_dir)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def api_headers(self) -> dict[str, str]:
        """What a client of the default tenant sends."""
        return {"Authorization": f"Bearer {self.credentials.api_key}"}

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.credentials.admin_token}"}

    def node_key(self, node_id: str) -> str:
        return node_key(self.mesh_secret, node_id)

    def start(
        self,
        layout: Sequence[LayerRange | None],
        timeout_s: float = 180.0,
        need_route: bool | None = None,
        threads: Sequence[int] | None = None,
    ) -> None:
        """Start the tracker and one node per layout entry; wait for them (and, unless
        ``need_route`` is False or every node is empty, for a complete route).
        ``threads`` gives each node its kernel threads (default: ``node_threads``)."""
        if threads is not None and len(threads) != len(layout):
            raise MeshnetError(f"{len(threads)} thread counts for {len(layout)} nodes")
        self.start_tracker()
        for i, layers in enumerate(layout):
            self.start_node(f"node-{i}", layers, threads=threads[i] if threads else None)
        if need_route is None:
            need_route = any(r is not None for r in layout)
        self.wait_ready(expected_nodes=len(layout), timeout_s=timeout_s, need_route=need_route)

    def start_tracker(self) -> None:
        args = ["tracker", "--host", self.host, "--port", str(self.port)]
        args += ["--data-dir", str(self.data_dir)]
        args += ["--heartbeat-timeout", str(self.heartbeat_timeout_s), *self.tracker_args]
        self.tracker = self._spawn("tracker", args)

    def start_node(
        self,
        node_id: str,
        layers: LayerRange | None,
        listen: str = "127.0.0.1:0",
        prefix: Sequence[str] = (),
        extra: Sequence[str] = (),
        threads: int | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start a node; ``prefix`` wraps the command (e.g. ``ip netns exec NS``),
        ``extra`` adds flags for this node only, ``threads`` its kernel threads
        (default: ``node_threads``). Flags in ``node_args`` and ``extra`` come
        last, so they override the mesh's own."""
        threads = threads or self.node_threads
        args = ["node", "--tracker", self.url, "--node-id", node_id, "--listen", listen]
        args += ["--heartbeat", str(self.heartbeat_s), "--threads", str(threads)]
        args += ["--head-assist", "on"]  # one operator's processes trust each other
        args += ["--empty"] if layers is None else ["--layers", f"{layers.start}:{layers.end}"]
        args += [*self.node_args, *extra]
        proc = self._spawn(node_id, args, prefix, threads, {NODE_KEY_ENV: self.node_key(node_id)})
        self.nodes[node_id] = proc
        self.killed.discard(node_id)
        return proc

    def wait_ready(
        self, expected_nodes: int, timeout_s: float, need_route: bool = True
    ) -> dict[str, Any]:
        """Poll /healthz until ``expected_nodes`` are up (and a route is complete)."""
        deadline = time.monotonic() + timeout_s
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(httpx.HTTPError):
                last = httpx.get(f"{self.url}/healthz", timeout=2.0).json()
                route_ok = last["route_complete"] or not need_route
                if last["nodes_up"] >= expected_nodes and route_ok:
                    return last
            time.sleep(0.2)
        raise MeshnetError(f"mesh not ready after {timeout_s:.0f}s: {last}")

    def _check_alive(self) -> None:
        procs = [("tracker", self.tracker), *self.nodes.items()]
        for name, p in procs:
            if p is not None and p.poll() is not None and name not in self.killed:
                log = self.data_dir / "logs" / f"{name}.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise MeshnetError(f"{name} exited with {p.returncode}:\n{tail}")

    def kill_node(self, node_id: str, sig: int = signal.SIGKILL) -> None:
        proc = self.nodes[node_id]
        if sig != signal.SIGCONT:
            self.killed.add(node_id)
        else:
            self.killed.discard(node_id)
        proc.send_signal(sig)
        if sig in (signal.SIGKILL, signal.SIGTERM):
            proc.wait(timeout=30)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every process (nodes first), then SIGKILL what is left; the mesh can
        be started again on its data dir."""
        procs = [*self.nodes.values(), *([self.tracker] if self.tracker else [])]
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGCONT)
                    p.terminate()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.nodes.clear()  # stopped on purpose: none is missed as having died
        self.tracker = None
        self.killed.clear()

    def _spawn(
        self,
        name: str,
        args: list[str],
        prefix: Sequence[str] = (),
        kernel_threads: int = 1,
        secrets: dict[str, str] | None = None,
    ) -> subprocess.Popen[bytes]:
        # One BLAS thread and the kernels' pool capped at the process's share. OpenMP's
        # idle threads keep their default wait (spin briefly, then sleep; libgomp spins
        # less when a process has more threads than cores): making them sleep at once
        # (OMP_WAIT_POLICY=PASSIVE) halved a two-thread node's decode, every step
        # waking them again for each of its many small parallel regions.
        threads = {
            "OPENBLAS_NUM_THREADS": "1",
            "NUMBA_NUM_THREADS": str(kernel_threads),
        }
        env = {
            **os.environ,
            **threads,
            "PYTHONUNBUFFERED": "1",
            **self.extra_env,
            **(secrets or {}),
        }
        cmd = [*prefix, sys.executable, "-m", "meshnet.cli.main", *args]
        if self.model:
            cmd += ["--model", self.model]
        with (self.data_dir / "logs" / f"{name}.log").open("ab") as log:  # the child keeps its fd
            return subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent,
            )


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the launching process dies."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
