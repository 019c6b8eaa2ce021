"""Half-open layer ranges ``[start, end)`` and their arithmetic, in one place.

A shard serves the layers ``start, start + 1, ..., end - 1``. The first range
of a model (``start == 0``) also owns the token embedding; the last
(``end == n_layers``) owns the output norm and head.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from meshnet.errors import LayerRangeError

_Cost = Callable[[int, int], int]  # bytes of the range [i, j)


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


def split_by_bytes(
    layer_bytes: Sequence[int], parts: int, first_bytes: int = 0, last_bytes: int = 0
) -> list[LayerRange]:
    """Cut ``[0, len(layer_bytes))`` into ``parts`` contiguous ranges whose largest holds
    the fewest bytes, exactly.

    A range holds the bytes of its layers, plus ``first_bytes`` when it is the first (the
    embedding) and ``last_bytes`` when it is the last (output norm and head, the embedding
    again when the head is tied to it). Among the layouts with the least largest range,
    the one whose ranges' squared bytes sum least is taken (the other nodes as even as the
    largest allows), then the one whose earlier ranges are the longer: with equal layers
    and nothing at the ends that is ``split_evenly``'s layout. Raises ``LayerRangeError``
    for a count outside ``[1, n_layers]`` or a negative size.
    """
    n = len(layer_bytes)
    if parts < 1 or parts > n:
        raise LayerRangeError(f"cannot split {n} layers into {parts} parts")
    if min(layer_bytes) < 0 or first_bytes < 0 or last_bytes < 0:
        raise LayerRangeError("layer bytes cannot be negative")
    prefix = [0, *itertools.accumulate(layer_bytes)]

    def cost(i: int, j: int) -> int:
        """Bytes of the range ``[i, j)``."""
        return (
            prefix[j] - prefix[i] + (first_bytes if i == 0 else 0) + (last_bytes if j == n else 0)
        )

    cap = _least_largest(n, parts, cost)
    cuts = _evenest_cuts(n, parts, cap, cost)
    return [LayerRange(a, b) for a, b in itertools.pairwise(cuts)]


def _least_largest(n: int, parts: int, cost: _Cost) -> int:
    """The least ``cap`` such that ``parts`` ranges of at most ``cap`` bytes each cover
    ``[0, n)``: a binary search over every range's bytes (the answer is one of them)."""
    candidates = sorted({cost(i, j) for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1  # the largest, the whole model in one range, always fits
    while lo < hi:
        mid = (lo + hi) // 2
        if _fewest_ranges(n, candidates[mid], cost) <= parts:
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def _fewest_ranges(n: int, cap: int, cost: _Cost) -> int:
    """How few ranges of at most ``cap`` bytes cover ``[0, n)`` (``n + 1``: none can).

    Greedy, each range as long as it fits, is optimal: ranges only grow by taking
    layers, so the greedy cuts are never behind any other layout's."""
    count, i = 0, 0
    while i < n:
        j = i
        while j < n and cost(i, j + 1) <= cap:
            j += 1
        if j == i:
            return n + 1
        count, i = count + 1, j
    return count


def _evenest_cuts(n: int, parts: int, cap: int, cost: _Cost) -> list[int]:
    """The cuts ``0 = c0 < c1 < ... < c_parts = n`` of ranges of at most ``cap`` bytes
    whose squared bytes sum least; of those, the one whose first cut (then second...)
    is the latest. ``cap`` must admit a layout (``_least_largest``)."""
    # best[k][i]: the least sum of squares of k ranges covering [i, n), None: no way.
    best: list[list[int | None]] = [[None] * (n + 1) for _ in range(parts + 1)]
    best[0][n] = 0
    for k in range(1, parts + 1):
        for i in range(n - k, -1, -1):
            best[k][i] = min(
                (c * c + rest for j, c, rest in _next_ranges(i, n, cap, cost, best[k - 1])),
                default=None,
            )
    cuts, i = [0], 0
    for k in range(parts, 0, -1):
        i = max(
            j
            for j, c, rest in _next_ranges(i, n, cap, cost, best[k - 1])
            if c * c + rest == best[k][i]
        )
        cuts.append(i)
    return cuts


def _next_ranges(
    i: int, n: int, cap: int, cost: _Cost, after: Sequence[int | None]
) -> Iterator[tuple[int, int, int]]:
    """``(j, bytes of [i, j), after[j])`` for every range ``[i, j)`` within ``cap`` whose
    rest ``[j, n)`` can be covered (``after[j]`` not None)."""
    for j in range(i + 1, n + 1):
        c = cost(i, j)
        if c > cap:
            return  # a longer range holds at least as much
        rest = after[j]
        if rest is not None:
            yield j, c, rest


def covers_exactly(ranges: Sequence[LayerRange], n_layers: int) -> bool:
    """True when ``ranges``, in order, cover ``[0, n_layers)`` once with no gap."""
    expected = 0
    for r in ranges:
        if r.start != expected:
            return False
        expected = r.end
    return expected == n_layers
