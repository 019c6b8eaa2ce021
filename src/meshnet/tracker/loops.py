"""How the tracker's background loops fare: passes run and failed, kept per loop.

The tracker runs a few loops for as long as it lives (the heartbeat sweeper,
the outbox's delivery loop, the session policy, retention). A pass of any of
them may fail — a database that is briefly gone, a full disk, a bug — and
the loop must go on: it logs the failure with its traceback, counts it here
and runs its next pass as usual. One ``LoopHealth`` belongs to one loop (no
shared state); anything may read it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from meshnet.errors import MeshnetError

log = logging.getLogger(__name__)


@dataclass
class LoopHealth:
    """The record of one loop. Call from the loop itself (one thread at a time)."""

    name: str
    passes: int = 0  # passes that ended without an exception
    failures: int = 0  # passes that raised, in all
    failing: int = 0  # passes that raised since the last good one
    last_failure: str = ""  # the last failure's type and message

    def passed(self) -> None:
        self.passes += 1
        self.failing = 0

    def failed(self, error: BaseException) -> None:
        """Count a failed pass and log it; with its traceback unless it is a typed
        mesh error (those say what happened in their message)."""
        self.failures += 1
        self.failing += 1
        self.last_failure = f"{type(error).__name__}: {error}"
        log.error(
            "%s: a pass failed (%d in a row, %d in all): %s; running on",
            self.name,
            self.failing,
            self.failures,
            self.last_failure,
            exc_info=None if isinstance(error, MeshnetError) else error,
        )
