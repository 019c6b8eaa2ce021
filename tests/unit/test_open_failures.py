"""A node whose stream breaks while opening, but which answers a probe, is not marked
down: its channel is dialled afresh and the open tried again (a pooled channel to a
restarted node's address can fail a first call fast)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from meshnet.auth.keys import new_secret
from meshnet.auth.mesh_keys import MeshKeys
from meshnet.errors import StreamReset, WorkerDeath
from meshnet.mesh_messages import NodeAnnouncement, NodeLoad
from meshnet.model.info import load_model_info
from meshnet.model.sampling import SamplingParams
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.nodes.registry import NodeState
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.service import Tracker, TrackerConfig
from meshnet.tracker.storage.database import SQLiteDatabase


class _Driver:
    """Fails the first opens with ``errors``, then opens."""

    def __init__(self, errors: list[Exception]) -> None:
        self.errors = errors
        self.opens = 0

    def new_generation(self, gid: str, route: Any, params: Any, top: int) -> Any:
        return type("Gen", (), {"id": gid, "route": route, "epoch": 1, "links": [], "reused": 0})()

    async def open(self, gen: Any, prompt_ids: Any = ()) -> None:
        self.opens += 1
        if self.errors:
            raise self.errors.pop(0)

    async def run(self, *args: Any) -> Any:
        if False:
            yield None


def _tracker(tiny_path: Path, driver: _Driver) -> tuple[Tracker, list[str]]:
    model = load_model_info(str(tiny_path))
    store = Store(SQLiteDatabase(tiny_path.parent / f"t{time.monotonic_ns()}.db"))
    load = NodeLoad(sessions=0, kv_bytes=0, queue_depth=0, steps=0)
    for node_id in ("a", "b"):
        store.register(
            NodeAnnouncement(
                node_id=node_id,
                address=f"127.0.0.1:{9 if node_id == 'a' else 10}",
                fingerprint=model.fingerprint,
                layer_start=0,
                layer_end=model.spec.n_layers,
                backend="fast",
                kv_budget_bytes=1 << 30,
                pid=1,
                load=load,
            ),
            time.time(),
        )
    retired: list[str] = []
    channels = ChannelPool(MeshKeys(new_secret()))
    channels.retire = retired.append  # type: ignore[method-assign]
    tracker = Tracker(store, model, channels, driver, TrackerConfig())  # type: ignore[arg-type]
    return tracker, retired


def test_a_stream_reset_while_opening_retries_on_a_fresh_channel(tiny_path: Path) -> None:
    driver = _Driver([StreamReset("stream to node a broke", "a")])
    tracker, retired = _tracker(tiny_path, driver)

    async def scenario() -> None:
        await tracker.start([1, 2, 3], SamplingParams(max_tokens=1))

    asyncio.run(scenario())
    assert driver.opens == 2
    states = {n.node_id: n.state for n in tracker.store.nodes()}
    assert states == {"a": NodeState.UP, "b": NodeState.UP}
    assert retired == ["127.0.0.1:9"]  # dialled afresh, not marked down


def test_a_dead_node_while_opening_is_marked_down_and_routed_around(tiny_path: Path) -> None:
    driver = _Driver([WorkerDeath("node a is gone", "a")])
    tracker, _ = _tracker(tiny_path, driver)
    asyncio.run(tracker.start([1, 2, 3], SamplingParams(max_tokens=1)))
    assert driver.opens == 2
    states = {n.node_id: n.state for n in tracker.store.nodes()}
    assert states["a"] is NodeState.DOWN
