"""The healer on its own (no tracker around it): given a registry, a route planner and a
``load``, a failing hop's span goes to a replica, else to an empty node it loads under
the Configure lock, else the failure is ``NoRoute``; a named route never leaves its
nodes. Nodes are registered in a real SQLite registry; ``load`` and the channels'
``retire`` are recorded, nothing is dialled (a worker's death needs no probe)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from meshnet.auth.keys import new_secret
from meshnet.auth.mesh_keys import MeshKeys
from meshnet.errors import NoRoute, StreamReset, WorkerDeath
from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import NodeAnnouncement, NodeLoad
from meshnet.tracker.healing import Healer
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.links.configure import LoadResult
from meshnet.tracker.nodes.admission import Admission, AdmissionConfig
from meshnet.tracker.nodes.prefix_routes import PrefixRouting
from meshnet.tracker.nodes.registry import NodeRecord, NodeState
from meshnet.tracker.nodes.routes import Hop, Route
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.planning import RoutePlanner
from meshnet.tracker.storage.database import SQLiteDatabase
from meshnet.tracker.watch.metrics import TrackerMetrics

FP = "f" * 64
N_LAYERS = 4


class _Mesh:
    """A registry of nodes (id -> layers, None: empty) and a healer over it."""

    def __init__(self, tmp_path: Path, nodes: dict[str, tuple[int, int] | None]) -> None:
        self.store = Store(SQLiteDatabase(tmp_path / "tracker.db"))
        for i, (node_id, layers) in enumerate(nodes.items()):
            start, end = layers or (0, 0)
            announcement = NodeAnnouncement(
                node_id=node_id,
                address=f"127.0.0.1:{20000 + i}",
                fingerprint=FP if layers else "",
                layer_start=start,
                layer_end=end,
                backend="fast",
                kv_budget_bytes=1 << 30,
                pid=1,
                load=NodeLoad(sessions=0, kv_bytes=0, queue_depth=0, steps=0),
            )
            self.store.register(announcement, time.time())
        model: Any = SimpleNamespace(
            fingerprint=FP, spec=SimpleNamespace(n_layers=N_LAYERS, context_length=64)
        )
        admission = Admission(AdmissionConfig())
        self.planner = RoutePlanner(self.store, model, admission, PrefixRouting())
        self.retired: list[str] = []
        channels = ChannelPool(MeshKeys(new_secret()))
        channels.retire = self.retired.append  # type: ignore[method-assign]
        self.lock = asyncio.Lock()
        self.loads: list[tuple[str, LayerRange, bool]] = []  # node, span, lock held
        self.metrics = TrackerMetrics()
        self.healer = Healer(self.store, channels, self.planner, self.metrics, self.lock, self.load)

    async def load(self, node: NodeRecord, span: LayerRange) -> LoadResult:
        self.loads.append((node.node_id, span, self.lock.locked()))
        self.store.set_layers(node.node_id, span, FP)
        return LoadResult(Hop(node.node_id, node.address, span))

    def hop(self, node_id: str) -> Hop:
        node = self.store.node(node_id)
        assert node is not None and node.layers is not None
        return Hop(node_id, node.address, node.layers)

    def state(self, node_id: str) -> NodeState:
        node = self.store.node(node_id)
        assert node is not None
        return node.state


def ids(route: Route) -> list[str]:
    return [h.node_id for h in route]


def test_a_dead_hops_span_goes_to_its_replica(tmp_path: Path) -> None:
    mesh = _Mesh(tmp_path, {"a": (0, 2), "b": (2, 4), "b2": (2, 4), "e": None})
    route = (mesh.hop("a"), mesh.hop("b"))
    new = asyncio.run(mesh.healer.reroute(route, route[1], WorkerDeath("gone", "b")))
    assert ids(new.route) == ["a", "b2"] and new.healed is None
    assert mesh.state("b") is NodeState.DOWN and mesh.retired == [route[1].address]
    assert mesh.loads == []  # a replica serves it: no empty node is touched
    assert [e.what for e in mesh.metrics.events()] == ["failover", "node-down"]


def test_without_a_replica_an_empty_node_loads_the_span_under_the_lock(tmp_path: Path) -> None:
    mesh = _Mesh(tmp_path, {"a": (0, 2), "b": (2, 4), "e": None})
    route = (mesh.hop("a"), mesh.hop("b"))
    new = asyncio.run(mesh.healer.reroute(route, route[1], WorkerDeath("gone", "b")))
    assert ids(new.route) == ["a", "e"] and new.healed == "e"
    assert mesh.loads == [("e", LayerRange(2, 4), True)]
    assert mesh.store.node("e") is not None and mesh.planner.usable(new.route)


def test_with_neither_the_failover_is_no_route(tmp_path: Path) -> None:
    mesh = _Mesh(tmp_path, {"a": (0, 2), "b": (2, 4)})
    route = (mesh.hop("a"), mesh.hop("b"))
    with pytest.raises(NoRoute):
        asyncio.run(mesh.healer.reroute(route, route[1], WorkerDeath("gone", "b")))
    assert "no replacement" in mesh.metrics.events()[0].detail


def test_a_broken_stream_keeps_its_node_up_and_redials_it(tmp_path: Path) -> None:
    mesh = _Mesh(tmp_path, {"a": (0, 2), "b": (2, 4)})
    hop = mesh.hop("b")
    failed = asyncio.run(mesh.healer.node_failed("b", StreamReset.kind, hop.address))
    assert not failed and mesh.state("b") is NodeState.UP and mesh.retired == [hop.address]


def test_a_named_route_stays_on_its_nodes_and_fails_once_one_is_down(tmp_path: Path) -> None:
    mesh = _Mesh(tmp_path, {"a": (0, 2), "b": (2, 4), "b2": (2, 4), "e": None})
    route = (mesh.hop("a"), mesh.hop("b"))
    again = asyncio.run(mesh.healer.keep_route(route, route[1], StreamReset("reset", "b")))
    assert again.route == route  # the same nodes, on the next epoch
    with pytest.raises(NoRoute, match="named route is down"):
        asyncio.run(mesh.healer.keep_route(route, route[1], WorkerDeath("gone", "b")))
    assert mesh.loads == [] and mesh.state("b2") is NodeState.UP


def _announce_again(mesh: _Mesh, node_id: str, address: str) -> None:
    """The node's process restarted and registered at ``address``."""
    old = mesh.store.node(node_id)
    assert old is not None and old.layers is not None
    announcement = NodeAnnouncement(
        node_id=node_id,
        address=address,
        fingerprint=FP,
        layer_start=old.layers.start,
        layer_end=old.layers.end,
        backend="fast",
        kv_budget_bytes=1 << 30,
        pid=2,
        load=NodeLoad(sessions=0, kv_bytes=0, queue_depth=0, steps=0),
    )
    mesh.store.register(announcement, time.time())


def test_a_node_that_registers_again_while_its_old_record_is_probed_stays_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sweep reads a silent record, probes its old address (gone), and meanwhile the
    node's new process registers: the sweep's verdict was on the old process only."""
    mesh = _Mesh(tmp_path, {"a": (0, 4)})

    async def probe_while_it_registers(keys: object, address: str, node_id: str, t: float) -> bool:
        _announce_again(mesh, node_id, "127.0.0.1:30000")
        return False

    monkeypatch.setattr("meshnet.tracker.healing.answers", probe_while_it_registers)
    lost = asyncio.run(mesh.healer.silent_gone(heartbeat_timeout_s=-1.0))
    assert lost == [] and mesh.state("a") is NodeState.UP


def test_records_from_before_a_restart_are_up_only_if_their_nodes_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tracker starting on its database probes every node it lists as up, however
    recently that node was heard from: one that does not answer is down before the
    tracker serves, not routed to until the sweep notices."""
    mesh = _Mesh(tmp_path, {"gone": (0, 2), "alive": (2, 4)})
    probed: list[str] = []

    async def probe(keys: object, address: str, node_id: str, t: float) -> bool:
        probed.append(node_id)
        return node_id == "alive"

    monkeypatch.setattr("meshnet.tracker.healing.answers", probe)
    assert asyncio.run(mesh.healer.unanswered_gone()) == ["gone"]
    assert sorted(probed) == ["alive", "gone"]
    assert (mesh.state("gone"), mesh.state("alive")) == (NodeState.DOWN, NodeState.UP)
    assert mesh.planner.single_hop_for(LayerRange(0, 2)) is None
