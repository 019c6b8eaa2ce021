"""How much of the machine others used while a benchmark measured.

On a shared VM a neighbour's load moves a measurement by far more than the
difference being measured, and not evenly: llama.cpp's threads wait for each
other at every operation, so one busy core slows it several times over (seen
here: llama-server from 130 to 5-20 tok/s) while ours slows less. So every
measurement is taken once the CPUs are idle (a bounded wait), the CPU time
*others* used during it is recorded (the machine's busy time less that of
this process and every process it started), and a measurement others
disturbed is taken again, a bounded number of times. Figures then come from
the undisturbed measurements where there are any.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

T = TypeVar("T")
_PROC = Path("/proc")


@dataclass(frozen=True)
class ProcTimes:
    ppid: int
    own: int  # user + system jiffies of the process
    reaped: int  # of its children it has waited for


def cpu_times(stat_text: str) -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from the text of ``/proc/stat``."""
    fields = [int(v) for v in stat_text.splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    total = sum(fields[:8])  # guest time is already counted in user
    return total - idle, total


def busy_share(before: tuple[int, int], after: tuple[int, int]) -> float:
    """The share of all CPUs' time spent busy between two ``cpu_times`` samples."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return busy / total if total > 0 else 0.0


def parse_proc_stat(text: str) -> ProcTimes:
    """One ``/proc/PID/stat`` line (the command name may hold spaces and parentheses)."""
    f = text[text.rindex(")") + 2 :].split()  # f[0] is field 3, the state
    return ProcTimes(int(f[1]), int(f[11]) + int(f[12]), int(f[13]) + int(f[14]))


def tree_jiffies(procs: Mapping[int, ProcTimes], root: int) -> int:
    """CPU jiffies of ``root`` and every live descendant, and of those they reaped."""
    children: dict[int, list[int]] = {}
    for pid, p in procs.items():
        children.setdefault(p.ppid, []).append(pid)
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            total += procs[pid].own + procs[pid].reaped
        todo += children.get(pid, [])
    return total


def _procs() -> dict[int, ProcTimes]:
    out = {}
    for d in _PROC.iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                out[int(d.name)] = parse_proc_stat((d / "stat").read_text())
    return out


@dataclass(frozen=True)
class _Sample:
    machine: tuple[int, int]
    ours: int


def _sample() -> _Sample | None:
    if not (_PROC / "stat").exists():
        return None
    return _Sample(cpu_times((_PROC / "stat").read_text()), tree_jiffies(_procs(), os.getpid()))


def others_share(before: _Sample | None, after: _Sample | None) -> float:
    """The share of all CPUs' time that processes not ours used between two samples."""
    if before is None or after is None:
        return 0.0
    total = after.machine[1] - before.machine[1]
    theirs = (after.machine[0] - before.machine[0]) - (after.ours - before.ours)
    return max(theirs, 0) / total if total > 0 else 0.0


def wait_idle(max_wait_s: float, threshold: float, window_s: float = 0.5) -> None:
    """Wait up to ``max_wait_s`` for a ``window_s`` in which others used at most
    ``threshold`` of the CPUs."""
    deadline = time.monotonic() + max_wait_s
    while True:
        before = _sample()
        time.sleep(window_s)
        if others_share(before, _sample()) <= threshold or time.monotonic() >= deadline:
            return


@dataclass(frozen=True)
class Measured:
    value: float
    others: float  # the share of the CPUs others used while it ran


@dataclass(frozen=True)
class Quiet:
    """How a benchmark keeps its measurements away from neighbours' load."""

    max_wait_s: float = 20.0  # before each measurement, for idle CPUs
    threshold: float = 0.10  # the share of the CPUs others may use during it
    retries: int = 2  # measurements taken again when others used more

    def measure(self, run: Callable[[], float]) -> list[Measured]:
        """``run()`` once the CPUs are idle, again while others disturbed it; every try."""
        return [Measured(value, others) for value, others in self.tries(run)]

    def tries(self, run: Callable[[], T]) -> list[tuple[T, float]]:
        """As ``measure``, for a result of any type: every try's result and the share
        of the CPUs others used while it ran."""
        tries: list[tuple[T, float]] = []
        for _ in range(1 + self.retries):
            wait_idle(self.max_wait_s, self.threshold)
            before = _sample()
            value = run()
            tries.append((value, others_share(before, _sample())))
            if tries[-1][1] <= self.threshold:
                break
        return tries

    def best(
        self, measured: Sequence[Measured], better: Literal["higher", "lower"] = "higher"
    ) -> tuple[float, bool]:
        """The best undisturbed value, and True; the best of all and False when every
        one was disturbed."""
        calm = [m.value for m in measured if m.others <= self.threshold]
        pool = calm or [m.value for m in measured]
        if not pool:
            raise ValueError("nothing was measured")
        return (max(pool) if better == "higher" else min(pool)), bool(calm)
