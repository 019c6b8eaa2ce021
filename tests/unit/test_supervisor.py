"""The supervisor of `meshnet up`: a child that exits is started again after a backoff that
doubles while it keeps dying, is capped, and starts over once a child ran for a while."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import pytest

from meshnet.supervisor import (
    Backoff,
    Exited,
    Restarted,
    StartFailed,
    Supervisor,
    describe_status,
    log_event,
)


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class FakeChild:
    name: str
    status: int | None = None  # set to make it "exit"
    starts: int = 0
    start_errors: list[OSError] = field(default_factory=list)

    def poll(self) -> int | None:
        return self.status

    def start(self) -> None:
        if self.start_errors:
            raise self.start_errors.pop(0)
        self.starts += 1
        self.status = None


def _setup(*names: str) -> tuple[Clock, list[FakeChild], Supervisor]:
    clock = Clock()
    children = [FakeChild(n) for n in names]
    backoff = Backoff(first_s=1.0, factor=2.0, max_s=5.0, stable_s=60.0)
    return clock, children, Supervisor(children, backoff, clock)


def test_backoff_doubles_and_is_capped() -> None:
    b = Backoff(first_s=0.5, factor=2.0, max_s=3.0)
    assert [b.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_running_children_are_left_alone() -> None:
    _, children, sup = _setup("tracker", "node-0")
    assert sup.step() == [] and all(c.starts == 0 for c in children)


def test_a_child_that_dies_is_restarted_after_its_delay_and_the_others_keep_running() -> None:
    clock, (tracker, node), sup = _setup("tracker", "node-0")
    node.status = -9
    assert sup.step() == [Exited("node-0", -9, 1, 1.0)]
    clock.now = 0.5
    assert sup.step() == []  # not yet
    clock.now = 1.0
    assert sup.step() == [Restarted("node-0", 1)]
    assert node.starts == 1 and tracker.starts == 0
    assert sup.step() == []  # running again


def test_a_child_that_keeps_dying_waits_longer_each_time_up_to_the_cap() -> None:
    clock, (node,), sup = _setup("node-0")
    delays = []
    for _ in range(5):
        node.status = 1
        (exited,) = sup.step()
        assert isinstance(exited, Exited)
        delays.append(exited.delay_s)
        clock.now += exited.delay_s
        assert sup.step() == [Restarted("node-0", exited.restarts)]
        clock.now += 1.0  # dies soon after each start
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_a_child_that_ran_a_while_starts_its_backoff_over() -> None:
    clock, (node,), sup = _setup("node-0")
    for _ in range(3):
        node.status = 1
        (exited,) = sup.step()
        clock.now += exited.delay_s  # type: ignore[union-attr]
        sup.step()
    clock.now += 61.0
    node.status = 1
    assert sup.step() == [Exited("node-0", 1, 1, 1.0)]


def test_a_start_that_fails_is_tried_again_later() -> None:
    clock, (node,), sup = _setup("node-0")
    node.status = 1
    node.start_errors.append(OSError("no such file"))
    sup.step()
    clock.now = 1.0
    assert sup.step() == [StartFailed("node-0", "no such file", 2.0)]
    clock.now = 2.9
    assert sup.step() == []
    clock.now = 3.0
    assert sup.step() == [Restarted("node-0", 2)] and node.starts == 1


def test_exit_statuses_are_said_plainly() -> None:
    assert describe_status(-9) == "killed by SIGKILL"
    assert describe_status(1) == "exited with 1"
    assert describe_status(-200) == "killed by signal 200"


def test_events_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "meshnet.supervisor"):
        log_event(Exited("node-1", -9, 2, 1.0))
        log_event(Restarted("node-1", 2))
    assert "node-1 killed by SIGKILL; starting it again in 1.0 s" in caplog.text
    assert "node-1 started again" in caplog.text
