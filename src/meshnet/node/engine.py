"""The node's one loop: every change to its shard and its sessions' KV happens here.

Request threads (gRPC handlers) submit commands and wait on futures; the loop
thread takes whatever is queued, applies control commands in order (open,
release, load), and runs all pending steps of different sessions as one
batched forward. Nothing else touches the shard or the KV.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshnet.backends.base import BatchEntry
from meshnet.errors import CacheMiss, DeadlineExceeded, ShardMismatch, StaleEpoch
from meshnet.kv.cache import SequenceKV
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import open_gguf
from meshnet.model.shard import Shard, load_shard
from meshnet.model.spec import read_spec

log = logging.getLogger(__name__)


@dataclass
class _Slot:
    epoch: int
    kv: SequenceKV


@dataclass
class StepWork:
    """One session's step, waiting to join a batch."""

    session_id: str
    epoch: int
    x: np.ndarray  # ids [T] on the first shard, hidden [T, d] elsewhere
    deadline: float | None  # time.monotonic() by which it must have run
    future: Future[np.ndarray] = field(default_factory=Future)

    @property
    def n_tokens(self) -> int:
        return int(self.x.shape[0])


@dataclass
class _Control:
    """A command the loop applies in order between batches."""

    apply: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


@dataclass(frozen=True)
class EngineStats:
    loaded: bool
    layers: LayerRange | None
    fingerprint: str
    sessions: int
    kv_bytes: int
    queue_depth: int
    steps: int
    last_batch: int


class NodeEngine:
    """Owns one shard (or none, when empty) and the KV of every session on it."""

    def __init__(self, max_batch_tokens: int = 8192) -> None:
        self.max_batch_tokens = max_batch_tokens
        self._shard: Shard | None = None
        self._slots: dict[str, _Slot] = {}
        self._queue: queue.Queue[StepWork | _Control | None] = queue.Queue()
        self._steps = 0
        self._last_batch = 0
        self._thread = threading.Thread(target=self._run, name="node-engine", daemon=True)

    # --- called from any thread -------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)

    @property
    def shard(self) -> Shard | None:
        return self._shard

    def stats(self) -> EngineStats:
        shard = self._shard
        slots = list(self._slots.values())
        return EngineStats(
            loaded=shard is not None,
            layers=shard.layers if shard else None,
            fingerprint=shard.fingerprint if shard else "",
            sessions=len(slots),
            kv_bytes=sum(s.kv.nbytes for s in slots),
            queue_depth=self._queue.qsize(),
            steps=self._steps,
            last_batch=self._last_batch,
        )

    def load(self, model_path: str, layers: LayerRange) -> Future[Shard]:
        """Load ``layers`` of the model (tier 3); drops every session's KV."""
        return self._control(lambda: self._apply_load(model_path, layers))

    def open(self, session_id: str, epoch: int) -> Future[None]:
        """Start (or restart at a newer epoch) a session's KV; an older epoch is stale."""
        return self._control(lambda: self._apply_open(session_id, epoch))

    def release(self, session_id: str, epoch: int) -> Future[None]:
        """Free a session's KV, unless a newer epoch has taken it over."""
        return self._control(lambda: self._apply_release(session_id, epoch))

    def submit(self, work: StepWork) -> Future[np.ndarray]:
        self._queue.put(work)
        return work.future

    def _control(self, apply: Callable[[], Any]) -> Future[Any]:
        c = _Control(apply)
        self._queue.put(c)
        return c.future

    # --- the loop thread --------------------------------------------------------

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            steps: list[StepWork] = []
            tokens = 0
            while item is not None:
                if isinstance(item, _Control):
                    self._run_batch(steps)  # earlier steps run before the command
                    steps, tokens = [], 0
                    _settle(item.future, item.apply)
                else:
                    if steps and tokens + item.n_tokens > self.max_batch_tokens:
                        self._run_batch(steps)
                        steps, tokens = [], 0
                    steps.append(item)
                    tokens += item.n_tokens
                item = self._next_nowait()
            self._run_batch(steps)

    def _next_nowait(self) -> StepWork | _Control | None:
        """The next queued item, or None when the queue is empty or stopping."""
        try:
            item = self._queue.get_nowait()
        except queue.Empty:
            return None
        if item is None:
            self._queue.put(None)  # the outer loop sees the stop next
        return item

    def _apply_load(self, model_path: str, layers: LayerRange) -> Shard:
        f = open_gguf(model_path)
        shard = load_shard(f, read_spec(f), layers)
        self._slots.clear()
        self._shard = shard
        log.info("loaded layers %s of %s", layers, f.path.name)
        return shard

    def _apply_open(self, session_id: str, epoch: int) -> None:
        shard = self._require_shard()
        slot = self._slots.get(session_id)
        if slot is not None and slot.epoch > epoch:
            raise StaleEpoch(f"session {session_id} is at epoch {slot.epoch}, not {epoch}")
        if slot is None or slot.epoch < epoch:  # the same epoch keeps its KV
            self._slots[session_id] = _Slot(epoch, shard.backend.new_kv())

    def _apply_release(self, session_id: str, epoch: int) -> None:
        slot = self._slots.get(session_id)
        if slot is not None and slot.epoch <= epoch:
            del self._slots[session_id]

    def _require_shard(self) -> Shard:
        if self._shard is None:
            raise ShardMismatch("this node is empty: no layers loaded")
        return self._shard

    def _run_batch(self, steps: list[StepWork]) -> None:
        ready = [w for w in steps if self._admit(w)]
        if not ready:
            return
        shard = self._require_shard()
        slots = [self._slots[w.session_id] for w in ready]
        x = np.concatenate([w.x for w in ready])
        try:
            batch = [BatchEntry(s.kv, w.n_tokens) for s, w in zip(slots, ready, strict=True)]
            out = shard.forward(x, batch)
        except Exception as e:  # a bug must fail the steps, not kill the loop
            log.exception("batch of %d steps failed", len(ready))
            for w in ready:
                w.future.set_exception(e)
            return
        self._steps += len(ready)
        self._last_batch = len(ready)
        offsets = np.cumsum([0] + [w.n_tokens for w in ready])
        for i, w in enumerate(ready):
            rows = out[i : i + 1] if shard.is_last else out[offsets[i] : offsets[i + 1]]
            w.future.set_result(rows)

    def _admit(self, w: StepWork) -> bool:
        """Check a step just before it runs; fail its future instead of running it."""
        slot = self._slots.get(w.session_id)
        if w.deadline is not None and time.monotonic() > w.deadline:
            w.future.set_exception(DeadlineExceeded("the step's deadline passed in the queue"))
        elif slot is None:
            w.future.set_exception(CacheMiss(f"no KV for session {w.session_id}"))
        elif slot.epoch != w.epoch:
            w.future.set_exception(
                StaleEpoch(f"session {w.session_id} is at epoch {slot.epoch}, not {w.epoch}")
            )
        else:
            return True
        return False


def _settle(future: Future[Any], apply: Callable[[], Any]) -> None:
    try:
        future.set_result(apply())
    except Exception as e:
        future.set_exception(e)
