"""Serving through the HTTP API against llama.cpp, in one run (issue 14's serving figures).

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/serving.py [--rounds 3] [--tokens 64]

1. tracker + one node (``--threads``, default 2) against ``llama-server -t 2 -np 8``
   on the same GGUF, each in its default serving configuration (llama-server: f16
   KV, flash attention auto, continuous batching): one stream's decode tok/s
   (goal >= 1.2x) and 8 concurrent streams' aggregate decode tok/s (goal >= 2x).
2. a 3-node mesh (``--layout``, ``--mesh-threads`` per node, default 1: 3 nodes
   share 2 cores, and llama.cpp's RPC servers run one thread each) through the
   same API: per-token time against one node with the same threads (goal
   <= 1.15x), the tracker's ``--no-relay`` for the effect of node-to-node
   activations, the nodes' ``--head-assist off`` for the effect of the last hop
   sharing its head with the first, and decode tok/s against llama.cpp's RPC split over two
   ``ggml-rpc-server`` processes (goal >= 1.5x).

Rounds alternate between the sides; each figure is its best round (see
bench/README.md). Each measurement waits up to ``--quiet-wait`` seconds for
idle CPUs and is taken again (``--retries``) when other processes used over
10 % of the CPUs meanwhile; a figure with no undisturbed measurement is marked
``*``. Every try is printed with the share others used. Every process started
is stopped at the end, however it ends.
Without bench/build_llamacpp.sh's build, our figures print alone.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from meshnet.backends.shard import BACKENDS, DEFAULT_BACKEND
from meshnet.benchmark.comparison import table
from meshnet.benchmark.llamacpp import find_llamacpp
from meshnet.benchmark.quiet import Quiet
from meshnet.benchmark.serving import ServingSetup, api_vs_llama_server, mesh_vs_single
from meshnet.model.bundled import bundled_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF (default: the bundled model)")
    p.add_argument("--llamacpp", help="directory of llama.cpp's binaries")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--threads", type=int, default=2, help="the single node's and llama-server's")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams; llama-server -np")
    p.add_argument("--mesh-threads", type=int, default=1, help="kernel threads per mesh node")
    p.add_argument("--layout", default="0:10,10:20,20:30")
    p.add_argument("--backend", default=DEFAULT_BACKEND, choices=BACKENDS, help="our nodes'")
    p.add_argument("--quiet-wait", type=float, default=20.0, help="seconds to wait for idle CPUs")
    p.add_argument("--retries", type=int, default=2, help="tries again of a disturbed measurement")
    p.add_argument("--only", choices=["api", "mesh"], help="run one comparison")
    p.add_argument("--logs", help="keep the processes' logs here (default: a temp dir)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="meshnet-serving-") as tmp:
        setup = ServingSetup(
            model=Path(args.model) if args.model else bundled_model_path(),
            bin_dir=find_llamacpp(args.llamacpp),
            data_dir=Path(args.logs or tmp),
            tokens=args.tokens,
            rounds=args.rounds,
            threads=args.threads,
            streams=args.streams,
            mesh_threads=args.mesh_threads,
            layout=args.layout,
            backend=args.backend,
            quiet=Quiet(max_wait_s=args.quiet_wait, retries=args.retries),
        )
        if setup.bin_dir is None:
            print("no llama.cpp build (bench/build_llamacpp.sh): our figures alone")
        print(
            f"greedy completions of {setup.tokens} tokens, streamed; best of {setup.rounds} "
            "alternating rounds; tok/s as the client sees tokens after the first; "
            "* = every try disturbed by other processes"
        )
        if args.only in (None, "api"):
            rows, notes = api_vs_llama_server(setup)
            print(f"\ntracker + 1 node ({setup.threads} kernel threads) vs llama-server")
            print(table(rows))
            print("\n".join(notes))
        if args.only in (None, "mesh"):
            rows, notes = mesh_vs_single(setup)
            print(f"\nmesh {setup.layout} ({setup.mesh_threads} kernel thread(s) per node)")
            print(table(rows))
            print("\n".join(notes))


if __name__ == "__main__":
    main()
