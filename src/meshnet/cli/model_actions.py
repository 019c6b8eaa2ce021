"""``meshnet models serve | replace | release``: change what a running tracker serves.

- ``serve PATH`` — load the GGUF at PATH (as the tracker sees it; ``--node-path``
  as the nodes see it) on ``--nodes N`` empty nodes the tracker chooses, or on
  ``--placement node-1=0:15,node-2=15:30``; answers once its route is complete.
- ``replace NAME PATH`` — the same, then NAME drains (its running generations
  finish, ``--drain`` seconds at most) and its nodes are emptied; NAME leads to
  the new model from then on.
- ``release NAME`` — NAME takes no new request, drains, and its nodes are emptied.
- ``prune`` — on a node's machine: remove the shards of models by reference in the
  cache (``--model-cache``) that no node of the mesh serves now, and unfinished
  fetches (``--dry-run``: only list them).

Each prints the tracker's answer about the model (``--json``: as it came).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshnet.client import AdminClient
from meshnet.errors import MeshnetError, RequestError
from meshnet.layer_range import LayerRange
from meshnet.model_source.config import SourceConfig, default_cache_dir
from meshnet.model_source.inventory import prune

_LOAD_TIMEOUT_S = 900.0  # a serve answers once every node has loaded its range

AddCommon = Callable[..., None]
Runner = Callable[[Callable[[AdminClient, argparse.Namespace], tuple[dict[str, Any], str]]], Any]


def add_parsers(models: argparse.ArgumentParser, add_common: AddCommon, runner: Runner) -> None:
    """The subcommands of ``meshnet models`` (without one it lists the models)."""
    sub = models.add_subparsers(dest="action", metavar="{serve,replace,release,prune}")
    serve = sub.add_parser("serve", help="serve another model on empty nodes")
    serve.add_argument(
        "path", help="the GGUF file as the tracker sees it, or hf:ORG/REPO[:QUANT], a URL"
    )
    _placement_flags(serve)
    replace = sub.add_parser("replace", help="serve a model in place of NAME, then release NAME")
    replace.add_argument("name")
    replace.add_argument(
        "path", help="the new GGUF file as the tracker sees it, or hf:ORG/REPO[:QUANT], a URL"
    )
    _placement_flags(replace)
    _drain_flag(replace)
    release = sub.add_parser("release", help="stop serving NAME and empty its nodes")
    release.add_argument("name")
    _drain_flag(release)
    prune = sub.add_parser("prune", help="free the disk of shards no node serves now")
    prune.add_argument(
        "--model-cache", help="the nodes' cache (default: $MESHNET_CACHE, else ~/.cache/meshnet)"
    )
    prune.add_argument("--dry-run", action="store_true", help="list, remove nothing")
    acts = ((serve, serve_model), (replace, replace_model), (release, release_model))
    for p, act in (*acts, (prune, prune_shards)):
        add_common(p, inner=True)
        p.set_defaults(run=runner(act))


def _placement_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--node-path", help="the file as the nodes see it (default: PATH)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--nodes", type=int, help="empty nodes the tracker chooses (default 1)")
    where.add_argument(
        "--placement", type=_placement_arg, help="NODE=START:END,... covering every layer once"
    )


def _placement_arg(text: str) -> list[dict[str, Any]]:
    try:
        return parse_placement(text)
    except MeshnetError as e:
        raise argparse.ArgumentTypeError(e.message) from None


def _drain_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--drain", type=float, default=60.0, help="seconds running generations may take (60)"
    )


def parse_placement(text: str) -> list[dict[str, Any]]:
    """``"node-1=0:15,node-2=15:30"`` -> the API's placement; ``RequestError`` otherwise."""
    out: list[dict[str, Any]] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        node_id, sep, span = part.partition("=")
        if not sep or not node_id:
            raise RequestError(f"placement {part!r} is not NODE=START:END")
        layers = LayerRange.parse(span)
        out.append({"node_id": node_id, "layers": [layers.start, layers.end]})
    if not out:
        raise RequestError("the placement names no node")
    return out


def serve_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {"path": args.path}
    if args.node_path:
        body["node_path"] = args.node_path
    if args.placement:
        body["placement"] = args.placement
    elif args.nodes:
        body["nodes"] = args.nodes
    return body


def serve_model(admin: AdminClient, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    answer = admin.send("POST", "/admin/models", serve_body(args), _LOAD_TIMEOUT_S)
    return answer, describe(answer)


def replace_model(admin: AdminClient, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    body = {**serve_body(args), "drain_s": args.drain}
    answer = admin.send("POST", f"/admin/models/{args.name}/replace", body, _LOAD_TIMEOUT_S)
    old = answer["replaced"]
    return answer, f"{describe(answer['model'])}\n{old['name']}: {old['state']}, then released"


def release_model(admin: AdminClient, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    answer = admin.send("DELETE", f"/admin/models/{args.name}", drain_s=args.drain)
    return answer, f"{answer['name']}: {answer['state']}; its nodes are emptied once it drains"


def prune_shards(admin: AdminClient, args: argparse.Namespace) -> tuple[dict[str, Any], str]:
    """Remove the cache's shards that no node the tracker knows serves now."""
    cache = Path(args.model_cache) if args.model_cache else default_cache_dir()
    keep = {
        (n["fingerprint"], LayerRange(*n["layers"]))
        for n in admin.get("/admin/nodes").get("nodes", [])
        if n.get("layers") and n.get("fingerprint")
    }
    cfg = SourceConfig(cache_dir=cache)
    freed = sum(s.disk_bytes for s in prune(cfg, keep, dry_run=True))
    files = [str(s.path) for s in prune(cfg, keep, dry_run=args.dry_run)]
    verb = "would remove" if args.dry_run else "removed"
    lines = [f"{verb} {len(files)} file(s), {freed} bytes on disk, from {cache}"]
    lines += [f"  {f}" for f in files]
    return {"removed": files, "dry_run": args.dry_run, "freed_bytes": freed}, "\n".join(lines)


def describe(model: dict[str, Any]) -> str:
    """One line: the model, its state and its nodes with their layers."""
    nodes = ", ".join(f"{n['node_id']}[{n['layers'][0]}:{n['layers'][1]}]" for n in model["nodes"])
    route = "route complete" if model["complete"] else "no complete route"
    return f"{model['name']}: {model['state']}, {route}; {nodes or 'no nodes'}"
