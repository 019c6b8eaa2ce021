"""What a check found, and the report of them all: one line per check."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Status(Enum):
    OK = "ok"
    FAIL = "FAIL"
    SKIP = "skip"  # not run: a check it needs failed


class Scope(Enum):
    LOCAL = "local"  # this host's setup: a node does not start on a failure
    PEER = "peer"  # depends on others (the tracker, a proxy): a node starts anyway


@dataclass(frozen=True)
class Check:
    """The outcome of one check, printed as one line."""

    name: str
    status: Status
    detail: str  # what was found
    fix: str = ""  # what to do about a failure
    scope: Scope = Scope.LOCAL

    @property
    def failed(self) -> bool:
        return self.status is Status.FAIL

    def line(self) -> str:
        fix = f"; fix: {self.fix}" if self.failed and self.fix else ""
        return f"{self.status.value:<4}  {self.name:<18} {self.detail}{fix}"


def ok(name: str, detail: str, scope: Scope = Scope.LOCAL) -> Check:
    return Check(name, Status.OK, detail, scope=scope)


def fail(name: str, detail: str, fix: str, scope: Scope = Scope.LOCAL) -> Check:
    return Check(name, Status.FAIL, detail, fix, scope)


def skip(name: str, why: str, scope: Scope = Scope.LOCAL) -> Check:
    return Check(name, Status.SKIP, why, scope=scope)


@dataclass(frozen=True)
class Report:
    checks: tuple[Check, ...]

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.failed]

    @property
    def blocking(self) -> list[Check]:
        """The failures a node must not start with (its own setup's)."""
        return [c for c in self.failed if c.scope is Scope.LOCAL]

    def lines(self) -> list[str]:
        return [c.line() for c in self.checks]


def size(n: float) -> str:
    """``n`` bytes, readable."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    i = 0
    while n >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{int(n)} B" if i == 0 else f"{n:.1f} {units[i]}"
