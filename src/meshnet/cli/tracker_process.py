"""The tracker process: registry, route driver and the HTTP API in one uvicorn server."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from meshnet.api.app import create_app
from meshnet.api.auth import TrackerAuth
from meshnet.api.quotas import QuotaGate
from meshnet.api.state import SessionServices
from meshnet.api.tenants import DEFAULT_TENANT, Quotas, TenantStore
from meshnet.auth.credentials import ensure_user_credentials
from meshnet.auth.keys import ensure_mesh_secret, read_secret_file
from meshnet.auth.mesh_keys import MeshKeys
from meshnet.errors import NotFound
from meshnet.kv.pace import TransferPace
from meshnet.model.info import ModelInfo
from meshnet.model_source.config import SourceConfig, source_config
from meshnet.model_source.info import model_info
from meshnet.model_source.whole import local_model_path
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.routing.driver import RouteDriver
from meshnet.tracker.routing.limits import DriverLimits
from meshnet.tracker.service import Tracker, TrackerConfig
from meshnet.tracker.serving.manifests import ManifestBook
from meshnet.tracker.serving.model_admin import ModelAdmin
from meshnet.tracker.serving.placement import Placement
from meshnet.tracker.serving.served import ServedModel, ServedModels, model_tracker
from meshnet.tracker.serving.served_store import ServedStore
from meshnet.tracker.session_data.session_models import SessionModels
from meshnet.tracker.session_data.session_store import SessionStore
from meshnet.tracker.session_data.snapshots import SnapshotStore
from meshnet.tracker.sessions.model_turns import ModelTurns
from meshnet.tracker.sessions.outbox import Outbox, OutboxConfig
from meshnet.tracker.sessions.retention import Retention, RetentionPolicy
from meshnet.tracker.sessions.sessions import SessionPolicy, Sessions
from meshnet.tracker.storage.database import Database, open_database
from meshnet.tracker.storage.leader_lease import PLACEMENT, Leadership, Lease, holder_id
from meshnet.tracker.storage.migrations import migrate
from meshnet.tracker.trust.verifier import TrustedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrackerProcessConfig:
    host: str  # interface the HTTP API listens on
    port: int
    data_dir: Path  # the SQLite database unless ``database`` names another; older snapshots
    database: str | None  # postgresql://... or an SQLite path; None: data_dir/tracker.db
    model_path: str | None  # None: the bundled model
    tracker: TrackerConfig
    driver: DriverLimits
    outbox: OutboxConfig = field(default_factory=OutboxConfig)
    policy: SessionPolicy = field(default_factory=SessionPolicy)
    mesh_secret_file: Path | None = None  # None: data_dir/mesh.secret, made on first start
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)  # what is kept how long
    # Share of committed chunks the verifier re-runs; above 0 nodes also calibrate (and the
    # tracker loads its own engine of the model: tracker/trust/verifier.py). 0: off.
    verify_rate: float = 0.0
    more_models: tuple[str, ...] = ()  # served too (nodes load them from the same paths)
    # Node ids trusted by configuration: not calibrated, not checked, billed at once, and
    # the verifier's capacity where their ranges fit (tracker/trust/trusted_capacity.py).
    trusted_nodes: frozenset[str] = frozenset()
    # Where models given by reference (hf:ORG/REPO:QUANT, URLs) are kept; None: the
    # default cache (MESHNET_CACHE).
    source: SourceConfig | None = None
    # How long one KV transfer (a snapshot's export or import) may take, by its size.
    kv_pace: TransferPace = field(default_factory=TransferPace)
    # The placement lease (tracker/storage/leader_lease.py): only its holder, among the trackers
    # on the database, runs placement. 0: this tracker places whatever others do.
    placement_lease_s: float = 10.0


def mesh_secret(cfg: TrackerProcessConfig) -> str:
    if cfg.mesh_secret_file is not None:
        return read_secret_file(cfg.mesh_secret_file, "the mesh secret")
    return ensure_mesh_secret(cfg.data_dir)


def tracker_auth(cfg: TrackerProcessConfig, db: Database, keys: MeshKeys) -> TrackerAuth:
    """The tenancy tables, with the credentials file's key (default tenant) and admin
    token registered: ``DATA_DIR/credentials.json``, made on first start."""
    creds = ensure_user_credentials(cfg.data_dir)
    tenants = TenantStore(db)
    try:
        tenants.tenant(DEFAULT_TENANT)
    except NotFound:
        tenants.create_tenant(DEFAULT_TENANT, Quotas())
    tenants.add_key(DEFAULT_TENANT, creds.api_key)
    tenants.add_admin_token(creds.admin_token)
    return TrackerAuth(tenants, keys, QuotaGate())


def serve(cfg: TrackerProcessConfig) -> int:
    source = cfg.source or source_config("tracker")
    # what nodes fetching a referenced model are given, with the hashes nodes learned
    manifests = ManifestBook(cfg.data_dir / "learned-hashes")

    def load_info(path: str | None) -> ModelInfo:
        return manifests.note(model_info(path, source))

    model = load_info(cfg.model_path)
    db = open_database(cfg.database or cfg.data_dir / "tracker.db")
    migrate(db)  # before any table is opened: an older table is brought up to date
    store = Store(db)
    keys = MeshKeys(mesh_secret(cfg))
    channels = ChannelPool(keys)
    driver = RouteDriver(channels, model.fingerprint, model.spec, model.tokenizer, cfg.driver)
    tracker = Tracker(store, model, channels, driver, cfg.tracker)
    tracker.trusted_nodes = cfg.trusted_nodes
    if cfg.placement_lease_s > 0:
        lease = Lease(store.db, PLACEMENT, holder_id(), cfg.placement_lease_s)
        tracker.leader = Leadership(lease)
    if cfg.verify_rate > 0:
        whole = local_model_path(model.ref, source) if model.ref else model.path
        tracker.verify(TrustedModel(str(whole)), cfg.verify_rate, cfg.trusted_nodes)
        log.info("verification on: calibration, and %.1f%% of chunks re-run", cfg.verify_rate * 100)
    elif cfg.trusted_nodes:
        log.warning("--trusted-node changes nothing while --verify-rate is 0: nothing is checked")
    placement = Placement(tracker)
    served = ServedModels(ServedModel(model, tracker, placement, ""))
    for path in cfg.more_models:
        info = load_info(path)
        served.check_new(info)
        other = model_tracker(tracker, info, path)
        served.add(ServedModel(info, other, Placement(other), path))
    session_store = SessionStore(store.db)
    snapshots = SnapshotStore(store.db, cfg.data_dir / "snapshots", cfg.kv_pace)
    session_models = SessionModels(store.db)
    runner = ModelTurns(served, session_models, session_store, snapshots)
    services = SessionServices(
        Sessions(tracker, session_store, snapshots, runner, cfg.policy),
        Outbox(session_store, runner, snapshots, cfg.outbox),
    )
    auth = tracker_auth(cfg, store.db, keys)
    runner.owner_of = auth.tenants.owner  # a session's turns are in its tenant's cache scope

    def purge_session_rows(limit: int) -> int:
        """The rows of sessions no longer kept: their owner and their model."""
        return auth.tenants.purge_orphans(limit) + session_models.purge_orphans(limit)

    retention = Retention(store, session_store, snapshots, cfg.retention, purge_session_rows)
    model_admin = ModelAdmin(served, placement.config, ServedStore(store.db), load_info)
    model_admin.restore()  # what the admin calls served before a restart
    app = create_app(
        tracker, services, auth, retention, placement=placement, model_admin=model_admin
    )
    app.state.manifests = manifests
    names = ", ".join(m.name for m in served)
    log.info("tracker serving %s on http://%s:%d", names, cfg.host, cfg.port)
    try:
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning", access_log=False)
    finally:
        store.close()
    return 0
