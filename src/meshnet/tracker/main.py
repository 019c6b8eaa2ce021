"""The tracker process: registry, route driver and the HTTP API in one uvicorn server."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from meshnet.api.app import create_app
from meshnet.model.info import load_model_info
from meshnet.tracker.channels import ChannelPool
from meshnet.tracker.driver import DriverLimits, RouteDriver
from meshnet.tracker.service import Tracker, TrackerConfig
from meshnet.tracker.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrackerProcessConfig:
    host: str  # interface the HTTP API listens on
    port: int
    data_dir: Path  # SQLite database (and, later, snapshots) live here
    model_path: str | None  # None: the bundled model
    tracker: TrackerConfig
    driver: DriverLimits


def serve(cfg: TrackerProcessConfig) -> int:
    model = load_model_info(cfg.model_path)
    store = Store(cfg.data_dir / "tracker.db")
    channels = ChannelPool()
    driver = RouteDriver(channels, model.fingerprint, model.spec, model.tokenizer, cfg.driver)
    app = create_app(Tracker(store, model, channels, driver, cfg.tracker))
    log.info("tracker serving %s on http://%s:%d", model.name, cfg.host, cfg.port)
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False)
    finally:
        store.close()
    return 0
