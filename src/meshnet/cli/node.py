"""``meshnet node``: serve one layer range (or start empty) and join a tracker."""

from __future__ import annotations

import argparse
import os

from meshnet.auth.credentials import MESH_SECRET_ENV, NODE_KEY_ENV, node_credential
from meshnet.cli.options import add_options, declare_node_options
from meshnet.layer_range import LayerRange
from meshnet.node.engine import EngineConfig
from meshnet.node.main import NodeConfig, new_node_id, serve


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("node", help="serve a layer range of the model over gRPC")
    p.add_argument("--tracker", required=True, help="tracker URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--listen", default="127.0.0.1:0", help="gRPC HOST:PORT (port 0: any free)")
    p.add_argument("--advertise-host", help="host the tracker should dial (default: listen host)")
    p.add_argument(
        "--advertise-port", type=int, help="port the tracker should dial (behind NAT or a proxy)"
    )
    p.add_argument("--model", help="GGUF file (default: the bundled model)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--layers", type=LayerRange.parse, help="START:END, half-open")
    group.add_argument("--empty", action="store_true", help="load nothing; wait for Configure")
    p.add_argument("--node-id", default=None, help="name on the mesh (default: random)")
    p.add_argument("--park-dir", help="where parked KV is kept (default: a temp directory)")
    p.add_argument(
        "--model-dir",
        action="append",
        default=[],
        help="a directory the tracker may load models from (repeatable; --model's is included)",
    )
    p.add_argument(
        "--node-key-file",
        help=f"this node's credential (or ${NODE_KEY_ENV}; `meshnet credentials node-key`)",
    )
    p.add_argument(
        "--mesh-secret-file",
        help=f"derive the credential from the mesh secret (or ${MESH_SECRET_ENV})",
    )
    add_options(p, declare_node_options, "node options (also taken by `meshnet up`)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    node_id = args.node_id or new_node_id()
    key = node_credential(node_id, args.node_key_file, args.mesh_secret_file, os.environ)
    return serve(
        NodeConfig(
            tracker_url=args.tracker,
            listen=args.listen,
            model_path=args.model,
            layers=None if args.empty else args.layers,
            node_id=node_id,
            node_key=key,
            model_dirs=tuple(args.model_dir),
            advertise_host=args.advertise_host,
            advertise_port=args.advertise_port,
            heartbeat_s=args.heartbeat,
            threads=args.threads,
            engine=EngineConfig(
                kv_budget_bytes=int(args.kv_budget_mb * 1024 * 1024),
                max_batch_tokens=args.max_batch_tokens,
                prefill_chunk=args.prefill_chunk,
                max_queued_steps=args.max_queued_steps,
                max_streams=args.max_streams,
                backend=args.backend,
                park_dir=args.park_dir,
            ),
        )
    )
