"""``meshnet credentials``: what an operator hands out — a node's key, the user credentials."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from meshnet.auth.credentials import ensure_user_credentials
from meshnet.auth.keys import ensure_mesh_secret, node_key, read_secret_file


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("credentials", help="print a node's key or the API credentials")
    p.add_argument("--data-dir", type=Path, default=Path("meshnet-data"), help="the tracker's")
    p.add_argument("--mesh-secret-file", type=Path, help="default: DATA_DIR/mesh.secret")
    what = p.add_subparsers(dest="what", required=True)
    key = what.add_parser("node-key", help="the key of one node id (give it to that node only)")
    key.add_argument("node_id")
    what.add_parser("user", help="the API key and admin token of DATA_DIR/credentials.json")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.what == "node-key":
        secret = (
            read_secret_file(args.mesh_secret_file, "the mesh secret")
            if args.mesh_secret_file
            else ensure_mesh_secret(args.data_dir)
        )
        print(node_key(secret, args.node_id))
    else:
        print(json.dumps(asdict(ensure_user_credentials(args.data_dir)), indent=2))
    return 0
