"""The largest KV moved over links held 10 ms each way, and its rate against the link's.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/kv_link.py [--tokens 1000,4000,8000]
        [--delay-ms 10] [--model PATH]

For each size (KV positions of the bundled model, 46 KB each), a session's KV is
imported into a node through the delay proxy (StatePut, as the tracker resumes a
snapshot) and pulled node to node through it (StatePull), under the nodes' own
transfer deadline; the same bytes pushed through the same proxy over one TCP
connection, in the same run, are the link's rate. Prints each size's rates and
ratios, then the largest size that moved.
"""

from __future__ import annotations

import argparse

from meshnet.benchmark.kv_link import measure_kv_link


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", default="1000,4000,8000", help="sizes in KV positions")
    p.add_argument("--delay-ms", type=float, default=10.0, help="each way")
    p.add_argument("--model")
    args = p.parse_args()
    sizes = [int(t) for t in args.tokens.split(",")]
    moves = measure_kv_link(args.model, sizes, args.delay_ms)
    print(f"links held {args.delay_ms:g} ms each way (delay proxy); MB/s and ratio to the link's")
    print(" positions      MB | link TCP | StatePut  ratio | StatePull  ratio")
    for m in moves:
        put, pull = m.mb_s(m.put_s), m.mb_s(m.pull_s)
        print(
            f"{m.tokens:10d} {m.nbytes / 1e6:7.1f} | {m.tcp_mb_s:8.1f} | {put:8.1f} "
            f"{put / m.tcp_mb_s:6.3f} | {pull:9.1f} {pull / m.tcp_mb_s:6.3f}"
            + (f"  FAILED: {m.failure}" if m.failure else "")
        )
    moved = [m for m in moves if not m.failure]
    if moved:
        top = max(moved, key=lambda m: m.nbytes)
        print(
            f"largest KV moved: {top.nbytes / 1e6:.1f} MB ({top.tokens} positions), "
            f"put {top.mb_s(top.put_s):.1f} MB/s, pull {top.mb_s(top.pull_s):.1f} MB/s, "
            f"link {top.tcp_mb_s:.1f} MB/s"
        )


if __name__ == "__main__":
    main()
