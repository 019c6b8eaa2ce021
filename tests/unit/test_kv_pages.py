"""A cache that reads its first positions from shared pages holds the same positions,
exports the same bytes and gives them up as one that holds them all itself."""

from __future__ import annotations

import numpy as np
import pytest

from meshnet.kv.cache import SequenceKV
from meshnet.kv.pages import PAGE_TOKENS, KVPage
from meshnet.kv.prefix_cache import PrefixCache
from meshnet.node.prefixes import read_cached_pages

P = PAGE_TOKENS
WINDOWS = (0, 8, 0)  # a windowed layer between two paged ones


def _grown(kv: SequenceKV, n: int, seed: int, chunk: int = 50) -> SequenceKV:
    """``kv`` with ``n`` more random positions, ``chunk`` at a time."""
    rng = np.random.default_rng(seed)
    while n:
        step = min(chunk, n)
        kv.reserve(step)
        for layer in range(kv.n_layers):
            k = rng.standard_normal((kv.n_kv_heads, step, kv.head_dim)).astype(np.float32)
            kv.write(layer, k, k * 2)
        kv.advance(step)
        n -= step
    return kv


def _new(paging: bool = True, windows: tuple[int, ...] = WINDOWS) -> SequenceKV:
    return SequenceKV(len(windows), 2, 8, windows=windows, rings=True, paging=paging)


def _pages_of(kv: SequenceKV, n: int) -> list[KVPage]:
    """Pages holding ``kv``'s first ``n`` pages' worth of positions (its paged layers)."""
    pages = []
    for p in range(n):
        page = KVPage(len(kv.page_layers), kv.n_kv_heads, kv.head_dim, kv.dtype)
        parts = [kv.read(layer, p * P, (p + 1) * P) for layer in kv.page_layers]
        page.fill(0, P, [h[0] for h in parts if h], [h[1] for h in parts if h])
        pages.append(page)
    return pages


def test_a_cache_that_shares_its_pages_holds_the_same_positions_in_less() -> None:
    kv = _grown(_new(), 3 * P + 10, 0)
    before, own = bytes(kv.export_bytes()), kv.nbytes
    pages = _pages_of(kv, 3)
    kv.share(pages[:2])
    kv.share(pages)  # more of them later (a prefill's next chunk)
    assert kv.pages == tuple(pages) and kv.shared == 3 * P
    assert bytes(kv.export_bytes()) == before
    per_position = 2 * kv.n_kv_heads * kv.head_dim * 4
    assert kv.nbytes <= own - 3 * P * per_position * len(kv.page_layers)
    for layer in kv.page_layers:
        assert all(not np.shares_memory(a, p.array) for a in kv.buffers(layer) for p in pages)
    # it grows and reads on as before: the same bytes as a cache that never shared
    plain = _grown(_new(paging=False), 3 * P + 10, 0)
    _grown(kv, 100, 1, chunk=1)
    _grown(plain, 100, 1, chunk=1)
    assert bytes(kv.export_bytes()) == bytes(plain.export_bytes())
    for layer in kv.page_layers:
        got, want = kv.read(layer, P - 5, 3 * P + 40), plain.read(layer, P - 5, 3 * P + 40)
        assert got is not None and want is not None
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])
        assert np.array_equal(kv.view(layer, 0)[0], plain.view(layer, 0)[0])


@pytest.mark.parametrize("to", [2 * P + 7, 2 * P, P + 1, 0])
def test_truncating_into_the_pages_keeps_whole_pages_and_copies_the_rest(to: int) -> None:
    dense = (0, 0)  # a ring cannot go back past its window
    kv = _grown(_new(windows=dense), 3 * P + 10, 2)
    pages = _pages_of(kv, 3)
    kv.share(pages)
    kept = [page.array.copy() for page in pages]
    plain = _grown(_new(paging=False, windows=dense), 3 * P + 10, 2)
    kv.truncate(to)
    plain.truncate(to)
    assert kv.pages == tuple(pages[: to // P])
    assert bytes(kv.export_bytes()) == bytes(plain.export_bytes())
    _grown(kv, 90, 3)  # rewritten past the cut: the pages it let go are not written
    _grown(plain, 90, 3)
    assert bytes(kv.export_bytes()) == bytes(plain.export_bytes())
    assert all(np.array_equal(p.array, k) for p, k in zip(pages, kept, strict=True))


def test_only_pages_that_start_with_its_own_are_shared() -> None:
    kv = _grown(_new(), 2 * P + 3, 4)
    pages = _pages_of(kv, 2)
    kv.share(pages[:1])
    with pytest.raises(ValueError):
        kv.share(_pages_of(kv, 2))  # a copy of its first page is not that page
    with pytest.raises(ValueError):
        kv.share([*pages, *_pages_of(kv, 1)])  # past its positions
    plain = _grown(_new(paging=False), 2 * P + 3, 4)
    plain.share(_pages_of(plain, 2))  # a cache that reads no pages keeps its own
    assert plain.shared == 0


def test_a_loaded_prefix_reads_the_caches_pages_and_stays_exact() -> None:
    ids = np.arange(3 * P + 20)
    source = _grown(_new(), len(ids), 5)
    cache = PrefixCache(1 << 30)
    cache.store(ids, source, 0)
    blocks = cache.match(ids, len(ids))
    loaded = _new()
    assert cache.load(blocks, loaded) == len(blocks) * 16
    assert loaded.pages == tuple(cache.pages_of(blocks)) and loaded.shared == 3 * P
    want = source.export_bytes()
    source.truncate(loaded.length)
    assert bytes(loaded.export_bytes()) == bytes(source.export_bytes())
    assert len(bytes(want)) > 0
    copied = _new(paging=False)  # a cache that reads no pages gets a copy
    cache.load(blocks, copied)
    assert copied.shared == 0 and bytes(copied.export_bytes()) == bytes(loaded.export_bytes())


def test_prompts_that_part_inside_a_page_each_load_their_own_positions() -> None:
    a = np.arange(3 * P)
    b = a.copy()
    b[P + 20 :] += 1000  # the same first block of the second page, then other ids
    cache = PrefixCache(1 << 30)
    kv_a = _grown(_new(), len(a), 6, chunk=16)
    cache.store(a, kv_a, 0)
    kv_b = _grown(_new(), P + 16, 6, chunk=16)  # a's first 80 positions (same ids), ...
    _grown(kv_b, 2 * P - 16, 8)  # ... then its own
    cache.store(b, kv_b, 0)
    for ids, source in ((a, kv_a), (b, kv_b)):
        blocks = cache.match(ids, len(ids))
        assert len(blocks) == len(ids) // 16
        loaded = _new()
        cache.load(blocks, loaded)
        assert loaded.shared == 3 * P
        assert bytes(loaded.export_bytes()) == bytes(source.export_bytes())
    pages_a, pages_b = (cache.pages_of(cache.match(x, len(x))) for x in (a, b))
    assert pages_a[0] is pages_b[0] and pages_a[1] is not pages_b[1]  # parted in page 2


def test_kv_loaded_from_a_park_reads_the_cached_pages_only_where_they_are_its_bits() -> None:
    """A parked session's KV names the cached prefix it read (its last page's key); back
    from the park it reads those pages again only if they hold its very bits."""
    ids = np.arange(3 * P + 20)
    source = _grown(_new(), len(ids), 6)
    cache = PrefixCache(1 << 30)
    cache.store(ids, source, 0)
    assert source.shared == 3 * P and source.pages[-1].key is not None
    key, length, payload = source.pages[-1].key, source.length, bytes(source.export_bytes())
    back = _new()
    back.load_bytes(length, payload)
    assert read_cached_pages(cache, back, key) == 3 * P
    assert back.pages == source.pages and bytes(back.export_bytes()) == payload
    other = bytearray(payload)  # the same prefix, other bits (another node's backend)
    other[4:8] = np.float32(7.0).tobytes()
    differs = _new()
    differs.load_bytes(length, other)
    assert read_cached_pages(cache, differs, key) == 0 and differs.pages == ()
    assert bytes(differs.export_bytes()) == bytes(other)
    assert read_cached_pages(PrefixCache(1 << 30), _new(), key) == 0  # the cache lost it
