"""``meshnet bench``: engine throughput against llama.cpp, measured in the same run;
with ``--route``, a route benchmark run by a tracker and recorded in its database.

The two sides take turns, one round each at a time, and each figure is the
fastest of its rounds: on a shared machine the neighbours' load drifts, and
alternating gives both sides the same drift to live with. A route benchmark
(``POST /admin/benchmarks``, docs/routes.md) times each route on the tracker
itself, one generation at a time, and checks its tokens against the unpinned run.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import httpx

from meshnet.backends.kernel_threads import set_threads
from meshnet.backends.shard import BACKENDS, DEFAULT_BACKEND
from meshnet.benchmark.engine import backend_text, bench_engine, warm_up
from meshnet.benchmark.figures import Throughput
from meshnet.benchmark.llamacpp import bench_llamacpp, find_llamacpp, peer_isa, peer_text
from meshnet.cli.mesh_admin import ADMIN_TOKEN_ENV, admin_token
from meshnet.cli.model_ref import MODEL_HELP, whole_model
from meshnet.cli.options import BACKEND_HELP, positive_duration, positive_int
from meshnet.engine.local import load_local_model
from meshnet.errors import MeshnetError, error_for_kind

DEFAULT_PROMPT = "The capital of France is"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "bench",
        help="prefill and decode throughput, with llama.cpp ratios; "
        "with --route, a tracker's route benchmark",
    )
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS, help=BACKEND_HELP)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument(
        "--decode-tokens", type=positive_int, default=32, help="also a route's max_tokens"
    )
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated")
    p.add_argument(
        "--at-depth",
        action="store_true",
        help="also decode one sequence after the prompt (llama.cpp: llama-bench -d)",
    )
    p.add_argument("--threads", type=int, default=2, help="threads for both sides")
    p.add_argument(
        "--rounds", type=positive_int, default=5, help="rounds per side (per route), in turns"
    )
    p.add_argument("--llamacpp", help="directory with llama-bench (default: found or skipped)")
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    p.add_argument(
        "--peer-kv",
        choices=("f16", "f32"),
        default="f16",
        help="llama.cpp's KV cache type (default f16, its own default; q8-kv16 holds f16, "
        "the other backends f32)",
    )
    p.add_argument("--json", action="store_true")
    routes = p.add_argument_group("route benchmark (run by a tracker, recorded there)")
    routes.add_argument(
        "--route",
        action="append",
        type=_route,
        help="node ids in order, comma-separated (e.g. node-0,node-1); repeat for each route",
    )
    routes.add_argument("--url", default="http://127.0.0.1:8000", help="the tracker's API")
    routes.add_argument(
        "--admin-token",
        help=f"default: ${ADMIN_TOKEN_ENV}, else DATA_DIR/credentials.json",
    )
    routes.add_argument("--data-dir", type=Path, default=Path("meshnet-data"), help="the tracker's")
    routes.add_argument("--prompt", default=DEFAULT_PROMPT, help="raw text, no chat template")
    routes.add_argument(
        "--timeout", type=positive_duration, default=900.0, help="how long to wait for the run"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.route:
        return run_routes(args)
    batches = [int(b) for b in args.batches.split(",") if b]
    set_threads(args.threads)
    model = load_local_model(whole_model(args.model), backend=args.backend)
    bin_dir = None if args.no_peer else find_llamacpp(args.llamacpp)
    warm_up(model)
    our_rounds: list[Throughput] = []
    peer_rounds: list[Throughput] = []
    for _ in range(args.rounds):
        our_rounds.append(
            bench_engine(model, args.prompt_tokens, args.decode_tokens, batches, args.at_depth)
        )
        if bin_dir is not None:
            peer_rounds.append(
                bench_llamacpp(
                    bin_dir,
                    model.file.path,
                    args.prompt_tokens,
                    args.decode_tokens,
                    batches,
                    args.threads,
                    args.at_depth,
                    args.peer_kv,
                )
            )
    ours = Throughput.best(our_rounds)
    peer = Throughput.best(peer_rounds) if peer_rounds else None
    rows = _rows(args.prompt_tokens, ours, peer)
    backend = backend_text(args.backend)
    isa = peer_isa(bin_dir) if bin_dir is not None else None
    if args.json:
        report = {
            "backend": backend,
            "threads": args.threads,
            "llamacpp_isa": isa,
            "llamacpp_kv": args.peer_kv,
            "rows": rows,
        }
        print(json.dumps(report))
        return 0
    print(f"backend {backend}, {args.threads} threads on each side")
    if bin_dir is not None:
        print(f"{peer_text(bin_dir)}; its KV cache {args.peer_kv}")
    print(f"{'figure':<22}{'meshnet':>12}{'llama.cpp':>12}{'ratio':>8}")
    for r in rows:
        theirs = f"{r['llamacpp']:.1f}" if r["llamacpp"] else "-"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        print(f"{r['figure']:<22}{r['meshnet']:>12.1f}{theirs:>12}{ratio:>8}")
    if peer is None:
        print("llama.cpp not found: run bench/build_llamacpp.sh for the ratios")
    return 0


def _rows(prompt_tokens: int, ours: Throughput, peer: Throughput | None) -> list[dict[str, Any]]:
    figures = [
        (f"prefill {prompt_tokens} tok/s", ours.prefill_tok_s, peer.prefill_tok_s if peer else None)
    ]
    for b, v in ours.decode_tok_s.items():
        figures.append((f"decode b={b} tok/s", v, peer.decode_tok_s.get(b) if peer else None))
    if ours.deep_decode_tok_s is not None:
        theirs = peer.deep_decode_tok_s if peer else None
        figures.append((f"decode @{prompt_tokens} tok/s", ours.deep_decode_tok_s, theirs))
    return [
        {
            "figure": name,
            "meshnet": ours,
            "llamacpp": theirs,
            "ratio": ours / theirs if theirs else None,
        }
        for name, ours, theirs in figures
    ]


def _route(text: str) -> list[str]:
    """An argparse type: ``node-a,node-b`` -> the node ids, in order."""
    ids = [part.strip() for part in text.split(",")]
    if not all(ids):
        raise argparse.ArgumentTypeError(f"not a list of node ids: {text!r}")
    return ids


def run_routes(args: argparse.Namespace) -> int:
    """Ask the tracker to benchmark ``--route``s; 0 when every route's output equals the
    unpinned run's, 1 when one differs."""
    token = admin_token(args, os.environ)
    body = {
        "routes": args.route,
        "prompt": args.prompt,
        "max_tokens": args.decode_tokens,
        "rounds": args.rounds,
    }
    try:
        r = httpx.post(
            f"{args.url}/admin/benchmarks",
            json=body,
            headers={"Authorization": f"Bearer {token}"},
            timeout=args.timeout,
        )
    except httpx.HTTPError as e:
        raise MeshnetError(f"the tracker at {args.url} did not answer: {e!r}") from None
    if r.status_code != 200:
        raise _api_error(r)
    report = r.json()
    if args.json:
        print(json.dumps(report))
    else:
        _print_routes(report)
    return 0 if all(f["output_equal"] for f in report["results"]) else 1


def _api_error(r: httpx.Response) -> MeshnetError:
    try:
        error = r.json()["error"]
        return error_for_kind(str(error["code"]), str(error["message"]))
    except (ValueError, KeyError, TypeError):
        return MeshnetError(f"the tracker answered {r.status_code}: {r.text[:200]}")


def _print_routes(report: dict[str, Any]) -> None:
    reference = report["reference"]
    nodes = ",".join(h["node_id"] for h in reference["route"])
    print(f"run {report['run_id']}: unpinned reference on {nodes}, {len(reference['ids'])} tokens")
    head = ("route", "ttft ms", "tok ms p50", "tok ms p90", "tok/s", "same output")
    print(f"{head[0]:<32}{head[1]:>10}{head[2]:>12}{head[3]:>12}{head[4]:>9}{head[5]:>13}")
    for f in report["results"]:
        route = ",".join(f"{h['node_id']}{h['layers']}" for h in f["route"]).replace(" ", "")
        cells = [_ms(f["ttft_ms"]), _ms(f["token_ms_median"]), _ms(f["token_ms_p90"])]
        tok_s = _ms(f["tokens_per_s"])
        same = "yes" if f["output_equal"] else "NO"
        print(f"{route:<32}{cells[0]:>10}{cells[1]:>12}{cells[2]:>12}{tok_s:>9}{same:>13}")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"
