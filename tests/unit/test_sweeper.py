"""The heartbeat sweeper outlives a failed pass: the next pass still marks nodes down."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from meshnet.api.app import sweep_forever


class _FlakyTracker:
    """Its first sweep fails (a database error, say); the later ones find a silent node."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(sweep_interval_s=0.01)
        self.passes = 0

    async def sweep(self) -> list[str]:
        self.passes += 1
        if self.passes == 1:
            raise RuntimeError("database is locked")
        return ["node-9"]


def test_a_failed_sweep_does_not_stop_the_sweeper() -> None:
    tracker = _FlakyTracker()

    async def scenario() -> None:
        task = asyncio.create_task(sweep_forever(tracker))  # type: ignore[arg-type]
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(scenario())
    assert tracker.passes >= 3
