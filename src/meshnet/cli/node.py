"""``meshnet node``: serve one layer range (or start empty) and join a tracker.

Before it loads anything the node runs the checks of ``meshnet doctor``
(``meshnet.node.preflight``) and refuses to start on a failed check of its own
setup.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from meshnet.cli.options import (
    add_options,
    declare_kv_pace,
    declare_node_options,
    declare_node_setup,
    kv_pace,
)
from meshnet.model_source.config import SourceConfig, default_cache_dir
from meshnet.node.engine_types import EngineConfig
from meshnet.node.main import new_node_id, serve
from meshnet.node.model_fetch import progress_wanted
from meshnet.node.node_config import NodeConfig
from meshnet.node.preflight import check_credential
from meshnet.node.relay_socket import RelayTimeouts
from meshnet.protocol.keepalive import Keepalive


def add_node_flags(p: argparse.ArgumentParser) -> None:
    """Every flag of ``meshnet node`` (``meshnet doctor`` takes the same)."""
    declare_node_setup(p)
    add_options(p, declare_node_options, "node options (also taken by `meshnet up`)")
    add_options(p, declare_kv_pace, "KV transfers (also taken by `meshnet up`)")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("node", help="serve a layer range of the model over gRPC")
    add_node_flags(p)
    p.set_defaults(run=run)


def node_config(args: argparse.Namespace, node_id: str, key: str) -> NodeConfig:
    """The ``NodeConfig`` the parsed node flags describe, as ``node_id`` with ``key``."""
    return NodeConfig(
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
        metrics_port=args.metrics_port,
        relay_port=args.relay_port,
        head_assist=args.head_assist == "on",
        source=SourceConfig(
            cache_dir=Path(args.model_cache) if args.model_cache else default_cache_dir(),
            client=node_id,
            progress=progress_wanted(),
        ),
        kv_pace=kv_pace(args),
        memory_cap_bytes=int(max(args.memory_mb, 0.0) * 1024 * 1024),
        relay_timeouts=RelayTimeouts(
            idle_s=args.relay_idle_timeout,
            frame_s=args.relay_frame_timeout,
            keepalive=Keepalive(args.keepalive, args.keepalive / 2),
        ),
        engine=EngineConfig(
            kv_budget_bytes=int(args.kv_budget_mb * 1024 * 1024),
            max_batch_tokens=args.max_batch_tokens,
            prefill_chunk=args.prefill_chunk,
            max_queued_steps=args.max_queued_steps,
            max_streams=args.max_streams,
            backend=args.backend,
            park_dir=args.park_dir,
            ctx=max(0, args.ctx),
            drain_timeout_s=args.drain_timeout,
            prefix_cache_bytes=int(max(args.prefix_cache_mb, 0.0) * 1024 * 1024),
        ),
    )


def run(args: argparse.Namespace) -> int:
    node_id = args.node_id or new_node_id()
    credential, key = check_credential(
        node_id, args.node_key_file, args.mesh_secret_file, os.environ
    )
    if credential.failed:
        print(credential.line(), file=sys.stderr)
        return 2
    return serve(node_config(args, node_id, key))
