"""The ``meshnet`` command: one subcommand per role or tool.

A process imports only the module of the command it runs: a node never imports the
tracker's HTTP stack, nor the tracker a node's kernels (a process starts in about a
third less CPU time). Help, and a command line naming no known command, build the
whole parser.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import sys
from collections.abc import Sequence
from importlib import metadata

from meshnet.errors import MeshnetError

# meshnet.cli modules in the order their commands are listed by ``meshnet --help``.
MODULES: tuple[str, ...] = (
    *("generate", "bench", "node", "doctor", "tracker", "up", "chat", "credentials"),
    "mesh_admin",
)
# Each command -> the meshnet.cli module that declares it (mesh_admin declares several).
COMMANDS = {name: name for name in MODULES if name != "mesh_admin"}
COMMANDS |= {name: "mesh_admin" for name in ("nodes", "sessions", "ledger", "billing", "models")}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command, or of ``command`` alone when it is a known one."""
    parser = argparse.ArgumentParser(
        prog="meshnet", description="Run one GGUF model split by layer ranges."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in (COMMANDS[command],) if command in COMMANDS else MODULES:
        importlib.import_module(f"meshnet.cli.{name}").add_parser(sub)
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING, ERROR")
    parser.add_argument("--version", action="version", version=f"meshnet {version()}")
    return parser


def version() -> str:
    """The installed package's version (its metadata), or ``unknown`` when not installed."""
    try:
        return metadata.version("meshnet")
    except metadata.PackageNotFoundError:
        return "unknown"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``argv`` parsed by its own command's parser alone. A command line that parser
    refuses is parsed again by the whole one, so the error and its usage read as they
    always did (every command listed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit as e:
        if e.code in (0, None):  # --help or --version: printed on stdout already
            raise
    return build_parser().parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
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
