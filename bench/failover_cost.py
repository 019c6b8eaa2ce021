"""Failover cost on the bundled model: kill -> next token, against re-prefilling the session.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/failover_cost.py [--prompt-tokens 400]
        [--kill-after 100] [--rounds 3]

A 3-node loopback mesh (A: first half of the layers; B, B': second half)
streams a greedy session; after --kill-after tokens the in-route B is killed
with SIGKILL. The gap from the kill to the next token is compared with the
time a fresh request holding the same history (prompt + tokens so far) takes
to its first token — what a system without failover would have to pay on top
of noticing the failure. Prints per-round figures and the median ratio.
"""

from __future__ import annotations

import argparse
import statistics

from meshnet.benchmark.failover import measure_failover


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--kill-after", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model")
    args = p.parse_args()
    rounds = measure_failover(args.model, args.prompt_tokens, args.kill_after, args.rounds)
    print(f"failover of a session holding {rounds[0].positions} KV positions (SIGKILL of B)")
    for i, r in enumerate(rounds):
        print(
            f"round {i}: kill->next token {r.gap_ms:7.1f} ms (tracker: {r.recovery_ms:7.1f} ms), "
            f"re-prefill {r.reprefill_ms:7.1f} ms, one token {r.token_ms:5.1f} ms, "
            f"identical={r.identical}"
        )
    gap = statistics.median(r.gap_ms for r in rounds)
    reprefill = statistics.median(r.reprefill_ms for r in rounds)
    print(f"median kill->next token {gap:.1f} ms vs re-prefill {reprefill:.1f} ms")
    print(f"ratio failover/re-prefill: {gap / reprefill:.3f}x")
    if not all(r.identical for r in rounds):
        raise SystemExit("a failover changed the output")


if __name__ == "__main__":
    main()
