"""Parking a session's KV on the node's local disk, out of the KV budget (docs/design.md §7).

At once (``ParkPhase.NOW``), or in two phases: ``PREPARE`` writes the file while
the KV stays hot, then ``COMMIT`` moves it (only if the session has not moved
on) or ``ABORT`` forgets it. A resuming open reads parked KV back (``_unpark``);
a file that fails its check is dropped and the session starts empty.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

from meshnet.backends.shard import Shard
from meshnet.errors import CacheMiss, Overloaded, StaleEpoch
from meshnet.node.engine_base import EngineState
from meshnet.node.engine_types import ParkedSlot
from meshnet.node.parking import ParkedKV, ParkPhase
from meshnet.node.scheduler import Slot, budget_full
from meshnet.protocol.commitments import RowLog

log = logging.getLogger(__name__)


class EngineParking(EngineState):
    """The engine's parking: the ``park`` call and the loop's side of it."""

    def park(
        self, session_id: str, epoch: int | None = None, phase: ParkPhase = ParkPhase.NOW
    ) -> Future[ParkedSlot]:
        """Move an idle session's KV (of ``epoch`` or older) to local disk, out of the
        budget: at once (``NOW``), or written by ``PREPARE`` (the KV stays hot) and
        then moved by ``COMMIT`` or forgotten by ``ABORT``. ``ParkFailed`` when it
        cannot be written (nothing is left on disk); the KV stays hot on any failure."""
        return self._control(lambda: self._apply_park(session_id, epoch, phase))

    def _apply_park(self, session_id: str, epoch: int | None, phase: ParkPhase) -> ParkedSlot:
        prepared = self._prepared.pop(session_id, None)
        if phase is ParkPhase.ABORT:
            if prepared is not None:
                self._park_store.remove(prepared)
            return ParkedSlot(0, 0)
        slot = self._slots.get(session_id)
        if slot is None:
            parked = self._parked.get(session_id)
            if parked is None:
                raise CacheMiss(f"no KV for session {session_id}")
            return ParkedSlot(parked.tokens, 0)  # parked already
        if phase is ParkPhase.COMMIT:
            if prepared is None or (prepared.epoch, prepared.steps) != (slot.epoch, slot.steps):
                if prepared is not None:
                    self._park_store.remove(prepared)
                raise StaleEpoch(f"session {session_id} moved on since its park was prepared")
            return self._move_to_disk(session_id, slot, prepared)
        if epoch is not None and slot.epoch > epoch:
            raise StaleEpoch(f"session {session_id} moved on to epoch {slot.epoch}")
        if any(w.session_id == session_id for w in self._pending):
            raise Overloaded(f"session {session_id} is running a step; park it when idle")
        payload = slot.kv.export_bytes()
        parked = self._park_store.write(session_id, slot.epoch, slot.steps, slot.kv.length, payload)
        if phase is ParkPhase.PREPARE:
            self._prepared[session_id] = parked
            return ParkedSlot(parked.tokens, 0)
        return self._move_to_disk(session_id, slot, parked)

    def _move_to_disk(self, session_id: str, slot: Slot, parked: ParkedKV) -> ParkedSlot:
        del self._slots[session_id]
        self._freed = True
        self._parked[session_id] = parked
        self._account()
        return ParkedSlot(parked.tokens, slot.kv.nbytes + slot.sent_bytes)  # as _account counts

    def _unpark(self, shard: Shard, session_id: str) -> bool:
        """Make parked KV hot again; a file that fails its check is dropped (KV rebuilt)."""
        parked = self._parked.pop(session_id)
        try:
            data = self._park_store.read(parked)
            kv = shard.backend.new_kv()
            if not self._budget.fits(kv.growth_bytes(parked.tokens)):
                self._parked[session_id] = parked  # still parked; the open is refused
                raise budget_full(self._budget, len(self._slots))
            kv.load_bytes(parked.tokens, data)
        except CacheMiss as e:
            log.warning("session %s: %s; it starts empty", session_id, e)
            self._park_store.remove(parked)
            return False
        self._park_store.remove(parked)
        # Row digests are not parked: the next chunk commits.
        rows, inputs = self._row_log(shard, parked.tokens), RowLog(parked.tokens)
        self._slots[session_id] = Slot(parked.epoch, kv, parked.steps, rows=rows, inputs=inputs)
        self._account()
        return True
