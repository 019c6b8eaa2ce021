"""Verification's cost and reach on the bundled model, in one run.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/verification.py [--tokens 96]
        [--requests 3] [--rates 0,0.01,0.1] [--honest-chunks 1000]

1. Throughput: for each rate a loopback mesh (tracker + 2 nodes, the layers
   split evenly) started with ``--verify-rate R``; greedy completions of
   ``--tokens`` tokens (a chat request for a long story) through the API, best-of
   ``--requests`` tokens/s (the tokens generated over the request's wall time).
2. Commitment bytes per token: read off the ledger records of those runs (their
   ``commitments`` column), against TOPLOC's ~8 bytes per token.
3. Detection: the probability that a node cheating on every chunk escapes a
   verifier sampling at rate R for n chunks is (1-R)^n; the chunks (and tokens,
   32 per chunk) for >= 99% detection, and a Monte-Carlo check of it.
4. False positives: in-process, ``--honest-chunks`` honest chunks of the two
   nodes' spans (a fast-backend node engine: prompt chunks and one-row decode
   steps) checked by the verifier's exact check; every one must pass.
"""

from __future__ import annotations

import argparse
import math
import random
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh, even_layout
from meshnet.model.bundled import bundled_model_path
from meshnet.node.engine import NodeEngine
from meshnet.node.scheduler import StepWork
from meshnet.protocol.commitments import CHUNK_TOKENS
from meshnet.tracker.verifier import SpanClaim, TrustedModel, check_span

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
TOPLOC_BYTES_PER_TOKEN = 258 / 32


def throughput(rate: float, tokens: int, requests: int) -> tuple[float, float]:
    """Best-of tokens/s through the API at ``rate``, and commitment bytes per token."""
    with tempfile.TemporaryDirectory() as d:
        mesh = LocalMesh(Path(d), tracker_args=["--verify-rate", str(rate)])
        try:
            mesh.start(even_layout(30, 2))
            best = 0.0
            models = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers).json()
            model = models["data"][0]["id"]
            messages = [{"role": "user", "content": PROMPT}]
            body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0}
            for _ in range(requests):
                t0 = time.perf_counter()
                r = httpx.post(
                    f"{mesh.url}/v1/chat/completions",
                    json=body,
                    headers=mesh.api_headers,
                    timeout=600,
                )
                r.raise_for_status()
                n = len(r.json()["meshnet"]["ids"])
                best = max(best, n / (time.perf_counter() - t0))
            time.sleep(1.0)
            ledger = httpx.get(f"{mesh.url}/admin/ledger", headers=mesh.admin_headers).json()
            records = ledger["records"]
            committed = sum(len(rec.get("commitments", "")) // 2 for rec in records)
            positions = sum(rec["token_end"] - rec["token_start"] for rec in records)
            return best, committed / max(positions, 1)
        finally:
            mesh.stop()


def chunks_for(rate: float, confidence: float = 0.99) -> int:
    """Chunks after which a node cheating on each is caught with ``confidence``."""
    return math.ceil(math.log(1 - confidence) / math.log(1 - rate))


def simulated_detection(rate: float, chunks: int, runs: int, seed: int = 1) -> float:
    rng = random.Random(seed)
    caught = sum(any(rng.random() < rate for _ in range(chunks)) for _ in range(runs))
    return caught / runs


def honest_checks(n_chunks: int) -> tuple[int, int]:
    """(checked, failed) over ``n_chunks`` honest chunks of two nodes' spans."""
    path = str(bundled_model_path())
    trusted = TrustedModel(path)
    spans = [LayerRange(0, 15), LayerRange(15, 30)]
    engines = [NodeEngine() for _ in spans]
    for e, span in zip(engines, spans, strict=True):
        e.start()
        e.load(path, span).result(120)
    rng = np.random.default_rng(0)
    checked = failed = 0
    session = 0
    try:
        while checked < n_chunks:
            session += 1
            sid = f"s{session}"
            for e in engines:
                e.open(sid, 1).result(10)
            ids = rng.integers(0, trusted.spec.vocab_size, 256)
            steps = [ids[:100], *[ids[i : i + 1] for i in range(100, 160)], ids[160:256]]
            claims: list[tuple[LayerRange, int, bytes]] = []
            for n, x in enumerate(steps):
                h = x
                for e, span in zip(engines, spans, strict=True):
                    w = StepWork(sid, 1, h, None, step=n)
                    h = e.submit(w).result(60)
                    claims += [(span, s, dg) for s, dg in w.chunks]
            for e in engines:
                e.release(sid, 1).result(10)
            for span, start, digest in claims:
                tokens = tuple(int(t) for t in ids[: start + CHUNK_TOKENS])
                verdict = check_span(trusted, SpanClaim("n", "g", span, start, digest, tokens))
                checked += 1
                failed += not verdict.passed
    finally:
        for e in engines:
            e.stop()
    return checked, failed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--rates", default="0,0.01,0.1")
    p.add_argument("--honest-chunks", type=int, default=1000)
    args = p.parse_args()
    base = 0.0
    for rate in [float(r) for r in args.rates.split(",")]:
        tps, bpt = throughput(rate, args.tokens, args.requests)
        base = base or tps
        print(
            f"verify-rate {rate:5.2f}: {tps:6.2f} tokens/s ({tps / base:.3f}x rate 0), "
            f"commitments {bpt:.3f} bytes/token (TOPLOC ~{TOPLOC_BYTES_PER_TOKEN:.1f})"
        )
    for rate in (0.01, 0.1, 1.0):
        n = chunks_for(rate) if rate < 1 else 1
        sim = simulated_detection(rate, n, 10000)
        print(
            f"rate {rate:4.2f}: >=99% detection of a node cheating on every chunk within "
            f"{n} chunks = {n * CHUNK_TOKENS} tokens of its span (simulated over 10000 runs: "
            f"{sim:.4f})"
        )
    checked, failed = honest_checks(args.honest_chunks)
    print(f"honest chunks checked exactly: {checked}, failed: {failed} (false positives)")
    if failed:
        raise SystemExit("an honest chunk failed its check")


if __name__ == "__main__":
    main()
