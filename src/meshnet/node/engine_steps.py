"""The steps a node's engine is handed: counted until answered, admitted, and failed.

``count_in`` bounds the steps submitted and not yet answered (any thread; past
``max_queued_steps`` a step is refused ``overloaded`` at once). ``pending`` holds
the steps admitted and not finished, in arrival order: only the loop's thread
reads or changes it (node/engine.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from meshnet.errors import Overloaded
from meshnet.node.scheduler import Slot, StepWork, check_step_number


class Steps:
    """The steps admitted to the loop, and the count of those not yet answered."""

    def __init__(self) -> None:
        self.pending: list[StepWork] = []  # admitted, not finished (loop thread only)
        self._outstanding = 0  # submitted, not finished (guarded by _lock)
        self._lock = threading.Lock()

    @property
    def outstanding(self) -> int:
        """Steps submitted and not yet answered."""
        return self._outstanding

    def count_in(self, work: StepWork, limit: int) -> Future[np.ndarray]:
        """Count a step as unfinished until it is; ``Overloaded`` when ``limit`` are."""
        with self._lock:
            if self._outstanding >= limit:
                raise Overloaded(f"{self._outstanding} steps queued on this node")
            self._outstanding += 1
        work.future.add_done_callback(self._finished)
        return work.future

    def _finished(self, _: Future[np.ndarray]) -> None:
        with self._lock:
            self._outstanding -= 1

    def admit(self, w: StepWork, slot: Slot | None, fence: int) -> None:
        """Queue a step of the session holding ``slot`` (None: none) fenced at ``fence``,
        or answer a duplicate with its recorded result, or refuse it."""
        running = self.running(w.session_id)
        verdict = check_step_number(w, slot, fence, running)
        if isinstance(verdict, np.ndarray):
            w.future.set_result(verdict)
        elif verdict is not None:
            w.future.set_exception(verdict)
        else:
            self.pending.append(w)

    def running(self, session_id: str) -> bool:
        """Whether a step of the session is admitted and unfinished."""
        return any(w.session_id == session_id for w in self.pending)

    def half_run(self) -> bool:
        """Whether a prompt has run some of its chunks and not all."""
        return any(w.done_rows for w in self.pending)

    def refuse(self, w: StepWork, error: Exception) -> None:
        """Take an admitted step out, failed with ``error``."""
        self.pending.remove(w)
        w.future.set_exception(error)

    def finish(self, w: StepWork, result: np.ndarray) -> None:
        """Take an admitted step out, answered with ``result``."""
        self.pending.remove(w)
        w.future.set_result(result)

    def fail(self, session_id: str, error: Exception) -> None:
        """Fail the session's unfinished steps with ``error``."""
        for w in [w for w in self.pending if w.session_id == session_id]:
            self.pending.remove(w)
            w.future.set_exception(error)

    def fail_all(self, error: Exception) -> None:
        """Fail every unfinished step with ``error``."""
        for w in self.pending:
            w.future.set_exception(error)
        self.pending.clear()
