"""The prefix cache's bookkeeping: chain keys, exact matches only, least recently used out."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.kv.cache import SequenceKV
from meshnet.kv.pages import PAGE_TOKENS
from meshnet.kv.prefix_cache import BLOCK_TOKENS, MAX_SCOPE_BYTES, PrefixCache, block_keys

B = BLOCK_TOKENS


def filled(n: int, seed: int = 0) -> SequenceKV:
    """A 2-layer cache holding ``n`` positions of values that name their position."""
    kv = SequenceKV(2, 1, 4)
    kv.reserve(n)
    rng = np.random.default_rng(seed)
    for layer in range(2):
        k = rng.standard_normal((1, n, 4)).astype(np.float32)
        kv.write(layer, k, k + 1)
    kv.advance(n)
    return kv


def test_a_block_key_names_its_whole_prefix() -> None:
    a = list(range(3 * B))
    b = [99, *a[1:]]  # the first id differs: every later key differs too
    assert len(block_keys(a)) == 3
    assert all(x != y for x, y in zip(block_keys(a), block_keys(b), strict=True))
    assert block_keys([*a, 5])[:3] == block_keys(a)  # a partial block has no key


def test_what_is_stored_loads_back_bit_for_bit() -> None:
    ids = np.arange(3 * B + 5)
    kv = filled(len(ids))
    cache = PrefixCache(1 << 20)
    assert cache.store(ids, kv, 0) == 3
    fresh = SequenceKV(2, 1, 4)
    assert cache.load(cache.match(ids, len(ids) - 1), fresh) == 3 * B
    for layer in range(2):
        want_k, want_v = kv.view(layer, 0)
        got_k, got_v = fresh.view(layer, 0)
        assert np.array_equal(got_k, want_k[:, : 3 * B])
        assert np.array_equal(got_v, want_v[:, : 3 * B])


def test_only_the_blocks_of_the_same_ids_match() -> None:
    ids = np.arange(3 * B)
    cache = PrefixCache(1 << 20)
    cache.store(ids, filled(len(ids)), 0)
    other = ids.copy()
    other[B + 3] = 500  # the second block differs
    assert len(cache.match(other, len(other))) == 1
    assert len(cache.match(ids, 2 * B + 1)) == 2  # the limit counts positions


def test_a_colliding_key_cannot_give_another_prefix() -> None:
    ids = np.arange(2 * B)
    cache = PrefixCache(1 << 20)
    cache.store(ids, filled(len(ids)), 0)
    other = ids + 1000
    # Make the other prompt's first key the same as this one's (a hash collision).
    key = block_keys(ids)[0]
    cache._blocks[block_keys(other)[0]] = cache._blocks[key]
    assert cache.match(other, len(other)) == []  # its tokens are not the request's


def test_the_least_recently_used_leaf_goes_first() -> None:
    cache = PrefixCache(1 << 20)
    a, b = np.arange(2 * PAGE_TOKENS), np.arange(2 * PAGE_TOKENS) + 500
    cache.store(a, filled(len(a)), 0)
    cache.store(b, filled(len(b), 1), 0)
    page = cache.stats().nbytes // 4  # each prompt's blocks fill two pages
    cache.match(a, len(a))  # a is now the most recent
    cache.trim(3 * page)  # a page's bytes go with the last block in it
    assert len(cache.match(a, len(a))) == 2 * PAGE_TOKENS // B
    assert len(cache.match(b, len(b))) == PAGE_TOKENS // B  # b's last page went
    assert cache.stats().evicted_blocks == PAGE_TOKENS // B
    cache.trim(0)
    assert cache.stats().blocks == 0 and cache.nbytes == 0
    assert cache.stats().evicted_blocks == 4 * PAGE_TOKENS // B


def test_an_off_cache_keeps_nothing() -> None:
    cache = PrefixCache(0)
    ids = np.arange(2 * B)
    cache.store(ids, filled(2 * B), 0)
    assert cache.stats().blocks == 0 and cache.match(ids, 2 * B) == []


def test_keys_differ_by_scope() -> None:
    ids = list(range(3 * B))
    alice, bob = block_keys(ids, scope=b"alice"), block_keys(ids, scope=b"bob")
    assert all(x != y for x, y in zip(alice, bob, strict=True))
    assert all(x != y for x, y in zip(alice, block_keys(ids), strict=True))  # unscoped
    assert block_keys(ids, scope=b"alice") == alice  # one scope's keys are stable
    with pytest.raises(ValueError):
        block_keys(ids, scope=bytes(MAX_SCOPE_BYTES + 1))


def test_a_lookup_under_another_scope_misses_with_identical_ids() -> None:
    ids = np.arange(3 * B + 2)
    cache = PrefixCache(1 << 20)
    assert cache.store(ids, filled(len(ids)), 0, b"alice") == 3
    assert cache.match(ids, len(ids) - 1, b"bob") == []
    assert cache.match(ids, len(ids) - 1) == []  # nor unscoped
    assert len(cache.match(ids, len(ids) - 1, b"alice")) == 3
    # the other scope stores its own copy, and each finds only its own
    cache.store(ids, filled(len(ids), 1), 0, b"bob")
    assert cache.stats().blocks == 6
    mine, theirs = cache.match(ids, 3 * B, b"alice"), cache.match(ids, 3 * B, b"bob")
    assert len(mine) == len(theirs) == 3
    assert all(a is not b for a, b in zip(mine, theirs, strict=True))


def test_a_colliding_key_cannot_give_another_scopes_blocks() -> None:
    ids = np.arange(2 * B)
    cache = PrefixCache(1 << 20)
    cache.store(ids, filled(len(ids)), 0, b"alice")
    # Make bob's first key the same as alice's (a hash collision): same ids, other scope.
    cache._blocks[block_keys(ids, scope=b"bob")[0]] = cache._blocks[
        block_keys(ids, scope=b"alice")[0]
    ]
    assert cache.match(ids, len(ids), b"bob") == []


def test_a_prompt_longer_than_the_cache_stores_each_block_once() -> None:
    """Its blocks past what the cache holds go as they come (the least recent leaf first);
    each chunk of its prefill must not store them all again (quadratic copying)."""
    ids = np.arange(64 * B)
    kv = filled(len(ids))
    cache = PrefixCache(1 << 20)
    cache.store(ids[: 4 * B], kv, 0)
    cache.trim(cache.nbytes)  # the cache holds 4 blocks at most from here
    limit = cache.nbytes
    done = 4
    for end in range(8 * B, len(ids) + 1, 4 * B):  # a prefill's chunks
        done = cache.store(ids[:end], kv, done)
        cache.trim(limit)
    assert cache.stats().stored_blocks <= len(ids) // B
