"""Route planning for the tracker's model: the pinned route, the least-loaded chain, the
prefix-holding one, a route a request names, and the capacity reserved on it.

The planners themselves are pure (tracker/nodes/routes.py, prefix_routes.py); this
is one model's use of them over the registry and admission: which route a
generation gets, ``Overloaded`` when routes exist but are all full, and whether a
route is still usable. A ``RoutePlanner`` is given the registry, the model, the
admission (shared by every model a tracker serves: capacity is the nodes') and
how to route by cached prefix; it owns the index of what prompt blocks each node
holds. The ``Tracker`` (service.py) holds one, and so does its ``Healer``
(healing.py), which plans replacements with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshnet.errors import NoRoute, RequestError
from meshnet.layer_range import LayerRange
from meshnet.model.info import ModelInfo
from meshnet.tracker.nodes.admission import Admission, Reservation
from meshnet.tracker.nodes.prefix_routes import (
    PrefixIndex,
    PrefixRouting,
    PromptBlocks,
    route_by_prefix,
)
from meshnet.tracker.nodes.registry import NodeId, NodeRecord
from meshnet.tracker.nodes.routes import (
    Hop,
    Route,
    pinned_route,
    plan_chain,
    plan_route,
    requested_route,
)
from meshnet.tracker.nodes.store import Store


class RoutePlanner:
    """Choosing and reserving routes over the registered nodes of one model."""

    def __init__(
        self, store: Store, model: ModelInfo, admission: Admission, prefix: PrefixRouting
    ) -> None:
        self.store = store
        self.model = model
        self.admission = admission
        self.prefix = prefix
        # What prompt blocks each node holds, as learned from what was routed to it.
        self.prefixes = PrefixIndex(prefix.max_blocks_per_node)

    def routed(self, route: Route, prompt: PromptBlocks) -> None:
        """``route``'s nodes were given ``prompt``: each now caches its full blocks
        (noted only while routing by prefix is on)."""
        if self.prefix.on:
            self.prefixes.record(route, prompt.keys)

    def forget(self, node_id: NodeId) -> None:
        """``node_id``'s prefix cache is empty now (it loaded a shard, or registered
        afresh): no route is chosen for what it held."""
        self.prefixes.forget(node_id)

    def _pinned(self) -> list[str] | None:
        """The pinned route, when it is of this model (with several models served, a pin
        holds nodes of one of them; the others route as if none were set)."""
        pinned = self.store.pinned()
        if pinned is None:
            return None
        fingerprints = {n.fingerprint for n in self.store.nodes() if n.node_id in pinned}
        other = bool(fingerprints) and self.model.fingerprint not in fingerprints
        return None if other else pinned

    def context_limit(self) -> int:
        """Positions a sequence of this model may reach: its trained context, or less
        where a routable node serving it says so (``meshnet node --ctx``): the least of
        them, so that no route a request may take cuts it short."""
        said = [
            n.load.context
            for n in self.store.nodes()
            if n.routable and n.fingerprint == self.model.fingerprint and n.load.context
        ]
        return min([self.model.spec.context_length, *said])

    def route(self, backend: str | None = None) -> Route:
        """The pinned route when one is set, else the least-loaded complete chain (on
        ``backend``, when a failover must keep its generation's numerics)."""
        nodes = self.store.nodes()
        spec = self.model.spec
        pinned = self._pinned()
        if pinned is not None:
            down = [n.node_id for n in nodes if n.node_id in pinned and not n.routable]
            if down:
                raise NoRoute(f"pinned route has nodes down: {', '.join(down)}")
            try:
                return pinned_route(pinned, nodes, self.model.fingerprint, spec.n_layers)
            except RequestError as e:
                raise NoRoute(f"pinned route is unusable: {e.message}") from None
        return plan_route(
            nodes, self.model.fingerprint, spec.n_layers, self.admission.streams, backend
        )

    def reserve(
        self, route: Route | None = None, prompt: PromptBlocks | None = None
    ) -> tuple[Route, Reservation]:
        """A route (planned among nodes with a free stream, unless given) and its
        capacity, reserved; ``Overloaded`` when routes exist but are all full. Given
        the prompt's blocks (under its tenant's scope), a route whose nodes hold a cached
        prefix of it may be chosen over a less loaded one (tracker/nodes/prefix_routes.py)."""
        if route is not None:
            return route, self.admission.reserve(h.node_id for h in route)
        nodes = self.store.nodes()
        full = self.admission.full_nodes(nodes)
        pinned = self._pinned()
        if pinned is None and full:
            spec = self.model.spec
            try:
                route = plan_chain(
                    nodes,
                    self.model.fingerprint,
                    LayerRange(0, spec.n_layers),
                    self.admission.streams,
                    full,
                )
            except NoRoute:
                self.route()  # NoRoute when there is none even with the full nodes
                raise self.admission.overloaded("every route's nodes are at capacity") from None
        else:
            route = self.route()
            busy = [h.node_id for h in route if h.node_id in full]
            if busy:
                raise self.admission.overloaded(f"nodes {', '.join(busy)} are at capacity")
        if pinned is None and prompt is not None and prompt.tokens and self.prefix.on:
            route = self._by_prefix(route, nodes, full, prompt)
        return route, self.admission.reserve(h.node_id for h in route)

    def _by_prefix(
        self,
        base: Route,
        nodes: Sequence[NodeRecord],
        full: frozenset[str],
        prompt: PromptBlocks,
    ) -> Route:
        """``base`` or a route whose nodes hold more of the prompt, whichever costs less."""
        return route_by_prefix(
            base,
            nodes,
            self.model.fingerprint,
            self.model.spec.n_layers,
            self.admission.streams,
            full,
            self.prefixes,
            prompt.keys,
            prompt.tokens,
            self.prefix.load_tokens,
        )

    def requested_route(self, node_ids: Sequence[str]) -> Route:
        """The route a request names, checked against the registry now; ``RequestError``
        (400) with the reason when a node is unknown, down, empty or of another model, or
        the chain does not cover the layers exactly once."""
        nodes = self.store.nodes()
        spec = self.model.spec
        return requested_route(node_ids, nodes, self.model.fingerprint, spec.n_layers)

    def reserve_named(self, route: Route) -> Reservation:
        """Capacity for a generation on the route its request named: ``Overloaded`` when
        one of its nodes has no stream left (it is never swapped for another)."""
        full = self.admission.full_nodes(self.store.nodes())
        busy = [h.node_id for h in route if h.node_id in full]
        if busy:
            raise self.admission.overloaded(f"nodes {', '.join(busy)} are at capacity")
        return self.admission.reserve(h.node_id for h in route)

    def pin(self, node_ids: Sequence[str]) -> Route:
        route = pinned_route(
            node_ids, self.store.nodes(), self.model.fingerprint, self.model.spec.n_layers
        )
        self.store.pin(node_ids)
        return route

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
        chain = self.replicas(span, frozenset())
        return chain[0] if chain is not None and len(chain) == 1 else None

    def replicas(
        self, span: LayerRange, exclude: frozenset[str], backend: str | None = None
    ) -> Route | None:
        """The least-loaded chain of up nodes (of ``backend``, if given) serving exactly
        ``span``, none of them in ``exclude``; None when there is none."""
        nodes = self.store.nodes()
        streams = self.admission.streams
        try:
            return plan_chain(nodes, self.model.fingerprint, span, streams, exclude, backend)
        except NoRoute:
            return None
