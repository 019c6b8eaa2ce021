"""Parking a session's KV on the node's local disk, out of the KV budget (docs/design.md §7).

At once (``ParkPhase.NOW``), or in two phases: ``PREPARE`` writes the file while
the KV stays hot, then ``COMMIT`` moves it (only if the session has not moved
on) or ``ABORT`` forgets it. A resuming open reads parked KV back (``unpark``);
a file that fails its check is dropped and the session starts empty.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import replace

from meshnet.backends.shard import Shard
from meshnet.errors import CacheMiss, Overloaded, StaleEpoch
from meshnet.node.engine_held import HeldKV
from meshnet.node.engine_inbox import Inbox
from meshnet.node.engine_steps import Steps
from meshnet.node.engine_types import ParkedSlot
from meshnet.node.parking import ParkedKV, ParkPhase
from meshnet.node.prefixes import read_cached_pages
from meshnet.node.scheduler import Slot, budget_full
from meshnet.protocol.commitments import RowLog

log = logging.getLogger(__name__)


class Parking:
    """Moves sessions' KV between ``held``'s hot slots and its files on local disk; never
    while a step of the session runs (``steps``)."""

    def __init__(self, inbox: Inbox, held: HeldKV, steps: Steps) -> None:
        self._inbox = inbox
        self._held = held
        self._steps = steps

    def park(
        self, session_id: str, epoch: int | None = None, phase: ParkPhase = ParkPhase.NOW
    ) -> Future[ParkedSlot]:
        """Move an idle session's KV (of ``epoch`` or older) to local disk, out of the
        budget: at once (``NOW``), or written by ``PREPARE`` (the KV stays hot) and
        then moved by ``COMMIT`` or forgotten by ``ABORT``. ``ParkFailed`` when it
        cannot be written (nothing is left on disk); the KV stays hot on any failure."""
        return self._inbox.control(lambda: self.apply(session_id, epoch, phase))

    def apply(self, session_id: str, epoch: int | None, phase: ParkPhase) -> ParkedSlot:
        """``park``, on the loop's thread."""
        held = self._held
        prepared = held.prepared.pop(session_id, None)
        if phase is ParkPhase.ABORT:
            if prepared is not None:
                held.store.remove(prepared)
            return ParkedSlot(0, 0)
        slot = held.slots.get(session_id)
        if slot is None:
            parked = held.parked.get(session_id)
            if parked is None:
                raise CacheMiss(f"no KV for session {session_id}")
            return ParkedSlot(parked.tokens, 0)  # parked already
        if phase is ParkPhase.COMMIT:
            if prepared is None or (prepared.epoch, prepared.steps) != (slot.epoch, slot.steps):
                if prepared is not None:
                    held.store.remove(prepared)
                raise StaleEpoch(f"session {session_id} moved on since its park was prepared")
            return self._move_to_disk(session_id, prepared)
        if epoch is not None and slot.epoch > epoch:
            raise StaleEpoch(f"session {session_id} moved on to epoch {slot.epoch}")
        if self._steps.running(session_id):
            raise Overloaded(f"session {session_id} is running a step; park it when idle")
        payload = slot.kv.export_bytes()
        parked = held.store.write(session_id, slot.epoch, slot.steps, slot.kv.length, payload)
        if slot.kv.pages:
            parked = replace(parked, prefix_key=slot.kv.pages[-1].key)
        if phase is ParkPhase.PREPARE:
            held.prepared[session_id] = parked
            return ParkedSlot(parked.tokens, 0)
        return self._move_to_disk(session_id, parked)

    def _move_to_disk(self, session_id: str, parked: ParkedKV) -> ParkedSlot:
        held = self._held
        held.account()
        before = held.budget.in_use
        del held.slots[session_id]
        held.freed = True
        held.parked[session_id] = parked
        held.account()  # a shared page other sessions read stays: it frees nothing
        return ParkedSlot(parked.tokens, before - held.budget.in_use)

    def unpark(self, shard: Shard, session_id: str) -> bool:
        """Make parked KV hot again; a file that fails its check is dropped (KV rebuilt)."""
        held = self._held
        parked = held.parked.pop(session_id)
        try:
            data = held.store.read(parked)
            kv = shard.backend.new_kv()
            if not held.budget.fits(kv.growth_bytes(parked.tokens)):
                held.parked[session_id] = parked  # still parked; the open is refused
                raise budget_full(held.budget, len(held.slots))
            kv.load_bytes(parked.tokens, data)
            read_cached_pages(held.prefixes, kv, parked.prefix_key)
        except CacheMiss as e:
            log.warning("session %s: %s; it starts empty", session_id, e)
            held.store.remove(parked)
            return False
        held.store.remove(parked)
        # Row digests are not parked: the next chunk commits.
        rows, inputs = held.row_log(shard, parked.tokens), RowLog(parked.tokens)
        held.slots[session_id] = Slot(parked.epoch, kv, parked.steps, rows=rows, inputs=inputs)
        held.account()
        return True
