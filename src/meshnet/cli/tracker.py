"""``meshnet tracker``: the registry, route driver and OpenAI-compatible API."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshnet.cli.options import add_options, declare_kv_pace, declare_tracker_options, kv_pace
from meshnet.cli.tracker_process import TrackerProcessConfig, serve
from meshnet.tracker.nodes.admission import AdmissionConfig
from meshnet.tracker.nodes.prefix_routes import PrefixRouting
from meshnet.tracker.routing.limits import DriverLimits
from meshnet.tracker.service import TrackerConfig
from meshnet.tracker.sessions.outbox import OutboxConfig
from meshnet.tracker.sessions.retention import RetentionPolicy
from meshnet.tracker.sessions.sessions import SessionPolicy
from meshnet.tracker.trust.trusted_capacity import trusted_ids


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("tracker", help="run the tracker and its HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--data-dir", type=Path, default=Path("meshnet-data"), help="its SQLite database here"
    )
    p.add_argument(
        "--model",
        action="append",
        help="a GGUF file, or hf:ORG/REPO[:QUANT], hf:ORG/REPO/FILE, an https:// URL, to serve "
        "(repeatable: each is served, routed by the requests' model; the first is the "
        "sessions' default; default: the bundled model). A reference is read once as a "
        "stream: the tracker keeps its header and the manifest of its tensors' hashes",
    )
    p.add_argument(
        "--mesh-secret-file",
        type=Path,
        help="the mesh secret nodes' keys derive from (default: DATA_DIR/mesh.secret, made once)",
    )
    add_options(p, declare_tracker_options, "tracker options (also taken by `meshnet up`)")
    add_options(p, declare_kv_pace, "KV transfers (also taken by `meshnet up`)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not 0.0 <= args.verify_rate <= 1.0:
        raise SystemExit(f"--verify-rate is a share of chunks, 0 to 1, not {args.verify_rate}")
    try:
        trusted = trusted_ids(args.trusted_node or ())
    except ValueError as e:
        raise SystemExit(f"--trusted-node: {e}") from None
    return serve(
        TrackerProcessConfig(
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            database=args.database,
            model_path=args.model[0] if args.model else None,
            more_models=tuple(args.model[1:]) if args.model else (),
            mesh_secret_file=args.mesh_secret_file,
            verify_rate=args.verify_rate,
            trusted_nodes=trusted,
            kv_pace=kv_pace(args),
            placement_lease_s=args.placement_lease,
            tracker=TrackerConfig(
                heartbeat_timeout_s=args.heartbeat_timeout,
                replicas=args.replicas,
                admission=AdmissionConfig(
                    max_in_flight=args.max_in_flight,
                    max_queued=args.max_queued,
                    queue_wait_s=args.queue_wait,
                    route_wait_s=args.route_wait,
                ),
                prefix=PrefixRouting(on=args.prefix_routing, load_tokens=args.prefix_load_tokens),
            ),
            driver=DriverLimits(
                step_timeout_s=args.step_timeout,
                generation_timeout_s=args.generation_timeout,
                max_recoveries=args.max_recoveries,
                route_wait_s=args.route_wait,
                relay=args.relay,
                autorun=args.autorun,
            ),
            outbox=OutboxConfig(
                lease_s=args.turn_lease,
                max_attempts=args.turn_attempts,
                max_wait_s=args.turn_max_wait,
            ),
            policy=SessionPolicy(
                park_after_s=args.park_after,
                evict_after_s=args.evict_after,
                pressure=args.kv_pressure,
                interval_s=args.policy_interval,
            ),
            retention=RetentionPolicy(
                sessions_s=args.keep_sessions,
                ledger_s=args.keep_ledger,
                dead_nodes_s=args.keep_dead_nodes,
                orphans_s=args.keep_orphans,
                interval_s=args.retention_interval,
            ),
        )
    )
