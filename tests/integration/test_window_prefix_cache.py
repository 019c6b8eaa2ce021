"""The prefix cache on a model with sliding-window layers (a Gemma-3-shaped tiny model:
layers 2 and 5 global, the others windowed), split over two shards as two nodes hold it.

Each shard keeps its own cache, filled as a node fills it (after every chunk of a
prompt's prefill). A prompt that starts with a cached prefix loads it and computes
only the rest; its logits, and the tokens decoded after, equal those of the prompt
computed from nothing, bit for bit, wherever the shared prefix ends against the window
and the blocks (windows of 8, 24 and 40 against blocks of 16)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tinyarch import CASES, write_arch_gguf

from meshnet.engine.chain import ChainKV, ShardChain
from meshnet.engine.local import load_local_model
from meshnet.kv.cache import SequenceKV
from meshnet.kv.prefix_cache import BLOCK_TOKENS, PrefixCache, loadable

pytest.importorskip("meshnet.backends._native")

B = BLOCK_TOKENS
PROMPT = [(7 * i) % 90 + 3 for i in range(150)]
FOLLOW = [11, 12, 13, 14, 15]


class Chain:
    """The model's shards, and the layout its windowed layers' KV is kept in."""

    def __init__(self, chain: ShardChain, rings: bool) -> None:
        self.shards, self.forward, self.rings = chain.shards, chain.forward, rings

    def new_sequence(self) -> ChainKV:
        return [
            SequenceKV(
                kv.n_layers, kv.n_kv_heads, kv.head_dim, windows=kv.windows, rings=self.rings
            )
            for kv in (s.backend.new_kv() for s in self.shards)
        ]


@pytest.fixture(scope="module", params=[(8, True), (24, True), (40, True), (24, False)])
def chain(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Chain:
    """Windows of 8, 24 and 40 in rings, and 24 laid out as the dense layers (the numpy
    and numba paths' layout)."""
    window, rings = request.param
    where = tmp_path_factory.mktemp("winprefix") / f"gemma3-{window}.gguf"
    path = write_arch_gguf(where, CASES["gemma3"], window=window)
    return Chain(load_local_model(Path(path), backend="fast", split=2).chain, rings)


def _prefill(
    chain: Chain,
    seq: ChainKV,
    ids: list[int],
    chunk: int,
    caches: list[PrefixCache] | None = None,
    start: int = 0,
) -> tuple[np.ndarray, list[int]]:
    """Compute ``ids[start:]`` after the ``start`` positions ``seq`` holds, ``chunk`` rows a
    forward, each shard's new full blocks kept after each; the last logits and the
    blocks each cache holds of ``ids`` after."""
    done = [start // B] * len(seq)
    logits = np.empty(0)
    for at in range(start, len(ids), chunk):
        piece = ids[at : at + chunk]
        logits = chain.forward(np.asarray(piece), [seq], [len(piece)])[0]
        if caches is not None:
            arr = np.asarray(ids)
            done = [c.store(arr, kv, d) for c, kv, d in zip(caches, seq, done, strict=True)]
    return logits, done


def _decode(chain: Chain, seq: ChainKV, first: np.ndarray) -> list[np.ndarray]:
    out = [first]
    for t in FOLLOW:
        out.append(chain.forward(np.asarray([t]), [seq], [1])[0])
    return out


def _reference(chain: Chain, ids: list[int]) -> list[np.ndarray]:
    seq = chain.new_sequence()
    logits, _ = _prefill(chain, seq, ids, len(ids))
    return _decode(chain, seq, logits)


def _cached(
    chain: Chain, caches: list[PrefixCache], ids: list[int]
) -> tuple[int, list[np.ndarray]]:
    """Start ``ids`` on the longest prefix every shard can load (as the hops agree on
    one), compute the rest; the positions reused and the logits."""
    window = max(max(kv.windows) for kv in chain.new_sequence())
    matched = [c.match(np.asarray(ids), len(ids) - 1) for c in caches]
    k = min(loadable(m, window) for m in matched)
    seq = chain.new_sequence()
    for c, m, kv in zip(caches, matched, seq, strict=True):
        assert c.load(m[:k], kv) == k * B
    logits, _ = _prefill(chain, seq, ids, 32, start=k * B)
    return k * B, _decode(chain, seq, logits)


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("shared", [3 * B, 3 * B + 7, 4 * B - 1, 5 * B + 8, 7 * B + 1])
def test_a_cached_prefix_gives_the_uncached_bits_around_the_window(
    chain: Chain, shared: int
) -> None:
    caches = [PrefixCache(1 << 24) for _ in chain.shards]
    _prefill(chain, chain.new_sequence(), PROMPT, 40, caches)
    other = PROMPT[:shared] + [(5 * i) % 80 + 9 for i in range(60)]
    reused, got = _cached(chain, caches, other)
    assert reused == shared // B * B  # every full shared block, the windowed ones too
    assert _same(got, _reference(chain, other))
    again, got = _cached(chain, caches, PROMPT)  # the whole prompt, short of its last id
    assert again == (len(PROMPT) - 1) // B * B
    assert _same(got, _reference(chain, PROMPT))


def test_blocks_whose_window_went_round_the_ring_are_not_loaded(chain: Chain) -> None:
    """Kept only at the end of a chunked prefill, the early blocks have no windowed KV
    where rings hold the window: a prefix ending there is not loaded, a prefix whose
    last window lies in blocks kept whole is, and both answers stay exact."""
    caches = [PrefixCache(1 << 24) for _ in chain.shards]
    seq = chain.new_sequence()
    _prefill(chain, seq, PROMPT, 32)
    for c, kv in zip(caches, seq, strict=True):
        c.store(np.asarray(PROMPT), kv, 0)  # one store after every chunk: a late one
    gone = any(  # where a ring went round past the window before position 2 * B
        kv.read(layer, 0, B) is None or kv.read(layer, B, 2 * B) is None
        for kv in seq
        for layer, window in enumerate(kv.windows)
        if window
    )
    assert gone == (max(seq[0].windows) < 40 and chain.rings)  # 150 positions, 32 a step
    early = PROMPT[: 2 * B + 3] + [42] * 20
    reused, got = _cached(chain, caches, early)
    assert reused == (0 if gone else 2 * B)
    assert _same(got, _reference(chain, early))
    reused, got = _cached(chain, caches, PROMPT)
    assert reused == (len(PROMPT) - 1) // B * B
    assert _same(got, _reference(chain, PROMPT))


def test_a_late_store_completes_blocks_kept_without_their_window(chain: Chain) -> None:
    """A block first kept without its windowed layers' KV gets it from the next prompt
    that computes it while its ring still holds it; then it loads."""
    caches = [PrefixCache(1 << 24) for _ in chain.shards]
    seq = chain.new_sequence()
    _prefill(chain, seq, PROMPT, 32)
    for c, kv in zip(caches, seq, strict=True):
        c.store(np.asarray(PROMPT), kv, 0)
    short = PROMPT[: 3 * B + 2]
    _prefill(chain, chain.new_sequence(), short, 40, caches)  # computes blocks 0..2 anew
    reused, got = _cached(chain, caches, [*short, 7, 8])
    assert reused == 3 * B
    assert _same(got, _reference(chain, [*short, 7, 8]))
