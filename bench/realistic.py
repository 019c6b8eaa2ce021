"""meshnet on a model of the size people run, against llama.cpp on the same file, in one run.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/realistic.py [--backend q8]

The model is a Llama-3.2-1B-shaped GGUF with seeded random weights and the real
Llama-3 tokenizer, quantized to Q4_K_M by llama.cpp's llama-quantize; it is made
on first use in ~/.cache/meshnet/models (scripts/make_synthetic_model.py, a few
minutes) unless --model names another file. Printed, each next to its peer and
the ratio:

- single process: prefill of a --prompt-tokens prompt and batch-1 decode, the
  engine with --threads kernel threads against llama-bench -t THREADS;
- a 2- and 3-node split (--nodes): meshnet's loopback mesh (tracker + node
  processes, --split-threads kernel threads each), decode as the client sees
  streamed tokens, against llama-bench over as many local ggml-rpc-server
  processes of as many threads (with more than one, llama.cpp's figure is the
  better of libgomp's default spin and a short one: benchmark/split.py);
- each node's RSS against the file bytes of the tensors it serves plus the KV
  of one benchmark sequence;
- with --delay-ms, the splits' links held that long each way by a user-space
  proxy (meshnet/benchmark/delay_proxy.py), as over a network: llama-bench's link
  to each RPC server, and every connection to a node (the tracker's, the
  previous hop's, its relay port's). Per token llama.cpp's RPC client makes
  round trips to every server; meshnet's ring crosses one link a hop;
- the memory ceiling of one thread's batch-1 decode, measured in the run: its
  streaming read bandwidth over the weight bytes a decode step reads
  (meshnet/benchmark/bandwidth.py). A split's nodes take turns on one stream,
  so the split's figures are also set against it.

Goals (issue 13): decode >= llama.cpp single-process, split >= 1.5x llama.cpp's
RPC split, RSS within ~15% of layer bytes + KV. The two sides take turns, one
round each, and each figure is the best of its --rounds (neighbours on a shared
VM move single runs by 20-40%).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

from meshnet.backends.kernel_threads import set_threads
from meshnet.benchmark.bandwidth import ceiling_tok_s, decode_bytes, read_gb_s
from meshnet.benchmark.engine import bench_engine, warm_up
from meshnet.benchmark.figures import Throughput
from meshnet.benchmark.llamacpp import bench_llamacpp, find_llamacpp
from meshnet.benchmark.mesh import PROMPT
from meshnet.benchmark.realistic_model import ensure_models
from meshnet.benchmark.split import SplitResult, SplitSetup, measure_split
from meshnet.benchmark.synthetic_model import LlamaShape
from meshnet.engine.local import load_local_model
from meshnet.model.shard import BACKENDS, DEFAULT_BACKEND

GOAL_DECODE = 1.0  # meshnet / llama.cpp, single process
GOAL_SPLIT = 1.5  # meshnet mesh / llama.cpp RPC split
GOAL_RSS = 1.15  # node RSS / (its tensors' file bytes + KV)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model", type=Path, help="GGUF (default: the synthetic Q4_K_M, made if missing)"
    )
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=32, help="per round, every figure")
    p.add_argument("--threads", type=int, default=2, help="single-process threads, both sides")
    p.add_argument("--nodes", default="2,3", help="split sizes, comma-separated")
    p.add_argument(
        "--split-threads",
        type=int,
        default=1,
        help="kernel threads of every split process, both sides (a hop of its own host "
        "would have all its cores: 2 gives each the machine's; the hops take turns)",
    )
    p.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="splits only: every link to a node or RPC server held this long each way by a "
        "user-space proxy, as over a network (0: loopback)",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds per side, taken in turns")
    p.add_argument("--llamacpp", help="folder with llama-bench and ggml-rpc-server")
    p.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS, help="ours, everywhere")
    args = p.parse_args()
    bin_dir = find_llamacpp(args.llamacpp)
    model_path = args.model or _default_model(bin_dir)
    print(f"model {model_path} ({model_path.stat().st_size / 1e9:.2f} GB), backend {args.backend}")
    if bin_dir is None:
        print("llama.cpp not found (bench/build_llamacpp.sh): meshnet's figures alone")

    set_threads(args.threads)
    local = load_local_model(model_path, backend=args.backend)
    print(f"loaded in {local.load_s:.1f} s: {local.spec.n_layers} layers, d={local.spec.d_model}")
    warm_up(local)
    ours: list[Throughput] = []
    theirs: list[Throughput] = []
    for _ in range(args.rounds):
        ours.append(bench_engine(local, args.prompt_tokens, args.decode_tokens, (1,)))
        if bin_dir is not None:
            theirs.append(
                bench_llamacpp(
                    bin_dir, model_path, args.prompt_tokens, args.decode_tokens, (1,), args.threads
                )
            )
    _print_single(args, Throughput.best(ours), Throughput.best(theirs) if theirs else None)

    tensor_bytes = {name: int(t.n_bytes) for name, t in local.file.tensors.items()}
    ceiling = _print_ceiling(decode_bytes(tensor_bytes))
    setup = SplitSetup(
        model=model_path,
        spec=local.spec,
        tensor_bytes=tensor_bytes,
        prompt_tokens=len(local.tokenizer.encode(PROMPT)),
        llamacpp=bin_dir,
        backend=args.backend,
        delay_ms=args.delay_ms,
    )
    del local  # the nodes load their own shards; this process's copy would crowd them
    gc.collect()
    for nodes in (int(n) for n in args.nodes.split(",") if n):
        split = measure_split(setup, nodes, args.decode_tokens, args.rounds, args.split_threads)
        _print_split(split, ceiling, args.split_threads, args.delay_ms)


def _default_model(bin_dir: Path | None) -> Path:
    quantize = bin_dir / "llama-quantize" if bin_dir is not None else None
    made = ensure_models(LlamaShape(), quantize_bin=quantize)
    if made.quantized is None:
        raise SystemExit("no quantized model was made")
    return made.quantized


def _print_single(args: argparse.Namespace, ours: Throughput, peer: Throughput | None) -> None:
    print(
        f"\nsingle process, {args.threads} threads each side, best of {args.rounds} "
        "alternating rounds"
    )
    print(f"{'figure':<26}{'meshnet':>10}{'llama.cpp':>11}{'ratio':>8}{'goal':>8}")
    prefill = f"prefill {args.prompt_tokens} tok/s"
    _row(prefill, ours.prefill_tok_s, peer.prefill_tok_s if peer else None, None)
    decode = peer.decode_tok_s[1] if peer else None
    _row("decode b=1 tok/s", ours.decode_tok_s[1], decode, GOAL_DECODE)


def _print_ceiling(step_bytes: int) -> float:
    """Measure and print one thread's decode ceiling; tok/s."""
    gb_s = read_gb_s()
    ceiling = ceiling_tok_s(gb_s, step_bytes)
    print(
        f"\nmemory ceiling: one thread reads {gb_s:.1f} GB/s, a decode step reads "
        f"{step_bytes / 1e6:.0f} MB of weights: at most {ceiling:.1f} tok/s on one thread"
    )
    return ceiling


def _print_split(r: SplitResult, ceiling: float, threads: int, delay_ms: float) -> None:
    links = f", every link to a node or RPC server {delay_ms:g} ms each way" if delay_ms else ""
    print(
        f"\n{r.nodes}-node split, {threads} thread(s) per process{links}, decode of "
        f"{r.tokens} tokens, best alternating round"
    )
    print(f"{'figure':<26}{'meshnet':>10}{'llama.cpp':>11}{'ratio':>8}{'goal':>8}")
    _row("decode tok/s (RPC peer)", r.mesh_tok_s, r.rpc_tok_s, GOAL_SPLIT)
    if threads == 1 and not delay_ms:  # the ceiling bounds compute, not links
        shares = f"of the one-thread ceiling: meshnet {r.mesh_tok_s / ceiling:.0%}"
        if r.rpc_tok_s:
            goal = GOAL_SPLIT * r.rpc_tok_s / ceiling
            shares += f", llama.cpp {r.rpc_tok_s / ceiling:.0%}; the goal needs {goal:.0%}"
        print(shares)
    print(
        f"{'node':<8}{'layers':<10}{'RSS MB':>8}{'anon':>6}{'file':>6}{'tensors MB':>12}"
        f"{'KV MB':>7}{'ratio':>7}{'-empty':>8}{'goal':>8}"
    )
    for m in r.memory:
        print(
            f"{m.node_id:<8}{m.layers!s:<10}{m.rss.total / 1e6:>8.0f}{m.rss.anon / 1e6:>6.0f}"
            f"{m.rss.file / 1e6:>6.0f}{m.file_bytes / 1e6:>12.0f}{m.kv_bytes / 1e6:>7.1f}"
            f"{m.ratio:>6.2f}x{m.ratio_above(r.empty_node):>7.2f}x{f'<={GOAL_RSS:.2f}x':>8}"
        )
    e = r.empty_node
    print(
        f"{'empty':<8}{'-':<10}{e.total / 1e6:>8.0f}{e.anon / 1e6:>6.0f}{e.file / 1e6:>6.0f}"
        "   (a node with no layers; '-empty': RSS less this, over tensors + KV)"
    )


def _row(name: str, mine: float, other: float | None, goal: float | None) -> None:
    theirs = f"{other:.1f}" if other else "-"
    ratio = f"{mine / other:.2f}x" if other else "-"
    target = f">={goal:.1f}x" if goal else ""
    print(f"{name:<26}{mine:>10.1f}{theirs:>11}{ratio:>8}{target:>8}")


if __name__ == "__main__":
    main()
