"""The ``meshnet`` command: one subcommand per role or tool."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from importlib import metadata

from meshnet.cli import bench, chat, credentials, doctor, generate, mesh_admin, node, tracker, up
from meshnet.errors import MeshnetError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshnet", description="Run one GGUF model split by layer ranges."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, bench, node, doctor, tracker, up, chat, credentials, mesh_admin):
        command.add_parser(sub)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--version", action="version", version=f"meshnet {version()}")
    return parser


def version() -> str:
    """The installed package's version (its metadata), or ``unknown`` when not installed."""
    try:
        return metadata.version("meshnet")
    except metadata.PackageNotFoundError:
        return "unknown"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s",
    )
    try:
        return int(args.run(args))
    except MeshnetError as e:
        print(f"meshnet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
