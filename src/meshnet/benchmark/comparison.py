"""One figure of ours beside its peer's, the ratio, and the goal it is held to.

The serving benchmarks print a list of these; the formatting and the
best-of-rounds rule live here so every such benchmark reads the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Better = Literal["higher", "lower"]


@dataclass(frozen=True)
class Comparison:
    """``ours`` against ``peer`` (same unit); the ratio is always ours / peer."""

    figure: str  # what is measured, with its unit
    ours: float
    peer: float | None  # None: no peer was measured
    peer_name: str
    goal: float | None = None  # the ratio the issue asks for; None: shown for context
    better: Better = "higher"  # "lower" for latencies: the goal is then a ceiling

    @property
    def ratio(self) -> float | None:
        return None if self.peer is None or self.peer == 0 else self.ours / self.peer

    @property
    def meets_goal(self) -> bool | None:
        if self.goal is None or self.ratio is None:
            return None
        return self.ratio >= self.goal if self.better == "higher" else self.ratio <= self.goal

    def line(self) -> str:
        peer = "-" if self.peer is None else f"{self.peer:8.2f}"
        ratio = "-" if self.ratio is None else f"{self.ratio:.2f}x"
        goal = ""
        if self.goal is not None:
            sign = ">=" if self.better == "higher" else "<="
            verdict = {True: "met", False: "NOT met", None: "-"}[self.meets_goal]
            goal = f"  (goal {sign} {self.goal:.2f}x: {verdict})"
        return f"{self.figure:<46} {self.ours:8.2f}  {self.peer_name:<26} {peer}  {ratio}{goal}"


def best(values: Sequence[float], better: Better = "higher") -> float:
    """The best round: on a shared machine the slower rounds measure the neighbours."""
    if not values:
        raise ValueError("no rounds to take the best of")
    return max(values) if better == "higher" else min(values)


def table(rows: Sequence[Comparison]) -> str:
    head = f"{'figure':<46} {'meshnet':>8}  {'peer':<26} {'value':>8}  ratio"
    return "\n".join([head, *(r.line() for r in rows)])
