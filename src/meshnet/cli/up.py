"""``meshnet up``: a whole local mesh (tracker + nodes) in one command."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import threading
from pathlib import Path

from meshnet.client import stream_chat
from meshnet.local_mesh import LocalMesh, even_layout, parse_layout
from meshnet.model.info import load_model_info


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("up", help="start a tracker and nodes on this machine")
    shape = p.add_mutually_exclusive_group()
    shape.add_argument("--nodes", type=int, default=3, help="nodes, layers split evenly")
    shape.add_argument("--layout", help='e.g. "0:10,10:20,20:30" ("empty" for an empty node)')
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--data-dir", type=Path, help="default: a new temporary directory")
    p.add_argument("--model", help="GGUF file (default: the bundled model)")
    p.add_argument("--once", metavar="MESSAGE", help="send one chat, print it, and stop")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = load_model_info(args.model).spec
    layout = parse_layout(args.layout) if args.layout else even_layout(spec.n_layers, args.nodes)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="meshnet-"))
    mesh = LocalMesh(data_dir=data_dir, port=args.port, model=args.model)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_on_signal)
    try:
        print(
            f"starting tracker and {len(layout)} nodes (logs in {data_dir}/logs)", file=sys.stderr
        )
        mesh.start(layout)
        print(f"meshnet API at {mesh.url}/v1", flush=True)
        if args.once is not None:
            print(f"> {args.once}")
            for piece in stream_chat(mesh.url, [{"role": "user", "content": args.once}]):
                sys.stdout.write(piece)
                sys.stdout.flush()
            print()
            return 0
        threading.Event().wait()  # until a signal ends the process
        return 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)  # let the shutdown finish
        mesh.stop()


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
