"""The tracker's use cases: choose a route, start a generation on it, account for load.

Failures met while opening a route (a dead or misconfigured node) mark that
node down and the route is planned again, so a node killed between requests
costs the next request nothing but a retry.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from meshnet.engine.request import check_request
from meshnet.errors import (
    KVBudgetExhausted,
    MeshnetError,
    NodeFailure,
    NoRoute,
    Overloaded,
    RequestError,
)
from meshnet.model.info import ModelInfo
from meshnet.model.sampling import SamplingParams
from meshnet.tracker.channels import ChannelPool
from meshnet.tracker.driver import DoneEvent, RouteDriver, TokenEvent
from meshnet.tracker.routes import Route, pinned_route, plan_route
from meshnet.tracker.store import Store

log = logging.getLogger(__name__)

_OPEN_ATTEMPTS = 4


@dataclass(frozen=True)
class TrackerConfig:
    heartbeat_timeout_s: float = 3.0  # silence after which a node is marked down
    sweep_interval_s: float = 0.5
    max_in_flight: int = 64  # generations at once; more get 429


@dataclass(frozen=True)
class Started:
    """A generation whose route is open; iterate ``events`` to run it."""

    route: Route
    epoch: int
    events: AsyncGenerator[TokenEvent | DoneEvent, None]


class Tracker:
    """Routes generations over the registered nodes. Call from the event loop only."""

    def __init__(
        self,
        store: Store,
        model: ModelInfo,
        channels: ChannelPool,
        driver: RouteDriver,
        config: TrackerConfig,
    ) -> None:
        self.store = store
        self.model = model
        self.channels = channels
        self.driver = driver
        self.config = config
        self._in_flight: Counter[str] = Counter()
        self._generations = 0

    def route(self) -> Route:
        """The pinned route when one is set, else the least-loaded complete chain."""
        nodes = self.store.nodes()
        spec = self.model.spec
        pinned = self.store.pinned()
        if pinned is not None:
            down = [n.node_id for n in nodes if n.node_id in pinned and not n.routable]
            if down:
                raise NoRoute(f"pinned route has nodes down: {', '.join(down)}")
            try:
                return pinned_route(pinned, nodes, self.model.fingerprint, spec.n_layers)
            except RequestError as e:
                raise NoRoute(f"pinned route is unusable: {e.message}") from None
        return plan_route(nodes, self.model.fingerprint, spec.n_layers, self._in_flight)

    def pin(self, node_ids: Sequence[str]) -> Route:
        route = pinned_route(
            node_ids, self.store.nodes(), self.model.fingerprint, self.model.spec.n_layers
        )
        self.store.pin(node_ids)
        return route

    async def start(self, prompt_ids: Sequence[int], params: SamplingParams) -> Started:
        """Open a route for a generation; ``NoRoute`` or ``Overloaded`` when impossible."""
        check_request(self.model.spec, prompt_ids, params)
        if self._generations >= self.config.max_in_flight:
            raise Overloaded(f"{self._generations} generations in flight; try again shortly")
        last: Exception | None = None
        for _ in range(_OPEN_ATTEMPTS):
            route = self.route()
            try:
                streams = await self.driver.open(route)
            except (KVBudgetExhausted, Overloaded):
                raise  # the node is healthy, only full: the client should come back later
            except MeshnetError as e:
                if not e.node_id:
                    raise
                last = e  # a dead or misbehaving node: route around it
                await self._node_failed(e.node_id, e.kind)
                continue
            events = self._accounted(route, self.driver.run(streams, prompt_ids, params))
            return Started(route, 1, events)
        raise NoRoute(f"could not open a route: {last}")

    async def _accounted(
        self, route: Route, events: AsyncGenerator[TokenEvent | DoneEvent, None]
    ) -> AsyncGenerator[TokenEvent | DoneEvent, None]:
        self._generations += 1
        self._in_flight.update(h.node_id for h in route)
        try:
            async for event in events:
                yield event
        except NodeFailure as e:
            await self._node_failed(e.node_id, e.kind)
            raise
        finally:
            self._generations -= 1
            self._in_flight.subtract(h.node_id for h in route)
            await events.aclose()  # ends the route's streams now, also when abandoned

    async def _node_failed(self, node_id: str, kind: str) -> None:
        if not node_id:
            return
        log.warning("node %s failed (%s): marked down", node_id, kind)
        address = next((n.address for n in self.store.nodes() if n.node_id == node_id), None)
        self.store.mark_down(node_id, kind)
        if address:
            await self.channels.drop(address)

    def sweep(self) -> list[str]:
        return self.store.sweep(time.time(), self.config.heartbeat_timeout_s)
