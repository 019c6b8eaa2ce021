"""Admission: capacity is reserved before a route is opened, and what does not fit waits
briefly in a bounded queue or is told to come back (``Overloaded``, 429 + Retry-After).

The tracker holds at most ``max_in_flight`` generations, and a node at most as many
streams as it says it can hold (its heartbeat's ``max_streams``, or
``node_streams``). A request that finds no room waits, up to ``queue_wait_s``,
for a generation to end; at most ``max_queued`` wait at once. One that finds no
complete route (``NoRoute``: a node restarting, a range being healed) waits the
same way, up to ``route_wait_s`` (a restart takes seconds), for one to appear,
looking again every ``route_poll_s``, before its 503. Reserving is synchronous
on the event loop, so two requests can never both take the last slot.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TypeVar

from meshnet.errors import NoRoute, Overloaded
from meshnet.tracker.nodes.registry import NodeId, NodeRecord

T = TypeVar("T")


@dataclass(frozen=True)
class AdmissionConfig:
    max_in_flight: int = 64  # generations this tracker drives at once
    node_streams: int = 32  # streams per node when the node does not say
    max_queued: int = 256  # requests waiting for room; more get 429 at once
    queue_wait_s: float = 1.0  # how long one waits for capacity before its 429
    route_wait_s: float = 15.0  # how long one waits for a complete route before its 503
    route_poll_s: float = 0.25  # how often one waiting for a route looks again

    @property
    def retry_after_s(self) -> int:
        """What a refused client is told to wait: about one queue wait."""
        return max(1, math.ceil(self.queue_wait_s))


@dataclass
class Reservation:
    """One generation's hold on a tracker slot and on a stream of every node it uses."""

    nodes: tuple[NodeId, ...]
    _admission: Admission = field(repr=False)
    released: bool = False

    def release(self) -> None:
        """Give the slots back (once; later calls do nothing)."""
        if not self.released:
            self.released = True
            self._admission._give_back(self)


class Admission:
    """Counts reserved capacity; call from the tracker's event loop only."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self.streams: Counter[NodeId] = Counter()  # reserved streams per node
        self.in_flight = 0
        self._waiting = 0
        self._freed = asyncio.Event()

    def capacity(self, node: NodeRecord) -> int:
        return node.load.max_streams or self.config.node_streams

    def full_nodes(self, nodes: Iterable[NodeRecord]) -> frozenset[NodeId]:
        """Nodes with no stream left for another generation."""
        return frozenset(n.node_id for n in nodes if self.streams[n.node_id] >= self.capacity(n))

    def reserve(self, nodes: Iterable[NodeId]) -> Reservation:
        """Take a tracker slot and a stream on each node; ``Overloaded`` when no slot."""
        if self.in_flight >= self.config.max_in_flight:
            raise self.overloaded(f"{self.in_flight} generations in flight")
        held = tuple(nodes)
        self.in_flight += 1
        self.streams.update(held)
        return Reservation(held, self)

    def overloaded(self, why: str) -> Overloaded:
        return Overloaded(f"{why}; try again shortly", retry_after_s=self.config.retry_after_s)

    async def acquire(self, attempt: Callable[[], T]) -> T:
        """``attempt()`` (which reserves), waiting in the queue while it is ``Overloaded``
        or finds ``NoRoute``. Raises its last refusal when the queue is full or the wait
        ran out.
        """
        try:
            return attempt()
        except (Overloaded, NoRoute) as e:
            if self._waiting >= self.config.max_queued:
                raise
            routeless = isinstance(e, NoRoute)
        start = time.monotonic()
        self._waiting += 1
        try:
            while True:
                self._freed.clear()
                deadline = start + self._wait_s(routeless)
                left = deadline - time.monotonic()
                if left <= 0:
                    return attempt()  # one last try; its refusal is the answer
                if routeless:  # nothing tells of a node's return: look again soon
                    left = min(left, self.config.route_poll_s)
                try:
                    async with asyncio.timeout(left):
                        await self._freed.wait()
                except TimeoutError:
                    pass
                try:
                    return attempt()
                except (Overloaded, NoRoute) as e:
                    routeless = isinstance(e, NoRoute)
                    if time.monotonic() >= start + self._wait_s(routeless):
                        raise
        finally:
            self._waiting -= 1

    def _wait_s(self, routeless: bool) -> float:
        return self.config.route_wait_s if routeless else self.config.queue_wait_s

    def _give_back(self, r: Reservation) -> None:
        self.in_flight -= 1
        self.streams.subtract(r.nodes)
        self._freed.set()  # every waiter tries again; those still without room wait on
