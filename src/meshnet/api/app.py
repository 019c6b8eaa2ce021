"""The tracker's HTTP application: public API, admin, node control plane."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from meshnet.api import admin, mesh, openai
from meshnet.api.errors import install_error_handlers
from meshnet.tracker.service import Tracker

log = logging.getLogger(__name__)


def create_app(tracker: Tracker) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sweeper = asyncio.create_task(_sweep_forever(tracker))
        try:
            yield
        finally:
            sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sweeper
            await tracker.channels.close()

    app = FastAPI(title="meshnet tracker", lifespan=lifespan)
    app.state.tracker = tracker
    install_error_handlers(app)
    app.include_router(openai.router)
    app.include_router(admin.router)
    app.include_router(mesh.router)
    return app


async def _sweep_forever(tracker: Tracker) -> None:
    """Mark down nodes that stopped heartbeating, every ``sweep_interval_s``."""
    while True:
        for node_id in tracker.sweep():
            log.warning("node %s missed its heartbeats: marked down", node_id)
        await asyncio.sleep(tracker.config.sweep_interval_s)
