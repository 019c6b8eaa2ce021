"""Half-open layer ranges ``[start, end)`` and their arithmetic, in one place.

A shard serves the layers ``start, start + 1, ..., end - 1``. The first range
of a model (``start == 0``) also owns the token embedding; the last
(``end == n_layers``) owns the output norm and head.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from meshnet.errors import LayerRangeError


@dataclass(frozen=True, order=True)
class LayerRange:
    """Layers ``[start, end)`` of a model."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise LayerRangeError(f"layer range {self} is empty or negative")

    def __str__(self) -> str:
        return f"[{self.start}, {self.end})"

    def __len__(self) -> int:
        return self.end - self.start

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end))

    @classmethod
    def parse(cls, text: str) -> LayerRange:
        """Parse ``"START:END"``; raise ``LayerRangeError`` on anything else."""
        start, sep, end = text.partition(":")
        try:
            if not sep:
                raise ValueError(text)
            return cls(int(start), int(end))
        except ValueError:
            raise LayerRangeError(f"layer range {text!r} is not START:END") from None

    def check_within(self, n_layers: int) -> None:
        """Raise ``LayerRangeError`` unless the range lies inside ``[0, n_layers)``."""
        if self.end > n_layers:
            raise LayerRangeError(f"layer range {self} is outside the model's {n_layers} layers")

    def is_first(self) -> bool:
        return self.start == 0

    def is_last(self, n_layers: int) -> bool:
        return self.end == n_layers


def split_evenly(n_layers: int, parts: int) -> list[LayerRange]:
    """Split ``[0, n_layers)`` into ``parts`` contiguous ranges of near-equal size.

    The first ``n_layers % parts`` ranges get one extra layer.
    """
    if parts < 1 or parts > n_layers:
        raise LayerRangeError(f"cannot split {n_layers} layers into {parts} parts")
    base, extra = divmod(n_layers, parts)
    ranges: list[LayerRange] = []
    start = 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        ranges.append(LayerRange(start, end))
        start = end
    return ranges


def covers_exactly(ranges: Sequence[LayerRange], n_layers: int) -> bool:
    """True when ``ranges``, in order, cover ``[0, n_layers)`` once with no gap."""
    expected = 0
    for r in ranges:
        if r.start != expected:
            return False
        expected = r.end
    return expected == n_layers
