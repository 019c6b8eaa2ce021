"""The route planner: pure functions from the registry's view to a chain of nodes.

A route is a chain of live nodes of the right model whose layer ranges cover
``[0, n_layers)`` exactly once, in order, all on one backend: backends differ in
their numerics (``fast`` float32 activations, ``q8`` 8-bit ones, the ``numpy``
reference), and a generation is exact across a failover only when every hop it
ever runs on computes alike. Among all such chains the planner picks the one
with the least total load (in-flight generations plus the sessions a node
reports), ties broken by backend and node id so plans are reproducible.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any

from meshnet.errors import NoRoute, RequestError
from meshnet.layer_range import LayerRange, covers_exactly
from meshnet.tracker.nodes.registry import NodeId, NodeRecord, NodeState


@dataclass(frozen=True)
class Hop:
    node_id: NodeId
    address: str
    layers: LayerRange


Route = tuple[Hop, ...]


def route_json(route: Route) -> list[dict[str, Any]]:
    """A route as the APIs show it: each hop's node and layers."""
    return [{"node_id": h.node_id, "layers": [h.layers.start, h.layers.end]} for h in route]


def plan_route(
    nodes: Sequence[NodeRecord],
    fingerprint: str,
    n_layers: int,
    in_flight: Mapping[NodeId, int],
    backend: str | None = None,
) -> Route:
    """The least-loaded complete chain; ``NoRoute`` naming the first uncovered layer."""
    return plan_chain(nodes, fingerprint, LayerRange(0, n_layers), in_flight, backend=backend)


def plan_chain(
    nodes: Sequence[NodeRecord],
    fingerprint: str,
    span: LayerRange,
    in_flight: Mapping[NodeId, int],
    exclude: Set[NodeId] = frozenset(),
    backend: str | None = None,
) -> Route:
    """The least-loaded chain covering exactly ``span`` (a whole route, or a failed hop's)
    on one backend: ``backend`` (a failed route's), or whichever gives the cheapest."""
    usable = [
        n for n in nodes if n.routable and n.fingerprint == fingerprint and n.node_id not in exclude
    ]
    backends = sorted({n.backend for n in usable}) if backend is None else [backend]
    plans: list[tuple[int, str, Route]] = []
    refusals: list[tuple[str, NoRoute]] = []
    for b in backends:
        try:
            cost, chain = _cheapest([n for n in usable if n.backend == b], span, in_flight)
        except NoRoute as e:
            refusals.append((b, e))
            continue
        plans.append((cost, b, chain))
    if plans:
        return min(plans, key=lambda p: (p[0], p[1]))[2]
    if len(refusals) == 1:
        raise refusals[0][1]
    if not refusals:
        raise NoRoute(f"no complete route: {_gap(_starts(usable, span), span)}")
    each = "; ".join(f"{b}: {e.message}" for b, e in refusals)
    raise NoRoute(f"no complete route on one backend ({each})")


def backend_of(route: Route, nodes: Sequence[NodeRecord]) -> str | None:
    """The backend a route's nodes compute with (its first known hop's); None if none is
    known any more."""
    index = {n.node_id: n.backend for n in nodes}
    return next((index[h.node_id] for h in route if h.node_id in index), None)


def _starts(usable: Sequence[NodeRecord], span: LayerRange) -> dict[int, list[NodeRecord]]:
    by_start: dict[int, list[NodeRecord]] = {}
    for n in usable:
        assert n.layers is not None  # routable
        if n.layers.start >= span.start and n.layers.end <= span.end:
            by_start.setdefault(n.layers.start, []).append(n)
    return by_start


def _cheapest(
    usable: Sequence[NodeRecord], span: LayerRange, in_flight: Mapping[NodeId, int]
) -> tuple[int, Route]:
    """The cost and hops of the least-loaded chain of ``usable`` nodes covering ``span``."""
    by_start = _starts(usable, span)
    # best[p]: (cost, node ids) of the cheapest chain covering [p, span.end)
    best: dict[int, tuple[int, tuple[NodeId, ...]]] = {span.end: (0, ())}
    for p in range(span.end - 1, span.start - 1, -1):
        options = [
            (_cost(n, in_flight) + best[n.layers.end][0], (n.node_id, *best[n.layers.end][1]))
            for n in by_start.get(p, [])
            if n.layers is not None and n.layers.end in best
        ]
        if options:
            best[p] = min(options)
    if span.start not in best:
        raise NoRoute(f"no complete route: {_gap(by_start, span)}")
    index = {n.node_id: n for n in usable}
    cost, ids = best[span.start]
    return cost, tuple(_hop(index[i]) for i in ids)


def pinned_route(
    node_ids: Sequence[NodeId], nodes: Sequence[NodeRecord], fingerprint: str, n_layers: int
) -> Route:
    """Validate an explicit chain; ``RequestError`` with the reason when it is unusable."""
    index = {n.node_id: n for n in nodes}
    unknown = [i for i in node_ids if i not in index]
    if unknown:
        raise RequestError(f"unknown node ids: {', '.join(unknown)}")
    chain = [index[i] for i in node_ids]
    for n in chain:
        if n.layers is None:
            raise RequestError(f"node {n.node_id} has no layers loaded")
        if n.fingerprint != fingerprint:
            raise RequestError(f"node {n.node_id} serves another model")
    backends = sorted({n.backend for n in chain})
    if len(backends) > 1:
        raise RequestError(f"the nodes compute with different backends: {', '.join(backends)}")
    ranges = [n.layers for n in chain if n.layers is not None]
    if not covers_exactly(ranges, n_layers):
        shown = ", ".join(str(r) for r in ranges)
        raise RequestError(f"layers {shown} do not cover [0, {n_layers}) exactly once in order")
    return tuple(_hop(n) for n in chain)


def requested_route(
    node_ids: Sequence[NodeId], nodes: Sequence[NodeRecord], fingerprint: str, n_layers: int
) -> Route:
    """Validate the route one request names: every node known, named once and up, then
    as ``pinned_route`` (layers loaded, this model, the layers covered exactly once in
    order). ``RequestError`` with the first reason it is unusable."""
    repeated = sorted(i for i, count in Counter(node_ids).items() if count > 1)
    if repeated:
        raise RequestError(f"nodes named more than once: {', '.join(repeated)}")
    index = {n.node_id: n for n in nodes}
    unknown = [i for i in node_ids if i not in index]
    if unknown:
        raise RequestError(f"unknown node ids: {', '.join(unknown)}")
    down = [index[i] for i in node_ids if index[i].state is not NodeState.UP]
    if down:
        shown = ", ".join(f"{n.node_id} ({n.down_reason or n.state.value})" for n in down)
        raise RequestError(f"nodes down: {shown}")
    return pinned_route(node_ids, nodes, fingerprint, n_layers)


def splice(route: Route, index: int, chain: Route) -> Route:
    """``route`` with its hop at ``index`` replaced by ``chain`` (which covers the same span)."""
    return (*route[:index], *chain, *route[index + 1 :])


def _cost(n: NodeRecord, in_flight: Mapping[NodeId, int]) -> int:
    return in_flight.get(n.node_id, 0) + n.load.sessions


def _hop(n: NodeRecord) -> Hop:
    assert n.layers is not None
    return Hop(n.node_id, n.address, n.layers)


def _gap(by_start: Mapping[int, Sequence[NodeRecord]], span: LayerRange) -> str:
    """Describe the first layer no chain from the span's start can reach."""
    reachable = {span.start}
    frontier = [span.start]
    while frontier:
        p = frontier.pop()
        for n in by_start.get(p, []):
            if n.layers is not None and n.layers.end not in reachable:
                reachable.add(n.layers.end)
                frontier.append(n.layers.end)
    first_missing = max(p for p in reachable if p < span.end)
    return f"no live node serves layer {first_missing}"
