"""Durable sessions in one run: snapshot resume vs re-prefill, and KV stream vs TCP.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/session_resume.py [--tokens 1000] [--rounds 3]

Builds a session of about --tokens positions on the bundled model (tracker +
2 node processes), then per round: park -> resume, evict -> resume from the
snapshot, evict and lose the snapshot -> re-prefill; prints the tracker's
resume_ms for each (medians) and the snapshot / re-prefill ratio (goal: at
most 1/50). Then moves a session of the same size node to node and pushes
the same bytes over a raw loopback socket (goal: KV stream at least 25% of TCP).
"""

from __future__ import annotations

import argparse
import statistics

from meshnet.benchmark.kv_stream import measure_kv_stream
from meshnet.benchmark.session_resume import measure_resume


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model")
    args = p.parse_args()
    r = measure_resume(args.model, args.tokens, args.rounds)
    med = statistics.median
    print(f"session of {min(r.tokens)}-{max(r.tokens)} positions, {len(r.tokens)} rounds (median)")
    print(f"hot resume      : {med(r.hot_ms):8.1f} ms")
    print(f"parked resume   : {med(r.parked_ms):8.1f} ms")
    print(f"snapshot resume : {med(r.snapshot_ms):8.1f} ms   rounds {r.snapshot_ms}")
    print(f"re-prefill      : {med(r.reprefill_ms):8.1f} ms   rounds {r.reprefill_ms}")
    print(f"ratio snapshot / re-prefill: 1/{1 / r.ratio:.0f} = {r.ratio:.4f} (goal <= 1/50)")
    plain = med(r.plain_prefill_ms)
    print(f"for scale: one-shot prefill of as many fresh tokens: {plain:8.1f} ms")
    print(f"  snapshot resume / one-shot prefill: {med(r.snapshot_ms) / plain:.4f}")
    k = measure_kv_stream(args.model, max(r.tokens), args.rounds)
    print(f"KV stream of {k.tokens} positions ({k.nbytes / 1e6:.1f} MB), best of {args.rounds}")
    print(f"node -> node (StatePull): {k.pull_mb_s:7.1f} MB/s")
    print(f"raw loopback TCP        : {k.tcp_mb_s:7.1f} MB/s")
    print(f"ratio KV stream / TCP: {k.pull_mb_s / k.tcp_mb_s:.3f} (goal >= 0.25)")


if __name__ == "__main__":
    main()
