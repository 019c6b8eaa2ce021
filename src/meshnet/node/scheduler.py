"""The node's scheduler: which steps join the next forward, and which are refused.

Pure: it reads the pending steps, the sessions' slots and the KV budget, and
returns a plan; the engine loop carries it out. A step contributes one row
when decoding and at most ``prefill_chunk`` rows of its prompt, counted from
the prompt's start, so chunking never depends on what else is running.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from meshnet.backends.base import HeadSplit
from meshnet.errors import (
    CacheMiss,
    ContextTooLong,
    DeadlineExceeded,
    KVBudgetExhausted,
    MalformedBundle,
    MeshnetError,
    ShardMismatch,
    StaleEpoch,
)
from meshnet.kv.cache import SequenceKV
from meshnet.kv.manager import KVBudget
from meshnet.protocol.commitments import RowLog


@dataclass
class Slot:
    """A session's KV on this node, the epoch that owns it, and its committed steps."""

    epoch: int
    kv: SequenceKV
    steps: int = 0  # steps committed; the next step's number
    last_step: int = -1  # number of the last committed step (or replay's first step)
    last_result: np.ndarray | None = None  # the last committed step's output, for duplicates
    # What this hop forwarded to the next one, by step: replayed into a replacement of it.
    # Changed only by ``keep_sent`` and ``cut_sent``, which keep ``sent_bytes`` (summing
    # it each step, as the KV budget is updated, cost a forwarding hop O(steps) a step).
    sent: dict[int, np.ndarray] = field(default_factory=dict)
    sent_bytes: int = 0
    # Digests of the rows computed at the range's end boundary: the chunks committed.
    rows: RowLog = field(default_factory=RowLog)
    # Digests of the rows received at its start (not on the first range): what a node
    # says the hop before it sent, should that hop's word and its own differ.
    inputs: RowLog = field(default_factory=RowLog)
    # The prompt ids whose full blocks the prefix cache keeps once computed (None: no
    # more to keep), how many of those blocks are kept or were loaded from it, and the
    # scope they are kept under (kv/prefix_cache.py: another scope never finds them).
    prefix: np.ndarray | None = None
    prefix_blocks: int = 0
    prefix_scope: bytes = b""

    def keep_sent(self, step: int, x: np.ndarray) -> None:
        old = self.sent.get(step)
        if old is not None:
            self.sent_bytes -= old.nbytes
        self.sent[step] = x
        self.sent_bytes += x.nbytes

    def cut_sent(self, steps: int) -> None:
        """Forget what was forwarded for step ``steps`` and later."""
        for step in [s for s in self.sent if s >= steps]:
            self.sent_bytes -= self.sent.pop(step).nbytes


@dataclass
class StepWork:
    """One session's step, waiting for (or part way through) the batches it joins."""

    session_id: str
    epoch: int
    x: np.ndarray  # ids [T] on the first shard, hidden [T, d] elsewhere
    deadline: float | None  # time.monotonic() by which it must have started
    step: int | None = None  # the step's number in its session; None: not checked
    replay: bool = False  # each row is a decode step sent again: computed as one, counted as one
    keep_output: bool = False  # forwarded to the next hop: keep it for replays
    # Called on the loop thread with the output of a step run in one forward, as soon
    # as the forward ends and before the step is committed: a ring's hop passes it on
    # while the loop does the step's bookkeeping (its future is answered after).
    on_output: Callable[[np.ndarray], None] | None = None
    # The last hop's head multiply shared with another node (node/head_assist.py) when
    # the step runs alone in its forward; otherwise the head is multiplied here.
    head_split: HeadSplit | None = None
    future: Future[np.ndarray] = field(default_factory=Future)
    done_rows: int = 0  # prompt rows already run (chunked prefill)
    outputs: list[np.ndarray] = field(default_factory=list)
    # (token_start, digest) of each chunk of positions this step completed, set before
    # ``future`` is answered (protocol/commitments.py).
    chunks: list[tuple[int, bytes]] = field(default_factory=list)
    inputs: dict[int, bytes] = field(default_factory=dict)  # the same chunks' input digests

    @property
    def n_tokens(self) -> int:
        return int(self.x.shape[0])

    @property
    def steps(self) -> int:
        """Session steps this work commits."""
        return self.n_tokens if self.replay else 1


@dataclass(frozen=True)
class BatchPlan:
    chosen: tuple[tuple[StepWork, int], ...]  # (step, rows it runs now), in queue order
    refused: tuple[tuple[StepWork, MeshnetError], ...]  # steps to fail, and why


def plan_batch(
    pending: Sequence[StepWork],
    slots: Mapping[str, Slot],
    loaded: bool,
    budget: KVBudget,
    max_batch_tokens: int,
    prefill_chunk: int,
    now: float,
    replays_batch: bool = True,
    context: int = 0,
) -> BatchPlan:
    """Pick, in queue order, the steps of the next forward within ``max_batch_tokens`` rows.

    Replayed decode rows go ``prefill_chunk`` at a time when the backend computes
    them exactly as one-row steps (``replays_batch``), else one per forward.
    """
    chosen: list[tuple[StepWork, int]] = []
    refused: list[tuple[StepWork, MeshnetError]] = []
    rows = 0
    growth = 0
    for w in pending:
        chunk = 1 if w.replay and not replays_batch else prefill_chunk
        n = min(w.n_tokens - w.done_rows, chunk)
        if chosen and rows + n > max_batch_tokens:
            break
        slot = slots.get(w.session_id)
        error = _refusal(w, slot, n, growth, loaded, budget, len(slots), now, context)
        if error is not None:
            refused.append((w, error))
            continue
        assert slot is not None  # _refusal checked it
        growth += slot.kv.growth_bytes(n)
        chosen.append((w, n))
        rows += n
    return BatchPlan(tuple(chosen), tuple(refused))


def check_step_number(
    w: StepWork, slot: Slot | None, fence: int, running: bool
) -> np.ndarray | MeshnetError | None:
    """Idempotent steps: a duplicate's recorded result, a refusal, or None when it should run.

    ``fence`` is the newest epoch the node has seen for the session (0 if none);
    ``running`` says whether another step of the session is already queued.
    """
    if w.epoch < fence:
        return StaleEpoch(f"session {w.session_id} is at epoch {fence}, not {w.epoch}")
    if w.step is None or slot is None or slot.epoch != w.epoch:
        return None  # the planner refuses sessions without KV
    if w.step == slot.last_step and slot.last_result is not None and not running:
        return slot.last_result
    if w.step < slot.steps:
        return MalformedBundle(
            f"step {w.step} of session {w.session_id} was committed before step "
            f"{slot.last_step}; only the last step's result is kept"
        )
    if w.step > slot.steps:
        return CacheMiss(
            f"session {w.session_id} has committed {slot.steps} steps; step {w.step} "
            "needs the ones before it"
        )
    if running:
        return MalformedBundle(f"a step of session {w.session_id} is already running")
    return None


def budget_full(budget: KVBudget, sessions: int) -> KVBudgetExhausted:
    return KVBudgetExhausted(
        f"KV budget of {budget.budget_bytes} bytes is full "
        f"({budget.in_use} in use by {sessions} sessions)"
    )


def _refusal(
    w: StepWork,
    slot: Slot | None,
    n: int,
    growth: int,
    loaded: bool,
    budget: KVBudget,
    sessions: int,
    now: float,
    context: int = 0,
) -> MeshnetError | None:
    """Why step ``w`` cannot run ``n`` more rows now, or None when it can (``context``:
    the positions a sequence may reach here; 0: no limit)."""
    if w.done_rows == 0 and w.deadline is not None and now > w.deadline:
        return DeadlineExceeded("the step's deadline passed in the queue")
    if not loaded:
        return ShardMismatch("this node is empty")
    if slot is None:
        return CacheMiss(f"no KV for session {w.session_id}")
    if slot.epoch != w.epoch:
        return StaleEpoch(f"session {w.session_id} is at epoch {slot.epoch}, not {w.epoch}")
    if context and slot.kv.length + n > context:
        return ContextTooLong(
            f"session {w.session_id} would reach {slot.kv.length + n} positions; this node "
            f"serves a context of {context}"
        )
    if not budget.fits(growth + slot.kv.growth_bytes(n)):
        return budget_full(budget, sessions)
    return None
