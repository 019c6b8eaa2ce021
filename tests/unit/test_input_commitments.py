"""A hop's word on what it was sent: the digests of the rows it received, which settle
whether a claim that differs is its own doing or the hop before it sent other rows
than it committed to (a node must not be able to frame the honest one after it)."""

from pathlib import Path

import numpy as np
import pytest

from meshnet.backends.shard import DEFAULT_BACKEND
from meshnet.layer_range import LayerRange
from meshnet.node.engine import NodeEngine
from meshnet.node.engine_types import EngineConfig
from meshnet.node.scheduler import StepWork
from meshnet.protocol.commitments import chunk_digests_of
from meshnet.tracker.trust.verifier import SpanClaim, TrustedModel, Upstream, check_claim

IDS = np.random.default_rng(4).integers(0, 200, 64)
BACKEND = DEFAULT_BACKEND  # the nodes' and the verifier's: what nodes run unless told


@pytest.fixture(scope="module")
def trusted(tiny_path: Path) -> TrustedModel:
    return TrustedModel(str(tiny_path), backend=BACKEND)


def test_a_later_hop_commits_the_rows_it_received(tiny_path: Path, trusted: TrustedModel) -> None:
    first, last = (
        NodeEngine(EngineConfig(backend=BACKEND)),
        NodeEngine(EngineConfig(backend=BACKEND)),
    )
    for e, layers in [(first, LayerRange(0, 2)), (last, LayerRange(2, 4))]:
        e.start()
        e.tiers.load(str(tiny_path), layers).result(30)
        e.sessions.open("s", 1).result(5)
    inputs: dict[int, bytes] = {}
    try:
        for n, x in enumerate([IDS[:40], *[IDS[i : i + 1] for i in range(40, 64)]]):
            w1 = StepWork("s", 1, x, None, step=n)
            h = first.submit(w1).result(10)
            w2 = StepWork("s", 1, h, None, step=n)
            last.submit(w2).result(10)
            assert w1.inputs == {}  # the first range is sent ids by the tracker, who knows them
            inputs.update(w2.inputs)
    finally:
        first.stop()
        last.stop()
    assert inputs == chunk_digests_of(trusted.boundary_rows(IDS, 2), 0)


def _claim(trusted: TrustedModel, received: dict[int, bytes]) -> SpanClaim:
    """Node "late" on 2:4 claims chunk 32 with other bytes than the verifier's, after node
    "early" on 0:2 committed exactly the verifier's rows; ``received``: late's word."""
    honest = chunk_digests_of(trusted.boundary_rows(IDS, 2), 0)
    early = Upstream("early", LayerRange(0, 2), tuple(sorted(honest.items())))
    tokens = tuple(int(t) for t in IDS)
    inputs = tuple(sorted(received.items()))
    return SpanClaim("late", "g", LayerRange(2, 4), 32, bytes(16), tokens, (early,), None, inputs)


def test_a_node_that_received_what_was_committed_answers_for_its_own_rows(
    trusted: TrustedModel,
) -> None:
    honest = chunk_digests_of(trusted.boundary_rows(IDS, 2), 0)
    for received in (honest, {}):  # its word agrees, or it gave none
        [verdict] = check_claim(trusted, _claim(trusted, received))
        assert not verdict.passed and verdict.claim.node_id == "late"


@pytest.mark.parametrize("chunk", [0, 32])
def test_when_sent_and_received_rows_differ_both_hops_fail(
    trusted: TrustedModel, chunk: int
) -> None:
    """Rows sent before the claim's chunk count too: its KV holds them."""
    received = dict(chunk_digests_of(trusted.boundary_rows(IDS, 2), 0))
    received[chunk] = bytes(16)
    verdicts = check_claim(trusted, _claim(trusted, received))
    assert sorted((v.claim.node_id, v.passed) for v in verdicts) == [
        ("early", False),
        ("late", False),
    ]
    assert all(f"at positions [{chunk}, {chunk + 32})" in v.detail for v in verdicts)
    assert all("one of them lies" in v.detail for v in verdicts)
