"""The sessions' KV on a node's engine: opened at an epoch, fenced, released, exported
and imported (docs/design.md §6, §7).

An open at a newer epoch fences every older one; a resumed open keeps (or reads
back from disk, node/engine_parking.py) what the session holds, cut back by
``rewind`` to the tracker's committed point; a fresh one may start on a cached
prompt prefix (node/prefixes.py). Each call is applied on the loop between
iterations.
"""

from __future__ import annotations

from concurrent.futures import Future

import numpy as np

from meshnet.backends.shard import Shard
from meshnet.errors import CacheMiss, Cancelled, Overloaded, ShardMismatch, StaleEpoch
from meshnet.node.engine_held import HeldKV
from meshnet.node.engine_inbox import Inbox
from meshnet.node.engine_parking import Parking
from meshnet.node.engine_steps import Steps
from meshnet.node.engine_types import ExportedKV, OpenedSlot, Serving
from meshnet.node.prefixes import PrefixAsk, reuse_prefix
from meshnet.node.scheduler import Slot, budget_full
from meshnet.protocol.commitments import RowLog


class Sessions:
    """The calls on sessions' KV (``held``), each applied on the loop: a session's steps
    (``steps``) fail when its KV goes, a parked session is read back by ``parking``,
    and none is opened while ``serving`` swaps its shard."""

    def __init__(
        self, inbox: Inbox, held: HeldKV, steps: Steps, parking: Parking, serving: Serving
    ) -> None:
        self._inbox = inbox
        self._held = held
        self._steps = steps
        self._parking = parking
        self._serving = serving

    def open(
        self,
        session_id: str,
        epoch: int,
        resume: bool = False,
        rewind: tuple[int, int] | None = None,
        prefix: PrefixAsk | None = None,
    ) -> Future[OpenedSlot]:
        """Start a session at ``epoch``, fencing every older one (their steps become stale).

        A newer epoch starts with empty KV, or with ``resume`` keeps the KV the
        session holds (reloading it when parked); the same epoch again keeps its
        KV; an older one is stale. ``rewind`` (positions, steps) cuts a resumed
        session that holds more back to them: the rest was an unfinished turn.
        ``prefix``: a fresh session's prompt, whose longest cached prefix (within
        ``prefix.reuse``) it starts with as its step 0, and whose blocks the cache
        keeps once computed (node/prefixes.py).
        """
        return self._inbox.control(lambda: self._open(session_id, epoch, resume, rewind, prefix))

    def release(self, session_id: str, epoch: int) -> Future[bool]:
        """Free a session's KV (hot or parked) and queued steps, unless a newer epoch
        has taken it over; True when something was freed."""
        return self._inbox.control(lambda: self._release(session_id, epoch))

    def fence(self, session_id: str, epoch: int) -> Future[None]:
        """The session moved on to ``epoch`` elsewhere: drop older KV, refuse older steps."""
        return self._inbox.control(lambda: self._fence(session_id, epoch))

    def export_kv(self, session_id: str) -> Future[ExportedKV]:
        """Copy a session's KV (consistent: no step runs while it is copied)."""
        return self._inbox.control(lambda: self._export(session_id))

    def import_kv(
        self, session_id: str, epoch: int, steps: int, tokens: int, payload: bytes | bytearray
    ) -> Future[OpenedSlot]:
        """Make verified KV a session's (replacing what it held); visible only once loaded."""
        return self._inbox.control(lambda: self._import(session_id, epoch, steps, tokens, payload))

    def quarantine(self, session_id: str) -> Future[None]:
        """After a failed import: the session holds nothing (KV, steps, queued work)."""
        return self._inbox.control(lambda: self._drop(session_id))

    def sent(self, session_id: str, first: int, end: int) -> Future[list[tuple[int, np.ndarray]]]:
        """What this hop forwarded for a session in steps [first, end), as far as it holds it."""

        def read() -> list[tuple[int, np.ndarray]]:
            slot = self._held.slots.get(session_id)
            if slot is None:
                return []
            return [(s, slot.sent[s]) for s in range(first, end) if s in slot.sent]

        return self._inbox.control(read)

    def cancel(self, session_id: str) -> Future[None]:
        """Free a session's KV whatever its epoch, and fail its unfinished steps."""
        return self._inbox.control(lambda: self._drop(session_id))

    # --- the loop thread --------------------------------------------------------

    def _drop(self, session_id: str) -> None:
        """Forget a session's KV (hot and parked) and fail its unfinished steps."""
        self._held.forget(session_id)
        self._steps.fail(session_id, Cancelled(f"session {session_id} was released"))
        self._held.account()

    def _admissible(self, session_id: str, epoch: int) -> Shard:
        """The shard a session at ``epoch`` may use, unless the node is empty or it is fenced."""
        shard = self._serving.shard
        if self._serving.swapping:
            raise Overloaded("the node is draining to load another shard")
        if shard is None:
            raise ShardMismatch("this node is empty: no layers loaded")
        fence = self._held.fence(session_id)
        if epoch < fence:
            raise StaleEpoch(f"session {session_id} is at epoch {fence}, not {epoch}")
        return shard

    def _open(
        self,
        session_id: str,
        epoch: int,
        resume: bool,
        rewind: tuple[int, int] | None,
        prefix: PrefixAsk | None,
    ) -> OpenedSlot:
        held = self._held
        shard = self._admissible(session_id, epoch)
        unparked = False
        if resume and session_id not in held.slots and session_id in held.parked:
            unparked = self._parking.unpark(shard, session_id)
        slot = held.slots.get(session_id)
        if slot is not None and slot.epoch < epoch and resume:
            self._steps.fail(session_id, StaleEpoch(f"epoch {slot.epoch} was fenced by {epoch}"))
            slot.epoch = epoch
        elif slot is None or slot.epoch < epoch:  # the same epoch keeps its KV
            kv, rows = shard.backend.new_kv(), held.row_log(shard, 0)
            if not held.budget.fits(kv.growth_bytes(1)):
                raise budget_full(held.budget, len(held.slots))
            self._drop(session_id)
            slot = held.slots[session_id] = Slot(epoch, kv, rows=rows)
            if prefix is not None:
                self._start_with_prefix(shard, slot, prefix)
        if resume and rewind is not None:
            try:
                _rewind(slot, *rewind)
            except CacheMiss:  # a windowed layer's ring no longer holds that far back:
                self._drop(session_id)  # held as nothing, the tracker replays the log
                kv, rows = shard.backend.new_kv(), held.row_log(shard, 0)
                slot = held.slots[session_id] = Slot(epoch, kv, rows=rows)
        held.remember_fence(session_id, epoch)
        return OpenedSlot(slot.kv.length, slot.steps, unparked)

    def _start_with_prefix(self, shard: Shard, slot: Slot, ask: PrefixAsk) -> None:
        """A fresh slot starts with the longest cached prefix of its prompt that the KV
        budget has room for, as step 0; its commitments start after it."""
        held = self._held
        n = reuse_prefix(held, slot, ask)
        if n:
            slot.rows, slot.inputs = held.row_log(shard, n), RowLog(n)
            held.account()

    def _export(self, session_id: str) -> ExportedKV:
        slot = self._held.slots.get(session_id)
        parked = self._held.parked.get(session_id)
        if slot is None and parked is not None:  # read back from disk, checked
            data = memoryview(self._held.store.read(parked))
            return ExportedKV(parked.epoch, parked.steps, parked.tokens, data)
        if slot is None:
            raise CacheMiss(f"no KV for session {session_id}")
        return ExportedKV(slot.epoch, slot.steps, slot.kv.length, slot.kv.export_bytes())

    def _import(
        self, session_id: str, epoch: int, steps: int, tokens: int, payload: bytes | bytearray
    ) -> OpenedSlot:
        held = self._held
        shard = self._admissible(session_id, epoch)
        self._drop(session_id)  # whatever it held is replaced, or quarantined on failure
        kv = shard.backend.new_kv()
        if not held.budget.fits(kv.growth_bytes(tokens)):
            raise budget_full(held.budget, len(held.slots))
        kv.load_bytes(tokens, payload)
        # KV computed elsewhere: its positions are not this node's to commit.
        rows, inputs = held.row_log(shard, tokens), RowLog(tokens)
        held.slots[session_id] = Slot(epoch, kv, steps=steps, rows=rows, inputs=inputs)
        held.remember_fence(session_id, epoch)
        held.account()
        return OpenedSlot(tokens, steps)

    def _fence(self, session_id: str, epoch: int) -> None:
        slot = self._held.slots.get(session_id)
        parked = self._held.parked.get(session_id)
        if (slot is not None and slot.epoch < epoch) or (parked and parked.epoch < epoch):
            self._drop(session_id)
        if epoch > self._held.fence(session_id):
            self._held.remember_fence(session_id, epoch)

    def _release(self, session_id: str, epoch: int) -> bool:
        slot = self._held.slots.get(session_id)
        parked = self._held.parked.get(session_id)
        if (slot is not None and slot.epoch <= epoch) or (parked and parked.epoch <= epoch):
            self._drop(session_id)
            return True
        return False


def _rewind(slot: Slot, tokens: int, steps: int) -> None:
    """Cut a resumed session back to a committed point it has passed."""
    if slot.kv.length > tokens and slot.steps > steps:
        slot.kv.truncate(tokens)
        slot.rows.truncate(tokens)  # the chunks past it were never the tracker's
        slot.inputs.truncate(tokens)
        slot.steps = steps
        slot.last_step = -1
        slot.last_result = None
        slot.cut_sent(steps)
