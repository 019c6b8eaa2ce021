"""Verification's cost and reach on the bundled model, in one run.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python bench/verification.py [--tokens 96]
        [--requests 3] [--rates 0,0.01,0.1] [--honest-chunks 1000] [--backend numpy]

1. Throughput: for each rate a loopback mesh (tracker + 2 nodes, the layers
   split evenly) started with ``--verify-rate R``, all at once, the requests going
   round them in turn (rate 0 first: the ratios are to it); greedy completions of
   ``--tokens`` tokens (a chat request for a long story) through the API, best-of
   ``--requests`` tokens/s (the tokens generated over the request's wall time).
2. Commitment bytes per token: read off the ledger records of those runs (their
   ``commitments`` column, per KV position a node computed: a route of two nodes
   stores twice that per token), against TOPLOC's ~8 bytes per token.
3. Detection: the probability that a node cheating on every chunk escapes a
   verifier sampling at rate R for n chunks is (1-R)^n; the chunks (and tokens,
   32 per chunk) for >= 99% detection, and the share of 10,000 runs of the
   verifier's own sampling (fresh seeds) that draw a chunk within them.
4. False positives: in-process, ``--honest-chunks`` honest chunks of the two
   nodes' spans (a node engine on ``--backend``, q8 by default: prompt chunks and
   one-row decode steps) checked by the verifier's exact check; every one must pass.

``--backend numpy``: the nodes run the numpy reference, which is not bit-exact, so
they commit top-k sketches (protocol/sketches.py), 256 bytes per 32 tokens, and
the false positives are of the tolerant check on the verifier's ``fast`` engine.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from meshnet.backends.shard import DEFAULT_BACKEND
from meshnet.layer_range import LayerRange
from meshnet.local_mesh import LocalMesh, even_layout
from meshnet.model.bundled import bundled_model_path
from meshnet.node.engine import EngineConfig, NodeEngine
from meshnet.node.scheduler import StepWork
from meshnet.protocol.commitments import (
    CHUNK_TOKENS,
    DIGEST_BYTES,
    SKETCH_BYTES,
    commits_exactly,
)
from meshnet.protocol.sketches import QUARTILE_RTOL, VALUE_RTOL, sketch_errors, upper_quartile
from meshnet.tracker.trust.verifier import SpanClaim, TrustedModel, Verifier, check_span

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
TOPLOC_BYTES_PER_TOKEN = 258 / 32


def _request(mesh: LocalMesh, tokens: int) -> float:
    """One greedy chat request of ``tokens`` tokens: its tokens/s over its wall time."""
    models = httpx.get(f"{mesh.url}/v1/models", headers=mesh.api_headers).json()
    messages = [{"role": "user", "content": PROMPT}]
    body = {
        "model": models["data"][0]["id"],
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    r = httpx.post(
        f"{mesh.url}/v1/chat/completions", json=body, headers=mesh.api_headers, timeout=600
    )
    r.raise_for_status()
    return len(r.json()["meshnet"]["ids"]) / (time.perf_counter() - t0)


def _bytes_per_token(mesh: LocalMesh) -> float:
    """Commitment bytes in the ledger per KV position its records computed."""
    records = httpx.get(f"{mesh.url}/admin/ledger", headers=mesh.admin_headers).json()["records"]
    committed = sum(len(rec["commitments"]) // 2 for rec in records)
    positions = sum(rec["token_end"] - rec["token_start"] for rec in records)
    return committed / max(positions, 1)


def throughput(
    rates: list[float], tokens: int, rounds: int, backend: str
) -> list[tuple[float, float]]:
    """Per rate: best-of tokens/s through the API, and commitment bytes per position.

    One mesh per rate, all started first; the requests go round them in turn (a pause
    after each lets a verifier finish its checks), so a noisy machine weighs on every
    rate alike."""
    with tempfile.TemporaryDirectory() as d:
        meshes = [
            LocalMesh(
                Path(d) / f"rate{i}",
                tracker_args=["--verify-rate", str(rate)],
                node_args=["--backend", backend],
            )
            for i, rate in enumerate(rates)
        ]
        try:
            for mesh in meshes:
                mesh.start(even_layout(30, 2))
            best = [0.0] * len(meshes)
            for _ in range(rounds):
                for i, mesh in enumerate(meshes):
                    best[i] = max(best[i], _request(mesh, tokens))
                    time.sleep(1.0)
            return [(b, _bytes_per_token(m)) for b, m in zip(best, meshes, strict=True)]
        finally:
            for mesh in meshes:
                mesh.stop()


def chunks_for(rate: float, confidence: float = 0.99) -> int:
    """Chunks after which a node cheating on each is caught with ``confidence``."""
    return math.ceil(math.log(1 - confidence) / math.log(1 - rate))


def measured_detection(rate: float, chunks: int, runs: int) -> float:
    """Share of ``runs`` (each a fresh verifier, its own seed) in which the verifier's
    own sampling draws at least one of ``chunks`` chunks of a node cheating on every
    one: a drawn chunk of a cheat is always caught (the check is exact)."""
    caught = 0
    for run in range(runs):
        verifier = Verifier(None, rate, lambda v: None, seed=run)  # type: ignore[arg-type]
        caught += any(verifier.draw() for _ in range(chunks))
    return caught / runs


def honest_checks(n_chunks: int, backend: str) -> tuple[int, int, tuple[float, float]]:
    """(checked, failed, worst) over ``n_chunks`` honest chunks of two nodes' spans on
    ``backend``, each checked as the verifier checks a node on it; ``worst``: the largest
    relative error of one value and of a chunk's upper quartile, of the sketches
    (``sketch_errors``; zeros for hashes)."""
    path = str(bundled_model_path())
    exact = commits_exactly(backend)
    trusted = TrustedModel(path).on(backend)
    spans = [LayerRange(0, 15), LayerRange(15, 30)]
    engines = [NodeEngine(EngineConfig(backend=backend)) for _ in spans]
    for e, span in zip(engines, spans, strict=True):
        e.start()
        e.tiers.load(path, span).result(120)
    rng = np.random.default_rng(0)
    checked = failed = 0
    worst = (0.0, 0.0)
    session = 0
    try:
        while checked < n_chunks:
            session += 1
            sid = f"s{session}"
            for e in engines:
                e.sessions.open(sid, 1).result(10)
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
                e.sessions.release(sid, 1).result(10)
            if not exact:
                value, mean = _worst_errors(trusted, ids, claims)
                worst = (max(worst[0], value), max(worst[1], mean))
            for span, start, digest in claims:
                tokens = tuple(int(t) for t in ids[: start + CHUNK_TOKENS])
                claim = SpanClaim("n", "g", span, start, digest, tokens)
                verdict = check_span(trusted, claim, exact)
                checked += 1
                failed += not verdict.passed
    finally:
        for e in engines:
            e.stop()
    return checked, failed, worst


def _worst_errors(
    trusted: TrustedModel, ids: np.ndarray, claims: list[tuple[LayerRange, int, bytes]]
) -> tuple[float, float]:
    """The largest relative error of one value, and of a chunk's upper quartile, of
    these sketches against the verifier's rows."""
    rows = {end: trusted.boundary_rows(ids, end) for end in {span.end for span, _, _ in claims}}
    errors = [
        sketch_errors(sketch, rows[span.end][start : start + CHUNK_TOKENS])
        for span, start, sketch in claims
    ]
    return max((float(e.max()) for e in errors), default=0.0), max(
        (upper_quartile(e) for e in errors), default=0.0
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--rates", default="0,0.01,0.1")
    p.add_argument("--honest-chunks", type=int, default=1000)
    p.add_argument(
        "--backend", default=DEFAULT_BACKEND, help="the nodes' backend (numpy: sketches)"
    )
    args = p.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    commitment = DIGEST_BYTES if commits_exactly(args.backend) else SKETCH_BYTES
    print(
        f"backend {args.backend}: {commitment} bytes per {CHUNK_TOKENS}-token chunk, "
        f"{(commitment + 8) / CHUNK_TOKENS:.3f} bytes/token on the wire with its start"
    )
    figures = throughput(rates, args.tokens, args.requests, args.backend)
    base = figures[0][0]
    for rate, (tps, bpt) in zip(rates, figures, strict=True):
        print(
            f"verify-rate {rate:5.2f}: {tps:6.2f} tokens/s ({tps / base:.3f}x rate 0), "
            f"commitments {bpt:.3f} bytes/token (TOPLOC ~{TOPLOC_BYTES_PER_TOKEN:.1f})"
        )
    for rate in (0.01, 0.1, 1.0):
        n = chunks_for(rate) if rate < 1 else 1
        sim = measured_detection(rate, n, 10000)
        print(
            f"rate {rate:4.2f}: >=99% detection of a node cheating on every chunk within "
            f"{n} chunks = {n * CHUNK_TOKENS} tokens of its span (measured over 10000 runs "
            "of the verifier's sampling: "
            f"{sim:.4f})"
        )
    checked, failed, worst = honest_checks(args.honest_chunks, args.backend)
    how = "exactly" if commits_exactly(args.backend) else "within the tolerance"
    print(f"honest chunks checked {how}: {checked}, failed: {failed} (false positives)")
    if not commits_exactly(args.backend):
        print(
            f"worst honest sketch error: one value {worst[0]:.3g} (tolerance {VALUE_RTOL:g}), "
            f"a chunk's upper quartile {worst[1]:.3g} (tolerance {QUARTILE_RTOL:g})"
        )
    if failed:
        raise SystemExit("an honest chunk failed its check")


if __name__ == "__main__":
    main()
