"""Operator commands against a running tracker: ``meshnet nodes | sessions | ledger | billing |
models``, and ``meshnet nodes readmit NODE`` (a quarantined node calibrates again).

Each reads the tracker's admin endpoints with the admin token (``--admin-token``,
else ``$MESHNET_ADMIN_TOKEN``, else the ``admin_token`` of
``DATA_DIR/credentials.json``, as ``meshnet chat`` finds its API key) and prints
a table, or with ``--json`` the tracker's answers as they came.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

from meshnet.auth.credentials import CREDENTIALS_FILE, read_user_credentials
from meshnet.cli import model_actions
from meshnet.cli.table import age, render, size
from meshnet.client import AdminClient
from meshnet.errors import MeshnetError, Unauthenticated

ADMIN_TOKEN_ENV = "MESHNET_ADMIN_TOKEN"
Show = Callable[[AdminClient, argparse.Namespace], tuple[dict[str, Any], str]]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    for name, show, help in (
        ("nodes", show_nodes, "the nodes the tracker knows: state, layers, load"),
        ("sessions", show_sessions, "sessions by state and the generations running now"),
        ("ledger", show_ledger, "the work ledger: attempts and tokens per node"),
        ("billing", show_billing, "billable usage per tenant and earnings per node"),
        ("models", show_models, "the models served: layers, coverage, route"),
    ):
        p = sub.add_parser(name, help=f"{help} (admin token)")
        _add_common(p)
        if show is show_ledger:
            _add_ledger_flags(p)
        if show is show_sessions:
            _add_session_flags(p)
        p.set_defaults(run=_runner(show))
        if show is show_models:
            model_actions.add_parsers(p, _add_common, _runner)
        if show is show_nodes:
            actions = p.add_subparsers(dest="action", metavar="{readmit}")
            readmit = actions.add_parser(
                "readmit", help="try a quarantined node again: it calibrates before it is routed"
            )
            readmit.add_argument("node_id")
            _add_common(readmit, inner=True)
            readmit.set_defaults(run=_runner(readmit_node))


def _add_common(p: argparse.ArgumentParser, inner: bool = False) -> None:
    """The flags every command takes; ``inner``: a subcommand's copy, which leaves the
    value given before the subcommand as it was when not given again."""

    def default(value: object) -> object:
        return argparse.SUPPRESS if inner else value

    url = default("http://127.0.0.1:8000")
    p.add_argument("--url", default=url, help="the tracker's API address")
    p.add_argument(
        "--admin-token",
        default=default(None),
        help=f"the admin token (default: ${ADMIN_TOKEN_ENV}, else DATA_DIR/credentials.json)",
    )
    data_dir = default(Path("meshnet-data"))
    p.add_argument("--data-dir", type=Path, default=data_dir, help="the tracker's")
    answer = default(False)
    p.add_argument(
        "--json", action="store_true", default=answer, help="print the tracker's JSON answer"
    )


def _add_ledger_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--records", action="store_true", help="list the attempts, not only totals")
    p.add_argument("--node", help="only this node's attempts (with --records)")
    p.add_argument("--generation", help="only this generation's (session's) attempts")
    p.add_argument("--limit", type=int, default=100, help="attempts listed, oldest first")


def _add_session_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--state", action="append", default=[], help="list sessions in this state")
    p.add_argument("--model", help="list sessions on this model")
    p.add_argument("--tenant", help="list sessions this tenant owns")
    p.add_argument("--limit", type=int, default=20, help="sessions listed at most (20)")


def admin_token(args: argparse.Namespace, env: Mapping[str, str]) -> str:
    """The admin token from the flag, the environment or the data dir's credentials."""
    if args.admin_token:
        return str(args.admin_token)
    if env.get(ADMIN_TOKEN_ENV):
        return env[ADMIN_TOKEN_ENV]
    try:
        return read_user_credentials(args.data_dir / CREDENTIALS_FILE).admin_token
    except MeshnetError as e:
        raise Unauthenticated(
            f"this command needs the admin token: --admin-token, ${ADMIN_TOKEN_ENV} or "
            f"--data-dir with the tracker's {CREDENTIALS_FILE} ({e.message})"
        ) from None


def _runner(show: Show) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        with AdminClient(args.url, admin_token(args, os.environ)) as admin:
            answer, table = show(admin, args)
        print(json.dumps(answer, indent=2) if args.json else table)
        return 0

    return run


def show_nodes(admin: AdminClient, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    answer = admin.get("/admin/nodes")
    now = time.time()
    rows = [
        [
            n["node_id"],
            n["state"] + (f" ({n['down_reason']})" if n.get("down_reason") else ""),
            _layers(n.get("layers")),
            n["address"],
            n.get("backend"),
            n["load"].get("sessions"),
            size(n["load"].get("kv_bytes")),
            n["load"].get("queue_depth"),
            n["load"].get("tokens_per_s"),
            age(now - n["last_seen"]) if n.get("last_seen") else None,
            (n.get("fingerprint") or "")[:12] or None,
        ]
        for n in answer["nodes"]
    ]
    headers = ["NODE", "STATE", "LAYERS", "ADDRESS", "BACKEND", "SESSIONS", "KV", "QUEUE"]
    headers += ["TOK/S", "SEEN", "MODEL SHA256"]
    return answer, render(headers, rows)


def readmit_node(admin: AdminClient, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    answer = admin.send("POST", f"/admin/nodes/{quote(args.node_id, safe='')}/readmit")
    return answer, f"node {answer['node_id']} is {answer['state']}"


def show_sessions(admin: AdminClient, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    counts = admin.get("/admin/dashboard").get("sessions") or {}
    running = admin.get("/admin/generations")["generations"]
    answer = {"sessions": counts, "generations": running}
    by_state = render(["STATE", "SESSIONS"], [[s, n] for s, n in counts.items()])
    rows = [
        [g["id"], g["epoch"], " ".join(_hop(h) for h in g["route"]), g["recoveries"]]
        for g in running
    ]
    generations = render(["GENERATION", "EPOCH", "ROUTE", "RECOVERIES"], rows)
    listed = _listed_sessions(admin, args)
    answer["listed"] = listed
    table = render(
        ["SESSION", "STATE", "MODEL", "TENANT", "TOKENS", "TURNS"],
        [[s["id"], s["state"], s["model"], s["tenant"], s["tokens"], s["turns"]] for s in listed],
    )
    return answer, f"{by_state}\n\nrunning now:\n{generations}\n\nsessions:\n{table}"


def _listed_sessions(admin: AdminClient, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Up to ``--limit`` sessions matching the filters, a page at a time."""
    wanted = {"state": ",".join(args.state), "model": args.model, "tenant": args.tenant}
    filters = {k: v for k, v in wanted.items() if v}
    listed: list[dict[str, Any]] = []
    after = ""
    while len(listed) < args.limit:
        page = min(500, args.limit - len(listed))
        answer = admin.get("/admin/sessions", **filters, after=after, limit=page)
        listed += answer["sessions"]
        if answer["next"] is None:
            break
        after = answer["next"]
    return listed[: args.limit]


def show_ledger(admin: AdminClient, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    params: dict[str, str | int] = {"limit": args.limit}
    if args.node:
        params["node_id"] = args.node
    if args.generation:
        params["generation_id"] = args.generation
    answer = admin.get("/admin/ledger", **params)
    totals = [_node_totals(node, t) for node, t in answer["totals"].items()]
    headers = ["NODE", *(s.upper() for s in _STATUSES), "TOKENS", "BILLABLE LAYER-TOKENS"]
    table = render(headers, totals)
    if args.records:
        rows = [_record(r) for r in answer["records"]]
        headers = ["GENERATION", "EPOCH", "NODE", "LAYERS", "TOKENS", "STATUS", "KIND"]
        table += "\n\n" + render(headers, rows)
    return answer, table


_STATUSES = ("completed", "verified", "unverified", "rejected", "failed", "cancelled")


def show_billing(admin: AdminClient, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    answer = admin.get("/admin/billing")
    amounts = ["BILLABLE TOKENS", "BILLABLE LAYER-TOKENS", "UNVERIFIED", "REJECTED"]
    keys = ["billable_tokens", "billable_layer_tokens"]
    keys += ["unverified_layer_tokens", "rejected_layer_tokens"]
    tenants = [
        [t["tenant"], t["billable_generations"], *(t[k] for k in keys)] for t in answer["tenants"]
    ]
    nodes = [[n["node_id"], n["billable_attempts"], *(n[k] for k in keys)] for n in answer["nodes"]]
    table = render(["TENANT", "GENERATIONS", *amounts], tenants)
    table += "\n\n" + render(["NODE", "ATTEMPTS", *amounts], nodes)
    return answer, table


def _node_totals(node: str, t: Mapping[str, int]) -> list[object]:
    attempts = [t.get(f"{s}_attempts", 0) for s in _STATUSES]
    return [node, *attempts, t.get("completed_tokens", 0), t.get("billable_layer_tokens", 0)]


def _record(r: Mapping[str, Any]) -> list[object]:
    layers = _layers([r["layer_start"], r["layer_end"]])
    tokens = f"{r['token_start']}:{r['token_end']}"
    kind = r.get("kind") or None
    return [r["generation_id"], r["epoch"], r["node_id"], layers, tokens, r["status"], kind]


def show_models(admin: AdminClient, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    models = admin.get("/admin/dashboard").get("models") or []
    states = {m["name"]: m["state"] for m in admin.get("/admin/models").get("models", [])}
    rows = [
        [
            m["name"],
            m["n_layers"],
            min(m["replicas"], default=0),
            "complete" if m.get("route") else f"none: {m.get('reason')}",
            m["fingerprint"][:12],
            states.get(m["name"], "serving"),
        ]
        for m in models
    ]
    headers = ["MODEL", "LAYERS", "MIN REPLICAS", "ROUTE", "SHA256", "STATE"]
    held = admin.get("/admin/inventory").get("nodes") or []
    held_rows = [
        [n["node_id"], s["model"] or s["fingerprint"][:12], _layers(s["layers"]), size(s["bytes"])]
        for n in held
        for s in n["shards"]
    ]
    table = render(headers, rows)
    if held_rows:
        table += "\n\nheld on disk (models by reference):\n"
        table += render(["NODE", "MODEL", "LAYERS", "DISK"], held_rows)
    return {"models": models, "inventory": held}, table


def _layers(span: list[int] | None) -> str:
    return f"{span[0]}:{span[1]}" if span else "empty"


def _hop(hop: Mapping[str, Any]) -> str:
    return f"{hop['node_id']}[{_layers(hop.get('layers'))}]"
