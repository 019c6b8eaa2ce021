"""The ``meshnet`` command: one subcommand per role or tool."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from meshnet.cli import bench, generate
from meshnet.errors import MeshnetError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="meshnet", description="Run one GGUF model split by layer ranges."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    generate.add_parser(sub)
    bench.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args))
    except MeshnetError as e:
        print(f"meshnet: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
