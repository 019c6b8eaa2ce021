"""The tracker's answer to a failed node: mark it down (after a probe), reroute, heal.

A failure met mid-generation comes back from the driver as a ``reroute``
(the driver's ``Fabric``, which the tracker makes for each generation, asks
``Healer.reroute``): the failed span is given to a replica, or an empty node is
told to load it (healing), or (failing both) the whole route is planned again.
A node that failed a call is marked down, but one that is only slow (a timeout,
late heartbeats) only when a probe on a fresh connection confirms it is gone,
and a broken stream only has its channel dialled afresh; the heartbeat sweep
(``silent_gone``) probes silent nodes alike. Healing without a failing
generation is the placement controller's (``placement``): it uses the
tracker's ``load`` under the same lock.

A ``Healer`` does this for one model's ``Tracker`` (service.py), which holds it
and gives it what it works with: the registry, the channels (a probe, a channel
retired), the metrics, the model's ``RoutePlanner`` (planning.py), the lock that
lets one Configure run at a time, and the tracker's ``load`` (an empty node told
to load a span, calibrated before it is routed). It keeps no state of its own:
the lock is shared with placement and every other model's tracker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from meshnet.errors import (
    DeadlineExceeded,
    HeartbeatLost,
    MalformedBundle,
    MeshnetError,
    NoRoute,
    StreamReset,
    VerificationFailed,
    WorkerDeath,
)
from meshnet.layer_range import LayerRange
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.links.configure import LoadResult
from meshnet.tracker.links.hop_link import answers
from meshnet.tracker.nodes.registry import NodeRecord, NodeState
from meshnet.tracker.nodes.routes import Hop, Route, backend_of, splice
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.planning import RoutePlanner
from meshnet.tracker.routing.failover import Reroute
from meshnet.tracker.watch.metrics import TrackerMetrics

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 2.0  # a node that does not answer Info in this long is gone
# Failures after which a node is not trusted with the replacement: it is marked down.
DEAD_KINDS = frozenset(
    {
        WorkerDeath.kind,
        VerificationFailed.kind,
        HeartbeatLost.kind,
        DeadlineExceeded.kind,
        MalformedBundle.kind,
    }
)
# Of those, the ones a merely slow node also gives: marked down only when a probe fails.
_PROBED_KINDS = frozenset({HeartbeatLost.kind, DeadlineExceeded.kind})


Load = Callable[[NodeRecord, LayerRange], Awaitable[LoadResult]]  # ``Tracker.load``


class Healer:
    """Marking failed nodes down, rerouting failing generations, healing spans."""

    def __init__(
        self,
        store: Store,
        channels: ChannelPool,
        planner: RoutePlanner,
        metrics: TrackerMetrics,
        heal_lock: asyncio.Lock,
        load: Load,
    ) -> None:
        self.store = store
        self.channels = channels
        self.planner = planner
        self.metrics = metrics
        self.heal_lock = heal_lock  # one Configure at a time (failover heals and placement)
        self.load = load

    async def reroute(self, route: Route, failed: Hop | None, error: MeshnetError) -> Reroute:
        """A route without the failed hop's fault: a replica chain for its span, an
        empty node healed to serve it, or (failing both) any complete route."""
        try:
            new = await self._reroute(route, failed, error)
        except MeshnetError as e:
            self._note_failover(failed, error, f"no replacement: {e.message}")
            raise
        healed = f"healed {new.healed}; " if new.healed else ""
        now = " > ".join(h.node_id for h in new.route)
        self._note_failover(failed, error, f"{healed}now {now}")
        return new

    def _note_failover(self, failed: Hop | None, error: MeshnetError, detail: str) -> None:
        self.metrics.failover(failed.node_id if failed else "", error.kind, detail)

    async def _reroute(self, route: Route, failed: Hop | None, error: MeshnetError) -> Reroute:
        # Every replacement computes as the route did: the generation stays exact.
        backend = backend_of(route, self.store.nodes())
        if failed is None:
            return Reroute(self.planner.route(backend))
        index = route.index(failed)
        exclude: frozenset[str] = frozenset()
        span = failed.layers
        if error.kind in DEAD_KINDS:
            exclude = frozenset({failed.node_id})
            if not await self.node_failed(failed.node_id, error.kind, failed.address):
                # Slow, not gone: a replica takes the span if there is one, else it does.
                chain = self.planner.replicas(span, exclude, backend) or self.planner.replicas(
                    span, frozenset(), backend
                )
                if chain is not None:
                    return Reroute(splice(route, index, chain))
                return Reroute(self.planner.route(backend))
        # A live node (stream reset, lost KV) keeps its channel: other generations use it,
        # and gRPC reconnects a broken one by itself.
        chain = self.planner.replicas(span, exclude, backend)
        if chain is not None:
            return Reroute(splice(route, index, chain))
        async with self.heal_lock:  # two failovers must not configure one empty node twice
            chain = self.planner.replicas(span, exclude, backend)
            if chain is not None:
                return Reroute(splice(route, index, chain))
            healed = await self._heal(span, exclude, backend)
        if healed is not None:
            return Reroute(splice(route, index, (healed,)), healed.node_id)
        return Reroute(self.planner.route(backend))

    async def keep_route(self, route: Route, failed: Hop | None, error: MeshnetError) -> Reroute:
        """The failover of a generation on a named route: the same nodes on a new epoch
        while every one is up and unchanged; ``NoRoute`` once one is gone (the request
        asked for these nodes, so no other takes their place)."""
        if (
            failed is not None
            and error.kind in DEAD_KINDS
            and await self.node_failed(failed.node_id, error.kind, failed.address)
        ):
            raise NoRoute(f"node {failed.node_id} of the named route is down")
        if not self.planner.usable(route):
            raise NoRoute("a node of the named route is down or serves other layers now")
        self._note_failover(failed, error, "same named route, next epoch")
        return Reroute(route)

    async def _heal(
        self, span: LayerRange, exclude: frozenset[str], backend: str | None = None
    ) -> Hop | None:
        """Tell an empty node (of ``backend``, if given) to load ``span``; the hop it
        now serves, or None."""
        empty = [
            n
            for n in self.store.nodes()
            if n.state is NodeState.UP
            and n.layers is None
            and n.node_id not in exclude
            and backend in (None, n.backend)
        ]
        for node in empty:
            loaded = await self.load(node, span)
            if loaded.hop is not None:
                return loaded.hop
        return None

    async def silent_gone(self, heartbeat_timeout_s: float) -> list[str]:
        """Mark down the nodes silent for ``heartbeat_timeout_s`` that do not answer a
        probe either (``heartbeat-lost``); their ids."""
        return await self._unanswered(self.store.silent(time.time(), heartbeat_timeout_s))

    async def unanswered_gone(self) -> list[str]:
        """Mark down every node listed up that does not answer a probe (``heartbeat-lost``);
        their ids. For a tracker starting on a database of an earlier run: its records
        say who was up then, not who is now."""
        return await self._unanswered([n for n in self.store.nodes() if n.state is NodeState.UP])

    async def _answers(self, node: NodeRecord) -> bool:
        return await answers(self.channels.keys, node.address, node.node_id, PROBE_TIMEOUT_S)

    async def _unanswered(self, nodes: list[NodeRecord]) -> list[str]:
        alive = await asyncio.gather(*(self._answers(n) for n in nodes))
        lost = []
        for n in (n for n, up in zip(nodes, alive, strict=True) if not up):
            self.metrics.node_down(n.node_id, HeartbeatLost.kind)  # first: as below
            # Only the process probed, unheard from since: a node that registered
            # again or beat while the probe ran stays up (the count above is of verdicts).
            if self.store.mark_down(n.node_id, HeartbeatLost.kind, n.address, n.last_seen):
                lost.append(n.node_id)
        return lost

    async def node_failed(self, node_id: str, kind: str, met_at: str = "") -> bool:
        """Mark a node that failed a call down; True when it was. A timeout or silence
        is first checked by a probe: a node that answers is slow, not gone, and stays up.
        A broken stream (the node answered a probe on a fresh connection) is no verdict
        on the node: its channel is dialled afresh, it stays up. ``met_at``: the address
        the failure came from; a node registered at another address since is a new
        process, which the old one's failure says nothing about (it stays up)."""
        if not node_id:
            return False
        if kind == VerificationFailed.kind:
            return True  # quarantined already (NodeTrust.quarantine)
        node = self.store.node(node_id)
        if node is None:
            return True  # not registered (any more): nothing routes to it
        address = node.address
        if met_at and address != met_at:
            log.info(
                "node %s failed (%s) at %s, but it runs at %s now", node_id, kind, met_at, address
            )
            return False
        if kind == StreamReset.kind:
            log.info("node %s: its stream broke but it answers; dialling it afresh", node_id)
            self.channels.retire(address)
            return False
        if kind in _PROBED_KINDS and await self._answers(node):
            log.info("node %s was %s but answers a probe: kept up", node_id, kind)
            return False
        log.warning("node %s failed (%s): marked down", node_id, kind)
        self.metrics.node_down(node_id, kind)  # first: a scrape that sees it down counts it
        if not self.store.mark_down(node_id, kind, address):
            log.info("node %s registered again while its failure was judged: kept up", node_id)
            return False
        self.channels.retire(address)
        return True
