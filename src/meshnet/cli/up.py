"""``meshnet up``: a whole local mesh (tracker + nodes) in one command.

It takes the node options of ``meshnet node`` and the tracker options of
``meshnet tracker`` (declared once, in ``cli.options``) and passes the ones
given on to every node and to the tracker. Each node's kernel threads are
``--threads`` when given, else its share of the cores available to ``up``.

Once the mesh serves, ``up`` supervises it (``meshnet.supervisor``): a process
that dies is logged and started again with backoff while the rest keeps
serving; only Ctrl-C or SIGTERM stops them all.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from meshnet.auth.credentials import CREDENTIALS_FILE
from meshnet.cli.model_ref import MODEL_HELP, header_info
from meshnet.cli.options import (
    add_options,
    declare_kv_pace,
    declare_node_options,
    declare_tracker_options,
    given_argv,
    positive_duration,
    positive_int,
)
from meshnet.cli.table import size
from meshnet.client import stream_chat
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh, parse_layout, split_threads
from meshnet.model.layer_bytes import LayerBytes, model_layer_bytes
from meshnet.node.main import available_cores
from meshnet.supervisor import Backoff, Child, Supervisor


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("up", help="start a tracker and nodes on this machine")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument(
        "--nodes", type=positive_int, default=3, help="nodes, layers split by their bytes"
    )
    shape.add_argument("--layout", help='e.g. "0:10,10:20,20:30" ("empty" for an empty node)')
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--data-dir", type=Path, help="default: a new temporary directory")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--once", metavar="MESSAGE", help="send one chat, print it, and stop")
    p.add_argument(
        "--restart-max",
        type=positive_duration,
        default=30.0,
        help="longest wait before a process that keeps dying is started again "
        "(the first is 0.5 s, doubling)",
    )
    add_options(
        p,
        declare_node_options,
        "node options",
        "passed to every node; the mesh's own heartbeat is 0.5 s",
        given_only=True,
    )
    add_options(
        p,
        declare_kv_pace,
        "KV transfers",
        "passed to the tracker and every node",
        given_only=True,
    )
    add_options(
        p,
        declare_tracker_options,
        "tracker options",
        "passed to the tracker; the mesh's own heartbeat timeout is 2 s",
        given_only=True,
    )
    p.set_defaults(run=run)


def node_threads(args: argparse.Namespace, nodes: int) -> list[int]:
    """Each node's kernel threads: ``--threads`` for all when given, else the cores
    available to this process split among the nodes (at least one each)."""
    given = getattr(args, "threads", None)
    return [given] * nodes if given else split_threads(available_cores(), nodes)


def local_mesh(args: argparse.Namespace, data_dir: Path) -> LocalMesh:
    """The mesh ``args`` describe, with the node and tracker options it was given."""
    return LocalMesh(
        data_dir=data_dir,
        port=args.port,
        model=args.model,
        node_args=[
            *given_argv(declare_node_options, args, skip={"threads"}),
            *given_argv(declare_kv_pace, args),
        ],
        tracker_args=[
            *given_argv(declare_tracker_options, args),
            *given_argv(declare_kv_pace, args),
        ],
    )


def plan_layout(args: argparse.Namespace, sizes: LayerBytes) -> list[LayerRange | None]:
    """The nodes' ranges: ``--layout`` as given, else ``--nodes`` ranges whose largest
    holds the fewest bytes (``LayerBytes.split``). ``LayerRangeError`` for a range
    outside the model or more nodes than layers."""
    if not args.layout:
        return list(sizes.split(args.nodes))
    layout = parse_layout(args.layout)
    for layers in layout:
        if layers is not None:
            layers.check_within(sizes.n_layers)
    return layout


def layout_lines(layout: list[LayerRange | None], sizes: LayerBytes) -> list[str]:
    """One line per node: its range, the bytes it holds and its KV per token."""
    lines: list[str] = []
    for i, layers in enumerate(layout):
        if layers is None:
            lines.append(f"  node-{i}: empty")
            continue
        held, kv = sizes.range_bytes(layers), sizes.kv_bytes_per_token(layers)
        lines.append(f"  node-{i}: layers {layers} {size(held)}, KV {size(kv)} per token")
    return lines


def run(args: argparse.Namespace) -> int:
    info = header_info(args.model, "up")
    sizes = model_layer_bytes(info.file, info.spec)
    layout = plan_layout(args, sizes)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="meshnet-"))
    mesh = local_mesh(args, data_dir)
    threads = node_threads(args, len(layout))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    try:
        print(
            f"starting tracker and {len(layout)} nodes, kernel threads {threads} "
            f"(logs in {data_dir}/logs)",
            file=sys.stderr,
        )
        print("\n".join(layout_lines(layout, sizes)), file=sys.stderr)
        mesh.start(layout, threads=threads)
        print(f"meshnet API at {mesh.url}/v1", flush=True)
        print(f"credentials (API key, admin token) in {data_dir / CREDENTIALS_FILE}", flush=True)
        if args.once is not None:
            print(f"> {args.once}")
            question = [{"role": "user", "content": args.once}]
            for piece in stream_chat(mesh.url, mesh.credentials.api_key, question):
                sys.stdout.write(piece)
                sys.stdout.flush()
            print()
            return 0
        supervisor = Supervisor(
            mesh_children(mesh, layout, threads), Backoff(max_s=args.restart_max)
        )
        supervisor.run(threading.Event())  # until a signal ends the process
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # let the shutdown finish
        mesh.stop()


@dataclass
class TrackerChild:
    """The mesh's tracker, for the supervisor."""

    mesh: LocalMesh
    name: str = "tracker"

    def poll(self) -> int | None:
        return self.mesh.tracker.poll() if self.mesh.tracker else None

    def start(self) -> None:
        self.mesh.start_tracker()


@dataclass
class NodeChild:
    """One of the mesh's nodes, started again as it was first (its id, layers, threads)."""

    mesh: LocalMesh
    name: str
    layers: LayerRange | None
    threads: int

    def poll(self) -> int | None:
        return self.mesh.nodes[self.name].poll()

    def start(self) -> None:
        self.mesh.start_node(self.name, self.layers, threads=self.threads)


def mesh_children(
    mesh: LocalMesh, layout: list[LayerRange | None], threads: list[int]
) -> list[Child]:
    """The processes ``mesh.start(layout, threads=threads)`` started: its tracker, and its
    nodes (in the order it started them) with the layers and threads each was given."""
    nodes = zip(list(mesh.nodes), layout, threads, strict=True)
    return [TrackerChild(mesh), *(NodeChild(mesh, *node) for node in nodes)]


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
