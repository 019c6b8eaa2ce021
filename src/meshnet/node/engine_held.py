"""The sessions' KV a node's engine holds, and what it is held within.

Hot KV (a ``Slot`` per session), KV parked on local disk, parks written for a
two-phase park and not yet committed, each session's newest epoch (its fence,
remembered after its KV is gone), the KV budget and the prompt-prefix cache
kept within what the budget leaves. Pages of a cached prefix that sessions read
in place (kv/pages.py) count once, for the sessions, however many read them.
Only the loop's thread reads or changes it: every call reaches it through the
inbox (node/engine_inbox.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from meshnet.backends.shard import Shard
from meshnet.kv.manager import KVBudget
from meshnet.kv.pages import KVPage
from meshnet.kv.prefix_cache import PrefixCache
from meshnet.node.engine_types import EngineConfig
from meshnet.node.parking import ParkedKV, ParkStore
from meshnet.node.scheduler import Slot
from meshnet.protocol.commitments import RowLog, commits_exactly
from meshnet.protocol.sketches import check_width

_MAX_FENCES = 65536  # sessions whose newest epoch is remembered after their KV is gone


class HeldKV:
    """Every session's KV on this node (hot, parked, prepared), its fences, the budget
    it is held within and the prefix cache."""

    def __init__(self, config: EngineConfig) -> None:
        self.slots: dict[str, Slot] = {}
        self.parked: dict[str, ParkedKV] = {}
        self.prepared: dict[str, ParkedKV] = {}  # parks written, KV still hot (PREPARE)
        self.store = ParkStore(config.park_dir)
        self.budget = KVBudget(config.kv_budget_bytes)  # its size follows tier 2
        self.prefixes = PrefixCache(config.prefix_cache_bytes)
        self.freed = False  # a session's memory was let go since the loop last idled
        self._fences: OrderedDict[str, int] = OrderedDict()  # newest epoch seen per session
        # No tier changes the backend: how rows are committed is the engine's for life.
        self._exact = commits_exactly(config.backend)

    def held_pages(self) -> list[KVPage]:
        """The pages the sessions read, each once."""
        pages = {id(p): p for s in self.slots.values() for p in s.kv.pages}
        return list(pages.values())

    def unheld_bytes(self, pages: Iterable[KVPage]) -> int:
        """Bytes of ``pages`` that no session reads yet (what reading them adds)."""
        held = {id(p) for p in self.held_pages()}
        return sum(p.nbytes for p in {id(p): p for p in pages}.values() if id(p) not in held)

    def account(self) -> None:
        """Count what the sessions hold against the budget, and trim the prefix cache."""
        own = sum(s.kv.nbytes + s.sent_bytes for s in self.slots.values())
        held = self.held_pages()
        self.budget.update(own + sum(p.nbytes for p in held))
        self.make_room(0, held)

    def make_room(self, extra: int, held: list[KVPage] | None = None) -> None:
        """Keep the prefix cache within what the KV budget leaves once the sessions hold
        ``extra`` more bytes: cached prefixes never make a session fail for memory.
        ``held``: ``held_pages()``, where the caller has them already."""
        budget = self.budget.budget_bytes
        if budget > 0 and self.prefixes.nbytes:
            held = self.held_pages() if held is None else held
            self.prefixes.trim(budget - self.budget.in_use - extra, held)

    def row_log(self, shard: Shard, base: int) -> RowLog:
        """A session's commitments log from position ``base``: hashes on an exact
        backend, top-k sketches on another (protocol/commitments.py); ``SketchTooWide``
        when the rows are too wide to sketch."""
        if not self._exact:
            check_width(shard.spec.d_model)
        return RowLog(base, self._exact)

    def fence(self, session_id: str) -> int:
        """The newest epoch seen of a session (0: none)."""
        return self._fences.get(session_id, 0)

    def remember_fence(self, session_id: str, epoch: int) -> None:
        self._fences[session_id] = epoch
        self._fences.move_to_end(session_id)
        while len(self._fences) > _MAX_FENCES:
            self._fences.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """Let a session's KV go, hot and parked (its files removed); not yet accounted."""
        if self.slots.pop(session_id, None) is not None:
            self.freed = True
        for files in (self.parked, self.prepared):
            parked = files.pop(session_id, None)
            if parked is not None:
                self.store.remove(parked)

    def forget_all(self, keep_parked: bool) -> int:
        """Let every session's hot KV and prepared park go, and the parked KV unless
        ``keep_parked``; the prefix cache is emptied. The sessions whose KV went."""
        ended = len(self.slots) + (0 if keep_parked else len(self.parked))
        self.slots.clear()
        for parked in self.prepared.values():
            self.store.remove(parked)
        self.prepared.clear()
        if not keep_parked:
            for parked in self.parked.values():
                self.store.remove(parked)
            self.parked.clear()
        self.prefixes.clear()
        self.account()
        return ended
