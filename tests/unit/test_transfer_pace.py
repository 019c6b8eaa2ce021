"""A transfer's limit grows with its bytes; the tracker's paced reads cut a stream whose
frames come slower than that (the node's side is tested end to end, test_kv_pace.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from meshnet.errors import KVImportFailed
from meshnet.kv.pace import MB, TransferPace, paced


def test_the_limit_is_a_base_plus_the_bytes_over_the_rate() -> None:
    pace = TransferPace(base_s=30.0, min_rate=2 * MB)
    assert pace.limit_s(0) == 30.0
    assert pace.limit_s(400 * MB) == 230.0
    with pytest.raises(ValueError):
        TransferPace(base_s=0.0)
    with pytest.raises(ValueError):
        TransferPace(min_rate=0.0)


async def _frames(sizes: list[int], gap_s: float) -> AsyncIterator[int]:
    """A header announcing ``sum(sizes)`` bytes, then one frame per size, ``gap_s`` apart."""
    yield sum(sizes)
    for size in sizes:
        await asyncio.sleep(gap_s)
        yield -size  # not a header: counts nothing


def _collect(frames: AsyncIterator[int], pace: TransferPace) -> list[int]:
    async def run() -> list[int]:
        return [f async for f in paced(frames, pace, lambda f: max(f, 0))]

    return asyncio.run(run())


def test_a_stream_within_its_sized_limit_passes_though_it_outlasts_the_base() -> None:
    pace = TransferPace(base_s=0.05, min_rate=1000.0)  # 1000 bytes: 1.05 s in all
    got = _collect(_frames([100] * 10, 0.02), pace)  # about 0.2 s
    assert len(got) == 11


def test_a_trickle_below_the_rate_is_cut() -> None:
    pace = TransferPace(base_s=0.05, min_rate=10_000.0)  # 1000 bytes: 0.15 s in all
    with pytest.raises(KVImportFailed) as cut:
        _collect(_frames([100] * 10, 0.1), pace)  # 1 s
    assert cut.value.reason == "deadline"


def test_a_silent_peer_is_cut_at_the_base() -> None:
    async def silent() -> AsyncIterator[int]:
        await asyncio.sleep(3600)
        yield 0

    with pytest.raises(KVImportFailed):
        _collect(silent(), TransferPace(base_s=0.05))
