"""The node's loop with its prefix cache, on the tiny model: a session opened on a
cached prefix computes the rest of its prompt to the same bits as a whole prefill."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from meshnet.errors import MalformedBundle
from meshnet.kv.prefix_cache import BLOCK_TOKENS
from meshnet.layer_range import LayerRange
from meshnet.node.engine import EngineConfig, NodeEngine
from meshnet.node.prefixes import PrefixAsk
from meshnet.node.scheduler import StepWork

B = BLOCK_TOKENS


@contextmanager
def running(tiny_path: Path, config: EngineConfig) -> Iterator[NodeEngine]:
    e = NodeEngine(config)
    e.start()
    try:
        e.load(str(tiny_path), LayerRange(0, 4)).result(timeout=30)
        yield e
    finally:
        e.stop()


def _step(engine: NodeEngine, sid: str, step: int, ids: np.ndarray) -> np.ndarray:
    work = StepWork(sid, 1, np.asarray(ids, np.int64), None, step=step)
    return engine.submit(work).result(10)


def _ids(n: int, seed: int) -> np.ndarray:
    return (np.arange(n) * 31 + seed * 7919) % 90 + 10


def test_a_cached_prefix_gives_the_logits_of_a_whole_prefill(tiny_path: Path) -> None:
    prompt = _ids(3 * B + 5, 1)
    other = np.concatenate([prompt[: 2 * B], _ids(B + 9, 2)])  # shares two blocks
    with running(tiny_path, EngineConfig(prefix_cache_bytes=0)) as plain:
        plain.open("w", 1).result(5)
        whole = _step(plain, "w", 0, other)
    with running(tiny_path, EngineConfig()) as engine:
        engine.open("a", 1, prefix=PrefixAsk(prompt, len(prompt) - 1)).result(5)
        _step(engine, "a", 0, prompt)  # nothing cached yet: the whole prompt is step 0
        opened = engine.open("b", 1, prefix=PrefixAsk(other, len(other) - 1)).result(5)
        assert (opened.kv_tokens, opened.steps) == (2 * B, 1)  # two blocks are step 0
        rest = _step(engine, "b", 1, other[2 * B :])
        stats = engine.stats().prefix
        assert stats is not None and stats.reused_tokens == 2 * B
    assert np.array_equal(rest, whole)


def test_the_reuse_limit_is_kept(tiny_path: Path) -> None:
    prompt = _ids(3 * B + 1, 3)
    with running(tiny_path, EngineConfig()) as engine:
        engine.open("a", 1, prefix=PrefixAsk(prompt, 0)).result(5)
        _step(engine, "a", 0, prompt)
        opened = engine.open("b", 1, prefix=PrefixAsk(prompt, B + 3)).result(5)
        assert (opened.kv_tokens, opened.steps) == (B, 1)
        opened = engine.open("c", 1, prefix=PrefixAsk(prompt, 0)).result(5)
        assert (opened.kv_tokens, opened.steps) == (0, 0)


def test_a_prefix_that_leaves_nothing_to_compute_is_refused() -> None:
    with pytest.raises(MalformedBundle):
        PrefixAsk.checked(np.arange(32), 32, 256)
    with pytest.raises(MalformedBundle):
        PrefixAsk.checked(np.arange(300), 0, 256)


def test_a_windowed_model_neither_reuses_nor_fills_the_cache() -> None:
    from meshnet.kv.cache import SequenceKV
    from meshnet.kv.prefix_cache import PrefixCache
    from meshnet.node.prefixes import keep_prefix, reuse_prefix
    from meshnet.node.scheduler import Slot

    cache = PrefixCache(1 << 20)
    ids = _ids(3 * B, 4)
    dense = Slot(1, SequenceKV(2, 1, 4))
    dense.kv.reserve(len(ids))
    for layer in range(2):
        dense.kv.write(layer, np.ones((1, len(ids), 4), np.float32), np.ones((1, len(ids), 4)))
    dense.kv.advance(len(ids))
    dense.prefix = ids
    keep_prefix(cache, dense)
    assert cache.stats().blocks == 3
    windowed = Slot(1, SequenceKV(2, 1, 4, windows=(8, 0), rings=True))
    assert reuse_prefix(cache, windowed, PrefixAsk(ids, len(ids) - 1), lambda n: True, print) == 0
    assert windowed.kv.length == 0 and windowed.prefix is None
