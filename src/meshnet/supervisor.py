"""Keep child processes running: one that exits is logged and started again after a backoff.

``meshnet up`` supervises the processes of its local mesh with this: a node (or
the tracker) that dies is restarted, and the others keep serving meanwhile.
A child that dies again soon after each start waits longer each time
(exponential, capped); one that ran for a while starts over from the first
delay. What to do is decided by ``Supervisor.step``, which only polls and
starts; it never stops anything: ending the whole set (Ctrl-C, SIGTERM) is the
caller's.

Call ``step`` / ``run`` from the thread that is to own the children: on Linux
a child asked to die with its parent (``PR_SET_PDEATHSIG``, as ``LocalMesh``
does) dies when the *thread* that started it ends.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backoff:
    """How long a child that exited waits before it is started again."""

    first_s: float = 0.5  # before the first restart in a row
    factor: float = 2.0  # each further restart in a row waits this much longer
    max_s: float = 30.0  # never longer than this
    stable_s: float = 60.0  # a child that ran this long before it exited starts over

    def delay(self, restarts: int) -> float:
        """Seconds before restart number ``restarts`` (1, 2, ...) in a row."""
        return min(self.max_s, self.first_s * self.factor ** max(0, restarts - 1))


class Child(Protocol):
    """One supervised process, however it is started."""

    name: str

    def poll(self) -> int | None:
        """Its exit status once it has exited (negative: killed by that signal), else None."""
        ...

    def start(self) -> None:
        """Start it (again); may raise ``OSError``."""
        ...


@dataclass(frozen=True)
class Exited:
    """A child exited; it is started again in ``delay_s``."""

    name: str
    status: int
    restarts: int  # in a row, this one included
    delay_s: float


@dataclass(frozen=True)
class Restarted:
    name: str
    restarts: int


@dataclass(frozen=True)
class StartFailed:
    """Starting a child again failed; it is tried again in ``delay_s``."""

    name: str
    error: str
    delay_s: float


Event = Exited | Restarted | StartFailed


@dataclass
class _Watch:
    child: Child
    started_at: float
    restarts: int = 0  # in a row: reset when a child ran ``stable_s``
    due_at: float | None = None  # when it is to be started again; None while it runs


class Supervisor:
    """Restarts the children that exit; ``step`` once per tick, from one thread."""

    def __init__(
        self,
        children: Sequence[Child],
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backoff = backoff or Backoff()
        self._clock = clock
        now = clock()
        self._watches = [_Watch(child, now) for child in children]

    def step(self) -> list[Event]:
        """Notice the children that exited, start those whose delay is over; what happened."""
        now = self._clock()
        events: list[Event] = []
        for w in self._watches:
            if w.due_at is None:
                status = w.child.poll()
                if status is not None:
                    events.append(self._exited(w, status, now))
            elif now >= w.due_at:
                events.append(self._restart(w, now))
        return events

    def run(self, stop: threading.Event, interval_s: float = 0.2) -> None:
        """Step and log every ``interval_s`` until ``stop`` is set."""
        while not stop.is_set():
            for event in self.step():
                log_event(event)
            stop.wait(interval_s)

    def _exited(self, w: _Watch, status: int, now: float) -> Exited:
        if now - w.started_at >= self.backoff.stable_s:
            w.restarts = 0
        w.restarts += 1
        delay = self.backoff.delay(w.restarts)
        w.due_at = now + delay
        return Exited(w.child.name, status, w.restarts, delay)

    def _restart(self, w: _Watch, now: float) -> Event:
        try:
            w.child.start()
        except OSError as e:
            w.restarts += 1
            delay = self.backoff.delay(w.restarts)
            w.due_at = now + delay
            return StartFailed(w.child.name, str(e), delay)
        w.started_at, w.due_at = now, None
        return Restarted(w.child.name, w.restarts)


def describe_status(status: int) -> str:
    """``-9`` -> ``"killed by SIGKILL"``, ``1`` -> ``"exited with 1"``."""
    if status < 0:
        try:
            return f"killed by {signal.Signals(-status).name}"
        except ValueError:
            return f"killed by signal {-status}"
    return f"exited with {status}"


def log_event(event: Event) -> None:
    if isinstance(event, Exited):
        log.warning(
            "%s %s; starting it again in %.1f s (restart %d in a row)",
            event.name,
            describe_status(event.status),
            event.delay_s,
            event.restarts,
        )
    elif isinstance(event, StartFailed):
        log.warning(
            "%s could not start: %s; trying again in %.1f s", event.name, event.error, event.delay_s
        )
    else:
        log.warning("%s started again", event.name)
