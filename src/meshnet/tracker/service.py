"""The tracker's use cases: choose a route, start a generation, fail over, account.

Failures met while opening a route (a dead or misconfigured node) mark that
node down and the route is planned again, so a node killed between requests
costs the next request nothing but a retry. Failures mid-generation come back
from the driver as a ``reroute``: the failed span is given to a replica, or
an empty node is told to load it (healing). Generations can be cancelled by
id, and a node whose heartbeats stop fails the steps waiting on it at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Iterable, Sequence
from dataclasses import dataclass

import grpc

from meshnet.engine.request import check_request
from meshnet.errors import (
    DeadlineExceeded,
    HeartbeatLost,
    KVBudgetExhausted,
    MalformedBundle,
    MeshnetError,
    NoRoute,
    Overloaded,
    RequestError,
    WorkerDeath,
)
from meshnet.layer_range import LayerRange
from meshnet.model.info import ModelInfo
from meshnet.model.sampling import SamplingParams
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.channels import ChannelPool
from meshnet.tracker.driver import DoneEvent, Reroute, RouteDriver, TokenEvent
from meshnet.tracker.generation import Generation
from meshnet.tracker.ledger import LedgerRecord
from meshnet.tracker.registry import NodeState
from meshnet.tracker.routes import Hop, Route, pinned_route, plan_chain, plan_route, splice
from meshnet.tracker.store import Store

log = logging.getLogger(__name__)

_OPEN_ATTEMPTS = 4


@dataclass(frozen=True)
class TrackerConfig:
    heartbeat_timeout_s: float = 3.0  # silence after which a node is marked down
    sweep_interval_s: float = 0.5
    max_in_flight: int = 64  # generations at once; more get 429
    heal_timeout_s: float = 120.0  # an empty node loading a failed span


@dataclass(frozen=True)
class Started:
    """A generation whose route is open; iterate ``events`` to run it."""

    generation_id: str
    route: Route
    epoch: int
    events: AsyncGenerator[TokenEvent | DoneEvent, None]


# Failures after which a node is not trusted with the replacement: it is marked down.
_DEAD_KINDS = frozenset(
    {
        WorkerDeath.kind,
        HeartbeatLost.kind,
        DeadlineExceeded.kind,
        MalformedBundle.kind,
    }
)


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
        self._generations: dict[str, Generation] = {}
        self._heal_lock = asyncio.Lock()

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
        self.admit()
        last: Exception | None = None
        for _ in range(_OPEN_ATTEMPTS):
            route = self.route()
            gen = self.driver.new_generation(uuid.uuid4().hex, route)
            try:
                await self.driver.open(gen)
            except (KVBudgetExhausted, Overloaded):
                raise  # the node is healthy, only full: the client should come back later
            except MeshnetError as e:
                if not e.node_id:
                    raise
                last = e  # a dead or misbehaving node: route around it
                await self._node_failed(e.node_id, e.kind)
                continue
            events = self._accounted(gen, self.driver.run(gen, prompt_ids, params, self))
            return Started(gen.id, route, gen.epoch, events)
        raise NoRoute(f"could not open a route: {last}")

    def admit(self) -> None:
        """``Overloaded`` when the tracker already drives as many generations as it may."""
        if len(self._generations) >= self.config.max_in_flight:
            raise Overloaded(f"{len(self._generations)} generations in flight; try again shortly")

    def drive(
        self,
        gen: Generation,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        history: Sequence[int] = (),
    ) -> AsyncGenerator[TokenEvent | DoneEvent, None]:
        """Run an opened generation (a session's turn), accounted, cancellable, failed over."""
        return self._accounted(gen, self.driver.run(gen, prompt_ids, params, self, history))

    def usable(self, route: Route) -> bool:
        """Whether every hop's node is up and still serves that hop's layers of this model."""
        nodes = {n.node_id: n for n in self.store.nodes()}
        for hop in route:
            n = nodes.get(hop.node_id)
            if n is None or not n.routable or n.layers != hop.layers or n.address != hop.address:
                return False
            if n.fingerprint != self.model.fingerprint:
                return False
        return bool(route)

    def single_hop_for(self, span: LayerRange) -> Hop | None:
        """One node serving exactly ``span`` (the least loaded), or None."""
        chain = self._replicas(span, frozenset())
        return chain[0] if chain is not None and len(chain) == 1 else None

    async def node_failed(self, node_id: str, kind: str) -> None:
        await self._node_failed(node_id, kind)

    def cancel(self, generation_id: str, reason: str = "cancelled by request") -> bool:
        """Cancel a running generation on every hop; False when none has that id."""
        gen = self._generations.get(generation_id)
        if gen is None:
            return False
        log.info("generation %s: %s", generation_id, reason)
        gen.cancel(reason)
        return True

    def generations(self) -> list[Generation]:
        return list(self._generations.values())

    async def _accounted(
        self, gen: Generation, events: AsyncGenerator[TokenEvent | DoneEvent, None]
    ) -> AsyncGenerator[TokenEvent | DoneEvent, None]:
        route = gen.route
        self._generations[gen.id] = gen
        self._in_flight.update(h.node_id for h in route)
        try:
            async for event in events:
                yield event
        finally:
            del self._generations[gen.id]
            self._in_flight.subtract(h.node_id for h in route)
            await events.aclose()  # ends the route's streams now, also when abandoned
            for link in gen.links:  # and when the driver never started
                link.close()

    # --- the driver's fabric -------------------------------------------------------

    async def reroute(self, route: Route, failed: Hop | None, error: MeshnetError) -> Reroute:
        """A route without the failed hop's fault: a replica chain for its span, an
        empty node healed to serve it, or (failing both) any complete route."""
        if failed is None:
            return Reroute(self.route())
        index = route.index(failed)
        exclude: frozenset[str] = frozenset()
        if error.kind in _DEAD_KINDS:
            await self._node_failed(failed.node_id, error.kind)
            exclude = frozenset({failed.node_id})
        # A live node (stream reset, lost KV) keeps its channel: other generations use it,
        # and gRPC reconnects a broken one by itself.
        span = failed.layers
        chain = self._replicas(span, exclude)
        if chain is not None:
            return Reroute(splice(route, index, chain))
        async with self._heal_lock:  # two failovers must not configure one empty node twice
            chain = self._replicas(span, exclude)
            if chain is not None:
                return Reroute(splice(route, index, chain))
            healed = await self._heal(span, exclude)
        if healed is not None:
            return Reroute(splice(route, index, (healed,)), healed.node_id)
        return Reroute(self.route())

    def record(self, records: Iterable[LedgerRecord]) -> None:
        batch = list(records)
        if batch:
            self.store.record_attempts(batch, time.time())

    def _replicas(self, span: LayerRange, exclude: frozenset[str]) -> Route | None:
        nodes = self.store.nodes()
        try:
            return plan_chain(nodes, self.model.fingerprint, span, self._in_flight, exclude)
        except NoRoute:
            return None

    async def _heal(self, span: LayerRange, exclude: frozenset[str]) -> Hop | None:
        """Tell an empty node to load ``span``; the hop it now serves, or None."""
        empty = [
            n
            for n in self.store.nodes()
            if n.state is NodeState.UP and n.layers is None and n.node_id not in exclude
        ]
        for node in empty:
            request = pb.ConfigureRequest(
                load=pb.LoadShard(layer_start=span.start, layer_end=span.end)
            )
            try:
                reply = await self.channels.stub(node.address).Configure(
                    request, timeout=self.config.heal_timeout_s
                )
            except grpc.aio.AioRpcError as e:
                log.warning("healing on %s failed: %s", node.node_id, e.code().name)
                continue
            if not reply.applied or reply.fingerprint != self.model.fingerprint:
                log.warning("node %s refused to load %s: %s", node.node_id, span, reply.failure)
                continue
            self.store.set_layers(node.node_id, span, reply.fingerprint)
            log.info("healed: node %s now serves layers %s", node.node_id, span)
            return Hop(node.node_id, node.address, span)
        return None

    async def _node_failed(self, node_id: str, kind: str) -> None:
        if not node_id:
            return
        log.warning("node %s failed (%s): marked down", node_id, kind)
        address = next((n.address for n in self.store.nodes() if n.node_id == node_id), None)
        self.store.mark_down(node_id, kind)
        if address:
            await self.channels.drop(address)

    def sweep(self) -> list[str]:
        """Mark down silent nodes and fail the steps waiting on them (``heartbeat-lost``)."""
        lost = self.store.sweep(time.time(), self.config.heartbeat_timeout_s)
        for node_id in lost:
            verdict = HeartbeatLost(f"node {node_id} stopped heartbeating", node_id)
            for gen in self.generations():
                gen.node_lost(node_id, verdict)
        return lost
