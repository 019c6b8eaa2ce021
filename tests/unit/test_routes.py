"""The route planner is pure: chains from registry records, least loaded, or a reason."""

import pytest

from meshnet.errors import NoRoute, RequestError
from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import NodeLoad
from meshnet.tracker.nodes.registry import NodeRecord, NodeState, is_stale
from meshnet.tracker.nodes.routes import backend_of, pinned_route, plan_chain, plan_route, splice

FP = "f" * 64


def node(
    node_id: str,
    start: int,
    end: int,
    *,
    sessions: int = 0,
    up: bool = True,
    fingerprint: str = FP,
    backend: str = "numpy",
) -> NodeRecord:
    return NodeRecord(
        node_id=node_id,
        address=f"127.0.0.1:{hash(node_id) % 60000}",
        fingerprint=fingerprint,
        layers=LayerRange(start, end) if end > start else None,
        backend=backend,
        kv_budget_bytes=0,
        pid=1,
        state=NodeState.UP if up else NodeState.DOWN,
        last_seen=0.0,
        load=NodeLoad(sessions=sessions, kv_bytes=0, queue_depth=0, steps=0),
    )


def ids(route) -> list[str]:  # type: ignore[no-untyped-def]
    return [h.node_id for h in route]


def test_plans_a_chain_covering_every_layer_once() -> None:
    nodes = [node("c", 20, 30), node("a", 0, 10), node("b", 10, 20)]
    assert ids(plan_route(nodes, FP, 30, {})) == ["a", "b", "c"]


def test_prefers_the_least_loaded_replica_and_breaks_ties_by_id() -> None:
    nodes = [node("a1", 0, 15, sessions=3), node("a2", 0, 15), node("b", 15, 30)]
    assert ids(plan_route(nodes, FP, 30, {})) == ["a2", "b"]
    assert ids(plan_route(nodes, FP, 30, {"a2": 5})) == ["a1", "b"]
    twins = [node("z", 0, 30), node("y", 0, 30)]
    assert ids(plan_route(twins, FP, 30, {})) == ["y"]


def test_a_whole_model_node_beats_a_loaded_chain() -> None:
    nodes = [node("a", 0, 15, sessions=1), node("b", 15, 30, sessions=1), node("w", 0, 30)]
    assert ids(plan_route(nodes, FP, 30, {})) == ["w"]


def test_down_empty_and_foreign_nodes_are_never_routed() -> None:
    nodes = [
        node("a", 0, 10, up=False),
        node("e", 0, 0),
        node("x", 0, 10, fingerprint="0" * 64),
        node("b", 10, 30),
    ]
    with pytest.raises(NoRoute, match="layer 0"):
        plan_route(nodes, FP, 30, {})


def test_no_route_names_the_first_unreachable_layer() -> None:
    with pytest.raises(NoRoute, match="layer 20"):
        plan_route([node("a", 0, 10), node("b", 10, 20), node("c", 21, 30)], FP, 30, {})


def test_overlapping_ranges_are_not_combined() -> None:
    with pytest.raises(NoRoute):
        plan_route([node("a", 0, 12), node("b", 10, 30)], FP, 30, {})


def test_pinned_route_validation() -> None:
    nodes = [node("a", 0, 10), node("b", 10, 30), node("w", 0, 30), node("e", 0, 0)]
    assert ids(pinned_route(["a", "b"], nodes, FP, 30)) == ["a", "b"]
    for bad, reason in [
        (["zz"], "unknown"),
        (["b", "a"], "cover"),
        (["a"], "cover"),
        (["a", "b", "w"], "cover"),
        (["e"], "no layers"),
    ]:
        with pytest.raises(RequestError, match=reason):
            pinned_route(bad, nodes, FP, 30)


def test_staleness() -> None:
    n = node("a", 0, 30)
    assert is_stale(n, now=10.0, timeout_s=3.0) and not is_stale(n, now=2.0, timeout_s=3.0)


def test_a_failed_span_is_replaced_by_a_chain_covering_exactly_it() -> None:
    nodes = [
        node("a", 0, 10),
        node("b", 10, 30),  # the failed hop
        node("c1", 10, 20),
        node("c2", 20, 30),
        node("wide", 0, 30),  # covers the span but starts outside it: unusable
        node("dead", 10, 30, up=False),
    ]
    chain = plan_chain(nodes, FP, LayerRange(10, 30), {}, exclude={"b"})
    assert ids(chain) == ["c1", "c2"]
    route = plan_route([nodes[0], nodes[1]], FP, 30, {})
    assert ids(splice(route, 1, chain)) == ["a", "c1", "c2"]
    with pytest.raises(NoRoute, match="layer 10"):
        plan_chain(nodes[:2], FP, LayerRange(10, 30), {}, exclude={"b"})


def test_a_route_computes_on_one_backend() -> None:
    """Backends differ in their numerics: a chain never mixes them, though mixed nodes
    would cover the layers; the cheapest single-backend chain wins."""
    mixed = [node("f1", 0, 15, backend="fast"), node("q1", 15, 30, backend="q8")]
    with pytest.raises(NoRoute, match="on one backend"):
        plan_route(mixed, FP, 30, {})
    both = [*mixed, node("f2", 15, 30, backend="fast", sessions=3), node("q0", 0, 15, backend="q8")]
    assert ids(plan_route(both, FP, 30, {})) == ["q0", "q1"]  # cost 0 against 3
    assert ids(plan_route(both, FP, 30, {}, backend="fast")) == ["f1", "f2"]
    assert backend_of(plan_route(both, FP, 30, {}, backend="fast"), both) == "fast"


def test_a_failed_hops_replacement_keeps_the_routes_backend() -> None:
    nodes = [
        node("q-spare", 15, 30, backend="q8"),
        node("f-spare", 15, 30, backend="fast", sessions=9),
    ]
    span = LayerRange(15, 30)
    assert ids(plan_chain(nodes, FP, span, {}, backend="fast")) == ["f-spare"]
    with pytest.raises(NoRoute):
        plan_chain(nodes, FP, span, {}, exclude={"f-spare"}, backend="fast")


def test_a_pinned_route_on_two_backends_is_refused() -> None:
    nodes = [node("a", 0, 15, backend="fast"), node("b", 15, 30, backend="q8")]
    with pytest.raises(RequestError, match="different backends: fast, q8"):
        pinned_route(["a", "b"], nodes, FP, 30)
