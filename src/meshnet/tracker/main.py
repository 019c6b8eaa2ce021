"""The tracker process: registry, route driver and the HTTP API in one uvicorn server."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from meshnet.api.app import create_app
from meshnet.api.state import SessionServices
from meshnet.model.info import load_model_info
from meshnet.tracker.channels import ChannelPool
from meshnet.tracker.database import open_database
from meshnet.tracker.driver import DriverLimits, RouteDriver
from meshnet.tracker.outbox import Outbox, OutboxConfig
from meshnet.tracker.retention import Retention, RetentionPolicy
from meshnet.tracker.service import Tracker, TrackerConfig
from meshnet.tracker.session_store import SessionStore
from meshnet.tracker.sessions import SessionPolicy, Sessions
from meshnet.tracker.snapshots import SnapshotStore
from meshnet.tracker.store import Store
from meshnet.tracker.turns import TurnRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrackerProcessConfig:
    host: str  # interface the HTTP API listens on
    port: int
    data_dir: Path  # snapshots, and the SQLite database unless ``database`` names another
    database: str | None  # postgresql://... or an SQLite path; None: data_dir/tracker.db
    model_path: str | None  # None: the bundled model
    tracker: TrackerConfig
    driver: DriverLimits
    outbox: OutboxConfig = field(default_factory=OutboxConfig)
    policy: SessionPolicy = field(default_factory=SessionPolicy)
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)  # what is kept how long


def serve(cfg: TrackerProcessConfig) -> int:
    model = load_model_info(cfg.model_path)
    store = Store(open_database(cfg.database or cfg.data_dir / "tracker.db"))
    channels = ChannelPool()
    driver = RouteDriver(channels, model.fingerprint, model.spec, model.tokenizer, cfg.driver)
    tracker = Tracker(store, model, channels, driver, cfg.tracker)
    session_store = SessionStore(store.db)
    snapshots = SnapshotStore(cfg.data_dir / "snapshots")
    runner = TurnRunner(tracker, session_store, snapshots)
    services = SessionServices(
        Sessions(tracker, session_store, snapshots, runner, cfg.policy),
        Outbox(session_store, runner, snapshots, cfg.outbox),
    )
    retention = Retention(store, session_store, snapshots, cfg.retention)
    app = create_app(tracker, services, retention)
    log.info("tracker serving %s on http://%s:%d", model.name, cfg.host, cfg.port)
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False)
    finally:
        store.close()
    return 0
