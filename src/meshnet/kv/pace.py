"""How long one KV transfer may take: a base plus its bytes over a minimum rate.

A fixed deadline either cuts a large session's KV on a slow link (which then
falls back to re-prefill) or lets a trickling peer hold an import slot for
long. The limit is instead sized to the data: ``base_s`` for everything that
does not grow with it (connecting, the header, loading), plus the stream's
bytes at ``min_rate`` bytes per second. A peer that sends slower than the rate
cannot finish within its limit and is cut, however large the stream. Until a
stream's header says how large it is, only ``base_s`` is granted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

from meshnet.errors import KVImportFailed

MB = 1 << 20
T = TypeVar("T")


@dataclass(frozen=True)
class TransferPace:
    base_s: float = 30.0  # seconds any transfer may take whatever its size
    min_rate: float = 1.0 * MB  # bytes per second a transfer must keep up, on average

    def __post_init__(self) -> None:
        if self.base_s <= 0 or self.min_rate <= 0:
            raise ValueError(f"a transfer pace needs a positive base and rate, not {self}")

    def limit_s(self, nbytes: int) -> float:
        """Seconds a transfer of ``nbytes`` may take from its start."""
        return self.base_s + max(nbytes, 0) / self.min_rate


async def paced(
    frames: AsyncIterator[T], pace: TransferPace, size: Callable[[T], int]
) -> AsyncIterator[T]:
    """``frames`` cut off at the pace's limit: the first (the header) within
    ``base_s``, the rest by ``limit_s`` of the size ``size`` reads from it (0 for a
    frame that is not a header). ``KVImportFailed`` (``deadline``) when late."""
    start = time.monotonic()
    deadline = start + pace.base_s
    iterator = frames.__aiter__()
    while True:
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for drops a cancel that
            # lands as a frame does, and the transfer would run on past its caller's end
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                frame = await iterator.__anext__()
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise KVImportFailed("the KV transfer ran past its deadline", "deadline") from None
        nbytes = size(frame)
        if nbytes:
            deadline = start + pace.limit_s(nbytes)
        yield frame
