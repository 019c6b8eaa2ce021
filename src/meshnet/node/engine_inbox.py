"""The inbox of a node's engine loop: steps and control calls, taken in arrival order.

Every call that changes what the engine holds (a session's open, a park, a
configure) is a ``Control`` put here by the part that owns it and applied by the
loop between iterations (node/engine.py), so none of the parts' state is locked;
the caller waits on the control's future.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from meshnet.node.scheduler import StepWork

T = TypeVar("T")


@dataclass
class Control:
    """A command the loop applies in order between iterations."""

    apply: Callable[[], Any]
    future: Future[Any] = field(default_factory=Future)


Item = StepWork | Control | None  # None: stop


class Inbox:
    """What the loop is handed: steps, controls, and ``None`` to stop. The loop is its
    one reader; any thread puts."""

    def __init__(self) -> None:
        # A SimpleQueue: a put wakes the idle loop with one handoff (a Queue's condition
        # made it two), paid on every step a ring's previous hop relays in.
        self._queue: queue.SimpleQueue[Item] = queue.SimpleQueue()

    def control(self, apply: Callable[[], T]) -> Future[T]:
        """Have the loop run ``apply`` between iterations; its result or error answers."""
        c = Control(apply)
        self._queue.put(c)
        return c.future

    def put(self, item: Item) -> None:
        self._queue.put(item)

    def get(self) -> Item:
        """The next item, waiting for one."""
        return self._queue.get()

    def get_nowait(self) -> Item:
        """The next item; ``queue.Empty`` when there is none."""
        return self._queue.get_nowait()

    def empty(self) -> bool:
        return self._queue.empty()


def settle(future: Future[Any], apply: Callable[[], Any]) -> None:
    """Answer ``future`` with what ``apply`` returns, or with what it raises."""
    try:
        future.set_result(apply())
    except Exception as e:
        future.set_exception(e)
