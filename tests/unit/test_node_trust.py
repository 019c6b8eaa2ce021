"""Node states under verification (tracker/calibration.py): calibrating until a node's
calibration passes, quarantined while it serves what it failed on, calibrated afresh
when it serves something else. The calibration itself is faked here (its exchange with a
real node is tests/e2e/test_verified_work.py's); the registry is a real SQLite store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from meshnet.mesh_messages import NodeAnnouncement, NodeLoad
from meshnet.tracker import calibration
from meshnet.tracker.calibration import NodeTrust
from meshnet.tracker.database import SQLiteDatabase
from meshnet.tracker.registry import NodeState
from meshnet.tracker.store import Store

FP = "f" * 64


def _announce(start: int, end: int, fingerprint: str = FP) -> NodeAnnouncement:
    load = NodeLoad(sessions=0, kv_bytes=0, queue_depth=0, steps=0)
    return NodeAnnouncement(
        node_id="n",
        address="127.0.0.1:1",
        fingerprint=fingerprint,
        layer_start=start,
        layer_end=end,
        backend="fast",
        kv_budget_bytes=0,
        pid=1,
        load=load,
    )


class _Model:
    """Stands in for the trusted model where ``prepare`` is faked: it only names a backend."""

    backend = "fast"

    def on(self, backend: str) -> _Model:
        return self


ANY_BACKEND = _Model()


@pytest.fixture
def answers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What the faked calibration inputs answer, in order ("" passes; a calibration
    sends ``CALIBRATION_INPUTS`` of them, and stops at the first that fails)."""
    queue: list[str] = []

    async def run(channels: Any, node: Any, fingerprint: str, cal: Any) -> str:
        return queue.pop(0)

    monkeypatch.setattr(calibration, "prepare", lambda model, layers, seed: None)
    monkeypatch.setattr(calibration, "run_calibration", run)
    return queue


def _state(store: Store) -> tuple[NodeState, str]:
    [node] = store.nodes()
    return node.state, node.down_reason


def test_calibration_decides_a_nodes_state(tmp_path: Path, answers: list[str]) -> None:
    store = Store(SQLiteDatabase(tmp_path / "t.db"))
    quarantined: list[str] = []
    trust = NodeTrust(store, None, FP, ANY_BACKEND, lambda n, r: quarantined.append(n))  # type: ignore[arg-type]

    async def register(a: NodeAnnouncement) -> tuple[NodeState, str]:
        store.register(a, 0.0)
        trust.decide("n")
        seen = _state(store)
        await trust.calibrated("n", 5.0)
        return seen

    async def scenario() -> None:
        answers.extend([""] * calibration.CALIBRATION_INPUTS)
        assert (await register(_announce(0, 2)))[0] is NodeState.CALIBRATING
        assert _state(store) == (NodeState.UP, "")
        answers.append("calibration: the output differs")
        await register(_announce(2, 4))  # another range: calibrated again, and failed
        assert _state(store) == (NodeState.QUARANTINED, "calibration: the output differs")
        assert quarantined == ["n"]
        seen = await register(_announce(2, 4))  # the same range again: stays out
        assert seen == _state(store) == (NodeState.QUARANTINED, "calibration: the output differs")
        answers.extend([""] * calibration.CALIBRATION_INPUTS)
        await register(_announce(0, 2))  # another range: a fresh chance
        assert _state(store) == (NodeState.UP, "")
        trust.quarantine("n", "verification failed: x")  # the verifier's verdict
        assert _state(store) == (NodeState.QUARANTINED, "verification failed: x")
        assert quarantined == ["n", "n"]
        store.register(_announce(0, 2, fingerprint="e" * 64), 0.0)
        trust.decide("n")  # a node of another model is not this tracker's to calibrate
        assert _state(store) == (NodeState.UP, "")
        assert answers == []

    asyncio.run(scenario())


def test_a_restarted_tracker_keeps_a_quarantined_node_out(
    tmp_path: Path, answers: list[str]
) -> None:
    store = Store(SQLiteDatabase(tmp_path / "t.db"))
    store.register(_announce(0, 2), 0.0)
    store.set_state("n", NodeState.QUARANTINED, "verification failed: x")

    async def scenario() -> None:
        trust = NodeTrust(store, None, FP, ANY_BACKEND, lambda n, r: None)  # type: ignore[arg-type]
        [before] = store.nodes()
        store.register(_announce(0, 2), 1.0)  # it registers again (Tracker.register)
        trust.decide("n", before)
        assert _state(store) == (NodeState.QUARANTINED, "verification failed: x")
        answers.extend([""] * calibration.CALIBRATION_INPUTS)
        store.register(_announce(0, 3), 2.0)  # until it serves something else
        trust.decide("n", before)
        await trust.calibrated("n", 5.0)
        assert _state(store) == (NodeState.UP, "")

    asyncio.run(scenario())
