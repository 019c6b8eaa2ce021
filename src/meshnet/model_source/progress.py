"""A download's progress: a callback per batch of bytes, and the CLI's bar with rate and ETA."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

OnBytes = Callable[[int], None]  # called with the bytes just fetched (and checked)
_MIN_REDRAW_S = 0.25


def _size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1000
    return f"{n:.1f} TB"


class ProgressBar:
    """A fetch's progress: bytes done of ``total`` (``plan`` may set it once known), the
    rate and ETA. With ``draw`` it is ``label [#####.....] 45% 12.3 MB/27.0 MB 5.1 MB/s
    ETA 3s`` on ``stream``, redrawn in place at most four times a second and once more by
    ``close``; without, it only counts (a node's heartbeats report it)."""

    def __init__(
        self, label: str, total: int, stream: TextIO | None = None, draw: bool = True
    ) -> None:
        self.label, self.total, self.done = label, max(total, 1), 0
        self.stream = stream or sys.stderr
        self.draw = draw
        self.started = self._drawn = time.monotonic()

    def __call__(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.draw and now - self._drawn >= _MIN_REDRAW_S:
            self._drawn = now
            self._draw(now)

    def plan(self, total: int) -> None:
        """The bytes the fetch needs, once it knows (its range's tensors)."""
        self.total = max(total, 1)

    def rate(self, now: float | None = None) -> float:
        """Bytes per second since the start."""
        return self.done / max((now or time.monotonic()) - self.started, 1e-6)

    def line(self, now: float) -> str:
        share = min(self.done / self.total, 1.0)
        rate = self.rate(now)
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        bar = "#" * int(share * 20)
        eta_text = f"{eta:.0f}s" if eta != float("inf") else "?"
        return (
            f"{self.label} [{bar:<20}] {share:4.0%} {_size(self.done)}/{_size(self.total)} "
            f"{_size(rate)}/s ETA {eta_text}"
        )

    def _draw(self, now: float) -> None:
        self.stream.write("\r" + self.line(now))
        self.stream.flush()

    def close(self) -> None:
        if not self.draw:
            return
        self._draw(time.monotonic())
        self.stream.write("\n")
        self.stream.flush()
