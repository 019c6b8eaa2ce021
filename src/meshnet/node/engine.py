"""The node's one loop: every change to its shard and its sessions' KV happens here.

Request threads (gRPC handlers) submit commands and steps and wait on
futures. The loop thread applies control commands in arrival order (load,
open, release, cancel) and then runs one *iteration*: a single batched
forward over the decode steps of every runnable session plus a chunk of each
pending prefill (node/engine_forward.py). While it waits for work, a thread
bringing a relayed step may run that step's iteration itself (``run_here``);
whoever runs the loop holds its lock, so it is still one loop.

``NodeEngine`` is an assembly of parts, each an object owning its own state and
handed the others it needs: the inbox (node/engine_inbox.py), the steps
admitted (engine_steps.py), the KV held (engine_held.py), parking
(engine_parking.py), the sessions' calls (engine_sessions.py), the tiers of
live configuration, which own the shard and the config (engine_tiers.py), and
the forwards (engine_forward.py). It runs the loop's thread and admits steps;
callers reach every other call on the part that owns it (``engine.sessions.open``,
``engine.tiers.load``, ``engine.parking.park``, ``engine.forwards.after_batch``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from meshnet.backends.shard import Shard
from meshnet.errors import Cancelled
from meshnet.memory import trim
from meshnet.node.context import served_context
from meshnet.node.engine_forward import Forwards, OnForward
from meshnet.node.engine_held import HeldKV
from meshnet.node.engine_inbox import Control, Inbox, settle
from meshnet.node.engine_parking import Parking
from meshnet.node.engine_sessions import Sessions
from meshnet.node.engine_steps import Steps
from meshnet.node.engine_tiers import Tiers
from meshnet.node.engine_types import EngineConfig, EngineStats
from meshnet.node.scheduler import StepWork

__all__ = ["EngineConfig", "EngineStats", "NodeEngine"]

log = logging.getLogger(__name__)


class NodeEngine:
    """Owns one shard (or none, when empty) and the KV of every session on it: its
    parts, assembled, and the loop that runs them. ``on_forward`` is told of every
    forward (rows, seconds, sessions): the node's metrics."""

    def __init__(
        self, config: EngineConfig = EngineConfig(), on_forward: OnForward | None = None
    ) -> None:
        self.inbox = Inbox()
        self.steps = Steps()
        self.held = HeldKV(config)
        self.parking = Parking(self.inbox, self.held, self.steps)
        self.tiers = Tiers(config, self.inbox, self.held, self.steps, self.parking)
        self.sessions = Sessions(self.inbox, self.held, self.steps, self.parking, self.tiers)
        self.forwards = Forwards(self.held, self.steps, self.tiers, on_forward)
        self._stopping = False
        # Whoever runs the loop holds ``_loop``: the loop's thread, or while it waits for
        # work a thread that brings a step (``run_here``).
        self._loop = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="node-engine", daemon=True)

    @property
    def config(self) -> EngineConfig:
        """The config it runs with now (a tier replaces it whole)."""
        return self.tiers.config

    @property
    def shard(self) -> Shard | None:
        return self.tiers.shard

    # --- called from any thread -------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.inbox.put(None)
        self._thread.join(timeout=10)

    def stats(self) -> EngineStats:
        shard, config, held, forwards = self.shard, self.config, self.held, self.forwards
        return EngineStats(
            loaded=shard is not None,
            layers=shard.layers if shard else None,
            fingerprint=shard.fingerprint if shard else "",
            sessions=len(held.slots),
            parked=len(held.parked),
            kv_bytes=held.budget.in_use,
            kv_peak_bytes=held.budget.peak,
            kv_budget_bytes=held.budget.budget_bytes,
            queue_depth=self.steps.outstanding,
            steps=forwards.finished,
            last_batch=forwards.last_batch,
            max_batch=forwards.max_batch,
            tokens_per_s=forwards.tokens_per_s,
            max_streams=config.max_streams,
            context=served_context(shard, config.ctx) if shard else 0,
            prefix=held.prefixes.stats(),
        )

    def submit(self, work: StepWork) -> Future[np.ndarray]:
        """Queue a step; ``Overloaded`` at once when too many are unfinished."""
        self.steps.count_in(work, self.config.max_queued_steps)
        self.inbox.put(work)
        return work.future

    def run_here(self, work: StepWork, then: Callable[[Future[np.ndarray]], None]) -> None:
        """Submit ``work``, ``then`` told when it is done; when the loop is idle (waiting
        on an empty inbox), run the forward it starts on this thread instead of waking
        the loop's. A ring's step relayed to an idle hop then starts ~40-90 us sooner,
        paid on every hop of every token. The loop's thread, woken meanwhile by other
        work, waits its turn: whoever holds ``_loop`` is the loop."""
        if not self._loop.acquire(blocking=False):
            self.submit(work).add_done_callback(then)
            return
        try:
            if self._stopping or not self.inbox.empty():  # what came first goes first
                self.submit(work).add_done_callback(then)
                return
            self.steps.count_in(work, self.config.max_queued_steps).add_done_callback(then)
            try:
                self._admit(work)
                self.tiers.apply_staged()
                if self.steps.pending:
                    self.forwards.iteration()
            finally:
                if self.steps.pending:  # a prompt's next chunk: the loop's thread goes on
                    self.inbox.put(Control(_nothing))
        finally:
            self._loop.release()

    # --- the loop thread --------------------------------------------------------

    def _run(self) -> None:
        self._loop.acquire()
        try:
            while not self._stopping:
                self.tiers.apply_staged()  # the last step of a drain may just have finished
                if not self.steps.pending:
                    self._idle()
                    self._take(self._wait())
                self._drain()
                self.tiers.apply_staged()
                if not self._stopping:
                    self.forwards.iteration()
            self._fail_leftovers()
        finally:
            self._loop.release()

    def _wait(self) -> StepWork | Control | None:
        """Idle: the next item of the inbox, ``run_here`` free to run the loop meanwhile."""
        self._loop.release()
        try:
            return self.inbox.get()
        finally:
            self._loop.acquire()

    def _idle(self) -> None:
        """About to wait for work: hand back the heap pages ended sessions freed, once,
        where it delays nothing."""
        if self.held.freed and self.inbox.empty():
            self.held.freed = False
            trim()

    def _fail_leftovers(self) -> None:
        """After a stop: whatever still waits is answered, so no caller hangs."""
        leftovers: list[StepWork | Control] = list(self.steps.pending)
        while True:
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                leftovers.append(item)
        waiting: list[Future[Any]] = [item.future for item in leftovers]
        staged = self.tiers.staged_future
        if staged is not None:
            waiting.append(staged)
        for future in waiting:
            if not future.done():  # a withdrawn configure is answered already
                future.set_exception(Cancelled("the node is stopping"))

    def _drain(self) -> None:
        # The loop is the inbox's one reader, so what ``empty`` saw is still there; no
        # ``Empty`` raised on every iteration.
        while not self.inbox.empty():
            self._take(self.inbox.get_nowait())

    def _take(self, item: StepWork | Control | None) -> None:
        if item is None:
            self._stopping = True
        elif isinstance(item, Control):
            settle(item.future, item.apply)
        else:
            self._admit(item)

    def _admit(self, w: StepWork) -> None:
        """Queue a step, or answer a duplicate with its recorded result, or refuse it."""
        self.steps.admit(w, self.held.slots.get(w.session_id), self.held.fence(w.session_id))


def _nothing() -> None:
    """A control that only wakes the loop's thread."""
