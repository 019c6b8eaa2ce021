"""The verifier checks each node on the backend it registered with: the tracker's engine
is made on the default backend (q8, what nodes run unless told), a node announcing
``fast`` is checked on ``fast``, and a numpy node's sketches on ``fast`` (float32
activations, as its own)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from meshnet.backends.shard import DEFAULT_BACKEND
from meshnet.layer_range import LayerRange
from meshnet.node.engine import NodeEngine
from meshnet.node.engine_types import EngineConfig
from meshnet.node.scheduler import StepWork
from meshnet.protocol.commitments import EXACT_BACKENDS
from meshnet.tracker.trust.verifier import (
    SKETCH_BACKEND,
    SpanClaim,
    TrustedModel,
    Verdict,
    Verifier,
)

IDS = np.random.default_rng(6).integers(0, 200, 64)
LAYERS = LayerRange(0, 2)


def _claims(tiny_path: Path, backend: str) -> list[SpanClaim]:
    """What node "n" on ``backend``, serving ``LAYERS``, commits to for ``IDS``: a
    prompt, then one-row decode steps."""
    engine = NodeEngine(EngineConfig(backend=backend))
    engine.start()
    try:
        engine.tiers.load(str(tiny_path), LAYERS).result(30)
        engine.sessions.open("s", 1).result(5)
        chunks: list[tuple[int, bytes]] = []
        for n, x in enumerate([IDS[:40], *[IDS[i : i + 1] for i in range(40, 64)]]):
            work = StepWork("s", 1, x, None, step=n)
            engine.submit(work).result(10)
            chunks += work.chunks
    finally:
        engine.stop()
    tokens = tuple(int(t) for t in IDS)
    return [SpanClaim("n", "g", LAYERS, s, d, tokens[: s + 32]) for s, d in chunks]


def _verdicts(model: TrustedModel, claims: list[SpanClaim], backend: str) -> list[Verdict]:
    """Every claim checked by a verifier told node "n" registered on ``backend``."""
    kept: list[Verdict] = []

    async def run() -> None:
        verifier = Verifier(model, 1.0, kept.append, backend_of=lambda node_id: backend)
        for claim in claims:
            assert verifier.offer(claim)
        await verifier.drain()

    asyncio.run(run())
    return kept


def test_the_trackers_engine_is_made_on_the_default_backend(tiny_path: Path) -> None:
    model = TrustedModel(str(tiny_path))
    assert model.backend == DEFAULT_BACKEND == "q8"
    assert model.on("q8") is model
    fast = model.on("fast")
    assert fast.backend == "fast" and model.on("fast") is fast  # made once
    assert model.on("numpy").backend == SKETCH_BACKEND == "fast"


@pytest.mark.parametrize("backend", sorted(EXACT_BACKENDS))
def test_a_node_is_checked_on_the_backend_it_announced(tiny_path: Path, backend: str) -> None:
    claims = _claims(tiny_path, backend)
    assert [c.token_start for c in claims] == [0, 32]
    model = TrustedModel(str(tiny_path))  # on the default backend, whatever the node's
    verdicts = _verdicts(model, claims, backend)
    assert len(verdicts) == 2 and all(v.passed for v in verdicts), verdicts
    # The check is exact: every other backend's rows are other bits (q8-kv16's cache
    # rounds to float16), so a node whose announced backend were not the one it ran on
    # would fail.
    for other in sorted(EXACT_BACKENDS - {backend}):
        assert not any(v.passed for v in _verdicts(model, claims, other)), other


def test_a_claim_is_checked_on_the_backend_its_node_had_when_it_was_offered(
    tiny_path: Path,
) -> None:
    """Checks run behind the generations, from a queue: a ``fast`` node that left the
    mesh before its claims came up (the registry then knows no backend for it) is still
    checked on ``fast``, not on the default backend, where its honest rows would fail."""
    claims = _claims(tiny_path, "fast")
    model = TrustedModel(str(tiny_path))
    registered = {"n": "fast"}
    kept: list[Verdict] = []

    async def run() -> None:
        verifier = Verifier(
            model,
            1.0,
            kept.append,
            backend_of=lambda node_id: registered.get(node_id, DEFAULT_BACKEND),
        )
        for claim in claims:
            assert verifier.offer(claim)
        registered.clear()  # the node drains and leaves before the worker runs
        await verifier.drain()

    asyncio.run(run())
    assert len(kept) == 2 and all(v.passed for v in kept), kept
