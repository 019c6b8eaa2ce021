"""A park that cannot be written leaves nothing on disk and the KV hot; a two-phase park
frees the hot KV only at its commit, and only if the session did not move on; the
policy's backoff between failed parks grows and is capped."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshnet.errors import ParkFailed, StaleEpoch
from meshnet.layer_range import LayerRange
from meshnet.node.engine import EngineConfig, NodeEngine
from meshnet.node.parking import ParkPhase, ParkStore
from meshnet.node.scheduler import StepWork
from meshnet.tracker.sessions.parking import BACKOFF_CAP_S, ParkBackoff


@pytest.fixture
def engine(tiny_path: Path, tmp_path: Path) -> Iterator[NodeEngine]:
    e = NodeEngine(EngineConfig(park_dir=str(tmp_path / "parked")))
    e.start()
    try:
        e.tiers.load(str(tiny_path), LayerRange(0, 4)).result(timeout=30)
        yield e
    finally:
        e.stop()


def _step(engine: NodeEngine, sid: str, ids: list[int]) -> np.ndarray:
    return engine.submit(StepWork(sid, 1, np.asarray(ids, np.int64), None)).result(10)


def test_a_park_directory_that_cannot_be_made_is_a_typed_failure(tmp_path: Path) -> None:
    (tmp_path / "parked").write_bytes(b"a file where the directory should be")
    store = ParkStore(str(tmp_path / "parked"))
    with pytest.raises(ParkFailed):
        store.write("s", 1, 2, 3, memoryview(b"kv"))


def test_an_unwritable_park_leaves_the_session_hot(engine: NodeEngine, tmp_path: Path) -> None:
    engine.sessions.open("s", 1).result(5)
    _step(engine, "s", [5, 6, 7])
    before = engine.stats()
    (tmp_path / "parked").write_bytes(b"in the way")
    with pytest.raises(ParkFailed):
        engine.parking.park("s").result(5)
    after = engine.stats()
    assert (after.sessions, after.parked, after.kv_bytes) == (1, 0, before.kv_bytes)
    _step(engine, "s", [9])  # still hot: it runs


def test_a_prepared_park_frees_only_at_its_commit(engine: NodeEngine, tmp_path: Path) -> None:
    engine.sessions.open("s", 1).result(5)
    _step(engine, "s", [5, 6, 7])
    held = engine.stats().kv_bytes
    assert engine.parking.park("s", 1, ParkPhase.PREPARE).result(5).freed_bytes == 0
    assert engine.stats().kv_bytes == held and len(list((tmp_path / "parked").iterdir())) == 1
    done = engine.parking.park("s", 1, ParkPhase.COMMIT).result(5)
    assert done.freed_bytes == held and engine.stats().kv_bytes == 0
    assert engine.stats().parked == 1


def test_an_aborted_park_drops_its_file(engine: NodeEngine, tmp_path: Path) -> None:
    engine.sessions.open("s", 1).result(5)
    _step(engine, "s", [5, 6, 7])
    engine.parking.park("s", 1, ParkPhase.PREPARE).result(5)
    engine.parking.park("s", 1, ParkPhase.ABORT).result(5)
    assert list((tmp_path / "parked").iterdir()) == []
    assert (engine.stats().sessions, engine.stats().parked) == (1, 0)


def test_a_commit_after_the_session_moved_on_is_refused(engine: NodeEngine, tmp_path: Path) -> None:
    engine.sessions.open("s", 1).result(5)
    _step(engine, "s", [5, 6, 7])
    engine.parking.park("s", 1, ParkPhase.PREPARE).result(5)
    _step(engine, "s", [9])  # a turn ran in between: the file is out of date
    with pytest.raises(StaleEpoch):
        engine.parking.park("s", 1, ParkPhase.COMMIT).result(5)
    assert list((tmp_path / "parked").iterdir()) == []
    assert (engine.stats().sessions, engine.stats().parked) == (1, 0)


def test_the_backoff_grows_to_its_cap_and_a_success_forgets_it() -> None:
    backoff = ParkBackoff(1.0, random.Random(7))
    now, waits = 100.0, []
    for _ in range(14):
        waits.append(backoff.failed("s", now, "park-failed: full"))
        assert not backoff.due("s", now + waits[-1] - 0.01)
        assert backoff.due("s", now + waits[-1])
    assert [0.5 <= w <= 1.0 for w in waits[:1]] == [True]
    assert all(2 ** (n - 1) / 2 <= w <= 2 ** (n - 1) for n, w in enumerate(waits[:9], 1))
    assert max(waits) <= BACKOFF_CAP_S and waits[-1] >= BACKOFF_CAP_S / 2
    assert backoff.describe("s")["failures"] == 14  # type: ignore[index]
    backoff.forget("s")
    assert backoff.due("s", now) and backoff.describe("s") is None
    backoff.failed("t", now, "x")
    backoff.keep_only({"s"})  # t is no longer idle
    assert backoff.describe("t") is None
