"""``meshnet chat``: an interactive chat with a running mesh."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from meshnet.auth.credentials import CREDENTIALS_FILE, read_user_credentials
from meshnet.client import stream_chat

API_KEY_ENV = "MESHNET_API_KEY"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("chat", help="chat with a running mesh")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the tracker's API address")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"the tenant's API key (default: ${API_KEY_ENV}, else DATA_DIR/credentials.json)",
    )
    p.add_argument("--data-dir", type=Path, default=Path("meshnet-data"), help="the tracker's")
    p.add_argument("--message", help="send one message, print the answer, exit")
    p.add_argument("--system", help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not args.api_key:
        args.api_key = read_user_credentials(args.data_dir / CREDENTIALS_FILE).api_key
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    if args.message is not None:
        _turn(args, history, args.message)
        return 0
    print("meshnet chat: empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            return 0
        if not line.strip():
            return 0
        _turn(args, history, line)


def _turn(args: argparse.Namespace, history: list[dict[str, str]], text: str) -> None:
    history.append({"role": "user", "content": text})
    parts: list[str] = []
    pieces = stream_chat(
        args.url, args.api_key, history, args.max_tokens, args.temperature, args.seed
    )
    for piece in pieces:
        parts.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    print()
    history.append({"role": "assistant", "content": "".join(parts)})
