"""The tracker's HTTP application: public API, admin, node control plane."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from meshnet.api import (
    admin,
    benchmarks,
    configure,
    dashboard,
    health,
    inventory,
    mesh,
    metrics,
    missing,
    models,
    openai,
    sessions,
    watch,
)
from meshnet.api.auth import TrackerAuth
from meshnet.api.body_limit import BodyLimit
from meshnet.api.errors import install_error_handlers
from meshnet.api.state import SessionServices
from meshnet.errors import HeartbeatLost
from meshnet.tracker.accounting.billing import Settlement
from meshnet.tracker.loops import LoopHealth
from meshnet.tracker.service import Tracker
from meshnet.tracker.serving.bench_store import BenchStore
from meshnet.tracker.serving.model_admin import ModelAdmin
from meshnet.tracker.serving.placement import Placement
from meshnet.tracker.serving.route_bench import RouteBench
from meshnet.tracker.serving.served import ServedModel, ServedModels
from meshnet.tracker.session_data.session_list import SessionList
from meshnet.tracker.sessions.retention import Retention
from meshnet.tracker.watch.events import EventLog
from meshnet.tracker.watch.state_watch import StateWatch

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 20


def create_app(
    tracker: Tracker,
    services: SessionServices,
    auth: TrackerAuth,
    retention: Retention | None = None,
    route_bench: RouteBench | None = None,
    placement: Placement | None = None,
    settlement: Settlement | None = None,
    served: ServedModels | None = None,
    model_admin: ModelAdmin | None = None,
) -> FastAPI:
    """The app; its lifespan runs the tracker's background loops (each survives a
    failed pass: logged, counted in its ``LoopHealth``, run again). ``route_bench``
    defaults to one recording in the tracker's own database, ``placement`` to the
    controller keeping ``tracker.config.replicas`` nodes on every layer range.
    ``served``: the models served (default: ``model_admin``'s, else ``tracker``'s alone,
    with ``placement``); ``tracker`` is the first of them. ``model_admin`` serves,
    replaces and releases them (default: one that records nothing)."""
    sweeper = LoopHealth("heartbeat sweeper")
    placement = placement or Placement(tracker)
    settlement = settlement or Settlement(tracker.store.db)  # settles unverified work
    if model_admin is not None:
        served = model_admin.models
    served = served or ServedModels(ServedModel(tracker.model, tracker, placement, ""))
    placement = served.first.placement
    model_admin = model_admin or ModelAdmin(served)
    tracker.metrics.served = lambda: [m.tracker for m in served]  # every model's, scraped
    events = EventLog()
    state_watch = StateWatch(services.sessions.store, tracker.store, events)
    watching = watch.Watching(events, SessionList(tracker.store.db, served.first_name))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # The registry lists who was up when the database was last written: before
        # serving, whoever does not answer now is down (not routed to until the
        # sweep would notice); its process registers again when it comes back.
        for node_id in await tracker.healer.unanswered_gone():
            log.info("node %s listed up from before this start does not answer: down", node_id)
        loops = [
            asyncio.create_task(sweep_forever(tracker, sweeper, served)),
            asyncio.create_task(services.outbox.run_forever()),
            asyncio.create_task(services.sessions.run_policy_forever()),
            asyncio.create_task(tracker.ledger.run_forever()),
            asyncio.create_task(model_admin.run_forever()),  # every model's placement
            asyncio.create_task(settlement.run_forever()),
            asyncio.create_task(state_watch.run_forever()),
        ]
        if retention is not None:
            loops.append(asyncio.create_task(retention.run_forever()))
        try:
            yield
        finally:
            for loop in loops:
                loop.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await services.outbox.stop()
            tracker.ledger.flush()  # what waited for the database, if it takes it now
            await tracker.channels.close()

    app = FastAPI(title="meshnet tracker", lifespan=lifespan)
    # No further than the largest request we take (a million-character prompt,
    # JSON-escaped): a bigger body is 413 before it costs parsing.
    app.add_middleware(BodyLimit, max_bytes=MAX_BODY_BYTES)
    app.add_middleware(metrics.CountRequests, metrics=tracker.metrics)  # outermost: sees all
    app.state.tracker = tracker
    app.state.models = served
    app.state.model_admin = model_admin
    app.state.sessions = services
    app.state.auth = auth
    app.state.watching = watching
    app.state.route_bench = route_bench or RouteBench(tracker, BenchStore(tracker.store.db))
    app.state.loops = [
        sweeper,
        services.outbox.health,
        services.sessions.policy_health,
        placement.health,
        *([tracker.leader.health] if tracker.leader is not None else []),
        settlement.health,
        state_watch.health,
        *([retention.health] if retention is not None else []),
    ]
    install_error_handlers(app)
    app.include_router(models.router)
    app.include_router(models.admin)
    app.include_router(openai.router)
    app.include_router(sessions.router)
    app.include_router(admin.router)
    app.include_router(watch.router)
    app.include_router(configure.router)
    app.include_router(benchmarks.router)
    app.include_router(mesh.router)
    app.include_router(inventory.admin)
    app.include_router(health.router)
    app.include_router(metrics.admin)
    app.include_router(dashboard.page)
    app.include_router(dashboard.admin)
    app.include_router(missing.router)  # last: only what no other route takes
    return app


async def sweep_forever(
    tracker: Tracker, health: LoopHealth | None = None, served: ServedModels | None = None
) -> None:
    """Mark down nodes that stopped heartbeating, every ``sweep_interval_s``; a failed
    pass (a database error, a bug) is logged, counted in ``health``, and the next one
    runs as usual. The steps waiting on a lost node fail at once in every ``served``
    model's generations (``tracker`` fails its own)."""
    health = health or LoopHealth("heartbeat sweeper")
    while True:
        try:
            for node_id in await tracker.sweep():
                log.warning("node %s missed its heartbeats: marked down", node_id)
                verdict = HeartbeatLost(f"node {node_id} stopped heartbeating", node_id)
                for model in served or ():
                    if model.tracker is not tracker:
                        for gen in model.tracker.generations():
                            gen.node_lost(node_id, verdict)
        except Exception as e:
            health.failed(e)
        else:
            health.passed()
        await asyncio.sleep(tracker.config.sweep_interval_s)
