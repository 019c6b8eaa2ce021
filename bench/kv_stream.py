"""KV stream throughput node -> node against raw loopback TCP, on the bundled model.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/kv_stream.py [--tokens 1000] [--rounds 3]

Moves a session of --tokens KV positions from one node process to another
(StateGet piped into StatePut: exported, hashed, verified, loaded) and pushes
the same bytes through a plain loopback socket in the same run. Prints both
(best of --rounds) and the ratio (goal: at least 25%).
"""

from __future__ import annotations

import argparse

from meshnet.benchmark.kv_stream import measure_kv_stream


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model")
    args = p.parse_args()
    r = measure_kv_stream(args.model, args.tokens, args.rounds)
    print(f"KV of {r.tokens} positions: {r.nbytes / 1e6:.1f} MB, best of {len(r.move_s)}")
    print(f"node -> node (StatePull)     : {min(r.pull_s) * 1000:7.1f} ms  {r.pull_mb_s:7.1f} MB/s")
    print(f"via the client (Get | Put)   : {min(r.move_s) * 1000:7.1f} ms  {r.kv_mb_s:7.1f} MB/s")
    print(f"raw loopback TCP             : {min(r.tcp_s) * 1000:7.1f} ms  {r.tcp_mb_s:7.1f} MB/s")
    print(f"ratio node->node KV stream / TCP: {r.pull_mb_s / r.tcp_mb_s:.3f} (goal >= 0.25)")


if __name__ == "__main__":
    main()
