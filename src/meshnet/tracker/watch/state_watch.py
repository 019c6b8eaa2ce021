"""Sees the sessions' and nodes' states change, and writes each change in the event log.

The database is the truth: a session's state is written by many paths (turns,
the session policy, parking, eviction, ending, retention) and, with several
trackers on one database, by other trackers. So the watch reads the states
themselves, every ``interval_s``, and publishes the difference with its last
reading: what any tracker changed, however it changed it. A change that is
undone within one interval is not seen; a watcher needing every step of a
session's life reads its turns. The first reading only sets the baseline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from meshnet.tracker.loops import LoopHealth
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.watch.events import EventLog

States = dict[tuple[str, str], str]  # (kind, id) -> state


class StateWatch:
    """Reads the states and publishes their changes; one loop per tracker process."""

    def __init__(
        self,
        sessions: SessionStore,
        nodes: Store,
        log: EventLog,
        interval_s: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.sessions = sessions
        self.nodes = nodes
        self.log = log
        self.interval_s = interval_s
        self.clock = clock
        self.health = LoopHealth("state watch")
        self._seen: States | None = None

    def read(self) -> States:
        """Every session's and node's state now. Blocking: a database read."""
        states: States = {("session", s): state for s, state in self.sessions.states().items()}
        states.update({("node", n.node_id): n.state.value for n in self.nodes.nodes()})
        return states

    def publish(self, now: States) -> int:
        """Publish what changed since the last reading; how many events that made."""
        before, self._seen = self._seen, now
        if before is None:
            return 0
        at = self.clock()
        changed = 0
        for key in sorted(now.keys() | before.keys()):
            new, old = now.get(key, ""), before.get(key, "")
            if new != old:
                self.log.publish(at, key[0], key[1], new, old)
                changed += 1
        return changed

    async def run_forever(self) -> None:
        """A reading every ``interval_s``; a failed one is logged, counted in ``health``,
        and the next one runs as usual."""
        while True:
            try:
                self.publish(await asyncio.to_thread(self.read))
            except Exception as e:  # a database gone for a moment, a bug
                self.health.failed(e)
            else:
                self.health.passed()
            await asyncio.sleep(self.interval_s)
