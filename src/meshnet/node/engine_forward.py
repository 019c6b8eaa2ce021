"""The loop's iterations: one batched forward over a chunk of every admitted step, then
each step committed and answered (docs/design.md §8).

A prefill is cut into fixed-size chunks counted from the start of its own prompt
(node/scheduler.py plans them), so a long prompt never stalls running streams and
a sequence is chunked the same way whatever else is running (its results stay
bit-identical alone or batched). During a drain for a tier-2 or tier-3 change only
half-run prompts go on. What a step's answer wakes in another thread waits until
the whole batch is answered (``after_batch``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import numpy as np

from meshnet.backends.base import BatchEntry, HeadSplit
from meshnet.backends.shard import Shard
from meshnet.node.context import served_context
from meshnet.node.engine_held import HeldKV
from meshnet.node.engine_steps import Steps
from meshnet.node.engine_types import Serving
from meshnet.node.prefixes import keep_prefix
from meshnet.node.scheduler import Slot, StepWork, plan_batch

log = logging.getLogger(__name__)

# Told of every forward: the rows it ran, its seconds and the sessions in it.
OnForward = Callable[[int, float, int], None]


class Forwards:
    """Runs the forwards of ``steps`` over the KV ``held`` on ``serving``'s shard, and
    keeps their speed; ``on_forward`` is told of each (the node's metrics)."""

    def __init__(
        self, held: HeldKV, steps: Steps, serving: Serving, on_forward: OnForward | None = None
    ) -> None:
        self._held = held
        self._steps = steps
        self._serving = serving
        self._on_forward = on_forward
        self.finished = 0  # steps finished since start
        self.last_batch = 0  # sessions in the last forward
        self.max_batch = 0  # most sessions in one forward since start
        self.tokens_per_s = 0.0  # rows per second over recent forwards
        # While a forward's steps are answered: the thread answering them, and what
        # ``after_batch`` deferred until all are.
        self._after: tuple[int, list[Callable[[], None]]] | None = None

    def after_batch(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` once the forward whose steps are being answered has answered and
        committed all of them; now when none is (another thread, between forwards).

        What wakes another thread of this process belongs here: a woken stream
        handler takes the GIL whenever the loop lets it go (an argmax over logits, a
        row's SHA-256), and the loop waits for it back. Eight streams' handlers woken
        one by one inside a batch's bookkeeping stretched it from ~0.8 to ~4 ms.
        """
        after = self._after
        if after is not None and threading.get_ident() == after[0]:
            after[1].append(fn)
        else:
            fn()

    def iteration(self) -> None:
        """One forward over a chunk of every admitted step, within the row budget."""
        shard, config = self._serving.shard, self._serving.config
        pending = self._steps.pending
        if self._serving.draining:
            pending = [w for w in pending if w.done_rows]  # drain: only half-run prompts go on
        plan = plan_batch(
            pending,
            self._held.slots,
            shard is not None,
            self._held.budget,
            config.max_batch_tokens,
            config.prefill_chunk,
            time.monotonic(),
            shard is not None and shard.backend.decodes_rows_exactly,
            served_context(shard, config.ctx) if shard else 0,
        )
        for w, error in plan.refused:
            self._steps.refuse(w, error)
        if plan.chosen and shard is not None:
            self._forward(shard, list(plan.chosen))

    def _forward(self, shard: Shard, chosen: list[tuple[StepWork, int]]) -> None:
        held = self._held
        x = np.concatenate([w.x[w.done_rows : w.done_rows + n] for w, n in chosen])
        batch = [BatchEntry(held.slots[w.session_id].kv, n, w.replay) for w, n in chosen]
        held.make_room(sum(entry.kv.growth_bytes(entry.n_new) for entry in batch))
        positions = [entry.kv.length for entry in batch]
        t0 = time.perf_counter()
        try:
            split = chosen[0][0].head_split if len(chosen) == 1 else None
            out, boundary = forward_committed(shard, x, batch, split)
        except Exception as e:  # a bug must fail the steps, not kill the loop
            log.exception("batch of %d steps failed", len(chosen))
            for w, _ in chosen:
                self._steps.refuse(w, e)
            held.account()
            return
        seconds = time.perf_counter() - t0
        deferred: list[Callable[[], None]] = []
        self._after = (threading.get_ident(), deferred)
        try:
            self._commit(shard, chosen, x, positions, out, boundary)
        finally:
            self._after = None
            for fn in deferred:
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
        slots, offset = self._held.slots, 0
        for i, (w, n) in enumerate(chosen):
            w.outputs.append(out[i : i + 1] if shard.is_last else out[offset : offset + n])
            slot = slots[w.session_id]
            w.chunks += slot.rows.add(positions[i], boundary[offset : offset + n])
            if not shard.is_first:
                w.inputs.update(slot.inputs.add(positions[i], x[offset : offset + n]))
            offset += n
            w.done_rows += n
            if w.done_rows == w.n_tokens:
                self.finished += 1
                result = w.outputs[-1] if shard.is_last else np.concatenate(w.outputs)
                if w.keep_output and not shard.is_last:
                    _keep_sent(slot, w, result)
                slot.last_step = slot.steps
                slot.steps += w.steps
                slot.last_result = result
                self._steps.finish(w, result)
        for w, _ in chosen:  # after the answers: copying blocks delays none of them
            keep_prefix(self._held.prefixes, slots.get(w.session_id))
        self._held.account()

    def _note_speed(self, rows: int, seconds: float, sessions: int) -> None:
        self.last_batch = sessions
        self.max_batch = max(self.max_batch, sessions)
        rate = rows / seconds if seconds > 0 else 0.0
        old = self.tokens_per_s
        self.tokens_per_s = rate if not old else 0.8 * old + 0.2 * rate
        if self._on_forward is not None:
            self._on_forward(rows, seconds, sessions)


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
