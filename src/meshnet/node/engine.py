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

Live configuration (node/configure.py) is applied here too: tier 1 at once,
tier 2 and a tier-3 shard swap once no prompt is half-run (only half-run
prompts go on until then; during a swap's drain opens and imports are
refused ``overloaded``).
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshnet.backends.base import BatchEntry, HeadSplit
from meshnet.errors import (
    CacheMiss,
    Cancelled,
    MeshnetError,
    Overloaded,
    ShardMismatch,
    StaleEpoch,
)
from meshnet.kv.manager import KVBudget
from meshnet.kv.prefix_cache import PrefixCache, PrefixStats
from meshnet.layer_range import LayerRange
from meshnet.memory import trim
from meshnet.model.shard import DEFAULT_BACKEND, Shard, load_shard_file
from meshnet.node.configure import (
    Batching,
    Limits,
    check_batching,
    set_log_level,
    with_batching,
    with_limits,
)
from meshnet.node.context import check_context_budget, served_context
from meshnet.node.parking import ParkedKV, ParkPhase, ParkStore
from meshnet.node.prefixes import PrefixAsk, keep_prefix, reuse_prefix
from meshnet.node.scheduler import Slot, StepWork, budget_full, check_step_number, plan_batch
from meshnet.protocol.commitments import RowLog, commits_exactly
from meshnet.protocol.sketches import check_width

log = logging.getLogger(__name__)

_MAX_FENCES = 65536  # sessions whose newest epoch is remembered after their KV is gone


@dataclass(frozen=True)
class EngineConfig:
    kv_budget_bytes: int = 0  # KV all sessions may hold; 0 means unlimited
    max_batch_tokens: int = 512  # rows in one forward
    prefill_chunk: int = 128  # prompt rows one session adds to one forward
    max_queued_steps: int = 256  # submitted but unfinished steps; more are refused
    max_streams: int = 64  # Forward streams held at once; more are refused with overloaded
    backend: str = DEFAULT_BACKEND
    park_dir: str | None = None  # where parked KV goes; None: a fresh temp directory
    ctx: int = 0  # positions a sequence may reach (``--ctx``); 0: the model's trained context
    drain_timeout_s: float = 60.0  # a T2/T3 change not applied by then is withdrawn
    # Bytes of prompt-prefix KV kept for reuse (kv/prefix_cache.py), within the KV
    # budget (what sessions hold comes first); 0 turns the prefix cache off.
    prefix_cache_bytes: int = 256 * 2**20


@dataclass
class _Control:
    """A command the loop applies in order between iterations."""

    apply: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


@dataclass
class _Staged:
    """A tier-2 or tier-3 change waiting for the loop to drain; ``future`` answers it."""

    change: Batching | Shard | None  # None: unload (the node becomes empty)
    future: Future[Any]


@dataclass(frozen=True)
class OpenedSlot:
    """A session's state right after an open: what a resuming driver checks."""

    kv_tokens: int  # positions of KV held
    steps: int  # steps committed
    unparked: bool = False  # read back from local disk by this open


@dataclass(frozen=True)
class ParkedSlot:
    """What a park did: the positions now on disk and the hot bytes it freed (0 when
    the session was parked already)."""

    tokens: int
    freed_bytes: int


@dataclass(frozen=True)
class ExportedKV:
    """A copy of one session's KV on this shard, taken between iterations."""

    epoch: int
    steps: int
    tokens: int
    payload: memoryview  # bytes, as SequenceKV.export_bytes lays them out


@dataclass(frozen=True)
class EngineStats:
    loaded: bool
    layers: LayerRange | None
    fingerprint: str
    sessions: int
    parked: int  # sessions whose KV is parked on disk
    kv_bytes: int
    kv_peak_bytes: int
    kv_budget_bytes: int
    queue_depth: int  # steps submitted and not finished
    steps: int  # steps finished since start
    last_batch: int  # sessions in the last forward
    max_batch: int  # most sessions in one forward since start
    tokens_per_s: float  # rows per second over recent forwards
    max_streams: int  # Forward streams it holds at once
    relayed: int = 0  # steps whose input came straight from the previous hop
    context: int = 0  # positions a sequence may reach here (0: empty)
    head_parts: int = 0  # head multiplies the ring's first hop shared in time
    head_parts_late: int = 0  # those it was asked for and this node did itself
    prefix: PrefixStats | None = None  # the prefix cache's state (None: never read)


class NodeEngine:
    """Owns one shard (or none, when empty) and the KV of every session on it.

    ``config`` is replaced whole, on the loop thread, by a tier-1 or tier-2 change
    (node/configure.py); other threads read it as it is at that moment.
    """

    def __init__(self, config: EngineConfig = EngineConfig()) -> None:
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
        self._inbox: queue.SimpleQueue[StepWork | _Control | None] = queue.SimpleQueue()
        self._pending: list[StepWork] = []  # admitted, not finished (loop thread only)
        self._outstanding = 0  # submitted, not finished (guarded by _lock)
        self._lock = threading.Lock()
        self._steps = 0
        self._last_batch = 0
        self._max_batch = 0
        self._tokens_per_s = 0.0
        self._stopping = False
        self._staged: _Staged | None = None  # a T2/T3 change waiting for a drain (loop only)
        self._freed = False  # a session's memory was let go since the loop last idled
        self._after: list[Callable[[], None]] | None = None  # see ``after_batch``
        # Whoever runs the loop holds ``_loop``: the loop's thread, or while it waits for
        # work a thread that brings a step (``run_here``). ``_runner``: that thread's id.
        self._loop = threading.Lock()
        self._runner: int | None = None
        self._thread = threading.Thread(target=self._run, name="node-engine", daemon=True)

    # --- called from any thread -------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    @property
    def shard(self) -> Shard | None:
        return self._shard

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

    def load(
        self, model_path: str, layers: LayerRange, fingerprint: str | None = None
    ) -> Future[Shard]:
        """Load ``layers`` of the model (tier 3); drops every session's KV. ``fingerprint``:
        the model's, when ``model_path`` holds only the range (``load_shard_file``)."""
        return self._control(lambda: self._apply_load(model_path, layers, fingerprint))

    def configure_limits(self, limits: Limits) -> Future[EngineConfig]:
        """Tier 1, applied by the loop at once (checked by the caller:
        ``configure.check_limits``); the config it runs with after."""
        return self._control(lambda: self._apply_limits(limits))

    def configure_batching(self, batching: Batching) -> Future[EngineConfig]:
        """Tier 2: checked on the loop against the KV held then, and applied at the first
        step boundary at which no prompt is half-run (no step starts meanwhile); the
        config it runs with after, or ``RequestError`` with the reason and nothing
        changed. Cancelling the future before it is answered withdraws the change."""
        staged = _Staged(batching, Future())
        self._control(lambda: self._stage(staged))
        return staged.future

    def swap(self, shard: Shard | None) -> Future[int]:
        """Tier 3: drain (opens and imports are refused ``overloaded``, half-run prompts
        finish, no other step starts), then serve ``shard`` instead (None: nothing, the
        node is empty until its next load); the steps still
        queued fail ``cache-miss``. The same model and layers again keep the sessions'
        KV, parked on local disk (a resuming open reads it back); any other shard drops
        it. The sessions whose KV was dropped. Cancelling the future before it is
        answered withdraws the swap."""
        staged = _Staged(shard, Future())
        self._control(lambda: self._stage(staged))
        return staged.future

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
        return self._control(lambda: self._apply_open(session_id, epoch, resume, rewind, prefix))

    def park(
        self, session_id: str, epoch: int | None = None, phase: ParkPhase = ParkPhase.NOW
    ) -> Future[ParkedSlot]:
        """Move an idle session's KV (of ``epoch`` or older) to local disk, out of the
        budget: at once (``NOW``), or written by ``PREPARE`` (the KV stays hot) and
        then moved by ``COMMIT`` or forgotten by ``ABORT``. ``ParkFailed`` when it
        cannot be written (nothing is left on disk); the KV stays hot on any failure."""
        return self._control(lambda: self._apply_park(session_id, epoch, phase))

    def release(self, session_id: str, epoch: int) -> Future[bool]:
        """Free a session's KV (hot or parked) and queued steps, unless a newer epoch
        has taken it over; True when something was freed."""
        return self._control(lambda: self._apply_release(session_id, epoch))

    def fence(self, session_id: str, epoch: int) -> Future[None]:
        """The session moved on to ``epoch`` elsewhere: drop older KV, refuse older steps."""
        return self._control(lambda: self._apply_fence(session_id, epoch))

    def export_kv(self, session_id: str) -> Future[ExportedKV]:
        """Copy a session's KV (consistent: no step runs while it is copied)."""
        return self._control(lambda: self._apply_export(session_id))

    def import_kv(
        self, session_id: str, epoch: int, steps: int, tokens: int, payload: bytes | bytearray
    ) -> Future[OpenedSlot]:
        """Make verified KV a session's (replacing what it held); visible only once loaded."""
        return self._control(lambda: self._apply_import(session_id, epoch, steps, tokens, payload))

    def quarantine(self, session_id: str) -> Future[None]:
        """After a failed import: the session holds nothing (KV, steps, queued work)."""
        return self._control(lambda: self._drop(session_id))

    def sent(self, session_id: str, first: int, end: int) -> Future[list[tuple[int, np.ndarray]]]:
        """What this hop forwarded for a session in steps [first, end), as far as it holds it."""

        def read() -> list[tuple[int, np.ndarray]]:
            slot = self._slots.get(session_id)
            if slot is None:
                return []
            return [(s, slot.sent[s]) for s in range(first, end) if s in slot.sent]

        return self._control(read)

    def cancel(self, session_id: str) -> Future[None]:
        """Free a session's KV whatever its epoch, and fail its unfinished steps."""
        return self._control(lambda: self._apply_cancel(session_id))

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
                    self._inbox.put(_Control(_nothing))
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

    def _control(self, apply: Callable[[], Any]) -> Future[Any]:
        c = _Control(apply)
        self._inbox.put(c)
        return c.future

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

    def _wait(self) -> StepWork | _Control | None:
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
        leftovers: list[StepWork | _Control] = list(self._pending)
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

    def _take(self, item: StepWork | _Control | None) -> None:
        if item is None:
            self._stopping = True
        elif isinstance(item, _Control):
            _settle(item.future, item.apply)
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

    def _account(self) -> None:
        self._budget.update(sum(s.kv.nbytes + s.sent_bytes for s in self._slots.values()))
        self._make_room(0)

    def _make_room(self, extra: int) -> None:
        """Keep the prefix cache within what the KV budget leaves once the sessions hold
        ``extra`` more bytes: cached prefixes never make a session fail for memory."""
        budget = self._budget.budget_bytes
        if budget > 0 and self._prefixes.nbytes:
            self._prefixes.trim(budget - self._budget.in_use - extra)

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
        for w in self._pending:
            w.future.set_exception(CacheMiss("the node loaded another shard; its KV is gone"))
        self._pending.clear()
        if park:
            for session_id in list(self._slots):
                try:
                    self._apply_park(session_id, None, ParkPhase.NOW)
                except MeshnetError as e:
                    log.warning("session %s could not be parked for the reload: %s", session_id, e)
        ended = len(self._slots) + (0 if park else len(self._parked))
        self._slots.clear()
        for parked in self._prepared.values():
            self._park_store.remove(parked)
        self._prepared.clear()
        if not park:
            for parked in self._parked.values():
                self._park_store.remove(parked)
            self._parked.clear()
        self._shard = shard
        self._prefixes.clear()  # another shard's KV (or the same one's, dropped with it)
        self._account()
        return ended

    def _apply_limits(self, limits: Limits) -> EngineConfig:
        self.config = with_limits(self.config, limits)
        set_log_level(limits.log_level)
        log.info("tier 1 applied: %s", limits)
        return self.config

    def _stage(self, staged: _Staged) -> None:
        """Hold a T2/T3 change until the loop has drained (``_apply_staged``)."""
        try:
            if self._staged is not None:
                raise Overloaded("another configure is waiting for the node to drain")
            if isinstance(staged.change, Batching):
                check_batching(staged.change, self.config, self._budget.in_use)
        except Exception as e:
            if staged.future.set_running_or_notify_cancel():
                staged.future.set_exception(e)
            return
        self._staged = staged

    def _swapping(self) -> bool:
        return self._staged is not None and not isinstance(self._staged.change, Batching)

    def _apply_staged(self) -> None:
        """Apply the staged change once drained (no prompt half-run). Withdrawn (its
        future cancelled) meanwhile: nothing changes."""
        staged = self._staged
        if staged is None:
            return
        change = staged.change
        if any(w.done_rows for w in self._pending):
            return
        self._staged = None
        if not staged.future.set_running_or_notify_cancel():
            log.info("a configure was withdrawn before the node drained: nothing changed")
            return
        if isinstance(change, Batching):
            _settle(staged.future, lambda: self._apply_batching(change))
        else:
            _settle(staged.future, lambda: self._apply_swap(change))

    def _apply_batching(self, batching: Batching) -> EngineConfig:
        check_batching(batching, self.config, self._budget.in_use)  # KV may have grown since
        self.config = with_batching(self.config, batching)
        self._budget.budget_bytes = self.config.kv_budget_bytes
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
        once, here, and the new shard is put out of reach in turn."""
        gc.unfreeze()
        park = shard is not None and _same_shard(self._shard, shard)
        ended = self._swap_in(shard, park=park)
        gc.collect()
        gc.freeze()
        return ended

    def _admissible(self, session_id: str, epoch: int) -> Shard:
        """The shard a session at ``epoch`` may use, unless the node is empty or it is fenced."""
        shard = self._shard
        if self._swapping():
            raise Overloaded("the node is draining to load another shard")
        if shard is None:
            raise ShardMismatch("this node is empty: no layers loaded")
        fence = self._fences.get(session_id, 0)
        if epoch < fence:
            raise StaleEpoch(f"session {session_id} is at epoch {fence}, not {epoch}")
        return shard

    def _apply_open(
        self,
        session_id: str,
        epoch: int,
        resume: bool,
        rewind: tuple[int, int] | None,
        prefix: PrefixAsk | None = None,
    ) -> OpenedSlot:
        shard = self._admissible(session_id, epoch)
        unparked = False
        if resume and session_id not in self._slots and session_id in self._parked:
            unparked = self._unpark(shard, session_id)
        slot = self._slots.get(session_id)
        if slot is not None and slot.epoch < epoch and resume:
            self._fail_steps(session_id, StaleEpoch(f"epoch {slot.epoch} was fenced by {epoch}"))
            slot.epoch = epoch
        elif slot is None or slot.epoch < epoch:  # the same epoch keeps its KV
            kv, rows = shard.backend.new_kv(), self._row_log(shard, 0)
            if not self._budget.fits(kv.growth_bytes(1)):
                raise budget_full(self._budget, len(self._slots))
            self._drop(session_id)
            slot = self._slots[session_id] = Slot(epoch, kv, rows=rows)
            if prefix is not None:
                self._start_with_prefix(shard, slot, prefix)
        if resume and rewind is not None:
            try:
                _rewind(slot, *rewind)
            except CacheMiss:  # a windowed layer's ring no longer holds that far back:
                self._drop(session_id)  # held as nothing, the tracker replays the log
                kv, rows = shard.backend.new_kv(), self._row_log(shard, 0)
                slot = self._slots[session_id] = Slot(epoch, kv, rows=rows)
        self._remember_fence(session_id, epoch)
        return OpenedSlot(slot.kv.length, slot.steps, unparked)

    def _start_with_prefix(self, shard: Shard, slot: Slot, ask: PrefixAsk) -> None:
        """A fresh slot starts with the longest cached prefix of its prompt that the KV
        budget has room for, as step 0; its commitments start after it."""
        n = reuse_prefix(self._prefixes, slot, ask, self._budget.fits, self._make_room)
        if n:
            slot.rows, slot.inputs = self._row_log(shard, n), RowLog(n)
            self._account()

    def _row_log(self, shard: Shard, base: int) -> RowLog:
        """A session's commitments log from position ``base``: hashes on an exact
        backend, top-k sketches on another (protocol/commitments.py); ``SketchTooWide``
        when the rows are too wide to sketch."""
        exact = commits_exactly(self.config.backend)
        if not exact:
            check_width(shard.spec.d_model)
        return RowLog(base, exact)

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

    def _apply_export(self, session_id: str) -> ExportedKV:
        slot = self._slots.get(session_id)
        parked = self._parked.get(session_id)
        if slot is None and parked is not None:  # read back from disk, checked
            data = memoryview(self._park_store.read(parked))
            return ExportedKV(parked.epoch, parked.steps, parked.tokens, data)
        if slot is None:
            raise CacheMiss(f"no KV for session {session_id}")
        return ExportedKV(slot.epoch, slot.steps, slot.kv.length, slot.kv.export_bytes())

    def _apply_import(
        self, session_id: str, epoch: int, steps: int, tokens: int, payload: bytes | bytearray
    ) -> OpenedSlot:
        shard = self._admissible(session_id, epoch)
        self._drop(session_id)  # whatever it held is replaced, or quarantined on failure
        kv = shard.backend.new_kv()
        if not self._budget.fits(kv.growth_bytes(tokens)):
            raise budget_full(self._budget, len(self._slots))
        kv.load_bytes(tokens, payload)
        # KV computed elsewhere: its positions are not this node's to commit.
        rows, inputs = self._row_log(shard, tokens), RowLog(tokens)
        self._slots[session_id] = Slot(epoch, kv, steps=steps, rows=rows, inputs=inputs)
        self._remember_fence(session_id, epoch)
        self._account()
        return OpenedSlot(tokens, steps)

    def _apply_fence(self, session_id: str, epoch: int) -> None:
        slot = self._slots.get(session_id)
        parked = self._parked.get(session_id)
        if (slot is not None and slot.epoch < epoch) or (parked and parked.epoch < epoch):
            self._drop(session_id)
        if epoch > self._fences.get(session_id, 0):
            self._remember_fence(session_id, epoch)

    def _remember_fence(self, session_id: str, epoch: int) -> None:
        self._fences[session_id] = epoch
        self._fences.move_to_end(session_id)
        while len(self._fences) > _MAX_FENCES:
            self._fences.popitem(last=False)

    def _apply_release(self, session_id: str, epoch: int) -> bool:
        slot = self._slots.get(session_id)
        parked = self._parked.get(session_id)
        if (slot is not None and slot.epoch <= epoch) or (parked and parked.epoch <= epoch):
            self._drop(session_id)
            return True
        return False

    def _apply_cancel(self, session_id: str) -> None:
        self._drop(session_id)

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


def _same_shard(old: Shard | None, new: Shard) -> bool:
    """Whether ``new`` is ``old`` loaded again: the same model file's layers, whose KV fits."""
    return old is not None and (old.fingerprint, old.layers) == (new.fingerprint, new.layers)


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


def _keep_sent(slot: Slot, w: StepWork, result: np.ndarray) -> None:
    """Log a forwarded output by step: a replayed run one row per decode step."""
    if w.replay:
        for row in range(result.shape[0]):
            slot.keep_sent(slot.steps + row, result[row : row + 1])
    else:
        slot.keep_sent(slot.steps, result)


def _settle(future: Future[Any], apply: Callable[[], Any]) -> None:
    try:
        future.set_result(apply())
    except Exception as e:
        future.set_exception(e)


def _nothing() -> None:
    """A control that only wakes the loop's thread."""
