"""Counting what is under way across threads, and callbacks that must run only once."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Tally:
    """How many of something are under way; thread-safe."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def enter(self) -> Once:
        """Count one more in; calling what it returns (any thread, any times) counts it
        out once."""
        with self._lock:
            self.count += 1
        return Once(self._leave)

    def _leave(self) -> None:
        with self._lock:
            self.count -= 1


class Once:
    """Calls ``fn`` the first time it is called, from any thread; later calls do nothing."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self._fn = fn
        self._lock = threading.Lock()
        self._done = False

    def __call__(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._fn()
