"""Decode through a mesh whose every link has added delay, against the bound it allows.

In the relay design the decode steps go round a ring: each node sends its output
to the next (``hops - 1`` links) and the last samples and sends the token to the
first (1), so one token's critical path crosses ``hops`` links. The token also
goes to the tracker, which streams it and extends the run ahead, beside that
path, not on it. So with ``d`` per one-way link and ``compute`` the per-token
time of the same mesh with no delay, a token takes at least
``compute + hops * d``: the bound is ``1 / (compute + hops * d)`` tokens per
second. With ``--no-relay`` the tracker carries every hop's input and output,
``2 * hops`` links a token.

The delay is ``tc netem`` on veth links between network namespaces (each node
in its own, see ``netem_links``) where the kernel has it; otherwise a user
space forwarder in front of each node's gRPC and relay ports (``delay_proxy``),
which delays every data-plane connection, tracker to node and node to node,
each direction (the nodes' heartbeats to the tracker go around it). Compute is
measured through the very same links with the delay set to 0, alternating
with the delayed runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal, Protocol

from meshnet.benchmark.delay_proxy import DelayProxy
from meshnet.benchmark.netem_links import NetemLinks, unavailable
from meshnet.benchmark.quiet import Measured, Quiet
from meshnet.benchmark.running_mesh import mesh_for, served_model
from meshnet.benchmark.serving import PROMPTS
from meshnet.benchmark.streams import completion_body, decode_tok_s, run_streams
from meshnet.errors import MeshnetError
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh, free_ports

Transport = Literal["auto", "netem", "proxy"]


def links_per_token(hops: int, relay: bool) -> int:
    """One-way links on a token's critical path (see the module's docstring)."""
    if not relay:
        return 2 * hops
    return hops if hops > 1 else 0  # one node feeds itself its tokens


def bound_tok_s(compute_ms: float, links: int, delay_ms: float) -> float:
    """The most tokens per second a route can decode: compute plus each link's delay."""
    return 1000.0 / (compute_ms + links * delay_ms)


class Links(Protocol):
    """The delayed links every mesh process talks over."""

    name: str

    @property
    def tracker_host(self) -> str:
        """The address nodes dial the tracker at."""
        ...

    def node_place(self, mesh: int, i: int) -> tuple[str, list[str], list[str]]:
        """Node ``i`` of mesh ``mesh``: its --listen, command prefix, extra flags."""
        ...

    def set_delay(self, delay_ms: float) -> None: ...

    def held_ms(self) -> float | None:
        """The mean delay links really added since the last call, where known."""
        ...


@dataclass
class _NetemPlaces:
    links: NetemLinks
    name: str = "tc netem, each node in its own network namespace"

    @property
    def tracker_host(self) -> str:
        return self.links.host_ip

    def node_place(self, mesh: int, i: int) -> tuple[str, list[str], list[str]]:
        return f"{self.links.node_ip(i)}:0", self.links.prefix(i), []

    def set_delay(self, delay_ms: float) -> None:
        self.links.set_delay(delay_ms)

    def held_ms(self) -> float | None:
        return None  # netem holds each packet for the asked time


PROXY_HOST = "127.0.0.2"  # where nodes behind the proxy are dialled


@dataclass
class _ProxyPlaces:
    """Nodes listen on 127.0.0.1 and are dialled at the proxy on 127.0.0.2: their gRPC
    port under another number, their relay port (offered by number) under its own."""

    ports: dict[tuple[int, int], tuple[int, int, int]]  # (mesh, node) -> listen, dialled, relay
    proxy: DelayProxy
    name: str = "user-space delay proxy before each node (no sch_netem in this kernel)"
    tracker_host: str = "127.0.0.1"

    def node_place(self, mesh: int, i: int) -> tuple[str, list[str], list[str]]:
        listen, dialled, relay = self.ports[(mesh, i)]
        extra = ["--advertise-host", PROXY_HOST, "--advertise-port", str(dialled)]
        return f"127.0.0.1:{listen}", [], [*extra, "--relay-port", str(relay)]

    def set_delay(self, delay_ms: float) -> None:
        self.proxy.set_delay(delay_ms)

    def held_ms(self) -> float | None:
        return self.proxy.held_ms()


@contextlib.contextmanager
def delayed_links(transport: Transport, meshes: int, hops: int) -> Iterator[Links]:
    """Links for ``meshes`` meshes of ``hops`` nodes; removed however the block ends.
    ``auto`` takes netem where it works, else the proxy."""
    why = unavailable() if transport != "proxy" else "the proxy was asked for"
    if why is None:
        links = NetemLinks(hops)
        links.open()
        try:
            yield _NetemPlaces(links)
        finally:
            links.close()
        return
    if transport == "netem":
        raise MeshnetError(f"cannot delay links with netem here: {why}")
    keys = [(m, i) for m in range(meshes) for i in range(hops)]
    numbers = iter(free_ports(3 * len(keys)))
    ports = {key: (next(numbers), next(numbers), next(numbers)) for key in keys}
    pairs = [(dialled, listen) for listen, dialled, _ in ports.values()]
    pairs += [(relay, relay) for _, _, relay in ports.values()]
    proxy = DelayProxy(pairs, host=PROXY_HOST)
    try:
        yield _ProxyPlaces(ports, proxy, name=f"user-space delay proxy ({why})")
    finally:
        proxy.close()


@dataclass
class DelayedRoute:
    """One mesh's rounds: tok/s with no delay and with the delay."""

    relay: bool
    url: str = ""
    model: str = ""
    headers: dict[str, str] = field(default_factory=dict)  # the mesh's API key
    plain: list[Measured] = field(default_factory=list)  # tok/s with no delay, every try
    delayed: list[Measured] = field(default_factory=list)  # with the delay, every try
    short: list[int] = field(default_factory=list)  # token counts of streams ended early

    def decode(self, tokens: int) -> float:
        body = completion_body(self.model, PROMPTS[0], tokens)
        record = run_streams(self.url, [body], self.headers)[0]
        if record.tokens != tokens:
            self.short.append(record.tokens)
        return decode_tok_s(record)

    def compute_ms(self, quiet: Quiet) -> tuple[float, bool]:
        """Per-token ms with no delay (the fastest undisturbed try), and whether one was."""
        tok_s, calm = quiet.best(self.plain)
        return 1000.0 / tok_s, calm

    def delayed_tok_s(self, quiet: Quiet) -> tuple[float, bool]:
        return quiet.best(self.delayed)


@contextlib.contextmanager
def started_meshes(
    links: Links,
    data_dir: Path,
    model: Path,
    layout: list[LayerRange],
    threads: int,
    timeout_s: float = 180.0,
) -> Iterator[list[DelayedRoute]]:
    """Two meshes over ``links`` (the relay, then ``--no-relay``); stopped at the end."""
    started: list[LocalMesh] = []
    try:
        routes = []
        for m, relay in enumerate((True, False)):
            mesh = mesh_for(data_dir / f"mesh{m}", model, threads, relay, host=links.tracker_host)
            started.append(mesh)
            mesh.start_tracker()
            for i, layers in enumerate(layout):
                listen, prefix, extra = links.node_place(m, i)
                mesh.start_node(f"node-{i}", layers, listen=listen, prefix=prefix, extra=extra)
            mesh.wait_ready(expected_nodes=len(layout), timeout_s=timeout_s)
            routes.append(DelayedRoute(relay, mesh.url, served_model(mesh), mesh.api_headers))
        yield routes
    finally:
        for mesh in started:
            mesh.stop()


def measure(
    routes: list[DelayedRoute],
    links: Links,
    delay_ms: float,
    tokens: int,
    rounds: int,
    quiet: Quiet,
) -> list[float]:
    """Alternate no-delay and delayed runs of each route, under the ``quiet`` rule;
    the delays the links held."""
    for route in routes:  # warm every hop and connection, then each delay's first run
        for d in (0.0, delay_ms):
            links.set_delay(d)
            route.decode(tokens)
    links.held_ms()
    held: list[float] = []
    for r in range(rounds):
        for route in routes if r % 2 == 0 else routes[::-1]:
            for d in (0.0, delay_ms) if r % 2 == 0 else (delay_ms, 0.0):
                links.set_delay(d)
                tries = quiet.measure(partial(route.decode, tokens))
                (route.delayed if d else route.plain).extend(tries)
                h = links.held_ms()
                if d and h is not None:
                    held.append(h)
    links.set_delay(0.0)
    return held
