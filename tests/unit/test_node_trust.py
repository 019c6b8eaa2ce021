"""Node states under verification (tracker/trust/calibration.py): calibrating until a node's
calibration passes, quarantined while it serves what it failed on, calibrated afresh
when it serves something else. The calibration itself is faked here (its exchange with a
real node is tests/e2e/test_verified_work.py's); the registry is a real SQLite store."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from meshnet.errors import MeshnetError, NodeFailure
from meshnet.mesh_messages import NodeAnnouncement, NodeLoad
from meshnet.tracker.nodes.registry import NodeState
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.storage.database import SQLiteDatabase
from meshnet.tracker.trust import calibration
from meshnet.tracker.trust.calibration import NodeTrust

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
def answers(monkeypatch: pytest.MonkeyPatch) -> list[str | MeshnetError]:
    """What the faked calibration inputs answer, in order ("" passes, an error is
    raised; a calibration sends ``CALIBRATION_INPUTS`` of them, and stops at the first
    that fails)."""
    queue: list[str | MeshnetError] = []

    async def run(channels: Any, node: Any, fingerprint: str, cal: Any) -> str:
        answer = queue.pop(0)
        if isinstance(answer, MeshnetError):
            raise answer
        return answer

    monkeypatch.setattr(calibration, "prepare", lambda model, layers, seed: None)
    monkeypatch.setattr(calibration, "run_calibration", run)
    return queue


def _state(store: Store) -> tuple[NodeState, str]:
    [node] = store.nodes()
    return node.state, node.down_reason


def test_calibration_decides_a_nodes_state(
    tmp_path: Path, answers: list[str | MeshnetError]
) -> None:
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
    tmp_path: Path, answers: list[str | MeshnetError]
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


def test_a_node_not_reached_is_tried_again_later_and_one_that_errs_is_quarantined(
    tmp_path: Path, answers: list[str | MeshnetError], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not reached (or busy) says nothing of a node: it stays calibrating and is tried
    again, backing off (each try costs the tracker a trusted computation); an error it
    answers to a calibration input is a failed calibration."""
    monkeypatch.setattr(calibration, "_RETRY_S", 0.2)
    store = Store(SQLiteDatabase(tmp_path / "t.db"))
    trust = NodeTrust(store, None, FP, ANY_BACKEND, lambda n, r: None)  # type: ignore[arg-type]
    store.register(_announce(0, 2), 0.0)

    async def scenario() -> None:
        answers.append(NodeFailure("unreachable", "n"))
        trust.decide("n")
        await trust.calibrated("n", 5.0)
        assert _state(store)[0] is NodeState.CALIBRATING
        answers.append("")  # not asked for until the back-off is over
        trust.decide("n")
        await trust.calibrated("n", 5.0)
        assert answers == [""] and _state(store)[0] is NodeState.CALIBRATING
        await asyncio.sleep(0.25)
        answers.append(MeshnetError("shard [0, 1) has no output head", "n"))
        trust.decide("n")
        await trust.calibrated("n", 5.0)
        assert answers == []
        assert _state(store) == (
            NodeState.QUARANTINED,
            "calibration: the node answered internal: shard [0, 1) has no output head",
        )

    asyncio.run(scenario())


def test_a_readmitted_node_calibrates_afresh_on_what_it_serves(
    tmp_path: Path, answers: list[str | MeshnetError]
) -> None:
    """An operator's readmit forgets the failed verdict (also one a restarted tracker
    read back from the registry): the node calibrates again, up when it passes, and
    quarantined again when it still fails. Only a quarantined node of this model is
    readmitted."""
    store = Store(SQLiteDatabase(tmp_path / "t.db"))
    store.register(_announce(0, 2), 0.0)
    store.set_state("n", NodeState.QUARANTINED, "verification failed: x")
    trust = NodeTrust(store, None, FP, ANY_BACKEND, lambda n, r: None)  # type: ignore[arg-type]

    async def scenario() -> None:
        [before] = store.nodes()
        store.register(_announce(0, 2), 1.0)
        trust.decide("n", before)  # the verdict read back: still out
        assert _state(store)[0] is NodeState.QUARANTINED
        answers.append("calibration: the output differs")
        assert trust.readmit("n")
        assert _state(store) == (NodeState.CALIBRATING, "")
        await trust.calibrated("n", 5.0)
        assert _state(store) == (NodeState.QUARANTINED, "calibration: the output differs")
        trust.decide("n")  # a heartbeat: the new verdict holds
        assert _state(store)[0] is NodeState.QUARANTINED
        answers.extend([""] * calibration.CALIBRATION_INPUTS)
        assert trust.readmit("n")
        assert await trust.calibrated("n", 5.0)
        assert _state(store) == (NodeState.UP, "")
        assert not trust.readmit("n")  # up: nothing to readmit
        assert _state(store) == (NodeState.UP, "") and answers == []

    asyncio.run(scenario())


def test_a_node_of_another_model_is_not_readmitted_here(tmp_path: Path) -> None:
    store = Store(SQLiteDatabase(tmp_path / "t.db"))
    store.register(_announce(0, 2, fingerprint="e" * 64), 0.0)
    store.set_state("n", NodeState.QUARANTINED, "verification failed: x")
    trust = NodeTrust(store, None, FP, ANY_BACKEND, lambda n, r: None)  # type: ignore[arg-type]
    assert not trust.readmit("n")
    assert _state(store) == (NodeState.QUARANTINED, "verification failed: x")
    assert not trust.readmit("nobody")
