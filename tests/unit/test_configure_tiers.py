"""Live configuration tiers: every value checked before anything changes, T1 at once, T2
only at a step boundary with no prompt half-run, T3 swapping the shard after a drain, and a
refused change of any tier leaving the node as it was."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnet.engine.local import LocalModel
from meshnet.errors import CacheMiss, LayerRangeError, MalformedBundle, Overloaded, RequestError
from meshnet.layer_range import LayerRange
from meshnet.node.configure import StreamLimit
from meshnet.node.engine import EngineConfig, NodeEngine
from meshnet.node.scheduler import StepWork
from meshnet.node.service import NodeService
from meshnet.node.tiers import (
    MAX_BATCH_TOKENS,
    Batching,
    Limits,
    ShardLoad,
    check_batching,
    check_limits,
    parse,
    with_batching,
)
from meshnet.protocol import meshnet_pb2 as pb

# --- checks (pure) -----------------------------------------------------------------


@pytest.mark.parametrize(
    "limits",
    [
        Limits(max_streams=0),
        Limits(max_streams=65),  # past the 64 the server was sized for
        Limits(max_queued_steps=0),
        Limits(max_queued_steps=1 << 20),
        Limits(log_level="LOUD"),
    ],
)
def test_limits_out_of_bounds_are_refused_with_the_field(limits: Limits) -> None:
    with pytest.raises(RequestError) as e:
        check_limits(limits, stream_ceiling=64)
    assert ("log_level" if limits.log_level else "must be in") in e.value.message


def test_limits_in_bounds_pass() -> None:
    check_limits(Limits(max_streams=64, max_queued_steps=1, log_level="DEBUG"), 64)
    check_limits(Limits(), 64)  # nothing asked: nothing to refuse


@pytest.mark.parametrize(
    ("batching", "words"),
    [
        (Batching(max_batch_tokens=0), "max_batch_tokens must be in"),
        (Batching(max_batch_tokens=MAX_BATCH_TOKENS + 1), "max_batch_tokens must be in"),
        (Batching(prefill_chunk=0), "prefill_chunk must be in"),
        (Batching(kv_budget_bytes=-1), "kv_budget_bytes must be in"),
        (Batching(kv_budget_bytes=1 << 60), "kv_budget_bytes must be in"),
        (Batching(prefill_chunk=1024), "larger than max_batch_tokens 512"),
        (Batching(kv_budget_bytes=999), "below the 1000 bytes"),
    ],
)
def test_batching_out_of_bounds_is_refused_with_the_reason(batching: Batching, words: str) -> None:
    with pytest.raises(RequestError) as e:
        check_batching(batching, EngineConfig(), held_bytes=1000)
    assert words in e.value.message


def test_batching_checks_the_values_it_would_run_with() -> None:
    config = EngineConfig(max_batch_tokens=512, prefill_chunk=128)
    check_batching(Batching(max_batch_tokens=1024, prefill_chunk=1024), config, 0)
    check_batching(Batching(kv_budget_bytes=0), config, 1 << 30)  # 0: no limit
    after = with_batching(config, Batching(prefill_chunk=64))
    assert (after.max_batch_tokens, after.prefill_chunk) == (512, 64)


def test_parse_leaves_unset_fields_unchanged() -> None:
    request = pb.ConfigureRequest(limits=pb.Limits(max_queued_steps=9, log_level="debug"))
    assert parse(request, None) == Limits(max_queued_steps=9, log_level="DEBUG")
    request = pb.ConfigureRequest(batching=pb.Batching(kv_budget_bytes=0))
    assert parse(request, None) == Batching(kv_budget_bytes=0)
    request = pb.ConfigureRequest(load=pb.LoadShard(layer_start=1, layer_end=3))
    assert parse(request, "/m.gguf") == ShardLoad("/m.gguf", LayerRange(1, 3))


def test_parse_refuses_no_tier_no_model_and_an_empty_range() -> None:
    with pytest.raises(MalformedBundle):
        parse(pb.ConfigureRequest(), None)
    with pytest.raises(RequestError):
        parse(pb.ConfigureRequest(load=pb.LoadShard(layer_start=0, layer_end=2)), None)
    with pytest.raises(LayerRangeError):
        parse(pb.ConfigureRequest(load=pb.LoadShard(layer_start=2, layer_end=2)), "/m")


def test_the_stream_limit_follows_its_size_for_new_streams_only() -> None:
    size = [2]
    gate = StreamLimit(lambda: size[0])
    assert gate.acquire() and gate.acquire() and not gate.acquire()
    size[0] = 1
    assert gate.held == 2 and not gate.acquire()  # held streams go on; no new one
    gate.release()
    gate.release()
    assert gate.acquire() and not gate.acquire()
    size[0] = 3
    assert gate.acquire() and gate.acquire() and not gate.acquire()


# --- the engine applying tiers between iterations -----------------------------------


class RecordingEngine(NodeEngine):
    """Notes, when a T2 change is applied, how many rows each admitted step had run."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.at_apply: list[list[int]] = []
        apply = self.tiers._apply_batching

        def recorded(batching: Batching) -> EngineConfig:
            self.at_apply.append([w.done_rows for w in self.steps.pending])
            return apply(batching)

        self.tiers._apply_batching = recorded  # type: ignore[method-assign]


@pytest.fixture
def engine(tiny_path: Path) -> Iterator[RecordingEngine]:
    e = RecordingEngine(EngineConfig(prefill_chunk=1, max_batch_tokens=8))
    e.start()
    e.tiers.load(str(tiny_path), LayerRange(0, 4)).result(30)
    yield e
    e.stop()


def _prompt(n: int) -> np.ndarray:
    return np.arange(1, n + 1, dtype=np.int64)


def test_t1_applies_at_once(engine: RecordingEngine) -> None:
    root = logging.getLogger()
    level = root.level
    try:
        config = engine.tiers.configure_limits(Limits(max_streams=3, log_level="ERROR")).result(5)
        assert (config.max_streams, engine.stats().max_streams) == (3, 3)
        assert config.max_queued_steps == EngineConfig().max_queued_steps
        assert root.level == logging.ERROR
        engine.tiers.configure_limits(Limits(max_queued_steps=1)).result(5)
        engine.sessions.open("s", 1).result(5)
        first = StepWork("s", 1, _prompt(40), None)
        engine.submit(first)
        with pytest.raises(Overloaded):  # one step unfinished is the limit now
            engine.submit(StepWork("t", 1, _prompt(1), None))
        first.future.result(30)
    finally:
        root.setLevel(level)


def test_t2_waits_for_a_half_run_prompt_and_the_prompt_stays_exact(
    engine: RecordingEngine, tiny: LocalModel
) -> None:
    engine.sessions.open("s", 1).result(5)
    work = StepWork("s", 1, _prompt(60), None)
    engine.submit(work)
    while work.done_rows == 0 and not work.future.done():
        pass  # the prompt has started: the change comes mid-prompt
    change = Batching(prefill_chunk=7, max_batch_tokens=16)
    config = engine.tiers.configure_batching(change).result(30)
    assert (config.prefill_chunk, config.max_batch_tokens) == (7, 16)
    assert engine.at_apply and all(rows == 0 for rows in engine.at_apply[0])
    got = work.future.result(30)
    want = tiny.chain.forward(_prompt(60), [tiny.chain.new_sequence()], [60])
    assert np.array_equal(got, want)
    # Later steps run with the new chunk, still exactly.
    engine.sessions.open("u", 1).result(5)
    again = engine.submit(StepWork("u", 1, _prompt(60), None)).result(30)
    assert np.array_equal(again, want)


def test_t2_below_the_kv_held_is_refused_and_changes_nothing(engine: RecordingEngine) -> None:
    engine.sessions.open("s", 1).result(5)
    engine.submit(StepWork("s", 1, _prompt(20), None)).result(30)
    held = engine.stats().kv_bytes
    assert held > 0
    with pytest.raises(RequestError) as e:
        change = Batching(kv_budget_bytes=held - 1, prefill_chunk=2)
        engine.tiers.configure_batching(change).result(5)
    assert f"below the {held} bytes" in e.value.message
    assert engine.config.prefill_chunk == 1 and engine.stats().kv_budget_bytes == 0
    config = engine.tiers.configure_batching(Batching(kv_budget_bytes=held)).result(5)
    assert config.kv_budget_bytes == held == engine.stats().kv_budget_bytes


def test_t3_lets_a_half_run_prompt_finish_then_swaps(
    engine: RecordingEngine, tiny_path: Path
) -> None:
    from meshnet.backends.shard import load_shard
    from meshnet.model.gguf_file import open_gguf
    from meshnet.model.spec import read_spec

    f = open_gguf(tiny_path)
    shard = load_shard(f, read_spec(f), LayerRange(0, 2))
    engine.sessions.open("s", 1).result(5)
    engine.sessions.open("q", 1).result(5)
    work = StepWork("s", 1, _prompt(60), None)
    engine.submit(work)
    while work.done_rows == 0 and not work.future.done():
        pass  # the prompt has started
    swapped = engine.tiers.swap(shard)
    queued = engine.submit(StepWork("q", 1, _prompt(3), None))
    refused: list[Any] = []
    try:
        engine.sessions.open("t", 1).result(5)
    except Overloaded as e:
        refused.append(e)
    assert work.future.result(30).shape[0] == 1  # the half-run prompt ran to its end
    assert swapped.result(30) == 2
    with pytest.raises(CacheMiss):  # queued behind the drain: its KV went with the swap
        queued.result(5)
    assert refused or work.future.done()  # the open came during the drain, or after it
    assert engine.stats().layers == LayerRange(0, 2) and engine.stats().sessions == 0
    engine.sessions.open("t", 2).result(5)  # the new shard serves


# --- Configure on the servicer ------------------------------------------------------


def _configure(service: NodeService, **kind: Any) -> pb.ConfigureResponse:
    return service.Configure(pb.ConfigureRequest(**kind), None)  # type: ignore[arg-type]


def test_a_configure_that_cannot_be_applied_changes_nothing(
    service: NodeService, tiny_path: Path, tmp_path: Path
) -> None:
    service.engine.sessions.open("s", 1).result(5)
    before = service.engine.stats()
    for load, kind in [
        (pb.LoadShard(model_path=str(tiny_path.parent / "missing.gguf"), layer_end=2), "model"),
        (pb.LoadShard(model_path=str(tmp_path / "x.gguf"), layer_end=2), "permission-denied"),
        (pb.LoadShard(layer_start=2, layer_end=9), "layer-range-invalid"),
    ]:
        reply = _configure(service, load=load)
        assert not reply.applied and reply.failure.kind.startswith(kind), reply
        assert (reply.layer_start, reply.layer_end) == (0, 4)
    reply = _configure(service, batching=pb.Batching(max_batch_tokens=0))
    assert (reply.applied, reply.failure.kind) == (False, "bad-request")
    reply = _configure(service, limits=pb.Limits(max_streams=1000))
    assert "max_streams must be in [1, 64]" in reply.failure.message
    after = service.engine.stats()
    assert (after.layers, after.sessions, after.max_streams) == (
        before.layers,
        before.sessions,
        before.max_streams,
    )
    assert reply.settings.max_batch_tokens == EngineConfig().max_batch_tokens


def test_configure_answers_each_tier_with_the_settings_after(
    service: NodeService, tiny_path: Path
) -> None:
    reply = _configure(service, limits=pb.Limits(max_streams=2))
    assert (reply.applied, reply.tier, reply.settings.max_streams) == (True, "t1", 2)
    assert service.forward.limit.acquire() and service.forward.limit.acquire()
    assert not service.forward.limit.acquire()
    reply = _configure(service, batching=pb.Batching(prefill_chunk=16), check_only=True)
    assert (reply.applied, reply.failure.kind, reply.settings.prefill_chunk) == (False, "", 128)
    reply = _configure(service, batching=pb.Batching(prefill_chunk=16))
    assert (reply.applied, reply.tier, reply.settings.prefill_chunk) == (True, "t2", 16)
    service.engine.sessions.open("s", 1).result(5)
    service.engine.submit(StepWork("s", 1, _prompt(5), None)).result(30)
    same = _configure(service, load=pb.LoadShard(layer_start=0, layer_end=4))
    assert (same.applied, same.keeps_kv, same.sessions_ended) == (True, True, 0)
    stats = service.engine.stats()
    assert (stats.sessions, stats.parked) == (0, 1)  # reloaded: the KV parked, still its
    assert service.engine.sessions.open("s", 2, resume=True).result(5).kv_tokens == 5
    moved = _configure(service, load=pb.LoadShard(layer_start=0, layer_end=2))
    assert (moved.applied, moved.tier, moved.sessions_ended, moved.keeps_kv) == (
        True,
        "t3",
        1,
        False,
    )
    assert (moved.layer_start, moved.layer_end) == (0, 2)
    assert service.engine.stats().sessions == 0
