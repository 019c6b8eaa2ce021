"""The placement planner is pure (registry records in, loads out), and the controller backs
off a span whose load failed, never loads one node twice in a pass, and goes on after."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from node_records import node_record

from meshnet.layer_range import LayerRange
from meshnet.tracker.links.configure import LoadResult
from meshnet.tracker.nodes.inventory import Inventory
from meshnet.tracker.nodes.registry import NodeRecord
from meshnet.tracker.nodes.routes import Hop
from meshnet.tracker.serving.placement import (
    Load,
    Placement,
    PlacementConfig,
    plan_placement,
)

FP = "f" * 64


def node(node_id: str, layers: str | None = None, *, up: bool = True, fp: str = FP) -> NodeRecord:
    return node_record(node_id, layers, up=up, fingerprint=fp if layers else "")


def plan(nodes: list[NodeRecord], replicas: int = 1, **kw: object) -> list[tuple[str, str]]:
    loads = plan_placement(nodes, FP, 4, replicas, **kw)  # type: ignore[arg-type]
    return [(load.node_id, f"{load.span.start}:{load.span.end}") for load in loads]


def test_a_covered_mesh_needs_nothing() -> None:
    assert plan([node("a", "0:2"), node("b", "2:4"), node("e")]) == []


def test_the_span_a_dead_node_served_goes_to_an_empty_node() -> None:
    nodes = [node("a", "0:2"), node("b", "2:4", up=False), node("e")]
    assert plan(nodes) == [("e", "2:4")]


def test_an_empty_node_holding_the_span_on_disk_loads_it_first() -> None:
    nodes = [node("a", "0:2"), node("b", "2:4", up=False), node("e"), node("f")]
    assert plan(nodes) == [("e", "2:4")]
    on_disk = {"f": {LayerRange(2, 4)}, "e": {LayerRange(0, 2)}}
    assert plan(nodes, on_disk=on_disk) == [("f", "2:4")]
    assert plan(nodes, on_disk=on_disk, avoid={"f"}) == [("e", "2:4")]


def test_without_an_empty_node_nothing_is_planned() -> None:
    assert plan([node("a", "0:2"), node("b", "2:4", up=False)]) == []


def test_down_and_busy_nodes_are_never_told_to_load() -> None:
    nodes = [node("a", "0:2"), node("b", "2:4", up=False), node("z", up=False)]
    assert plan(nodes) == []


def test_layers_nobody_ever_served_are_left_alone() -> None:
    # A mesh still being assembled: node-1 (2:4) has not registered yet.
    assert plan([node("a", "0:2"), node("e")]) == []
    assert plan([node("e"), node("f")]) == []


def test_a_gap_is_cut_as_the_dead_nodes_served_it() -> None:
    nodes = [node("a", "0:1"), node("b", "1:2", up=False), node("c", "2:4", up=False)]
    nodes += [node("e"), node("f")]
    assert plan(nodes) == [("e", "1:2"), ("f", "2:4")]


def test_with_fewer_empty_nodes_than_pieces_a_gap_is_loaded_whole() -> None:
    nodes = [node("a", "0:1"), node("b", "1:2", up=False), node("c", "2:4", up=False)]
    assert plan([*nodes, node("e")]) == [("e", "1:4")]


def test_replicas_give_every_range_another_node_least_covered_first() -> None:
    nodes = [node("a", "0:2"), node("b", "2:4"), node("x", "2:4"), node("e"), node("f")]
    assert plan(nodes, replicas=2) == [("e", "0:2")]
    assert plan(nodes, replicas=3) == [("e", "0:2"), ("f", "0:2")]
    assert plan([node("a", "0:2"), node("b", "2:4"), node("e"), node("f")], replicas=2) == [
        ("e", "0:2"),
        ("f", "2:4"),
    ]


def test_gaps_come_before_replicas() -> None:
    nodes = [node("a", "0:2"), node("b", "2:4", up=False), node("e")]
    assert plan(nodes, replicas=2) == [("e", "2:4")]


def test_a_whole_model_node_counts_for_every_layer() -> None:
    nodes = [node("w", "0:4"), node("a", "0:2"), node("b", "2:4"), node("e")]
    assert plan(nodes, replicas=2) == []
    assert plan(nodes, replicas=3) == [("e", "0:2")]


def test_another_models_nodes_cover_nothing() -> None:
    nodes = [node("a", "0:2"), node("b", "2:4", up=False), node("o", "2:4", fp="o" * 64)]
    assert plan([*nodes, node("e")]) == [("e", "2:4")]


def test_held_spans_wait_and_avoided_nodes_go_last() -> None:
    nodes = [node("a", "0:2"), node("b", "2:4"), node("e"), node("f")]
    assert plan(nodes, replicas=2, held={LayerRange(0, 2)}) == [("e", "2:4")]
    assert plan(nodes, replicas=2, avoid={"e"}) == [("f", "0:2"), ("e", "2:4")]


def test_zero_replicas_plans_nothing() -> None:
    assert plan([node("a", "0:2"), node("b", "2:4", up=False), node("e")], replicas=0) == []


class _FakeTracker:
    """The parts of ``Tracker`` the controller uses: a registry, the lock, ``load``."""

    def __init__(self, nodes: list[NodeRecord], works: set[str], replicas: int = 1) -> None:
        self.nodes = {n.node_id: n for n in nodes}
        self.works = works  # the nodes whose loads succeed
        self.calls: list[Load] = []
        self.heal_lock = asyncio.Lock()
        self.model = SimpleNamespace(
            fingerprint=FP, spec=SimpleNamespace(n_layers=4, context_length=256)
        )
        self.config = SimpleNamespace(replicas=replicas)
        self.inventory = Inventory()
        self.leader: Any = None  # no lease: this tracker places alone
        self.store = SimpleNamespace(
            nodes=lambda: sorted(self.nodes.values(), key=lambda n: n.node_id)
        )

    async def load(self, n: NodeRecord, span: LayerRange) -> LoadResult:
        assert self.heal_lock.locked()
        self.calls.append(Load(n.node_id, span))
        if n.node_id not in self.works:
            return LoadResult(None, "refused: model-file-invalid: no such file")
        self.nodes[n.node_id] = node(n.node_id, f"{span.start}:{span.end}")
        return LoadResult(Hop(n.node_id, n.address, span))


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_failed_load_backs_off_its_span_exponentially() -> None:
    tracker = _FakeTracker([node("a", "0:2"), node("b", "2:4", up=False), node("bad")], set())
    clock = _Clock()
    placement = Placement(tracker, PlacementConfig(backoff_s=1.0, backoff_max_s=4.0), clock)  # type: ignore[arg-type]
    attempts = []
    for second in range(20):
        clock.now = float(second)
        before = len(tracker.calls)
        asyncio.run(placement.pass_once())
        attempts += [second] * (len(tracker.calls) - before)
    assert attempts == [0, 1, 3, 7, 11, 15, 19]  # waits 1, 2, 4, then capped at 4
    assert placement.health.load_failures == 7 and placement.health.loads == 0
    assert placement.health.backoff == {"[2, 4)": 4.0}
    assert "no such file" in placement.health.last_load_failure


def test_a_pass_tries_each_node_once_and_heals_with_the_next() -> None:
    nodes = [node("a", "0:2"), node("b", "2:4", up=False), node("bad"), node("good")]
    tracker = _FakeTracker(nodes, {"good"})
    placement = Placement(tracker, PlacementConfig(), _Clock())  # type: ignore[arg-type]
    made = asyncio.run(placement.pass_once())
    # "bad" comes first by id and fails; its span waits, so "good" is not tried for
    # it in this pass.
    assert tracker.calls == [Load("bad", LayerRange(2, 4))]
    assert made == []
    placement._clock.now = 1.0  # type: ignore[attr-defined]
    made = asyncio.run(placement.pass_once())
    assert made == [Load("good", LayerRange(2, 4))]  # "bad" is avoided: "good" goes first
    assert placement.health.loads == 1 and placement.health.backoff == {}
    assert asyncio.run(placement.pass_once()) == []  # covered: nothing more to do


def test_the_backoff_of_a_span_no_longer_needed_is_forgotten() -> None:
    tracker = _FakeTracker([node("a", "0:2"), node("b", "2:4", up=False), node("bad")], set())
    clock = _Clock()
    placement = Placement(tracker, PlacementConfig(), clock)  # type: ignore[arg-type]
    asyncio.run(placement.pass_once())
    assert placement.health.backoff == {"[2, 4)": 1.0}
    tracker.nodes["b"] = node("b", "2:4")  # came back
    asyncio.run(placement.pass_once())
    assert placement.health.backoff == {}


def test_one_pass_makes_every_load_the_registry_needs() -> None:
    nodes = [node("a", "0:2"), node("b", "2:4"), node("e"), node("f")]
    tracker = _FakeTracker(nodes, {"e", "f"}, replicas=2)
    placement = Placement(tracker, PlacementConfig(), _Clock())  # type: ignore[arg-type]
    made = asyncio.run(placement.pass_once())
    assert made == [Load("e", LayerRange(0, 2)), Load("f", LayerRange(2, 4))]
    assert asyncio.run(placement.pass_once()) == [] and len(tracker.calls) == 2


def test_zero_replicas_never_calls_a_node() -> None:
    nodes = [node("a", "0:2"), node("b", "2:4", up=False), node("e")]
    tracker = _FakeTracker(nodes, {"e"}, replicas=0)
    assert asyncio.run(Placement(tracker).pass_once()) == []  # type: ignore[arg-type]
    assert tracker.calls == []


class _Leader:
    """A placement lease this tracker holds or not (tracker/storage/leader_lease.py)."""

    def __init__(self, leads: bool) -> None:
        self.leading = leads

    def leads(self) -> bool:
        return self.leading


def test_a_tracker_that_does_not_hold_the_lease_loads_nothing_until_it_does() -> None:
    nodes = [node("a", "0:2"), node("b", "2:4", up=False), node("good")]
    tracker = _FakeTracker(nodes, {"good"})
    tracker.leader = _Leader(False)  # another tracker on the database leads
    placement = Placement(tracker, PlacementConfig(), _Clock())  # type: ignore[arg-type]
    assert asyncio.run(placement.pass_once()) == []
    assert tracker.calls == [] and placement.health.leading is False
    tracker.leader.leading = True  # it took the lease over
    assert asyncio.run(placement.pass_once()) == [Load("good", LayerRange(2, 4))]
    assert placement.health.leading is True
