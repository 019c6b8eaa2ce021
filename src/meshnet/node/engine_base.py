"""The state a node's engine keeps, and the helpers each of its parts shares.

The engine (node/engine.py) is one class built in layers, each a module of one
concept: this state; parking KV on local disk (node/engine_parking.py); the
sessions' KV, opened, fenced, released, exported and imported
(node/engine_sessions.py); live configuration, tiers 1 to 3
(node/engine_tiers.py); and the loop itself. Every method that changes this
state runs on the loop (``_control`` hands it there), so none of it is locked
but ``_outstanding``.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from meshnet.backends.shard import Shard
from meshnet.errors import Cancelled
from meshnet.kv.manager import KVBudget
from meshnet.kv.prefix_cache import PrefixCache
from meshnet.node.engine_types import EngineConfig
from meshnet.node.parking import ParkedKV, ParkStore
from meshnet.node.scheduler import Slot, StepWork
from meshnet.node.tiers import Batching
from meshnet.protocol.commitments import RowLog, commits_exactly
from meshnet.protocol.sketches import check_width

_MAX_FENCES = 65536  # sessions whose newest epoch is remembered after their KV is gone


@dataclass
class Control:
    """A command the loop applies in order between iterations."""

    apply: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


@dataclass
class Staged:
    """A tier-2 or tier-3 change waiting for the loop to drain; ``future`` answers it."""

    change: Batching | Shard | None  # None: unload (the node becomes empty)
    future: Future[Any]


class EngineState:
    """The shard, the sessions' KV (hot, parked, prepared), their fences, the inbox
    and the steps admitted: what every part of ``NodeEngine`` reads and changes.

    ``config`` is replaced whole, on the loop thread, by a tier-1 or tier-2 change
    (node/engine_tiers.py); other threads read it as it is at that moment.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._shard: Shard | None = None
        self._slots: dict[str, Slot] = {}
        self._parked: dict[str, ParkedKV] = {}
        self._prepared: dict[str, ParkedKV] = {}  # parks written, KV still hot (PREPARE)
        self._park_store = ParkStore(config.park_dir)
        self._fences: OrderedDict[str, int] = OrderedDict()  # newest epoch seen per session
        self._budget = KVBudget(config.kv_budget_bytes)
        self._prefixes = PrefixCache(config.prefix_cache_bytes)  # loop thread only
        # A SimpleQueue: a put wakes the idle loop with one handoff (a Queue's condition
        # made it two), paid on every step a ring's previous hop relays in.
        self._inbox: queue.SimpleQueue[StepWork | Control | None] = queue.SimpleQueue()
        self._pending: list[StepWork] = []  # admitted, not finished (loop thread only)
        self._outstanding = 0  # submitted, not finished (guarded by _lock)
        self._lock = threading.Lock()
        self._steps = 0
        self._last_batch = 0
        self._max_batch = 0
        self._tokens_per_s = 0.0
        self._stopping = False
        self._staged: Staged | None = None  # a T2/T3 change waiting for a drain (loop only)
        self._freed = False  # a session's memory was let go since the loop last idled
        self._after: list[Callable[[], None]] | None = None  # see ``after_batch``
        # Whoever runs the loop holds ``_loop``: the loop's thread, or while it waits for
        # work a thread that brings a step (``run_here``). ``_runner``: that thread's id.
        self._loop = threading.Lock()
        self._runner: int | None = None

    @property
    def shard(self) -> Shard | None:
        return self._shard

    def _control(self, apply: Callable[[], Any]) -> Future[Any]:
        c = Control(apply)
        self._inbox.put(c)
        return c.future

    def _account(self) -> None:
        self._budget.update(sum(s.kv.nbytes + s.sent_bytes for s in self._slots.values()))
        self._make_room(0)

    def _make_room(self, extra: int) -> None:
        """Keep the prefix cache within what the KV budget leaves once the sessions hold
        ``extra`` more bytes: cached prefixes never make a session fail for memory."""
        budget = self._budget.budget_bytes
        if budget > 0 and self._prefixes.nbytes:
            self._prefixes.trim(budget - self._budget.in_use - extra)

    def _swapping(self) -> bool:
        return self._staged is not None and not isinstance(self._staged.change, Batching)

    def _row_log(self, shard: Shard, base: int) -> RowLog:
        """A session's commitments log from position ``base``: hashes on an exact
        backend, top-k sketches on another (protocol/commitments.py); ``SketchTooWide``
        when the rows are too wide to sketch."""
        exact = commits_exactly(self.config.backend)
        if not exact:
            check_width(shard.spec.d_model)
        return RowLog(base, exact)

    def _remember_fence(self, session_id: str, epoch: int) -> None:
        self._fences[session_id] = epoch
        self._fences.move_to_end(session_id)
        while len(self._fences) > _MAX_FENCES:
            self._fences.popitem(last=False)

    def _drop(self, session_id: str) -> None:
        """Forget a session's KV (hot and parked) and fail its unfinished steps."""
        if self._slots.pop(session_id, None) is not None:
            self._freed = True
        for files in (self._parked, self._prepared):
            parked = files.pop(session_id, None)
            if parked is not None:
                self._park_store.remove(parked)
        self._fail_steps(session_id, Cancelled(f"session {session_id} was released"))
        self._account()

    def _fail_steps(self, session_id: str, error: Exception) -> None:
        for w in [w for w in self._pending if w.session_id == session_id]:
            self._pending.remove(w)
            w.future.set_exception(error)


def settle(future: Future[Any], apply: Callable[[], Any]) -> None:
    try:
        future.set_result(apply())
    except Exception as e:
        future.set_exception(e)
