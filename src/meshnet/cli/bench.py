"""``meshnet bench``: engine throughput against llama.cpp, measured in the same run.

The two sides take turns, one round each at a time, and each figure is the
fastest of its rounds: on a shared machine the neighbours' load drifts, and
alternating gives both sides the same drift to live with.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from meshnet.backends.fast import set_threads
from meshnet.backends.quant import kernel_name
from meshnet.benchmark.engine import bench_engine, warm_up
from meshnet.benchmark.figures import Throughput
from meshnet.benchmark.llamacpp import bench_llamacpp, find_llamacpp, peer_isa
from meshnet.cli.options import positive_int
from meshnet.engine.local import load_local_model
from meshnet.model.shard import BACKENDS, DEFAULT_BACKEND


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("bench", help="prefill and decode throughput, with llama.cpp ratios")
    p.add_argument("--model", help="GGUF file (default: the bundled model)")
    p.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS)
    p.add_argument("--prompt-tokens", type=int, default=100)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes, comma-separated")
    p.add_argument("--threads", type=int, default=2, help="threads for both sides")
    p.add_argument("--rounds", type=positive_int, default=5, help="rounds per side, taken in turns")
    p.add_argument("--llamacpp", help="directory with llama-bench (default: found or skipped)")
    p.add_argument("--no-peer", action="store_true", help="skip llama.cpp")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    batches = [int(b) for b in args.batches.split(",") if b]
    set_threads(args.threads)
    model = load_local_model(args.model, backend=args.backend)
    bin_dir = None if args.no_peer else find_llamacpp(args.llamacpp)
    warm_up(model)
    our_rounds: list[Throughput] = []
    peer_rounds: list[Throughput] = []
    for _ in range(args.rounds):
        our_rounds.append(bench_engine(model, args.prompt_tokens, args.decode_tokens, batches))
        if bin_dir is not None:
            peer_rounds.append(
                bench_llamacpp(
                    bin_dir,
                    model.file.path,
                    args.prompt_tokens,
                    args.decode_tokens,
                    batches,
                    args.threads,
                )
            )
    ours = Throughput.best(our_rounds)
    peer = Throughput.best(peer_rounds) if peer_rounds else None
    rows = _rows(args.prompt_tokens, ours.prefill_tok_s, ours.decode_tok_s, peer)
    backend = args.backend + (f" ({kernel_name()} kernels)" if args.backend == "fast" else "")
    isa = peer_isa(bin_dir) if bin_dir is not None else None
    if args.json:
        report = {"backend": backend, "threads": args.threads, "llamacpp_isa": isa, "rows": rows}
        print(json.dumps(report))
        return 0
    print(f"backend {backend}, {args.threads} threads on each side")
    if bin_dir is not None:
        print(f"llama.cpp in {bin_dir}, built with {_isa_text(isa)}")
    print(f"{'figure':<22}{'meshnet':>12}{'llama.cpp':>12}{'ratio':>8}")
    for r in rows:
        theirs = f"{r['llamacpp']:.1f}" if r["llamacpp"] else "-"
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] else "-"
        print(f"{r['figure']:<22}{r['meshnet']:>12.1f}{theirs:>12}{ratio:>8}")
    if peer is None:
        print("llama.cpp not found: run bench/build_llamacpp.sh for the ratios")
    return 0


def _isa_text(isa: list[str] | None) -> str:
    if isa is None:
        return "unrecorded extensions (rerun bench/build_llamacpp.sh to record them)"
    return " ".join(isa) if isa else "no vector extensions"


def _rows(
    prompt_tokens: int, prefill: float, decode: dict[int, float], peer: Throughput | None
) -> list[dict[str, Any]]:
    figures = [(f"prefill {prompt_tokens} tok/s", prefill, peer.prefill_tok_s if peer else None)]
    for b, v in decode.items():
        figures.append((f"decode b={b} tok/s", v, peer.decode_tok_s.get(b) if peer else None))
    return [
        {
            "figure": name,
            "meshnet": ours,
            "llamacpp": theirs,
            "ratio": ours / theirs if theirs else None,
        }
        for name, ours, theirs in figures
    ]
