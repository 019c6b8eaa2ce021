"""How a node's sessions use its prefix cache (kv/prefix_cache.py).

A fresh session opened with its prompt (``PrefixAsk``) starts holding the
longest cached prefix of it, up to the positions the driver allows, as its
step 0: the driver then sends the rest of the prompt as step 1, and every hop
of the route agrees on the length because the driver asks each for the same
(node/engine_sessions.py answers what it loaded; tracker/routing/prefix_open.py
settles on it). As the session's steps commit, the full blocks of its prompt
it has computed are copied into the cache (after every chunk of its prefill,
while a windowed layer's ring still holds them), and it then reads the whole
pages of them in place (kv/pages.py): its own copy goes, so the prompt's KV is
held once for it, the cache and every session that loads it. Both are under the open's
scope: the tracker's name for the request's tenant, so one tenant's prompts
are never another's hits.
Run on the engine's loop thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshnet.errors import MalformedBundle
from meshnet.kv.cache import SequenceKV
from meshnet.kv.pages import PAGE_TOKENS
from meshnet.kv.prefix_cache import BLOCK_TOKENS, MAX_SCOPE_BYTES, PrefixCache, loadable
from meshnet.node.engine_held import HeldKV
from meshnet.node.scheduler import Slot


@dataclass(frozen=True)
class PrefixAsk:
    """What an open says of a fresh session's prompt."""

    ids: np.ndarray  # the prompt's token ids [T], int64, from position 0
    reuse: int  # the most positions to start with from the cache (0: none)
    scope: bytes = b""  # whose cache: looked up and stored under it (empty: unscoped)

    @staticmethod
    def checked(ids: np.ndarray, reuse: int, max_tokens: int, scope: bytes = b"") -> PrefixAsk:
        """``MalformedBundle`` when the prompt is longer than the model's context,
        ``reuse`` leaves none of it to compute, or the scope is longer than
        ``MAX_SCOPE_BYTES``."""
        if len(scope) > MAX_SCOPE_BYTES:
            raise MalformedBundle(f"a prefix scope of {len(scope)} bytes is past {MAX_SCOPE_BYTES}")
        if len(ids) > max_tokens:
            raise MalformedBundle(f"a prefix of {len(ids)} ids is past {max_tokens} positions")
        if reuse >= max(len(ids), 1) and reuse:
            raise MalformedBundle(f"reusing {reuse} positions of a {len(ids)}-id prompt")
        return PrefixAsk(np.asarray(ids, dtype=np.int64), int(reuse), bytes(scope))


def reuse_prefix(held: HeldKV, slot: Slot, ask: PrefixAsk) -> int:
    """Start the fresh ``slot`` with the longest cached prefix of ``ask`` that the KV
    budget has room for (cached blocks evicted for it where needed); the positions
    loaded (then step 0 is committed)."""
    cache = held.prefixes
    if not cache.enabled:
        return 0
    slot.prefix, slot.prefix_blocks, slot.prefix_scope = ask.ids, 0, ask.scope
    if ask.reuse < BLOCK_TOKENS:
        return 0
    blocks = cache.match(ask.ids, ask.reuse, ask.scope)
    blocks = blocks[: loadable(blocks, max(slot.kv.windows))]
    pages = cache.pages_to_read(blocks, slot.kv)
    shared = len(pages) * PAGE_TOKENS
    need = slot.kv.load_growth_bytes(len(blocks) * BLOCK_TOKENS, shared)
    need += held.unheld_bytes(pages)  # counted for the sessions from now on
    if not blocks or not held.budget.fits(need):
        return 0
    held.make_room(need)  # the blocks matched stay alive in ``blocks`` if evicted meanwhile
    n = cache.load(blocks, slot.kv)
    slot.prefix_blocks = len(blocks)
    slot.steps = 1
    return n


def keep_prefix(cache: PrefixCache, slot: Slot | None) -> None:
    """Copy the full prompt blocks ``slot`` has computed since into the cache (its KV
    then reads their whole pages in place)."""
    if slot is None or slot.prefix is None:
        return
    if not cache.enabled:
        slot.prefix = None
        return
    slot.prefix_blocks = cache.store(slot.prefix, slot.kv, slot.prefix_blocks, slot.prefix_scope)
    if slot.prefix_blocks >= len(slot.prefix) // BLOCK_TOKENS:
        slot.prefix = None  # every full block is kept (or was refused): nothing more


def read_cached_pages(cache: PrefixCache, kv: SequenceKV, key: bytes | None) -> int:
    """Have ``kv``, just loaded from a park, read the cached prefix pages it read when
    parked (``key``: the last one's, ``ParkedKV.prefix_key``) rather than hold its own
    copy, where the cache still has them and they hold its very bits (a compare, not a
    trust: KV brought from another node may come from another backend); the positions
    it reads from pages after."""
    if key is None or not cache.enabled or not kv.paging:
        return 0
    pages = cache.pages_ending(key)
    if pages and kv.holds(pages):
        kv.share(pages)
    return kv.shared
