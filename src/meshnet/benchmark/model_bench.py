"""A model of realistic scale against llama.cpp on the same file, in one run, whatever the model.

``bench/realistic.py`` (a Llama-3.2-1B shape) and ``bench/moe.py`` (a
Qwen3-MoE shape) differ only in the file they make and the goals they hold
meshnet to; this runs the rest. Printed, each figure next to llama.cpp's and
the ratio:

- one process, ``--threads`` threads each side: prefill of a
  ``--prompt-tokens`` prompt and batch-1 decode (``benchmark/engine.py``
  against llama-bench), the two sides taking turns, one round each, every
  figure its best round;
- that decode as a share of its memory bound: the streaming read bandwidth of
  as many threads, measured in the run, over the weight bytes a decode step
  reads (for a mixture of experts only the experts a token is routed to:
  ``benchmark/bandwidth.py``);
- 2- and 3-node splits (``--nodes``), optionally over delayed links, against
  llama.cpp's RPC split, and each node's RSS against its tensors' file bytes
  plus its KV (``benchmark/split.py``).

A file meshnet cannot load yet (a family not in ``model/arch``) is still
measured on llama.cpp's side, so the harness and the file are checked before
the engine is.
"""

from __future__ import annotations

import argparse
import gc
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from meshnet.backends.kernel_threads import set_threads
from meshnet.backends.shard import BACKENDS, DEFAULT_BACKEND
from meshnet.benchmark.bandwidth import ceiling_tok_s, decode_bytes, read_gb_s
from meshnet.benchmark.engine import backend_text, bench_engine, warm_up
from meshnet.benchmark.figures import Throughput
from meshnet.benchmark.llamacpp import bench_llamacpp, find_llamacpp, peer_text
from meshnet.benchmark.mesh import PROMPT
from meshnet.benchmark.quiet import Quiet
from meshnet.benchmark.split import SplitResult, SplitSetup, measure_split, rpc_round
from meshnet.engine.local import LocalModel, load_local_model
from meshnet.model.gguf_file import GGUFFile, open_gguf

# llama.cpp's bin folder (its llama-quantize; None when not built) -> the GGUF to measure
ModelMaker = Callable[[Path | None], Path]


@dataclass(frozen=True)
class Goals:
    """The ratios a benchmark holds meshnet to; None: the figure is shown for context."""

    prefill: float | None = None  # meshnet / llama.cpp prefill tok/s, one process
    decode: float | None = None  # meshnet / llama.cpp batch-1 decode tok/s, one process
    bound_share: float | None = None  # one-process decode / its memory bound
    split: float | None = None  # mesh decode / llama.cpp's RPC split
    rss: float | None = None  # node RSS / (its tensors' file bytes + KV), at most


def add_arguments(p: argparse.ArgumentParser, delay_ms: float = 0.0) -> None:
    """The flags every model benchmark takes; ``delay_ms``: the default of ``--delay-ms``."""
    p.add_argument(
        "--model", type=Path, help="GGUF (default: the benchmark's own, made if missing)"
    )
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=32, help="per round, every figure")
    p.add_argument("--threads", type=int, default=2, help="single-process threads, both sides")
    p.add_argument("--nodes", default="2,3", help="split sizes, comma-separated ('' for none)")
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
        default=delay_ms,
        help="splits only: every link to a node or RPC server held this long each way by a "
        f"user-space proxy, as over a network (0: loopback; default {delay_ms:g})",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds per side, taken in turns")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=20.0,
        help="single process: seconds to wait for idle CPUs",
    )
    p.add_argument(
        "--retries", type=int, default=2, help="single process: tries again of a disturbed round"
    )
    p.add_argument(
        "--even-layers",
        action="store_true",
        help="splits: as many layers per node (default: by bytes, as `meshnet up` plans)",
    )
    p.add_argument("--llamacpp", help="folder with llama-bench and ggml-rpc-server")
    p.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS, help="ours, everywhere")


def run(args: argparse.Namespace, make_model: ModelMaker, goals: Goals) -> None:
    """Make (or take) the model, measure both sides and print every figure."""
    bin_dir = find_llamacpp(args.llamacpp)
    path: Path = args.model or make_model(bin_dir)
    file = open_gguf(path)
    size = sum(p.stat().st_size for p in file.parts)  # a split GGUF: its parts together
    print(f"model {path} ({size / 1e9:.2f} GB), backend {backend_text(args.backend)}")
    if bin_dir is None:
        print("llama.cpp not found (bench/build_llamacpp.sh): meshnet's figures alone")
    else:
        print(peer_text(bin_dir))
    step = step_bytes(file)
    tensor_bytes = _tensor_bytes(file)
    set_threads(args.threads)
    local = _load(path, args.backend)
    if local is not None:
        print(
            f"loaded in {local.load_s:.1f} s: {local.spec.n_layers} layers, d={local.spec.d_model}"
        )
        warm_up(local)
    quiet = Quiet(max_wait_s=args.quiet_wait, retries=args.retries)
    ours, peer, reads = _single_rounds(args, quiet, local, bin_dir, path)
    bound = _print_bound(reads, step, args.threads)
    _print_single(args, ours, peer, bound, goals)
    nodes = [int(n) for n in args.nodes.split(",") if n]
    if local is None:
        _peer_splits(args, bin_dir, path, nodes)
        return
    setup = SplitSetup(
        model=path,
        spec=local.spec,
        tensor_bytes=tensor_bytes,
        prompt_tokens=len(local.tokenizer.encode(PROMPT)),
        llamacpp=bin_dir,
        backend=args.backend,
        delay_ms=args.delay_ms,
        even_layers=args.even_layers,
    )
    del local  # the nodes load their own shards; this process's copy would crowd them
    gc.collect()
    one_thread = bound  # the splits' nodes run one thread each
    if args.threads != 1:
        one_thread = _print_bound([read_gb_s() for _ in range(args.rounds)], step, 1)
    for n in nodes:
        split = measure_split(setup, n, args.decode_tokens, args.rounds, args.split_threads)
        _print_split(split, one_thread, args, goals)


def step_bytes(file: GGUFFile) -> int:
    """Weight bytes one batch-1 decode step of ``file``'s model reads (its experts: only
    the ``expert_used_count`` of ``expert_count`` a token is routed to)."""
    arch = file.value("general.architecture")
    count = int(file.value_or(f"{arch}.expert_count", 0))
    used = int(file.value_or(f"{arch}.expert_used_count", 0))
    return decode_bytes(_tensor_bytes(file), (used, count) if count else None)


def _tensor_bytes(file: GGUFFile) -> dict[str, int]:
    return {name: int(t.n_bytes) for name, t in file.tensors.items()}


def _load(path: Path, backend: str) -> LocalModel | None:
    """meshnet's whole model in this process, or None (said why) when it cannot load it.

    Any failure is reported, not only a refused family (``ModelError``): an engine
    midway through learning a family fails in other ways, and llama.cpp's side of
    the run still checks the file and the harness.
    """
    try:
        return load_local_model(path, backend=backend)
    except Exception as e:  # printed; the run goes on with the peer alone
        why = f"{type(e).__name__}: {e}"
        print(f"meshnet cannot load this model ({why}): llama.cpp's figures alone")
        return None


def _single_rounds(
    args: argparse.Namespace,
    quiet: Quiet,
    local: LocalModel | None,
    bin_dir: Path | None,
    path: Path,
) -> tuple[Throughput | None, Throughput | None, list[float]]:
    """Each side's best of ``args.rounds`` one-process rounds, taken in turns, and the
    read bandwidth of ``args.threads`` threads (GB/s) measured after each round.

    Each round waits for idle CPUs and is taken again while neighbours used more
    than ``Quiet.threshold`` of them (``--retries``): llama.cpp's threads wait for
    each other at every operation, so one busy core slows it several times over
    (llama-bench -t 2 measured 1.1 tok/s beside a compiler here, 60 without). Every
    try is printed with that share; a side's figures come from its undisturbed
    tries where it has any.
    """
    n_prompt, n_decode = args.prompt_tokens, args.decode_tokens
    sides: list[tuple[str, Callable[[], Throughput]]] = []
    if local is not None:
        sides.append(("meshnet", partial(bench_engine, local, n_prompt, n_decode, (1,))))
    if bin_dir is not None:
        run_peer = partial(bench_llamacpp, bin_dir, path, n_prompt, n_decode, (1,), args.threads)
        sides.append(("llama.cpp", run_peer))
    tries: dict[str, list[tuple[Throughput, float]]] = {"meshnet": [], "llama.cpp": []}
    reads: list[float] = []
    for i in range(args.rounds):
        for side, run in sides:
            tries[side] += _tries(quiet, f"round {i + 1} {side}", run)
        reads.append(read_gb_s(threads=args.threads))
    ours, peer = (
        _best(quiet, "meshnet", tries["meshnet"]),
        _best(quiet, "llama.cpp", tries["llama.cpp"]),
    )
    return ours, peer, reads


def _tries(
    quiet: Quiet, what: str, run: Callable[[], Throughput]
) -> list[tuple[Throughput, float]]:
    tries = quiet.tries(run)
    for t, others in tries:
        print(
            f"  {what}: prefill {t.prefill_tok_s:.1f}, decode {t.decode_tok_s[1]:.1f} tok/s "
            f"(others used {others:.0%} of the CPUs)"
        )
    return tries


def _best(quiet: Quiet, side: str, tries: list[tuple[Throughput, float]]) -> Throughput | None:
    if not tries:
        return None
    calm = [t for t, others in tries if others <= quiet.threshold]
    if not calm:
        print(f"  {side}: every try disturbed (others > {quiet.threshold:.0%}): best of them all")
    return Throughput.best(calm or [t for t, _ in tries])


def _print_bound(reads: list[float], step: int, threads: int) -> float:
    """Print the decode memory bound of ``threads`` threads from the read bandwidths
    measured through the run; tok/s. The fastest read is taken: this VM's bandwidth
    moves with its neighbours (28 to 53 GB/s for two threads within an hour), and the
    highest is the bound least flattering to either side."""
    gb_s = max(reads)
    bound = ceiling_tok_s(gb_s, step)
    spread = ", ".join(f"{r:.1f}" for r in reads)
    print(
        f"\nmemory bound: {threads} thread(s) read {gb_s:.1f} GB/s (the fastest of {spread}), "
        f"a decode step reads {step / 1e6:.0f} MB of weights: at most {bound:.1f} tok/s"
    )
    return bound


def _print_single(
    args: argparse.Namespace,
    ours: Throughput | None,
    peer: Throughput | None,
    bound: float,
    goals: Goals,
) -> None:
    print(
        f"\nsingle process, {args.threads} threads each side, best of {args.rounds} "
        "alternating rounds"
    )
    _head()
    prefill = f"prefill {args.prompt_tokens} tok/s"
    prefill_ours = ours.prefill_tok_s if ours else None
    _row(prefill, prefill_ours, peer.prefill_tok_s if peer else None, goals.prefill)
    decode_ours = ours.decode_tok_s[1] if ours else None
    decode_peer = peer.decode_tok_s[1] if peer else None
    _row("decode b=1 tok/s", decode_ours, decode_peer, goals.decode)
    _share_row("decode / memory bound", decode_ours, decode_peer, bound, goals.bound_share)


def _peer_splits(
    args: argparse.Namespace, bin_dir: Path | None, path: Path, nodes: list[int]
) -> None:
    """llama.cpp's RPC splits alone, for a model meshnet cannot load yet."""
    if bin_dir is None:
        return
    for n in nodes:
        rounds = [
            rpc_round(bin_dir, path, n, args.decode_tokens, args.split_threads, args.delay_ms)
            for _ in range(args.rounds)
        ]
        _split_head(n, args, args.decode_tokens)
        _row("decode tok/s (RPC peer)", None, max(rounds), None)


def _print_split(r: SplitResult, one_thread: float, args: argparse.Namespace, goals: Goals) -> None:
    _split_head(r.nodes, args, r.tokens)
    _row("decode tok/s (RPC peer)", r.mesh_tok_s, r.rpc_tok_s, goals.split)
    if args.split_threads == 1 and not args.delay_ms:  # the ceiling bounds compute, not links
        shares = f"of the one-thread ceiling: meshnet {r.mesh_tok_s / one_thread:.0%}"
        if r.rpc_tok_s:
            shares += f", llama.cpp {r.rpc_tok_s / one_thread:.0%}"
            if goals.split:
                shares += f"; the goal needs {goals.split * r.rpc_tok_s / one_thread:.0%}"
        print(shares)
    rss_goal = f"<={goals.rss:.2f}x" if goals.rss else ""
    print(
        f"{'node':<8}{'layers':<10}{'RSS MB':>8}{'anon':>6}{'file':>6}{'tensors MB':>12}"
        f"{'KV MB':>7}{'ratio':>7}{'-empty':>8}{'goal':>8}"
    )
    for m in r.memory:
        print(
            f"{m.node_id:<8}{m.layers!s:<10}{m.rss.total / 1e6:>8.0f}{m.rss.anon / 1e6:>6.0f}"
            f"{m.rss.file / 1e6:>6.0f}{m.file_bytes / 1e6:>12.0f}{m.kv_bytes / 1e6:>7.1f}"
            f"{m.ratio:>6.2f}x{m.ratio_above(r.empty_node):>7.2f}x{rss_goal:>8}"
        )
    e = r.empty_node
    print(
        f"{'empty':<8}{'-':<10}{e.total / 1e6:>8.0f}{e.anon / 1e6:>6.0f}{e.file / 1e6:>6.0f}"
        "   (a node with no layers; '-empty': RSS less this, over tensors + KV)"
    )


def _split_head(nodes: int, args: argparse.Namespace, tokens: int) -> None:
    delay = args.delay_ms
    links = f", every link to a node or RPC server {delay:g} ms each way" if delay else ""
    print(
        f"\n{nodes}-node split, {args.split_threads} thread(s) per process{links}, decode of "
        f"{tokens} tokens, best alternating round"
    )
    _head()


def _head() -> None:
    print(f"{'figure':<26}{'meshnet':>10}{'llama.cpp':>11}{'ratio':>8}{'goal':>8}")


def _row(name: str, mine: float | None, other: float | None, goal: float | None) -> None:
    ours = f"{mine:.1f}" if mine else "-"
    theirs = f"{other:.1f}" if other else "-"
    ratio = f"{mine / other:.2f}x" if mine and other else "-"
    target = f">={goal:.1f}x" if goal else ""
    print(f"{name:<26}{ours:>10}{theirs:>11}{ratio:>8}{target:>8}")


def _share_row(
    name: str, mine: float | None, other: float | None, bound: float, goal: float | None
) -> None:
    """Each side's decode as a share of the memory bound (the ratio column: ours / theirs)."""
    ours = f"{mine / bound:.0%}" if mine else "-"
    theirs = f"{other / bound:.0%}" if other else "-"
    ratio = f"{mine / other:.2f}x" if mine and other else "-"
    target = f">={goal:.0%}" if goal else ""
    print(f"{name:<26}{ours:>10}{theirs:>11}{ratio:>8}{target:>8}")
