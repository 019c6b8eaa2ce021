"""The node's one loop: every change to its shard and its sessions' KV happens here.

Request threads (gRPC handlers) submit commands and steps and wait on
futures. The loop thread applies control commands in arrival order (load,
open, release, cancel) and then runs one *iteration*: a single batched
forward over the decode steps of every runnable session plus a chunk of each
pending prefill. While it waits for work, a thread bringing a relayed step may
run that step's iteration itself (``run_here``); whoever runs the loop holds its
lock, so it is still one loop. A prefill is cut into fixed-size chunks counted
from the start of its own prompt, so a long prompt never stalls running streams
and a sequence is chunked the same way whatever else is running (its results
stay bit-identical alone or batched).

Live configuration is applied here too (node/engine_tiers.py): tier 1 at once,
tier 2 and a tier-3 shard swap once no prompt is half-run (only half-run
prompts go on until then; during a swap's drain opens and imports are
refused ``overloaded``). The engine is one class built in layers, a module each:
its state (node/engine_base.py), parking (node/engine_parking.py), the sessions'
KV (node/engine_sessions.py), the tiers, and this loop.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import numpy as np

from meshnet.backends.base import BatchEntry, HeadSplit
from meshnet.backends.shard import Shard
from meshnet.errors import Cancelled, Overloaded
from meshnet.memory import trim
from meshnet.node.context import served_context
from meshnet.node.engine_base import Control, settle
from meshnet.node.engine_tiers import EngineTiers
from meshnet.node.engine_types import EngineConfig, EngineStats
from meshnet.node.prefixes import keep_prefix
from meshnet.node.scheduler import Slot, StepWork, check_step_number, plan_batch

log = logging.getLogger(__name__)


class NodeEngine(EngineTiers):
    """Owns one shard (or none, when empty) and the KV of every session on it: the
    loop, and the calls that hand it steps (the rest of its calls are its parts':
    node/engine_sessions.py, node/engine_parking.py, node/engine_tiers.py)."""

    def __init__(self, config: EngineConfig = EngineConfig()) -> None:
        super().__init__(config)
        self._thread = threading.Thread(target=self._run, name="node-engine", daemon=True)

    # --- called from any thread -------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def stats(self) -> EngineStats:
        shard = self._shard
        return EngineStats(
            loaded=shard is not None,
            layers=shard.layers if shard else None,
            fingerprint=shard.fingerprint if shard else "",
            sessions=len(self._slots),
            parked=len(self._parked),
            kv_bytes=self._budget.in_use,
            kv_peak_bytes=self._budget.peak,
            kv_budget_bytes=self._budget.budget_bytes,
            queue_depth=self._outstanding,
            steps=self._steps,
            last_batch=self._last_batch,
            max_batch=self._max_batch,
            tokens_per_s=self._tokens_per_s,
            max_streams=self.config.max_streams,
            context=served_context(shard, self.config.ctx) if shard else 0,
            prefix=self._prefixes.stats(),
        )

    def after_batch(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the forward whose steps are being answered has answered and
        committed all of them; now when none is (another thread, between forwards).

        What wakes another thread of this process belongs here: a woken stream
        handler takes the GIL whenever the loop lets it go (an argmax over logits, a
        row's SHA-256), and the loop waits for it back. Eight streams' handlers woken
        one by one inside a batch's bookkeeping stretched it from ~0.8 to ~4 ms.
        """
        after = self._after
        if after is not None and threading.get_ident() == self._runner:
            after.append(fn)
        else:
            fn()

    def submit(self, work: StepWork) -> Future[np.ndarray]:
        """Queue a step; ``Overloaded`` at once when too many are unfinished."""
        self._count_in(work)
        self._inbox.put(work)
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
            if self._stopping or not self._inbox.empty():  # what came first goes first
                self.submit(work).add_done_callback(then)
                return
            self._count_in(work).add_done_callback(then)
            self._runner = threading.get_ident()
            try:
                self._admit(work)
                self._apply_staged()
                if self._pending:
                    self._iteration()
            finally:
                self._runner = None
                if self._pending:  # a prompt's next chunk: the loop's thread goes on
                    self._inbox.put(Control(_nothing))
        finally:
            self._loop.release()

    def _count_in(self, work: StepWork) -> Future[np.ndarray]:
        """Count a step as unfinished until it is; ``Overloaded`` when too many are."""
        with self._lock:
            if self._outstanding >= self.config.max_queued_steps:
                raise Overloaded(f"{self._outstanding} steps queued on this node")
            self._outstanding += 1
        work.future.add_done_callback(self._finished)
        return work.future

    def _finished(self, _: Future[np.ndarray]) -> None:
        with self._lock:
            self._outstanding -= 1

    # --- the loop thread --------------------------------------------------------

    def _run(self) -> None:
        self._loop.acquire()
        self._runner = threading.get_ident()
        try:
            while not self._stopping:
                self._apply_staged()  # the last step of a drain may just have finished
                if not self._pending:
                    self._idle()
                    self._take(self._wait())
                self._drain()
                self._apply_staged()
                if not self._stopping:
                    self._iteration()
            self._fail_leftovers()
        finally:
            self._runner = None
            self._loop.release()

    def _wait(self) -> StepWork | Control | None:
        """Idle: the next item of the inbox, ``run_here`` free to run the loop meanwhile."""
        self._runner = None
        self._loop.release()
        try:
            return self._inbox.get()
        finally:
            self._loop.acquire()
            self._runner = threading.get_ident()

    def _idle(self) -> None:
        """About to wait for work: hand back the heap pages ended sessions freed, once,
        where it delays nothing."""
        if self._freed and self._inbox.empty():
            self._freed = False
            trim()

    def _fail_leftovers(self) -> None:
        """After a stop: whatever still waits is answered, so no caller hangs."""
        leftovers: list[StepWork | Control] = list(self._pending)
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                leftovers.append(item)
        waiting: list[Future[Any]] = [item.future for item in leftovers]
        if self._staged is not None:
            waiting.append(self._staged.future)
        for future in waiting:
            if not future.done():  # a withdrawn configure is answered already
                future.set_exception(Cancelled("the node is stopping"))

    def _drain(self) -> None:
        # The loop is the inbox's one reader, so what ``empty`` saw is still there; no
        # ``Empty`` raised on every iteration.
        while not self._inbox.empty():
            self._take(self._inbox.get_nowait())

    def _take(self, item: StepWork | Control | None) -> None:
        if item is None:
            self._stopping = True
        elif isinstance(item, Control):
            settle(item.future, item.apply)
        else:
            self._admit(item)

    def _admit(self, w: StepWork) -> None:
        """Queue a step, or answer a duplicate with its recorded result, or refuse it."""
        running = any(p.session_id == w.session_id for p in self._pending)
        fence = self._fences.get(w.session_id, 0)
        verdict = check_step_number(w, self._slots.get(w.session_id), fence, running)
        if isinstance(verdict, np.ndarray):
            w.future.set_result(verdict)
        elif verdict is not None:
            w.future.set_exception(verdict)
        else:
            self._pending.append(w)

    def _iteration(self) -> None:
        """One forward over a chunk of every admitted step, within the row budget."""
        pending = self._pending
        if self._staged is not None:
            pending = [w for w in pending if w.done_rows]  # drain: only half-run prompts go on
        plan = plan_batch(
            pending,
            self._slots,
            self._shard is not None,
            self._budget,
            self.config.max_batch_tokens,
            self.config.prefill_chunk,
            time.monotonic(),
            self._shard is not None and self._shard.backend.decodes_rows_exactly,
            served_context(self._shard, self.config.ctx) if self._shard else 0,
        )
        for w, error in plan.refused:
            self._pending.remove(w)
            w.future.set_exception(error)
        if plan.chosen and self._shard is not None:
            self._forward(self._shard, list(plan.chosen))

    def _forward(self, shard: Shard, chosen: list[tuple[StepWork, int]]) -> None:
        x = np.concatenate([w.x[w.done_rows : w.done_rows + n] for w, n in chosen])
        batch = [BatchEntry(self._slots[w.session_id].kv, n, w.replay) for w, n in chosen]
        self._make_room(sum(entry.kv.growth_bytes(entry.n_new) for entry in batch))
        positions = [entry.kv.length for entry in batch]
        t0 = time.perf_counter()
        try:
            split = chosen[0][0].head_split if len(chosen) == 1 else None
            out, boundary = forward_committed(shard, x, batch, split)
        except Exception as e:  # a bug must fail the steps, not kill the loop
            log.exception("batch of %d steps failed", len(chosen))
            for w, _ in chosen:
                self._pending.remove(w)
                w.future.set_exception(e)
            self._account()
            return
        seconds = time.perf_counter() - t0
        self._after = []
        try:
            self._commit(shard, chosen, x, positions, out, boundary)
        finally:
            after, self._after = self._after, None
            for fn in after:
                try:
                    fn()
                except Exception:
                    log.exception("a step's deferred answer failed")
        self._note_speed(x.shape[0], seconds, len(chosen))

    def _commit(
        self,
        shard: Shard,
        chosen: list[tuple[StepWork, int]],
        x: np.ndarray,
        positions: list[int],
        out: np.ndarray,
        boundary: np.ndarray,
    ) -> None:
        """Hand over, commit and answer each step of a forward's batch."""
        _hand_over(chosen, out, shard.is_last)  # first: a ring's next hop waits on it
        offset = 0
        for i, (w, n) in enumerate(chosen):
            w.outputs.append(out[i : i + 1] if shard.is_last else out[offset : offset + n])
            slot = self._slots[w.session_id]
            w.chunks += slot.rows.add(positions[i], boundary[offset : offset + n])
            if not shard.is_first:
                w.inputs.update(slot.inputs.add(positions[i], x[offset : offset + n]))
            offset += n
            w.done_rows += n
            if w.done_rows == w.n_tokens:
                self._pending.remove(w)
                self._steps += 1
                result = w.outputs[-1] if shard.is_last else np.concatenate(w.outputs)
                if w.keep_output and not shard.is_last:
                    _keep_sent(slot, w, result)
                slot.last_step = slot.steps
                slot.steps += w.steps
                slot.last_result = result
                w.future.set_result(result)
        for w, _ in chosen:  # after the answers: copying blocks delays none of them
            keep_prefix(self._prefixes, self._slots.get(w.session_id))
        self._account()

    def _note_speed(self, rows: int, seconds: float, sessions: int) -> None:
        self._last_batch = sessions
        self._max_batch = max(self._max_batch, sessions)
        rate = rows / seconds if seconds > 0 else 0.0
        old = self._tokens_per_s
        self._tokens_per_s = rate if not old else 0.8 * old + 0.2 * rate


def forward_committed(
    shard: Shard, x: np.ndarray, batch: list[BatchEntry], split: HeadSplit | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``Shard.forward`` that also returns the rows at the range's end boundary [T, d]:
    the output itself, or on the last shard the last layer's output before the final
    norm and head (what a split there would send), which the node commits to. ``split``:
    the head's multiply shared through it (the same logits)."""
    hidden = shard.backend.embed(x) if shard.is_first else x
    hidden = shard.backend.run_layers(hidden, batch)
    if not shard.is_last:
        return hidden, hidden
    last_rows = np.cumsum([e.n_new for e in batch]) - 1
    return shard.backend.head(hidden[last_rows], split), hidden


def _hand_over(chosen: list[tuple[StepWork, int]], out: np.ndarray, last: bool) -> None:
    """Give each step run whole in this forward that asks for it (``on_output``) its
    output now, before the bookkeeping of the batch: a ring's next hop can start
    meanwhile. A hook's error is logged; the step is committed and answered as ever."""
    offset = 0
    for i, (w, n) in enumerate(chosen):
        if w.on_output is not None and w.done_rows == 0 and n == w.n_tokens:
            try:
                w.on_output(out[i : i + 1] if last else out[offset : offset + n])
            except Exception:
                log.exception("handing over the output of step %s failed", w.step)
        offset += n


def _keep_sent(slot: Slot, w: StepWork, result: np.ndarray) -> None:
    """Log a forwarded output by step: a replayed run one row per decode step."""
    if w.replay:
        for row in range(result.shape[0]):
            slot.keep_sent(slot.steps + row, result[row : row + 1])
    else:
        slot.keep_sent(slot.steps, result)


def _nothing() -> None:
    """A control that only wakes the loop's thread."""
