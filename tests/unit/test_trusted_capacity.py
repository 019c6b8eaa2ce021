"""Trusted nodes (tracker/trust/trusted_capacity.py): which chains of trusted nodes fit a claim,
a check that falls back to the tracker's engine when its chain does not answer, the flag's
parsing, and trust as configuration (no calibration, work billable at once). The chain's
network run is faked here; tests/e2e/test_trusted_nodes.py runs it on real nodes."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnet.cli.main import build_parser
from meshnet.cli.options import declare_tracker_options, given_argv
from meshnet.errors import DeadlineExceeded, WorkerDeath
from meshnet.layer_range import LayerRange
from meshnet.mesh_messages import MAX_ID, NodeAnnouncement, NodeLoad
from meshnet.model.sampling import SamplingParams
from meshnet.tracker.accounting.ledger import AttemptStatus, LedgerRecord, LedgerSpool
from meshnet.tracker.nodes.registry import NodeRecord, NodeState
from meshnet.tracker.nodes.routes import Route
from meshnet.tracker.nodes.store import Store
from meshnet.tracker.storage.database import SQLiteDatabase
from meshnet.tracker.trust import calibration
from meshnet.tracker.trust.calibration import NodeTrust
from meshnet.tracker.trust.sampled_check import Sampled
from meshnet.tracker.trust.trusted_capacity import (
    MAX_TRUSTED,
    ChainAnswer,
    TrustedCapacity,
    trusted_chain,
    trusted_ids,
)
from meshnet.tracker.trust.verifier import SpanClaim, Verdict, Verifier

FP = "f" * 64
LOAD = NodeLoad(sessions=0, kv_bytes=0, queue_depth=0, steps=0)


def _node(
    node_id: str,
    start: int,
    end: int,
    state: NodeState = NodeState.UP,
    backend: str = "fast",
    fingerprint: str = FP,
) -> NodeRecord:
    layers = LayerRange(start, end)
    return NodeRecord(node_id, f"{node_id}:1", fingerprint, layers, backend, 0, 1, state, 0.0, LOAD)


def _ids(chain: Route | None) -> list[str] | None:
    return None if chain is None else [h.node_id for h in chain]


TRUSTED = frozenset({"a", "b", "c", "d", "q8", "other", "late", "gone"})
NODES = [
    _node("a", 0, 2),
    _node("b", 2, 4),
    _node("c", 0, 4),
    _node("d", 0, 3),
    _node("u", 0, 2),  # up, fits, but not trusted
    _node("q8", 0, 2, backend="q8"),
    _node("other", 0, 2, fingerprint="e" * 64),
    _node("late", 2, 3, state=NodeState.CALIBRATING),
    _node("gone", 3, 4, state=NodeState.DOWN),
]


@pytest.mark.parametrize(
    ("end", "backend", "chain"),
    [
        (2, "fast", ["a"]),  # a range that ends at the claim's end
        (4, "fast", ["c"]),  # the fewest hops: c, not a > b
        (3, "fast", ["d"]),  # "late" (2:3) is not up: a > late does not count
        (1, "fast", None),  # nothing ends at 1: a (0:2) runs past it
        (2, "q8", ["q8"]),  # only nodes on the claim's backend
        (4, "q8", None),
    ],
)
def test_the_chain_of_trusted_nodes_that_fits_a_claims_end(
    end: int, backend: str, chain: list[str] | None
) -> None:
    assert _ids(trusted_chain(NODES, TRUSTED, FP, backend, end)) == chain


def test_a_chain_chains_from_layer_zero_through_up_trusted_nodes_only() -> None:
    nodes = [_node("a", 0, 2), _node("b", 2, 4), _node("u", 0, 2)]
    assert _ids(trusted_chain(nodes, frozenset({"a", "b"}), FP, "fast", 4)) == ["a", "b"]
    assert trusted_chain(nodes, frozenset({"b"}), FP, "fast", 4) is None  # u is not trusted
    quarantined = [_node("a", 0, 2, NodeState.QUARANTINED), _node("b", 2, 4)]
    assert trusted_chain(quarantined, frozenset({"a", "b"}), FP, "fast", 4) is None
    resting = frozenset({"a"})
    assert trusted_chain(nodes, frozenset({"a", "b"}), FP, "fast", 4, resting) is None
    replicas = [_node("z", 0, 2), *nodes]  # of as many hops, the smallest ids
    assert _ids(trusted_chain(replicas, frozenset({"z", "a", "b"}), FP, "fast", 2)) == ["a"]
    assert trusted_chain(nodes, frozenset({"a"}), "e" * 64, "fast", 2) is None  # other model


FIRST = LayerRange(0, 2)


def _claim(start: int = 0, layers: LayerRange = FIRST) -> SpanClaim:
    tokens = tuple(range(start + 32))
    return SpanClaim("u", "g", layers, start, b"\x01" * 16, tokens)


class _Chain:
    """A faked chain run: answers ``digests`` (and ``logits`` when asked) or raises
    ``error``; records what it ran."""

    def __init__(
        self,
        digests: dict[int, bytes],
        error: Exception | None = None,
        logits: np.ndarray | None = None,
    ) -> None:
        self.digests = digests
        self.error = error
        self.logits = logits
        self.ran: list[tuple[list[str], int, int | None]] = []

    async def __call__(
        self, chain: Route, tokens: np.ndarray, logits_from: int | None
    ) -> ChainAnswer:
        self.ran.append(([h.node_id for h in chain], len(tokens), logits_from))
        if self.error is not None:
            raise self.error
        return ChainAnswer(self.digests, self.logits if logits_from is not None else None)


def _capacity(run: _Chain, nodes: list[NodeRecord] | None = None) -> TrustedCapacity:
    listed = [_node("t", 0, 2), _node("t2", 0, 4)] if nodes is None else nodes
    return TrustedCapacity(frozenset({"t", "t2"}), FP, lambda: listed, run)


def test_a_trusted_chain_passes_or_fails_a_claim_of_a_first_range() -> None:
    honest = _Chain({0: b"\x01" * 16})
    capacity = _capacity(honest)
    [v] = asyncio.run(capacity.check(_claim(), "fast")) or []
    assert v.passed and v.detail == "exact on trusted t"
    assert honest.ran == [(["t"], 32, None)]  # the claim's tokens [0, chunk end)
    other = _capacity(_Chain({0: b"\x02" * 16, 32: b"\x01" * 16}))
    [v] = asyncio.run(other.check(_claim(), "fast")) or []
    assert not v.passed and "trusted t 0202" in v.detail
    assert (other.stats.ran, other.checks["t"]) == (1, 1)


def test_a_claim_after_other_hops_that_differs_is_left_to_the_engine() -> None:
    capacity = _capacity(_Chain({0: b"\x02" * 16}))  # t2 serves 0:4
    assert asyncio.run(capacity.check(_claim(0, LayerRange(2, 4)), "fast")) is None
    assert capacity.stats.upstream == 1  # the engine's check_claim says whom to blame


@pytest.mark.parametrize(
    "error",
    [WorkerDeath("node t is gone", "t"), DeadlineExceeded("node t did not answer", "t")],
)
def test_a_chain_that_does_not_answer_leaves_the_check_to_the_engine(error: Exception) -> None:
    dead = _Chain({}, error)
    capacity = _capacity(dead)
    assert asyncio.run(capacity.check(_claim(), "fast")) is None
    assert capacity.stats.unanswered == 1
    assert asyncio.run(capacity.check(_claim(), "fast")) is None  # t rests: not asked again
    assert (len(dead.ran), capacity.stats.unfit, capacity.checks["t"]) == (1, 1, 0)


def test_a_chain_that_does_not_commit_the_chunk_or_fits_nothing_is_no_verdict() -> None:
    silent = _capacity(_Chain({32: b"\x01" * 16}))
    assert asyncio.run(silent.check(_claim(), "fast")) is None
    assert silent.stats.unanswered == 1
    unfit = _capacity(_Chain({0: b"\x01" * 16}), nodes=[_node("t", 0, 2, backend="q8")])
    assert asyncio.run(unfit.check(_claim(), "fast")) is None
    assert unfit.stats.unfit == 1


def _picks(start: int, wrong_at: int = -1) -> Sampled:
    """Greedy picks from the logits of ``_logits``: the id at q is (q - 1) % 10."""
    picked = tuple(
        (q, ((q - 1) % 10 + (q == wrong_at)) % 10) for q in range(start + 1, start + 32 + 1)
    )
    return Sampled(SamplingParams(temperature=0.0), start + 1, picked)


def _logits(start: int) -> np.ndarray:
    """[32, 10]: position p's likeliest id is p % 10."""
    positions = np.arange(start, start + 32)
    return np.eye(10, dtype=np.float32)[positions % 10]


@pytest.mark.parametrize(("wrong_at", "passed"), [(-1, True), (50, False)])
def test_a_last_hops_picks_are_checked_on_the_trusted_chains_logits(
    wrong_at: int, passed: bool
) -> None:
    """The chain's last hop answers the logits of the chunk's positions (one step each);
    a last hop whose rows are honest and whose picks are not fails, though it follows
    other hops (honest rows mean honest inputs)."""
    start, last = 32, LayerRange(2, 4)
    run = _Chain({start: b"\x01" * 16}, logits=_logits(start))
    capacity = _capacity(run)  # t2 serves 0:4
    claim = dataclasses.replace(_claim(start, last), sampled=_picks(start, wrong_at))
    [v] = asyncio.run(capacity.check(claim, "fast")) or []
    assert run.ran == [(["t2"], 64, start)]
    assert v.passed is passed, v.detail
    if not passed:
        assert (
            "position 50: sampled 0, the verifier's sampler picks 9" in v.detail
            and "(trusted t2)" in v.detail
        )


class _Engine:
    """Stands in for the tracker's trusted model where ``check_claim`` is faked."""

    backend = "fast"

    def on(self, backend: str) -> _Engine:
        return self


def test_the_verifier_checks_on_the_engine_what_trusted_nodes_did_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from meshnet.tracker.trust import verifier

    engine: list[int] = []

    def on_engine(model: Any, c: SpanClaim, exact: bool = True) -> list[Verdict]:
        engine.append(c.token_start)
        return [Verdict(c, True, "exact")]

    monkeypatch.setattr(verifier, "check_claim", on_engine)
    kept: list[Verdict] = []
    capacity = _capacity(_Chain({}, WorkerDeath("node t is gone", "t")))

    async def scenario() -> None:
        v = Verifier(_Engine(), 1.0, kept.append)  # type: ignore[arg-type]
        v.elsewhere = capacity.check
        v.offer(_claim(0))
        await asyncio.wait_for(v.drain(), 5)
        capacity.run = _Chain({32: b"\x01" * 16})
        capacity._resting.clear()  # t answers again
        v.offer(_claim(32))
        await asyncio.wait_for(v.drain(), 5)

    asyncio.run(scenario())
    assert engine == [0]  # the trusted node's failure is not the claim's: checked here
    assert [(k.passed, k.detail) for k in kept] == [(True, "exact"), (True, "exact on trusted t")]


def test_trusted_ids_are_node_ids_and_bounded() -> None:
    assert trusted_ids(["a", "node-1", "a", "x.y_z"]) == {"a", "node-1", "x.y_z"}
    for bad in ["", "a b", "n/1", "é", "x" * (MAX_ID + 1)]:
        with pytest.raises(ValueError, match="not a node id"):
            trusted_ids([bad])
    with pytest.raises(ValueError, match="at most"):
        trusted_ids(f"n{i}" for i in range(MAX_TRUSTED + 1))


def test_the_flag_is_repeatable_refuses_bad_ids_and_reaches_the_tracker_from_up(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["tracker", "--trusted-node", "a", "--trusted-node", "b"])
    assert args.trusted_node == ["a", "b"]
    assert build_parser().parse_args(["tracker"]).trusted_node is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["tracker", "--trusted-node", "a b"])
    assert "not a node id" in capsys.readouterr().err
    up = build_parser().parse_args(["up", "--trusted-node", "a", "--trusted-node", "b"])
    argv = given_argv(declare_tracker_options, up)
    assert argv == ["--trusted-node", "a", "--trusted-node", "b"]
    assert build_parser().parse_args(["tracker", *argv]).trusted_node == ["a", "b"]


def test_a_trusted_node_is_up_without_a_calibration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def never(*args: Any) -> str:
        raise AssertionError("a trusted node was calibrated")

    monkeypatch.setattr(calibration, "run_calibration", never)
    store = Store(SQLiteDatabase(tmp_path / "t.db"))
    announce = NodeAnnouncement(
        node_id="t",
        address="127.0.0.1:1",
        fingerprint=FP,
        layer_start=0,
        layer_end=2,
        backend="fast",
        kv_budget_bytes=0,
        pid=1,
        load=LOAD,
    )

    async def scenario() -> None:
        trust = NodeTrust(store, None, FP, _Engine(), lambda n, r: None, frozenset({"t"}))  # type: ignore[arg-type]
        store.register(announce, 0.0)
        store.set_state("t", NodeState.QUARANTINED, "from before")  # a tracker restarted
        trust.decide("t")
        assert [(n.state, n.down_reason) for n in store.nodes()] == [(NodeState.UP, "")]
        assert await trust.calibrated("t", 1.0)  # a heal or placement may route it at once
        assert (trust.calibrations, trust.runs["t"]) == (0, 0)

    asyncio.run(scenario())


def test_a_trusted_nodes_work_is_billable_at_once() -> None:
    written: list[LedgerRecord] = []
    spool = LedgerSpool(lambda records, when: written.extend(records), verifying=True)
    spool.trusted = frozenset({"t"})
    done = AttemptStatus.COMPLETED
    spool.submit([LedgerRecord("g", 1, n, 0, 2, 0, 40, done) for n in ("t", "u")])
    spool.submit([LedgerRecord("g", 1, "t", 0, 2, 40, 50, AttemptStatus.FAILED)])
    assert [(r.node_id, r.status) for r in written] == [
        ("t", AttemptStatus.COMPLETED),
        ("u", AttemptStatus.UNVERIFIED),
        ("t", AttemptStatus.FAILED),
    ]
    assert written[0].billable and not written[1].billable
