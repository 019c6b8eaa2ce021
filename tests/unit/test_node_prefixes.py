"""The node's loop with its prefix cache, on the tiny model: a session opened on a
cached prefix computes the rest of its prompt to the same bits as a whole prefill."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from meshnet.errors import KVBudgetExhausted, MalformedBundle
from meshnet.kv.pages import PAGE_TOKENS
from meshnet.kv.prefix_cache import BLOCK_TOKENS
from meshnet.layer_range import LayerRange
from meshnet.node.engine import EngineConfig, NodeEngine
from meshnet.node.prefixes import PrefixAsk
from meshnet.node.scheduler import StepWork

B = BLOCK_TOKENS


@contextmanager
def running(tiny_path: Path, config: EngineConfig, n_layers: int = 4) -> Iterator[NodeEngine]:
    e = NodeEngine(config)
    e.start()
    try:
        e.tiers.load(str(tiny_path), LayerRange(0, n_layers)).result(timeout=30)
        yield e
    finally:
        e.stop()


def _step(engine: NodeEngine, sid: str, step: int, ids: np.ndarray) -> np.ndarray:
    work = StepWork(sid, 1, np.asarray(ids, np.int64), None, step=step)
    return engine.submit(work).result(10)


def _sessions_on(engine: NodeEngine, prompt: np.ndarray, sids: str) -> None:
    """Open each of ``sids`` on ``prompt`` (the cached prefix loaded where there is
    one) and compute the rest of it."""
    for sid in sids:
        opened = engine.sessions.open(sid, 1, prefix=PrefixAsk(prompt, len(prompt) - 1)).result(5)
        _step(engine, sid, opened.steps, prompt[opened.kv_tokens :])


# float32 and float16 caches: pages, parks and reuse keep the same contracts on both
BACKENDS = pytest.mark.parametrize("backend", ["q8", "q8-kv16"])


def _ids(n: int, seed: int) -> np.ndarray:
    return (np.arange(n) * 31 + seed * 7919) % 90 + 10


@BACKENDS
def test_a_cached_prefix_gives_the_logits_of_a_whole_prefill(tiny_path: Path, backend: str) -> None:
    prompt = _ids(3 * B + 5, 1)
    other = np.concatenate([prompt[: 2 * B], _ids(B + 9, 2)])  # shares two blocks
    with running(tiny_path, EngineConfig(backend=backend, prefix_cache_bytes=0)) as plain:
        plain.sessions.open("w", 1).result(5)
        whole = _step(plain, "w", 0, other)
    with running(tiny_path, EngineConfig(backend=backend)) as engine:
        engine.sessions.open("a", 1, prefix=PrefixAsk(prompt, len(prompt) - 1)).result(5)
        _step(engine, "a", 0, prompt)  # nothing cached yet: the whole prompt is step 0
        opened = engine.sessions.open("b", 1, prefix=PrefixAsk(other, len(other) - 1)).result(5)
        assert (opened.kv_tokens, opened.steps) == (2 * B, 1)  # two blocks are step 0
        rest = _step(engine, "b", 1, other[2 * B :])
        stats = engine.stats().prefix
        assert stats is not None and stats.reused_tokens == 2 * B
    assert np.array_equal(rest, whole)


def test_the_reuse_limit_is_kept(tiny_path: Path) -> None:
    prompt = _ids(3 * B + 1, 3)
    with running(tiny_path, EngineConfig()) as engine:
        engine.sessions.open("a", 1, prefix=PrefixAsk(prompt, 0)).result(5)
        _step(engine, "a", 0, prompt)
        opened = engine.sessions.open("b", 1, prefix=PrefixAsk(prompt, B + 3)).result(5)
        assert (opened.kv_tokens, opened.steps) == (B, 1)
        opened = engine.sessions.open("c", 1, prefix=PrefixAsk(prompt, 0)).result(5)
        assert (opened.kv_tokens, opened.steps) == (0, 0)


def test_a_prefix_that_leaves_nothing_to_compute_is_refused() -> None:
    with pytest.raises(MalformedBundle):
        PrefixAsk.checked(np.arange(32), 32, 256)
    with pytest.raises(MalformedBundle):
        PrefixAsk.checked(np.arange(300), 0, 256)


def test_a_windowed_model_reuses_a_cached_prefix_exactly(tmp_path: Path) -> None:
    """On a Gemma-3-shaped model whose window (24) spans blocks, prefilled 32 rows a
    forward (its rings go round before the prompt ends): the shared blocks are reused and
    the rest of the prompt gives the logits of a whole prefill with no cache."""
    from tinyarch import CASES, write_arch_gguf

    path = write_arch_gguf(tmp_path / "g.gguf", CASES["gemma3"], window=24)
    prompt = _ids(9 * B + 3, 5)
    other = np.concatenate([prompt[: 5 * B + 4], _ids(2 * B, 6)])  # five whole blocks shared
    chunked = EngineConfig(prefill_chunk=32)
    with running(path, EngineConfig(prefix_cache_bytes=0), 6) as plain:
        plain.sessions.open("w", 1).result(5)
        whole = _step(plain, "w", 0, other)
    with running(path, chunked, 6) as engine:
        engine.sessions.open("a", 1, prefix=PrefixAsk(prompt, len(prompt) - 1)).result(5)
        _step(engine, "a", 0, prompt)
        opened = engine.sessions.open("b", 1, prefix=PrefixAsk(other, len(other) - 1)).result(5)
        assert (opened.kv_tokens, opened.steps) == (5 * B, 1)
        rest = _step(engine, "b", 1, other[5 * B :])
    assert np.array_equal(rest, whole)


@BACKENDS
def test_sessions_on_one_prompt_hold_its_pages_once(tiny_path: Path, backend: str) -> None:
    """The session that computed a prompt and one that loads it read the cache's pages:
    the same logits as without the cache, in far less than two sessions' KV."""
    prompt = _ids(3 * PAGE_TOKENS + 5, 4)
    with running(tiny_path, EngineConfig(backend=backend, prefix_cache_bytes=0)) as plain:
        plain.sessions.open("a", 1).result(5)
        whole = _step(plain, "a", 0, prompt)
        plain.sessions.open("b", 1).result(5)
        _step(plain, "b", 0, prompt)
        two = plain.stats().kv_bytes
    with running(tiny_path, EngineConfig(backend=backend)) as engine:
        engine.sessions.open("a", 1, prefix=PrefixAsk(prompt, len(prompt) - 1)).result(5)
        assert np.array_equal(_step(engine, "a", 0, prompt), whole)
        opened = engine.sessions.open("b", 1, prefix=PrefixAsk(prompt, len(prompt) - 1)).result(5)
        assert opened.kv_tokens == len(prompt) // B * B
        assert np.array_equal(_step(engine, "b", 1, prompt[opened.kv_tokens :]), whole)
        shared = engine.stats()
        assert shared.prefix is not None and shared.prefix.reused_tokens == opened.kv_tokens
    # the pages count once (for the sessions), and each holds only what follows them
    assert shared.kv_bytes < 0.75 * two, (shared.kv_bytes, two)


def test_sessions_on_one_prompt_fit_a_budget_their_copies_would_not(tiny_path: Path) -> None:
    prompt = _ids(3 * PAGE_TOKENS + 5, 5)
    with running(tiny_path, EngineConfig(prefix_cache_bytes=0)) as plain:
        plain.sessions.open("a", 1).result(5)
        _step(plain, "a", 0, prompt)
        one = plain.stats().kv_bytes
    budget = int(2.2 * one)
    with running(tiny_path, EngineConfig(prefix_cache_bytes=0, kv_budget_bytes=budget)) as plain:
        for sid in "ab":
            plain.sessions.open(sid, 1).result(5)
            _step(plain, sid, 0, prompt)
        with pytest.raises(KVBudgetExhausted):  # a third copy does not fit
            plain.sessions.open("c", 1).result(5)
            _step(plain, "c", 0, prompt)
    with running(tiny_path, EngineConfig(kv_budget_bytes=budget)) as engine:
        _sessions_on(engine, prompt, "abc")
        stats = engine.stats()
        assert stats.sessions == 3 and stats.kv_bytes <= budget
        assert stats.prefix is not None and stats.prefix.reused_tokens == 2 * 12 * B


def test_parking_a_session_on_shared_pages_frees_what_only_it_held(
    tiny_path: Path, tmp_path: Path
) -> None:
    prompt = _ids(3 * PAGE_TOKENS + 5, 6)
    with running(tiny_path, EngineConfig(park_dir=str(tmp_path))) as engine:
        _sessions_on(engine, prompt, "ab")
        both = engine.stats().kv_bytes
        first = engine.parking.park("a").result(5).freed_bytes
        alone = engine.stats().kv_bytes
        assert 0 < first == both - alone  # its own arrays: b still reads the pages
        assert engine.parking.park("b").result(5).freed_bytes == alone  # the pages too
        assert engine.stats().kv_bytes == 0
        # and a parked session comes back with its own copy, the same bits
        out = []
        for sid in "ab":
            opened = engine.sessions.open(sid, 2, resume=True).result(5)
            assert opened.unparked and opened.kv_tokens == len(prompt)
            step = StepWork(sid, 2, prompt[:1], None, step=opened.steps)
            out.append(engine.submit(step).result(10))
        assert np.array_equal(out[0], out[1])


@BACKENDS
def test_a_parked_session_comes_back_reading_the_cached_pages_again(
    tiny_path: Path, tmp_path: Path, backend: str
) -> None:
    """Back from a park, a session on a cached prompt reads its pages again rather than
    hold a copy of them: the node holds what it held before the park, and the session
    goes on to the bits of one that never parked."""
    prompt = _ids(3 * PAGE_TOKENS + 5, 7)
    with running(tiny_path, EngineConfig(backend=backend, park_dir=str(tmp_path))) as engine:
        _sessions_on(engine, prompt, "ab")
        both = engine.stats().kv_bytes
        engine.parking.park("a").result(5)
        alone = engine.stats().kv_bytes
        opened = engine.sessions.open("a", 2, resume=True).result(5)
        assert opened.unparked and opened.kv_tokens == len(prompt)
        back = engine.stats().kv_bytes
        out = []
        for sid, epoch in (("a", 2), ("b", 1)):
            steps = opened.steps if sid == "a" else 2
            out.append(engine.submit(StepWork(sid, epoch, prompt[:1], None, step=steps)).result(10))
    assert alone < both  # a's own positions went with it, the pages stayed for b
    assert back == both, (back, both)  # not a copy of the pages beside them
    assert np.array_equal(out[0], out[1])
