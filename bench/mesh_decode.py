"""Per-token decode latency: 3-node loopback mesh vs single process, same run.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/mesh_decode.py [--nodes 3] [--tokens 48]

Both sides get the same kernel threads per process (--threads, default 1, as
`meshnet up` runs its nodes; with 2, every node pays for waking its idle
OpenMP threads in each parallel region), and their runs alternate so both see
the same machine. Prints the ratio mesh/single (goal at most 1.15) and, when
bench/build_llamacpp.sh has run, llama.cpp's RPC split over two local
processes for comparison.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshnet.benchmark.llamacpp import find_llamacpp
from meshnet.benchmark.mesh import llamacpp_rpc_tok_s, measure
from meshnet.model.bundled import bundled_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nodes", type=int, default=3)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="kernel threads per process, both sides")
    p.add_argument("--model")
    args = p.parse_args()
    r = measure(args.model, args.nodes, args.tokens, args.rounds, args.threads)
    print(
        f"decode, {r.tokens} tokens per run, median of {r.rounds} alternating runs, "
        f"{r.threads} kernel threads per process"
    )
    print(f"single process : {r.single_ms:7.2f} ms/token ({1000 / r.single_ms:6.1f} tok/s)")
    print(f"{r.nodes}-node mesh    : {r.mesh_ms:7.2f} ms/token ({1000 / r.mesh_ms:6.1f} tok/s)")
    print(f"ratio mesh/single: {r.ratio:.3f}x (goal <= 1.15x)")
    bin_dir = find_llamacpp()
    if bin_dir is not None and (bin_dir / "ggml-rpc-server").exists():
        model = Path(args.model) if args.model else bundled_model_path()
        rpc = llamacpp_rpc_tok_s(bin_dir, model, 2, args.tokens)
        print(f"llama.cpp RPC 2-way split: {1000 / rpc:7.2f} ms/token ({rpc:6.1f} tok/s)")


if __name__ == "__main__":
    main()
