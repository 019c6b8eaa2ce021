"""The relay mailbox: inputs sent by a previous hop wait for their step, bounded in
count, bytes and time, and a step waits for its input only while it is wanted."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from meshnet.errors import Cancelled, DeadlineExceeded, Overloaded
from meshnet.node.relay import Mailbox


def x(rows: int = 1) -> np.ndarray:
    return np.ones((rows, 4), dtype=np.float32)


def test_an_input_that_came_first_is_taken_once() -> None:
    box = Mailbox(max_entries=4, max_bytes=1 << 20)
    box.put(("s", 1, 0), x(2))
    assert box.take(("s", 1, 0), 1.0, lambda: True).shape == (2, 4)
    with pytest.raises(DeadlineExceeded):
        box.take(("s", 1, 0), 0.05, lambda: True)
    assert box.delivered == 1


def test_a_step_waits_for_its_input_and_not_for_another_epochs() -> None:
    box = Mailbox(max_entries=4, max_bytes=1 << 20)
    box.put(("s", 1, 3), x())  # the fenced epoch's input is not this step's
    threading.Timer(0.05, lambda: box.put(("s", 2, 3), x(3))).start()
    assert box.take(("s", 2, 3), 5.0, lambda: True).shape == (3, 4)


def test_a_step_no_longer_wanted_stops_waiting() -> None:
    box = Mailbox(max_entries=4, max_bytes=1 << 20)
    t0 = time.monotonic()
    with pytest.raises(Cancelled):
        box.take(("s", 1, 0), None, lambda: time.monotonic() - t0 < 0.1)


def test_the_mailbox_is_bounded_in_entries_and_bytes() -> None:
    box = Mailbox(max_entries=2, max_bytes=1 << 20)
    box.put(("a", 1, 0), x())
    box.put(("b", 1, 0), x())
    with pytest.raises(Overloaded):
        box.put(("c", 1, 0), x())
    box.put(("a", 1, 0), x())  # sent again: replaces, takes no more room
    small = Mailbox(max_entries=8, max_bytes=100)
    with pytest.raises(Overloaded):
        small.put(("a", 1, 0), x(8))  # 128 bytes


def test_inputs_nobody_takes_expire_and_a_released_session_drops_its_own() -> None:
    box = Mailbox(max_entries=1, max_bytes=1 << 20, ttl_s=0.05)
    box.put(("a", 1, 0), x())
    time.sleep(0.1)
    box.put(("b", 1, 0), x())  # the stale one made room
    box.drop("b", 1)
    box.put(("c", 1, 0), x())
    with pytest.raises(DeadlineExceeded):
        box.take(("b", 1, 0), 0.01, lambda: True)


def test_a_step_running_ahead_is_handed_its_input_now_or_when_it_comes() -> None:
    """``when``: a ring's hop starts a step the moment its input is here, on the thread
    that files it, and takes no room in the box; a released session's waiter is gone."""
    box = Mailbox(max_entries=1, max_bytes=1 << 20)
    got: list[tuple[str, int]] = []
    box.put(("s", 1, 0), x(2))
    box.when(("s", 1, 0), lambda v: got.append(("now", v.shape[0])))
    box.when(("s", 1, 1), lambda v: got.append(("later", v.shape[0])))
    assert got == [("now", 2)]
    box.put(("t", 1, 0), x())  # the box's one entry: a waiter holds none
    box.put(("s", 1, 1), x(3))  # handed over, not filed: the full box does not refuse it
    assert got == [("now", 2), ("later", 3)]
    assert box.delivered == 2
    box.when(("s", 2, 5), lambda v: got.append(("dropped", 0)))
    box.drop("s", 2)
    box.drop("t", 1)
    box.put(("s", 2, 5), x())  # filed: nobody waits for it any more
    assert got == [("now", 2), ("later", 3)]
    assert box.take(("s", 2, 5), 0.01, lambda: True).shape == (1, 4)


def test_inputs_relayed_after_their_stream_ended_give_way_to_live_ones() -> None:
    """A cancelled generation's previous hop may still have inputs on the wire when this
    hop's stream ends; they must not fill the box and refuse every later generation."""
    box = Mailbox(max_entries=2, max_bytes=1 << 20)
    box.drop("gone", 1)
    box.put(("gone", 1, 7), x())  # came after the drop: filed, but first to go
    box.put(("gone", 1, 8), x())
    box.put(("live", 1, 0), x())
    box.put(("live", 1, 1), x())
    with pytest.raises(Overloaded):  # live inputs are still bounded
        box.put(("live", 1, 2), x())
    assert box.take(("live", 1, 0), 0.01, lambda: True).shape == (1, 4)


def test_a_reopened_epoch_keeps_inputs_that_came_before_its_stream() -> None:
    box = Mailbox(max_entries=1, max_bytes=1 << 20)
    box.drop("s", 1)  # one turn of a kept session ended
    box.opened("s", 1)  # the next turn's stream is open again
    box.put(("s", 1, 4), x(2))
    with pytest.raises(Overloaded):  # not a leftover: it is not pushed out
        box.put(("t", 1, 0), x())
    assert box.take(("s", 1, 4), 0.01, lambda: True).shape == (2, 4)
