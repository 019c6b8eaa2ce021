"""The node's loop on the tiny model: epochs, cache misses, batching, deadlines, load."""

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from meshnet.engine.local import LocalModel
from meshnet.errors import (
    CacheMiss,
    Cancelled,
    DeadlineExceeded,
    KVBudgetExhausted,
    Overloaded,
    ShardMismatch,
    StaleEpoch,
)
from meshnet.layer_range import LayerRange
from meshnet.node.engine import EngineConfig, NodeEngine
from meshnet.node.scheduler import StepWork


@contextmanager
def running(tiny_path: Path, config: EngineConfig | None = None) -> Iterator[NodeEngine]:
    """A started engine serving every layer of the tiny model, stopped on exit."""
    e = NodeEngine(config or EngineConfig())
    e.start()
    try:
        e.tiers.load(str(tiny_path), LayerRange(0, 4)).result(timeout=30)
        yield e
    finally:
        e.stop()


@pytest.fixture
def engine(tiny_path: Path):  # type: ignore[no-untyped-def]
    with running(tiny_path) as e:
        yield e


def _step(engine: NodeEngine, sid: str, epoch: int, ids: list[int]) -> np.ndarray:
    return engine.submit(StepWork(sid, epoch, np.asarray(ids, np.int64), None)).result(10)


def test_steps_match_the_in_process_chain(engine: NodeEngine, tiny: LocalModel) -> None:
    engine.sessions.open("s", 1).result(5)
    got = [_step(engine, "s", 1, [5, 6, 7]), _step(engine, "s", 1, [9])]
    kv = tiny.chain.new_sequence()
    want = [
        tiny.chain.forward(np.asarray([5, 6, 7]), [kv], [3]),
        tiny.chain.forward(np.asarray([9]), [kv], [1]),
    ]
    for g, w in zip(got, want, strict=True):
        assert np.array_equal(g, w)


def test_an_idle_node_hands_back_what_ended_sessions_freed(
    engine: NodeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ended session's KV (heap blocks under memory.KEEP_UNDER) stays resident until
    the heap is trimmed: the loop trims once, as it next waits for work, and not while
    steps run (a step's freed buffers serve the next step) or when nothing was freed."""
    trims: list[float] = []
    monkeypatch.setattr("meshnet.node.engine.trim", lambda: trims.append(time.monotonic()))
    engine.sessions.open("s", 1).result(5)
    _step(engine, "s", 1, [5, 6, 7])
    _step(engine, "s", 1, [9])
    assert trims == []
    assert engine.sessions.release("s", 1).result(5)
    deadline = time.monotonic() + 5
    while not trims and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(trims) == 1
    engine.sessions.open("t", 1).result(5)
    _step(engine, "t", 1, [4])
    assert not engine.sessions.release("s", 1).result(5)  # nothing left to free
    time.sleep(0.1)
    assert len(trims) == 1


def test_stale_epochs_are_rejected_and_change_nothing(engine: NodeEngine) -> None:
    engine.sessions.open("s", 2).result(5)
    _step(engine, "s", 2, [1, 2])
    with pytest.raises(StaleEpoch):
        engine.sessions.open("s", 1).result(5)
    with pytest.raises(StaleEpoch):
        _step(engine, "s", 1, [3])
    assert engine.stats().sessions == 1
    kv_before = engine.stats().kv_bytes
    engine.sessions.release("s", 1).result(5)  # an older epoch cannot free the newer one's KV
    assert engine.stats().kv_bytes == kv_before
    engine.sessions.release("s", 2).result(5)
    assert engine.stats().sessions == 0 and engine.stats().kv_bytes == 0


def test_unknown_session_is_a_cache_miss(engine: NodeEngine) -> None:
    with pytest.raises(CacheMiss):
        _step(engine, "nobody", 1, [1])


def test_expired_step_is_not_run(engine: NodeEngine) -> None:
    engine.sessions.open("s", 1).result(5)
    work = StepWork("s", 1, np.asarray([1], np.int64), deadline=time.monotonic() - 1)
    with pytest.raises(DeadlineExceeded):
        engine.submit(work).result(5)


def test_concurrent_sessions_are_batched_and_each_gets_its_own_result(
    engine: NodeEngine, tiny: LocalModel
) -> None:
    prompts = {f"s{i}": [i + 3, i + 4, 40 + i] for i in range(6)}
    for sid in prompts:
        engine.sessions.open(sid, 1).result(5)
    futures = {
        sid: engine.submit(StepWork(sid, 1, np.asarray(p, np.int64), None))
        for sid, p in prompts.items()
    }
    for sid, p in prompts.items():
        kv = tiny.chain.new_sequence()
        want = tiny.chain.forward(np.asarray(p), [kv], [len(p)])
        assert np.allclose(futures[sid].result(10), want, rtol=1e-4, atol=1e-4)


def test_empty_node_refuses_sessions_until_loaded(tiny_path: Path) -> None:
    e = NodeEngine()
    e.start()
    try:
        with pytest.raises(ShardMismatch):
            e.sessions.open("s", 1).result(5)
        e.tiers.load(str(tiny_path), LayerRange(2, 4)).result(30)
        assert e.stats().layers == LayerRange(2, 4)
        e.sessions.open("s", 1).result(5)
    finally:
        e.stop()


@pytest.fixture
def chunky(tiny_path: Path):  # type: ignore[no-untyped-def]
    config = EngineConfig(prefill_chunk=4, max_batch_tokens=8, max_queued_steps=2)
    with running(tiny_path, config) as e:
        yield e


def test_long_prefill_is_chunked_and_decodes_keep_running(
    chunky: NodeEngine, tiny: LocalModel
) -> None:
    chunky.sessions.open("a", 1).result(5)
    chunky.sessions.open("b", 1).result(5)
    _step(chunky, "a", 1, [5, 6, 7])
    long_prompt = list(range(3, 203))
    b = chunky.submit(StepWork("b", 1, np.asarray(long_prompt, np.int64), None))
    a = chunky.submit(StepWork("a", 1, np.asarray([9], np.int64), None))
    a.result(10)
    assert not b.done()  # the decode did not wait for the 200-token prompt
    kv = tiny.chain.new_sequence()
    whole = tiny.chain.forward(np.asarray(long_prompt), [kv], [len(long_prompt)])
    assert np.allclose(b.result(30), whole, rtol=1e-4, atol=1e-4)


def test_too_many_queued_steps_are_refused_at_once(chunky: NodeEngine) -> None:
    for sid in "abc":
        chunky.sessions.open(sid, 1).result(5)
    chunky.submit(StepWork("a", 1, np.arange(3, 203, dtype=np.int64), None))
    chunky.submit(StepWork("b", 1, np.arange(3, 203, dtype=np.int64), None))
    with pytest.raises(Overloaded):
        chunky.submit(StepWork("c", 1, np.asarray([1], np.int64), None))


def test_cancel_fails_unfinished_steps_and_frees_kv(chunky: NodeEngine) -> None:
    chunky.sessions.open("a", 1).result(5)
    work = chunky.submit(StepWork("a", 1, np.arange(3, 203, dtype=np.int64), None))
    chunky.sessions.cancel("a").result(5)
    with pytest.raises(Cancelled):
        work.result(5)
    assert chunky.stats().sessions == 0 and chunky.stats().kv_bytes == 0


def test_kv_budget_refuses_growth_and_changes_nothing(tiny_path: Path) -> None:
    e = NodeEngine(EngineConfig(kv_budget_bytes=100 * 1024))
    e.start()
    try:
        e.tiers.load(str(tiny_path), LayerRange(0, 4)).result(30)
        e.sessions.open("a", 1).result(5)
        _step(e, "a", 1, [5, 6, 7])
        before = e.stats().kv_bytes
        with pytest.raises(KVBudgetExhausted):
            _step(e, "a", 1, list(range(3, 153)))
        assert e.stats().kv_bytes == before and e.stats().kv_peak_bytes == before
        _step(e, "a", 1, [9])  # the session is intact and goes on
    finally:
        e.stop()


def test_stop_answers_everything_still_waiting(tiny_path: Path) -> None:
    e = NodeEngine(EngineConfig(prefill_chunk=1, max_batch_tokens=1))
    e.start()
    e.tiers.load(str(tiny_path), LayerRange(0, 4)).result(30)
    e.sessions.open("a", 1).result(5)
    work = e.submit(StepWork("a", 1, np.arange(3, 203, dtype=np.int64), None))
    e.stop()  # mid-prefill: 200 one-row chunks
    with pytest.raises(Cancelled):
        work.result(5)


@pytest.mark.parametrize("backend", ["fast", "numpy"])
def test_a_replay_of_decode_steps_rebuilds_bit_identical_kv(tiny_path: Path, backend: str) -> None:
    """Failover sends a span's logged decode steps as one message; the KV it builds must
    equal the one built by the steps sent one by one, or the output would drift."""
    with running(tiny_path, EngineConfig(backend=backend, prefill_chunk=4)) as e:
        prompt, decoded = [5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17, 18, 19]
        e.sessions.open("alone", 1).result(5)
        _step(e, "alone", 1, prompt)
        for i in decoded:
            _step(e, "alone", 1, [i])
        e.sessions.open("replayed", 1).result(5)
        _step(e, "replayed", 1, prompt)
        work = StepWork("replayed", 1, np.asarray(decoded, np.int64), None, step=1, replay=True)
        e.submit(work).result(10)
        assert e.sessions.open("replayed", 1).result(5).steps == 1 + len(decoded)  # one per row
        assert np.array_equal(_step(e, "alone", 1, [20]), _step(e, "replayed", 1, [20]))


@pytest.fixture
def parking(tiny_path: Path, tmp_path: Path):  # type: ignore[no-untyped-def]
    """An engine that parks KV under ``tmp_path``."""
    with running(tiny_path, EngineConfig(park_dir=str(tmp_path))) as e:
        yield e


def test_a_parked_session_leaves_the_budget_and_resumes_bit_identical(
    parking: NodeEngine, tmp_path: Path
) -> None:
    engine = parking
    for sid in ("hot", "parked"):
        engine.sessions.open(sid, 1).result(5)
        _step(engine, sid, 1, [5, 6, 7])
    bytes_hot = engine.stats().kv_bytes
    assert engine.parking.park("parked").result(5).tokens == 3
    stats = engine.stats()
    assert (stats.sessions, stats.parked) == (1, 1)
    assert stats.kv_bytes == bytes_hot // 2
    assert len(list(tmp_path.glob("*.kv"))) == 1
    with pytest.raises(CacheMiss):  # a parked session runs no step until resumed
        _step(engine, "parked", 1, [9])
    opened = engine.sessions.open("parked", 2, resume=True).result(5)
    assert (opened.kv_tokens, opened.steps) == (3, 1)
    assert engine.stats().parked == 0 and not list(tmp_path.glob("*.kv"))
    engine.sessions.open("hot", 2, resume=True).result(5)
    assert np.array_equal(_step(engine, "parked", 2, [9]), _step(engine, "hot", 2, [9]))


def test_a_corrupt_parked_file_resumes_empty(parking: NodeEngine, tmp_path: Path) -> None:
    engine = parking
    engine.sessions.open("s", 1).result(5)
    _step(engine, "s", 1, [5, 6, 7])
    engine.parking.park("s").result(5)
    (path,) = tmp_path.glob("*.kv")
    data = bytearray(path.read_bytes())
    data[10] ^= 1
    path.write_bytes(bytes(data))
    opened = engine.sessions.open("s", 2, resume=True).result(5)
    assert (opened.kv_tokens, opened.steps) == (0, 0)  # the driver rebuilds it


def test_release_frees_parked_kv_and_rewind_cuts_an_unfinished_turn(
    engine: NodeEngine,
) -> None:
    engine.sessions.open("s", 1).result(5)
    _step(engine, "s", 1, [5, 6, 7])
    before = _step(engine, "s", 1, [9])
    _step(engine, "s", 1, [11])  # a turn that never committed on the tracker
    opened = engine.sessions.open("s", 2, resume=True, rewind=(4, 2)).result(5)
    assert (opened.kv_tokens, opened.steps) == (4, 2)
    again = engine.sessions.open("s", 3, resume=True, rewind=(3, 1)).result(5)
    assert (again.kv_tokens, again.steps) == (3, 1)
    assert np.array_equal(
        engine.submit(StepWork("s", 3, np.asarray([9], np.int64), None, step=1)).result(10), before
    )
    engine.parking.park("s").result(5)
    assert engine.sessions.release("s", 3).result(5) is True
    assert engine.stats().parked == 0 and engine.stats().sessions == 0
    assert engine.sessions.release("s", 3).result(5) is False


def test_a_parked_session_exports_the_kv_it_had(parking: NodeEngine) -> None:
    engine = parking
    engine.sessions.open("s", 1).result(5)
    _step(engine, "s", 1, [5, 6, 7])
    hot = engine.sessions.export_kv("s").result(5)
    engine.parking.park("s").result(5)
    parked = engine.sessions.export_kv("s").result(5)
    assert (parked.epoch, parked.steps, parked.tokens) == (hot.epoch, hot.steps, hot.tokens)
    assert bytes(parked.payload) == bytes(hot.payload)


def test_a_forwarding_hop_keeps_what_it_sent_and_a_rewind_cuts_it(
    tiny_path: Path, tiny: LocalModel
) -> None:
    e = NodeEngine(EngineConfig())
    e.start()
    try:
        e.tiers.load(str(tiny_path), LayerRange(0, 2)).result(timeout=30)
        e.sessions.open("s", 1).result(5)

        def step(ids: list[int], n: int, keep: bool = True) -> np.ndarray:
            work = StepWork("s", 1, np.asarray(ids, np.int64), None, step=n, keep_output=keep)
            return e.submit(work).result(10)

        prompt, first, second = step([5, 6, 7], 0), step([9], 1), step([11], 2)
        step([12], 3, keep=False)  # carried by the driver: not kept here
        sent = e.sessions.sent("s", 0, 10).result(5)
        assert [n for n, _ in sent] == [0, 1, 2]
        for (_, got), want in zip(sent, [prompt, first, second], strict=True):
            assert np.array_equal(got, want)
        assert e.stats().kv_bytes > 0
        e.sessions.open("s", 2, resume=True, rewind=(4, 2)).result(5)  # the last two steps unseen
        assert [n for n, _ in e.sessions.sent("s", 0, 10).result(5)] == [0, 1]
        assert e.sessions.sent("other", 0, 10).result(5) == []
    finally:
        e.stop()


def test_what_a_step_defers_runs_once_its_whole_batch_is_answered(engine: NodeEngine) -> None:
    """A stream's handler woken inside a batch's bookkeeping takes the GIL from the loop
    whenever the loop lets it go: what wakes one is held until every step is answered."""
    sids = ["a", "b", "c"]
    for sid in sids:
        engine.sessions.open(sid, 1).result(5)
    gate = threading.Event()
    engine.inbox.control(gate.wait)  # holds the loop, so the three steps meet in one batch
    futures = [engine.submit(StepWork(sid, 1, np.asarray([3, 4], np.int64), None)) for sid in sids]
    seen: list[list[bool]] = []
    all_seen = threading.Event()

    def deferred() -> None:
        seen.append([f.done() for f in futures])
        if len(seen) == len(futures):
            all_seen.set()

    for f in futures:
        f.add_done_callback(lambda _: engine.forwards.after_batch(deferred))
    gate.set()
    assert all_seen.wait(10)
    assert engine.stats().last_batch == 3
    assert seen == [[True, True, True]] * 3
    ran: list[int] = []
    engine.forwards.after_batch(lambda: ran.append(1))  # not the loop's thread: at once
    assert ran == [1]


def _brought(engine: NodeEngine, work: StepWork) -> tuple[str, list[str], Future[np.ndarray]]:
    """Bring ``work`` with ``run_here`` from a thread of its own: that thread's name, the
    threads its forward and its ``then`` ran on, and its future."""
    ran_on: list[str] = []
    work.on_output = lambda _: ran_on.append(threading.current_thread().name)
    bringer = threading.Thread(
        target=engine.run_here,
        args=(work, lambda _: ran_on.append(threading.current_thread().name)),
        name="bringer",
    )
    bringer.start()
    bringer.join(10)
    return bringer.name, ran_on, work.future


def test_a_step_brought_to_an_idle_loop_runs_on_the_thread_that_brings_it(
    engine: NodeEngine, tiny: LocalModel
) -> None:
    """A ring's hop that idles starts a relayed step without waking its loop's thread."""
    engine.sessions.open("s", 1).result(5)
    name, ran_on, future = _brought(engine, StepWork("s", 1, np.asarray([5], np.int64), None))
    assert future.done()  # answered before run_here returned
    assert ran_on == [name, name]  # the forward, then the step's ``then``
    kv = tiny.chain.new_sequence()
    assert np.array_equal(future.result(), tiny.chain.forward(np.asarray([5]), [kv], [1]))
    assert _step(engine, "s", 1, [6]).shape == future.result().shape  # the loop goes on


def test_a_step_brought_to_a_busy_loop_waits_for_the_loops_thread(engine: NodeEngine) -> None:
    engine.sessions.open("s", 1).result(5)
    gate = threading.Event()
    engine.inbox.control(gate.wait)  # the loop's thread is busy
    _, ran_on, future = _brought(engine, StepWork("s", 1, np.asarray([5], np.int64), None))
    assert not future.done()
    gate.set()
    future.result(10)
    assert ran_on == ["node-engine", "node-engine"]


def test_a_prompt_brought_to_an_idle_loop_finishes_every_chunk(
    tiny_path: Path, tiny: LocalModel
) -> None:
    """The thread that brings a long prompt runs its first chunk; the loop's thread runs
    the rest, as it would have."""
    with running(tiny_path, EngineConfig(prefill_chunk=2)) as e:
        e.sessions.open("s", 1).result(5)
        ids = [5, 6, 7, 8, 9]
        _, ran_on, future = _brought(e, StepWork("s", 1, np.asarray(ids, np.int64), None))
        got = future.result(10)
        assert ran_on == ["node-engine"]  # run whole in no one forward: no hand-over; then
    kv = tiny.chain.new_sequence()
    assert np.array_equal(got, tiny.chain.forward(np.asarray(ids), [kv], [len(ids)]))
