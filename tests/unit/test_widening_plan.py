"""Widening a live node over a dead peer's layers, and absorbing the peer's return, are
planned in pure code from what nodes report: empty nodes first, then the node with most
memory to spare; a node whose report says the wider range does not fit is never asked."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

from node_records import node_record

from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import NodeLoad
from meshnet.model.layer_bytes import LayerBytes
from meshnet.tracker.links.configure import LoadResult
from meshnet.tracker.nodes.inventory import Inventory
from meshnet.tracker.nodes.registry import NodeRecord, NodeState
from meshnet.tracker.nodes.routes import Hop
from meshnet.tracker.serving.placement import Placement, PlacementConfig, plan_placement
from meshnet.tracker.serving.widening import Load, chains, headroom

FP = "f" * 64
CONTEXT = 256
# Four layers of 100 bytes, an embedding and a head of 50, one byte of KV per layer and
# position: [0, 4) weighs 500, [0, 2) and [2, 4) 250 each; one sequence of 256 positions
# on four layers takes 1024 bytes of KV.
SIZES = LayerBytes((100, 100, 100, 100), 50, 50, 0, False, 1)
FITS = 2000  # [0, 4) beside [0, 2) (500), and after the swap 500 + 1024 of KV < 2000 + 250


def node(
    node_id: str, layers: str | None = None, *, up: bool = True, free: int = 0, budget: int = 0
) -> NodeRecord:
    """A node of model ``FP`` that says ``free`` bytes of memory are available to it."""
    n = node_record(node_id, layers, up=up)
    load = NodeLoad(sessions=0, kv_bytes=0, queue_depth=0, steps=0, free_memory_bytes=free)
    return replace(n, load=load, kv_budget_bytes=budget)


def plan(nodes: list[NodeRecord], replicas: int = 1, **kw: object) -> list[tuple[str, str]]:
    loads = plan_placement(
        nodes,
        FP,
        4,
        replicas,
        sizes=lambda backend: SIZES,
        context=CONTEXT,
        **kw,  # type: ignore[arg-type]
    )
    return [(x.node_id, f"{x.span.start}:{x.span.end}" if x.span else "empty") for x in loads]


def test_the_survivor_of_two_nodes_widens_over_its_dead_peer() -> None:
    assert plan([node("a", "0:2", free=FITS), node("b", "2:4", up=False)]) == [("a", "0:4")]
    assert plan([node("a", "0:2", up=False), node("b", "2:4", free=FITS)]) == [("b", "0:4")]


def test_a_range_a_new_node_is_calibrating_is_not_widened_over() -> None:
    """A node that registered for a gap is being checked before it is routed: its range
    is about to be served, so no neighbour reloads over it (and then absorbs it)."""
    newcomer = replace(node("b", "2:4", up=False), state=NodeState.CALIBRATING)
    assert plan([node("a", "0:2", free=FITS), newcomer]) == []
    failed = replace(newcomer, state=NodeState.QUARANTINED)  # out: its range is a gap
    assert plan([node("a", "0:2", free=FITS), failed]) == [("a", "0:4")]


def test_an_empty_node_is_preferred_to_widening() -> None:
    nodes = [node("a", "0:2", free=FITS), node("b", "2:4", up=False), node("e")]
    assert plan(nodes) == [("e", "2:4")]


def test_of_the_nodes_next_to_a_gap_the_one_with_most_room_widens() -> None:
    dead = node("b", "1:2", up=False)
    small, large = FITS, FITS + 1000  # a widened by one layer holds less than c by one
    nodes = [node("a", "0:1", free=small), dead, node("c", "2:4", free=large)]
    assert plan(nodes) == [("c", "1:4")]
    nodes = [node("a", "0:1", free=large), dead, node("c", "2:4", free=small)]
    assert plan(nodes) == [("a", "0:2")]
    nodes = [node("a", "0:1", free=large), dead, node("c", "2:4", free=small)]
    assert plan(nodes, avoid={"a"}) == [("c", "1:4")]  # its last load failed: used last


def test_a_node_that_cannot_fit_the_wider_range_is_never_asked() -> None:
    dead = node("b", "2:4", up=False)
    assert plan([node("a", "0:2"), dead]) == []  # says nothing of its memory
    assert plan([node("a", "0:2", free=400), dead]) == []  # 500 of weights beside its own
    assert plan([node("a", "0:2", free=1000), dead]) == []  # no room for a sequence's KV
    # A KV budget is what it may hold: 500 + 1800 > 2000 + 250.
    assert plan([node("a", "0:2", free=FITS, budget=1800), dead]) == []
    assert plan([node("a", "0:2", free=FITS, budget=1700), dead]) == [("a", "0:4")]


def test_a_node_not_next_to_the_gap_or_of_another_model_is_not_asked() -> None:
    other = replace(node("o", "0:2", free=FITS), fingerprint="o" * 64)
    assert plan([other, node("a", "0:2", up=False), node("b", "2:4", up=False)]) == []
    # Layers 1:2 lost; only a node ending at 1 or starting at 2 can take them.
    nodes = [node("w", "0:1", free=FITS), node("b", "1:2", up=False), node("c", "2:4")]
    assert plan(nodes) == [("w", "0:2")]


def test_held_spans_and_busy_nodes_wait() -> None:
    nodes = [node("a", "0:2", free=FITS), node("b", "2:4", up=False)]
    assert plan(nodes, held={LayerRange(0, 4)}) == []
    assert plan(nodes, busy={"a"}) == []


def test_headroom_counts_what_the_swap_frees() -> None:
    a = node("a", "0:2", free=1300)
    # 500 beside 250 fits 1300; after the swap 1300 + 250 held - 500 - 1024 = 26 left.
    assert headroom(a, LayerRange(0, 4), SIZES, CONTEXT) == 26
    busy = replace(a, load=a.load.model_copy(update={"kv_bytes": 100}))
    assert headroom(busy, LayerRange(0, 4), SIZES, CONTEXT) == 126  # its KV goes too
    short = replace(a, load=a.load.model_copy(update={"context": 16}))  # --ctx 16
    assert headroom(short, LayerRange(0, 4), SIZES, CONTEXT) == 1300 + 250 - 500 - 64


def test_a_returned_node_inside_a_wider_range_becomes_its_replica_or_is_emptied() -> None:
    wide = node("a", "0:4")
    assert plan([wide, node("b", "2:4", free=FITS)]) == [("b", "0:4")]
    assert plan([wide, node("b", "2:4", free=400)]) == [("b", "empty")]
    assert plan([wide, node("b", "2:4")]) == [("b", "empty")]  # says nothing: emptied


def test_ranges_that_chain_are_left_alone() -> None:
    assert plan([node("a", "0:2", free=FITS)]) == []  # a mesh being assembled
    assert plan([node("b", "2:4", free=FITS)]) == []
    assert plan([node("w", "0:4"), node("a", "0:2"), node("b", "2:4", free=FITS)]) == []


def test_chains() -> None:
    ranges = [LayerRange(0, 4), LayerRange(2, 4), LayerRange(0, 1), LayerRange(1, 2)]
    assert chains(LayerRange(2, 4), ranges, 4)
    assert not chains(LayerRange(2, 4), [LayerRange(0, 4), LayerRange(2, 4)], 4)


class _Tracker:
    """The parts of ``Tracker`` the controller uses, with ``load`` and ``unload``."""

    def __init__(self, nodes: list[NodeRecord]) -> None:
        self.nodes = {n.node_id: n for n in nodes}
        self.calls: list[Load] = []
        self.heal_lock = asyncio.Lock()
        self.model = SimpleNamespace(fingerprint=FP, spec=SimpleNamespace(n_layers=4))
        self.model.spec.context_length = CONTEXT
        self.config = SimpleNamespace(replicas=1)
        self.inventory = Inventory()
        self.store = SimpleNamespace(nodes=lambda: sorted(self.nodes.values(), key=_id))
        self.leader = None  # no placement lease: this tracker places alone

    async def load(self, n: NodeRecord, span: LayerRange) -> LoadResult:
        assert self.heal_lock.locked()
        self.calls.append(Load(n.node_id, span))
        self.nodes[n.node_id] = replace(n, layers=span)
        return LoadResult(Hop(n.node_id, n.address, span))

    async def unload(self, n: NodeRecord) -> LoadResult:
        assert self.heal_lock.locked()
        self.calls.append(Load(n.node_id, None))
        self.nodes[n.node_id] = replace(n, layers=None, fingerprint="")
        return LoadResult(None, emptied=True)


def _id(n: NodeRecord) -> str:
    return n.node_id


def test_the_controller_widens_then_absorbs_the_return() -> None:
    tracker = _Tracker([node("a", "0:2", free=FITS), node("b", "2:4", up=False)])
    placement = Placement(tracker, PlacementConfig(), sizes=lambda backend: SIZES)  # type: ignore[arg-type]
    assert asyncio.run(placement.pass_once()) == [Load("a", LayerRange(0, 4))]
    assert asyncio.run(placement.pass_once()) == []  # covered
    tracker.nodes["b"] = node("b", "2:4", free=400)  # back, too small to be a replica
    assert asyncio.run(placement.pass_once()) == [Load("b", None)]
    assert tracker.nodes["b"].layers is None
    assert asyncio.run(placement.pass_once()) == []
    assert placement.health.loads == 2
