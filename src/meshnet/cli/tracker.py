"""``meshnet tracker``: the registry, route driver and OpenAI-compatible API."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshnet.tracker.driver import DriverLimits
from meshnet.tracker.main import TrackerProcessConfig, serve
from meshnet.tracker.outbox import OutboxConfig
from meshnet.tracker.service import TrackerConfig
from meshnet.tracker.sessions import SessionPolicy


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("tracker", help="run the tracker and its HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--data-dir", type=Path, default=Path("meshnet-data"), help="snapshots here")
    p.add_argument(
        "--database",
        help="postgresql://... to share state with other trackers (default: DATA_DIR/tracker.db)",
    )
    p.add_argument("--model", help="GGUF file (default: the bundled model)")
    p.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=3.0,
        help="seconds of silence before a node is marked down",
    )
    p.add_argument("--step-timeout", type=float, default=30.0, help="seconds per shard step")
    p.add_argument(
        "--generation-timeout", type=float, default=600.0, help="seconds one generation may run"
    )
    p.add_argument("--max-recoveries", type=int, default=8, help="failovers per generation")
    p.add_argument(
        "--no-relay",
        dest="relay",
        action="store_false",
        help="carry every hop's activations through the tracker instead of node to node",
    )
    p.add_argument("--max-in-flight", type=int, default=64, help="generations at once")
    p.add_argument("--park-after", type=float, default=300.0, help="idle seconds; 0: never")
    p.add_argument("--evict-after", type=float, default=1800.0, help="parked seconds; 0: never")
    p.add_argument(
        "--kv-pressure", type=float, default=0.9, help="share of a node's KV budget that parks"
    )
    p.add_argument("--policy-interval", type=float, default=5.0, help="seconds between passes")
    p.add_argument("--turn-lease", type=float, default=15.0, help="seconds a claimed turn is held")
    p.add_argument("--turn-attempts", type=int, default=6, help="deliveries before a turn fails")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    return serve(
        TrackerProcessConfig(
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            database=args.database,
            model_path=args.model,
            tracker=TrackerConfig(
                heartbeat_timeout_s=args.heartbeat_timeout, max_in_flight=args.max_in_flight
            ),
            driver=DriverLimits(
                step_timeout_s=args.step_timeout,
                generation_timeout_s=args.generation_timeout,
                max_recoveries=args.max_recoveries,
                relay=args.relay,
            ),
            outbox=OutboxConfig(lease_s=args.turn_lease, max_attempts=args.turn_attempts),
            policy=SessionPolicy(
                park_after_s=args.park_after,
                evict_after_s=args.evict_after,
                pressure=args.kv_pressure,
                interval_s=args.policy_interval,
            ),
        )
    )
