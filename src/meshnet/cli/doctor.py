"""``meshnet doctor``: check a node's setup, with the node's own flags, before it serves.

It takes every flag of ``meshnet node`` and runs the checks ``meshnet node``
runs at start (``meshnet.node.preflight``), printing one line per check with
the fix of each failure. Exit status 0 when every check passed, 1 otherwise;
nothing is loaded, registered or left listening.
"""

from __future__ import annotations

import argparse
import os

from meshnet.cli.node import add_node_flags, node_config
from meshnet.node.main import new_node_id
from meshnet.node.preflight import check_credential, check_node


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "doctor",
        help="check a node's setup (model, layers, addresses, tracker, disk, memory)",
        description="Takes the flags of `meshnet node`; prints ok or FAIL (and the fix) per "
        "check; exits 1 on any failure.",
    )
    add_node_flags(p)
    p.add_argument(
        "--check-timeout", type=float, default=3.0, help="seconds each network check may take"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    node_id = args.node_id or new_node_id()
    credential, key = check_credential(
        node_id, args.node_key_file, args.mesh_secret_file, os.environ
    )
    report = check_node(node_config(args, node_id, key), timeout_s=args.check_timeout)
    checks = [credential, *report.checks]
    for check in checks:
        print(check.line(), flush=True)
    failed = [c for c in checks if c.failed]
    print(f"{len(failed)} of {len(checks)} checks failed" if failed else "every check passed")
    return 1 if failed else 0
