"""Live configuration applied on a node's engine: tiers 1 to 3 (docs/design.md §11).

Tier 1 (limits) applies at once. Tier 2 (batching) and a tier-3 shard swap are
staged and applied by the loop at the first step boundary at which no prompt is
half-run; meanwhile only half-run prompts go on, and during a swap's drain opens
and imports are refused ``overloaded``. The values are checked before, in pure
functions (node/tiers.py).
"""

from __future__ import annotations

import gc
import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from meshnet.backends.shard import Shard, load_shard_file
from meshnet.errors import CacheMiss, MeshnetError, Overloaded
from meshnet.layer_range import LayerRange
from meshnet.memory import trim
from meshnet.node.context import check_context_budget
from meshnet.node.engine_held import HeldKV
from meshnet.node.engine_inbox import Inbox, settle
from meshnet.node.engine_parking import Parking
from meshnet.node.engine_steps import Steps
from meshnet.node.engine_types import EngineConfig
from meshnet.node.parking import ParkPhase
from meshnet.node.tiers import (
    Batching,
    Limits,
    check_batching,
    set_log_level,
    with_batching,
    with_limits,
)

log = logging.getLogger(__name__)


@dataclass
class Staged:
    """A tier-2 or tier-3 change waiting for the loop to drain; ``future`` answers it."""

    change: Batching | Shard | None  # None: unload (the node becomes empty)
    future: Future[Any]


class Tiers:
    """What the node serves, its shard and its configuration, and the changes to them.

    ``config`` is replaced whole, on the loop thread, by a tier-1 or tier-2 change;
    other threads read it as it is at that moment. A shard swap lets go of the
    sessions' KV (``held``) and fails the steps queued (``steps``), or keeps the
    KV parked (``parking``) when the same shard is loaded again.
    """

    def __init__(
        self, config: EngineConfig, inbox: Inbox, held: HeldKV, steps: Steps, parking: Parking
    ) -> None:
        self.config = config
        self._shard: Shard | None = None
        self._staged: Staged | None = None  # a T2/T3 change waiting for a drain (loop only)
        self._inbox = inbox
        self._held = held
        self._steps = steps
        self._parking = parking

    @property
    def shard(self) -> Shard | None:
        return self._shard

    @property
    def draining(self) -> bool:
        return self._staged is not None

    @property
    def swapping(self) -> bool:
        return self._staged is not None and not isinstance(self._staged.change, Batching)

    def load(
        self, model_path: str, layers: LayerRange, fingerprint: str | None = None
    ) -> Future[Shard]:
        """Load ``layers`` of the model (tier 3); drops every session's KV. ``fingerprint``:
        the model's, when ``model_path`` holds only the range (``load_shard_file``)."""
        return self._inbox.control(lambda: self._apply_load(model_path, layers, fingerprint))

    def configure_limits(self, limits: Limits) -> Future[EngineConfig]:
        """Tier 1, applied by the loop at once (checked by the caller:
        ``configure.check_limits``); the config it runs with after."""
        return self._inbox.control(lambda: self._apply_limits(limits))

    def configure_batching(self, batching: Batching) -> Future[EngineConfig]:
        """Tier 2: checked on the loop against the KV held then, and applied at the first
        step boundary at which no prompt is half-run (no step starts meanwhile); the
        config it runs with after, or ``RequestError`` with the reason and nothing
        changed. Cancelling the future before it is answered withdraws the change."""
        staged = Staged(batching, Future())
        self._inbox.control(lambda: self._stage(staged))
        return staged.future

    def swap(self, shard: Shard | None) -> Future[int]:
        """Tier 3: drain (opens and imports are refused ``overloaded``, half-run prompts
        finish, no other step starts), then serve ``shard`` instead (None: nothing, the
        node is empty until its next load); the steps still
        queued fail ``cache-miss``. The same model and layers again keep the sessions'
        KV, parked on local disk (a resuming open reads it back); any other shard drops
        it. The sessions whose KV was dropped. Cancelling the future before it is
        answered withdraws the swap."""
        staged = Staged(shard, Future())
        self._inbox.control(lambda: self._stage(staged))
        return staged.future

    # --- the loop thread --------------------------------------------------------

    def apply_staged(self) -> None:
        """Apply the staged change once drained (no prompt half-run). Withdrawn (its
        future cancelled) meanwhile: nothing changes."""
        staged = self._staged
        if staged is None:
            return
        change = staged.change
        if self._steps.half_run():
            return
        self._staged = None
        if not staged.future.set_running_or_notify_cancel():
            log.info("a configure was withdrawn before the node drained: nothing changed")
            return
        if isinstance(change, Batching):
            settle(staged.future, lambda: self._apply_batching(change))
        else:
            settle(staged.future, lambda: self._apply_swap(change))

    @property
    def staged_future(self) -> Future[Any] | None:
        """What answers the change waiting for a drain (None: none waits)."""
        return self._staged.future if self._staged is not None else None

    def _apply_load(self, model_path: str, layers: LayerRange, fingerprint: str | None) -> Shard:
        shard = load_shard_file(model_path, layers, self.config.backend, fingerprint)
        check_context_budget(shard, self.config.ctx, self.config.kv_budget_bytes)
        self._swap_in(shard)
        log.info("loaded layers %s of %s on %s", layers, model_path, shard.backend.name)
        return shard

    def _swap_in(self, shard: Shard | None, park: bool = False) -> int:
        """Serve ``shard``: queued steps fail, every session's KV is dropped, or with
        ``park`` (``shard`` has the same model and layers) parked first and kept; the
        sessions whose KV was dropped."""
        self._steps.fail_all(CacheMiss("the node loaded another shard; its KV is gone"))
        if park:
            for session_id in list(self._held.slots):
                try:
                    self._parking.apply(session_id, None, ParkPhase.NOW)
                except MeshnetError as e:
                    log.warning("session %s could not be parked for the reload: %s", session_id, e)
        self._shard = shard
        # Another shard's KV, or the same one's dropped with it: the prefix cache goes too.
        return self._held.forget_all(keep_parked=park)

    def _apply_limits(self, limits: Limits) -> EngineConfig:
        self.config = with_limits(self.config, limits)
        set_log_level(limits.log_level)
        log.info("tier 1 applied: %s", limits)
        return self.config

    def _stage(self, staged: Staged) -> None:
        """Hold a T2/T3 change until the loop has drained (``apply_staged``)."""
        try:
            if self._staged is not None:
                raise Overloaded("another configure is waiting for the node to drain")
            if isinstance(staged.change, Batching):
                check_batching(staged.change, self.config, self._held.budget.in_use)
        except Exception as e:
            if staged.future.set_running_or_notify_cancel():
                staged.future.set_exception(e)
            return
        self._staged = staged

    def _apply_batching(self, batching: Batching) -> EngineConfig:
        check_batching(batching, self.config, self._held.budget.in_use)  # KV may have grown
        self.config = with_batching(self.config, batching)
        self._held.budget.budget_bytes = self.config.kv_budget_bytes
        log.info("tier 2 applied: %s", batching)
        return self.config

    def _apply_swap(self, shard: Shard | None) -> int:
        ended = self._swap_in_collected(shard)
        if shard is None:
            log.info("tier 3 applied: unloaded, the node is empty; %d sessions' KV dropped", ended)
            return ended
        log.info(
            "tier 3 applied: layers %s of %s on %s; %d sessions' KV dropped",
            shard.layers,
            shard.fingerprint[:12],
            shard.backend.name,
            ended,
        )
        return ended

    def _swap_in_collected(self, shard: Shard | None) -> int:
        """``_swap_in`` with the collector told: what the node held for its life is out
        of its reach (node/main.py freezes it), so the old shard's cycles are collected
        once, here, and the new shard is put out of reach in turn. What the old shard
        and the dropped KV held in the heap then goes back to the system (memory.py)."""
        gc.unfreeze()
        park = shard is not None and _same_shard(self._shard, shard)
        ended = self._swap_in(shard, park=park)
        gc.collect()
        gc.freeze()
        trim()
        return ended


def _same_shard(old: Shard | None, new: Shard) -> bool:
    """Whether ``new`` is ``old`` loaded again: the same model file's layers, whose KV fits."""
    return old is not None and (old.fingerprint, old.layers) == (new.fingerprint, new.layers)
