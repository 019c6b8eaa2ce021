"""A node's prefix cache: the KV of prompt prefixes, kept by block and reused exactly.

A prompt's positions are cut into blocks of ``BLOCK_TOKENS`` from position 0;
block ``i``'s key is a chain hash, SHA-256 of block ``i - 1``'s key and block
``i``'s token ids, so one key names the whole prefix up to the block's end
(vLLM's prefix caching keys its blocks the same way). Block 0's parent is the
root of the request's **scope** (``scope_root``): the tracker derives a scope
from each request's tenant (auth/mesh_keys.py), so a prompt stored under one
scope is never found under another, even with identical ids, and one tenant
cannot learn by timing, or by ``cached_tokens``, what another sent (vLLM's
``cache_salt``). A block keeps this shard's keys and values for its positions,
the token ids, and its parent block itself: a lookup walks the prompt's keys
from the first, and takes a block only where its tokens are the prompt's and
its parent is the block just taken (and was stored under the lookup's scope), so
even a colliding hash cannot hand a request KV of another prefix, or another
scope's.
Reusing a block is exact: KV of a position depends only on the tokens up to it
(meshnet computes a row identically alone, batched or chunked), so a prompt
prefilled after a cached prefix gives the bits a whole prefill gives.

**Pages, shared with the sessions** (kv/pages.py): the layers without a window
keep a block's positions in a page of ``PAGE_TOKENS`` (four blocks), which the
block's parent's page continues where its next positions are free, and a new page
starts (with a copy of the parent page's positions before it) where another
prefix took them, so the page of a prefix's fourth block holds that prefix's
positions exactly. A session that loads a prefix reads its whole pages in place
and copies only the rest; the session that computed a prompt gives its own copy
up for the pages stored from it (``store``). So eight sessions on one
system prompt hold its KV once, the cache's copy. A page's bytes are counted
while a cached block is in it; what sessions hold of them the node counts once
for the sessions (node/engine_held.py), and ``trim`` then counts only what
evicting would give back.

**Windowed layers** (Gemma 2/3, gpt-oss: a row sees only its last ``window``
positions) keep a ring of their last positions (kv/cache.py), so a block's
positions may have gone round the ring before they are copied. A block holds
the windowed layers' keys and values where the ring still had them when it was
stored (always, for a prompt: its full blocks are copied after every chunk of
its prefill), and none otherwise. A prefix of ``k`` blocks is loaded only when
the blocks its last ``window`` positions fall in hold their windowed parts, and
a windowed layer is given only those positions: what it would hold after
computing the prefix itself, so the next row sees the same keys either way.

The cache is bounded in bytes; the least recently used block goes first, and
only a block no other block extends (a lookup touches a prefix's blocks from its
last to its first, so parents are always more recent than their children).

Not thread-safe: the node's engine loop is its only user.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import numpy as np

from meshnet.kv.cache import SequenceKV
from meshnet.kv.pages import PAGE_TOKENS, KVPage

BLOCK_TOKENS = 16  # positions per block: what a prefix is reused in multiples of
_PER_PAGE = PAGE_TOKENS // BLOCK_TOKENS  # blocks a page holds
MAX_SCOPE_BYTES = 64  # the longest scope an open may name
_ROOT = b"meshnet-prefix-v2\0"  # what every scope's root is derived from


def scope_root(scope: bytes = b"") -> bytes:
    """The parent key of block 0 under ``scope`` (empty: the unscoped cache)."""
    if len(scope) > MAX_SCOPE_BYTES:
        raise ValueError(f"a prefix scope has at most {MAX_SCOPE_BYTES} bytes")
    return hashlib.sha256(_ROOT + scope).digest()


def block_keys(
    ids: Sequence[int] | np.ndarray, blocks: int | None = None, scope: bytes = b""
) -> list[bytes]:
    """The chain keys of the first ``blocks`` full blocks of ``ids`` (all by default)
    under ``scope``."""
    tokens = np.asarray(ids, dtype="<i8")
    n = len(tokens) // BLOCK_TOKENS if blocks is None else blocks
    keys: list[bytes] = []
    parent = scope_root(scope)
    for i in range(n):
        block = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS]
        parent = hashlib.sha256(parent + block.tobytes()).digest()
        keys.append(parent)
    return keys


@dataclass(eq=False)
class _Block:
    key: bytes
    scope: bytes  # what it was stored under
    tokens: bytes  # the block's ids, int64 little-endian
    parent: _Block | None
    page: KVPage  # where the paged layers' positions are (views of it in ``keys``)
    # per layer [n_kv_heads, BLOCK_TOKENS, head_dim]; None: a windowed layer's ring had
    # let these positions go when the block was stored
    keys: list[np.ndarray | None]
    values: list[np.ndarray | None]
    paged: frozenset[int]  # the layers whose arrays are views of the page
    children: int = 0  # cached blocks that extend this one
    nbytes: int = field(init=False)  # its windowed layers' copies (the page counts apart)

    def __post_init__(self) -> None:
        self.nbytes = sum(
            a.nbytes
            for layer, (k, v) in enumerate(zip(self.keys, self.values, strict=True))
            if layer not in self.paged
            for a in (k, v)
            if a is not None
        )

    def extends(self, parent: _Block | None, tokens: bytes, scope: bytes) -> bool:
        """Whether this is the block of ``tokens`` after ``parent`` under ``scope``
        (not a key that collides with it)."""
        return self.parent is parent and self.tokens == tokens and self.scope == scope

    @property
    def whole(self) -> bool:
        """Whether it holds every layer's positions (the windowed ones' too)."""
        return all(a is not None for a in self.keys)


def loadable(blocks: list[_Block], window: int) -> int:
    """How many of ``blocks`` (a ``match``) can be loaded: the most ``k`` whose last
    ``window`` positions (every position when 0) lie in blocks that are ``whole``."""
    for k in range(len(blocks), 0, -1):
        end = k * BLOCK_TOKENS
        first = max(0, end - window) // BLOCK_TOKENS if window else 0
        if all(b.whole for b in blocks[first:k]):
            return k
    return 0


@dataclass(frozen=True)
class PrefixStats:
    blocks: int  # blocks held
    nbytes: int  # bytes they hold
    capacity_bytes: int  # the most it may hold (0: off)
    hits: int  # opens that reused at least one block
    reused_tokens: int  # positions loaded from the cache instead of computed
    stored_blocks: int  # blocks ever stored
    evicted_blocks: int  # blocks let go to stay within the bounds


class PrefixCache:
    """Blocks of prefix KV by chain key, least recently used first."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = max(capacity_bytes, 0)  # 0: the cache is off
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.nbytes = 0  # the blocks' windowed copies and the pages they are in
        self._hits = 0
        self._reused = 0
        self._stored = 0
        self._evicted = 0

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def stats(self) -> PrefixStats:
        return PrefixStats(
            len(self._blocks),
            self.nbytes,
            self.capacity_bytes,
            self._hits,
            self._reused,
            self._stored,
            self._evicted,
        )

    def match(self, ids: np.ndarray, limit: int, scope: bytes = b"") -> list[_Block]:
        """The cached blocks of the longest prefix of ``ids`` of at most ``limit``
        positions stored under ``scope``, in order; touched, so they go last."""
        found: list[_Block] = []
        tokens = np.asarray(ids, dtype="<i8")
        blocks = min(limit, len(tokens)) // BLOCK_TOKENS
        parent: _Block | None = None
        for i, key in enumerate(block_keys(tokens, blocks, scope)):
            block = self._blocks.get(key)
            want = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS].tobytes()
            if block is None or not block.extends(parent, want, scope):
                break
            found.append(block)
            parent = block
        self._touch(found)
        return found

    @staticmethod
    def pages_of(blocks: Sequence[_Block]) -> list[KVPage]:
        """The full pages holding the positions of ``blocks`` (a prefix's, from its
        first), in order: the page of every fourth block."""
        return [b.page for b in blocks[_PER_PAGE - 1 :: _PER_PAGE]]

    @classmethod
    def pages_to_read(cls, blocks: Sequence[_Block], kv: SequenceKV) -> list[KVPage]:
        """``pages_of(blocks)`` where ``kv`` reads pages in place, else none."""
        return cls.pages_of(blocks) if kv.paging else []

    def pages_ending(self, key: bytes) -> list[KVPage]:
        """The full pages of the cached prefix whose last block's key is ``key`` (a
        page's ``key``), in order and touched; none when that block has gone."""
        chain: list[_Block] = []
        block = self._blocks.get(key)
        while block is not None:
            chain.append(block)
            block = block.parent
        chain.reverse()
        if not chain or len(chain) % _PER_PAGE:
            return []
        self._touch(chain)
        return self.pages_of(chain)

    def load(self, blocks: list[_Block], kv: SequenceKV) -> int:
        """Fill the empty ``kv`` with ``blocks`` (a ``match`` cut to what is ``loadable``):
        each layer's last ``kv.kept`` positions of them, read in place from their pages
        where ``kv`` reads pages; the positions loaded."""
        n = len(blocks) * BLOCK_TOKENS
        if not n:
            return 0
        pages = self.pages_to_read(blocks, kv)
        kv.start_loaded(n, pages)
        shared = len(pages) * PAGE_TOKENS
        for layer in range(kv.n_layers):  # one copy a layer, every block into its place
            first = n - kv.kept(layer, n)
            if layer in kv.page_layers:
                first = max(first, shared)
            if first == n:
                continue
            keys: list[np.ndarray] = []
            values: list[np.ndarray] = []
            for b in blocks[first // BLOCK_TOKENS :]:  # from the block the window starts in
                k, v = b.keys[layer], b.values[layer]
                if k is None or v is None:
                    raise ValueError("a block without its windowed layers' KV was loaded")
                keys.append(k)
                values.append(v)
            skip = first % BLOCK_TOKENS
            keys[0], values[0] = keys[0][:, skip:], values[0][:, skip:]
            kv.put_parts(layer, first, keys, values)
        self._hits += 1
        self._reused += n
        return n

    def store(self, ids: np.ndarray, kv: SequenceKV, done: int, scope: bytes = b"") -> int:
        """Keep the full blocks of ``ids`` that ``kv`` holds under ``scope``, from block
        ``done`` on (the ones before it are cached already or were loaded from here);
        the blocks done after. ``kv`` then reads the whole pages of its blocks in place,
        its own copy of them let go. Stops at a block whose key another prefix holds (a
        collision). Where one before ``done`` has gone meanwhile, the prompt's chain is
        cut and none of it is kept from then on (all its blocks are done): storing it
        again from where the cache ends, every chunk of a prompt longer than the cache
        copied all of its blocks past the cache again, each then evicted at once."""
        tokens = np.asarray(ids, dtype="<i8")
        blocks = min(len(tokens), kv.length) // BLOCK_TOKENS
        if not self.enabled or blocks <= done:
            return max(done, blocks)
        path = self.match(tokens, done * BLOCK_TOKENS, scope)
        if len(path) < done:
            return len(tokens) // BLOCK_TOKENS
        keys = block_keys(tokens, blocks, scope)
        parent = path[-1] if path else None
        added: list[_Block] = []
        for i in range(done, blocks):
            want = tokens[i * BLOCK_TOKENS : (i + 1) * BLOCK_TOKENS].tobytes()
            block = self._blocks.get(keys[i])
            if block is None:
                block = self._copy(keys[i], scope, want, parent, kv, i)
            elif not block.extends(parent, want, scope):
                break  # a colliding key: leave the one held
            elif not block.whole:
                self._complete(block, kv, i)
            added.append(block)
            parent = block
        chain = path + added
        self._touch(chain)
        pages = self.pages_to_read(chain, kv)
        if tuple(pages[: len(kv.pages)]) == kv.pages:  # else stored anew since kv loaded
            kv.share(pages)
        self.trim(self.capacity_bytes)
        return blocks

    def _copy(
        self,
        key: bytes,
        scope: bytes,
        tokens: bytes,
        parent: _Block | None,
        kv: SequenceKV,
        i: int,
    ) -> _Block:
        start = i * BLOCK_TOKENS
        page = self._page_for(parent, kv, i)
        at = start % PAGE_TOKENS
        keys: list[np.ndarray | None] = []
        values: list[np.ndarray | None] = []
        for layer in range(kv.n_layers):
            if layer in kv.page_layers:
                row = page.array[kv.page_layers.index(layer)]
                keys.append(row[0, :, at : at + BLOCK_TOKENS])
                values.append(row[1, :, at : at + BLOCK_TOKENS])
                continue
            held = kv.read(layer, start, start + BLOCK_TOKENS)
            keys.append(None if held is None else held[0])
            values.append(None if held is None else held[1])
        block = _Block(key, scope, tokens, parent, page, keys, values, frozenset(kv.page_layers))
        if at + BLOCK_TOKENS == PAGE_TOKENS:
            page.key = key  # the page is full: it ends this prefix
        if parent is not None:
            parent.children += 1
        self._blocks[key] = block
        page.blocks += 1
        self.nbytes += block.nbytes + (page.nbytes if page.blocks == 1 else 0)
        self._stored += 1
        return block

    def _page_for(self, parent: _Block | None, kv: SequenceKV, i: int) -> KVPage:
        """The page holding block ``i`` of ``kv`` (its positions written there): the one
        ``kv`` reads them from already, else its parent's where it is written up to the
        block, else a new one, started with the parent page's positions before it."""
        j, at = divmod(i * BLOCK_TOKENS, PAGE_TOKENS)
        if j < len(kv.pages):
            return kv.pages[j]
        page = parent.page if parent is not None and at else None
        if page is None or page.filled != at:
            fresh = KVPage(len(kv.page_layers), kv.n_kv_heads, kv.head_dim, kv.dtype)
            if page is not None:
                fresh.copy_from(page, at)
            page = fresh
        start = i * BLOCK_TOKENS
        keys: list[np.ndarray] = []
        values: list[np.ndarray] = []
        for layer in kv.page_layers:  # no window: every position is held
            held = kv.read(layer, start, start + BLOCK_TOKENS)
            assert held is not None
            keys.append(held[0])
            values.append(held[1])
        page.fill(at, BLOCK_TOKENS, keys, values)
        return page

    def _complete(self, block: _Block, kv: SequenceKV, i: int) -> None:
        """Give a block stored without its windowed layers' KV what ``kv`` holds of it."""
        start = i * BLOCK_TOKENS
        for layer, k in enumerate(block.keys):
            held = None if k is not None else kv.read(layer, start, start + BLOCK_TOKENS)
            if held is not None:
                block.keys[layer], block.values[layer] = held
                self.nbytes += held[0].nbytes + held[1].nbytes
                block.nbytes += held[0].nbytes + held[1].nbytes

    def _touch(self, path: list[_Block]) -> None:
        """Most recent last: a path's blocks from its end to its start, so a parent is
        never evicted before a block that extends it."""
        for block in reversed(path):
            self._blocks.move_to_end(block.key)

    def trim(self, limit_bytes: int, held: Collection[KVPage] = ()) -> int:
        """Evict least recently used blocks that nothing extends until at most
        ``limit_bytes`` are held but for the pages in ``held`` (which sessions hold too:
        evicting their blocks gives none of their bytes back); the bytes freed."""
        distinct = {id(p): p for p in held}
        alone = self.nbytes - sum(p.nbytes for p in distinct.values() if p.blocks)
        freed = 0
        while alone > max(limit_bytes, 0) and self._blocks:
            victim = next((b for b in self._blocks.values() if not b.children), None)
            if victim is None:  # cannot happen: some block is a leaf
                break
            del self._blocks[victim.key]
            if victim.parent is not None:
                victim.parent.children -= 1
            victim.page.blocks -= 1
            gone = victim.nbytes + (0 if victim.page.blocks else victim.page.nbytes)
            self.nbytes -= gone
            given = gone if victim.page.blocks or id(victim.page) not in distinct else victim.nbytes
            alone -= given
            freed += given
            self._evicted += 1
        return freed

    def clear(self) -> None:
        """Forget every block (the node loaded another shard)."""
        self._evicted += len(self._blocks)
        for block in self._blocks.values():
            block.page.blocks -= 1
        self._blocks.clear()
        self.nbytes = 0
