"""Commitments: chunk digests of boundary rows, the same however the rows were computed."""

from pathlib import Path

import numpy as np
import pytest

from meshnet.errors import MalformedBundle
from meshnet.layer_range import LayerRange
from meshnet.node.engine import NodeEngine
from meshnet.node.engine_types import EngineConfig
from meshnet.node.scheduler import StepWork
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol.commitments import CHUNK_TOKENS, EXACT_BACKENDS, RowLog, chunk_digests_of
from meshnet.tracker.links import commitments
from meshnet.tracker.trust.verifier import SpanClaim, TrustedModel, Upstream, check_claim


def _rows(n: int, d: int = 8, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, d)).astype(np.float32)


def test_a_row_log_commits_whole_chunks_whatever_the_steps() -> None:
    rows = _rows(100)
    want = chunk_digests_of(rows, 0)
    assert sorted(want) == [0, 32, 64]
    log = RowLog()
    got: dict[int, bytes] = {}
    position = 0
    for n in [40, 1, 1, 20, 3, 35]:  # a prompt, then decode steps and a replay
        got.update(log.add(position, rows[position : position + n]))
        position += n
    assert got == want


def test_one_ulp_changes_the_chunk() -> None:
    rows = _rows(32)
    bent = rows.copy()
    bent[17, 3] = np.nextafter(bent[17, 3], np.float32(np.inf))
    assert chunk_digests_of(rows, 0)[0] != chunk_digests_of(bent, 0)[0]


def test_a_rewound_log_commits_what_was_computed_again() -> None:
    rows, other = _rows(64), _rows(64, seed=1)
    log = RowLog()
    log.add(0, rows[:40])
    log.truncate(30)  # a turn's end cut the KV back
    tail = log.add(30, other[30:64])  # both chunks end among the rows computed again
    assert dict(tail) == chunk_digests_of(np.concatenate([rows[:30], other[30:]]), 0)


def test_kv_from_elsewhere_is_not_committed() -> None:
    rows = _rows(70)
    log = RowLog(40)  # imported 40 positions
    assert log.add(40, rows[40:70]) == []  # [32, 64) was not all computed here
    assert log.add(70, _rows(30)) != []  # [64, 96) was


def test_ledger_encoding_round_trips_and_cuts_to_what_was_committed() -> None:
    chunks = {0: b"a" * 16, 32: b"b" * 16, 64: b"c" * 16}
    kept = commitments.committed(chunks, 95)
    assert sorted(kept) == [0, 32]
    data = commitments.encode(kept)
    assert len(data) == 2 * commitments.RECORD_BYTES
    assert commitments.decode(data) == kept
    with pytest.raises(MalformedBundle):
        commitments.decode(data[:-1])


@pytest.mark.parametrize(
    "chunk", [pb.ChunkDigest(token_start=5, digest=b"x" * 16), pb.ChunkDigest(digest=b"x")]
)
def test_a_malformed_commitment_is_refused(chunk: pb.ChunkDigest) -> None:
    with pytest.raises(MalformedBundle):
        commitments.checked_chunks([chunk])


@pytest.mark.parametrize("backend", sorted(EXACT_BACKENDS))
def test_the_engines_commitments_match_the_verifiers(tiny_path: Path, backend: str) -> None:
    """A node of the first two layers and one of the last two commit what a trusted
    re-run from the token ids on their backend computes; a prompt then one-row decode
    steps. Each exact backend: the default (q8) and fast."""
    ids = np.random.default_rng(3).integers(0, 200, 70)
    trusted = TrustedModel(str(tiny_path), backend=backend)
    first, last = (
        NodeEngine(EngineConfig(backend=backend)),
        NodeEngine(EngineConfig(backend=backend)),
    )
    for e, layers in [(first, LayerRange(0, 2)), (last, LayerRange(2, 4))]:
        e.start()
        e.tiers.load(str(tiny_path), layers).result(30)
        e.sessions.open("s", 1).result(5)
    try:
        claims: list[tuple[LayerRange, int, bytes]] = []
        steps = [ids[:45], *[ids[i : i + 1] for i in range(45, 70)]]
        for n, x in enumerate(steps):
            w1 = StepWork("s", 1, x, None, step=n)
            h = first.submit(w1).result(10)
            w2 = StepWork("s", 1, h, None, step=n)
            last.submit(w2).result(10)
            claims += [(LayerRange(0, 2), s, d) for s, d in w1.chunks]
            claims += [(LayerRange(2, 4), s, d) for s, d in w2.chunks]
    finally:
        first.stop()
        last.stop()
    assert sorted((c[0].end, c[1]) for c in claims) == [(2, 0), (2, 32), (4, 0), (4, 32)]
    for layers, start, digest in claims:
        tokens = tuple(int(t) for t in ids[: start + CHUNK_TOKENS])
        claim = SpanClaim("n", "g", layers, start, digest, tokens)
        [verdict] = check_claim(trusted, claim)
        assert verdict.passed
    forged = SpanClaim("n", "g", LayerRange(0, 2), 32, bytes(16), tuple(int(t) for t in ids[:64]))
    [verdict] = check_claim(trusted, forged)
    assert not verdict.passed and verdict.claim.node_id == "n"
    # A later hop that differs because the hop before it cheated is not blamed: the
    # verdict falls on the first hop whose commitments differ; too few: no verdict.
    first = {(c[0].end, c[1]): c[2] for c in claims}
    bent = {0: first[(2, 0)], 32: bytes(16)}
    tokens = tuple(int(t) for t in ids[:64])
    after_cheat = _after("early", tokens, tuple(bent.items()))
    [verdict] = check_claim(trusted, after_cheat)
    assert not verdict.passed and verdict.claim.node_id == "early"
    assert verdict.claim.token_start == 32
    unvouched = _after("early", tokens, ((0, first[(2, 0)]),))
    assert check_claim(trusted, unvouched) == []
    honest_before = _after("early", tokens, ((0, first[(2, 0)]), (32, first[(2, 32)])))
    [verdict] = check_claim(trusted, honest_before)
    assert not verdict.passed and verdict.claim.node_id == "late"


def _after(
    upstream: str, tokens: tuple[int, ...], chunks: tuple[tuple[int, bytes], ...]
) -> SpanClaim:
    """A forged claim of node "late" on layers 2:4, chunk 32, whose inputs came from
    ``upstream`` on 0:2 with these commitments."""
    early = Upstream(upstream, LayerRange(0, 2), chunks)
    return SpanClaim("late", "g", LayerRange(2, 4), 32, bytes(16), tokens, (early,))


def _claim(start: int = 0) -> SpanClaim:
    return SpanClaim("n", "g", LayerRange(0, 2), start, bytes(16), tuple(range(start + 32)))


def _fast(node_id: str) -> str:
    """The backend every node of these tests registered with (the verifier asks, with
    no model to default to)."""
    return "fast"


def test_the_verifier_samples_at_its_rate_and_skips_when_full() -> None:
    import asyncio

    from meshnet.tracker.trust.verifier import Verifier

    async def scenario() -> None:
        never = Verifier(None, 0.0, lambda v: None)  # type: ignore[arg-type]
        assert not any(never.offer(_claim()) for _ in range(100))
        every = Verifier(None, 1.0, lambda v: None, queue_size=3, backend_of=_fast)  # type: ignore[arg-type]
        every._worker = asyncio.get_running_loop().create_future()  # type: ignore[assignment]
        taken = [every.offer(_claim(32 * i)) for i in range(5)]
        assert taken == [True, True, True, False, False]
        assert (every.stats.sampled, every.stats.skipped) == (5, 2)
        tenth = Verifier(None, 0.1, lambda v: None, 10_000, 7, _fast)  # type: ignore[arg-type]
        tenth._worker = asyncio.get_running_loop().create_future()  # type: ignore[assignment]
        drawn = sum(tenth.offer(_claim()) for _ in range(5000))
        assert 400 < drawn < 600

    asyncio.run(scenario())


def test_a_verifier_with_a_rate_out_of_range_is_refused() -> None:
    from meshnet.tracker.trust.verifier import Verifier

    with pytest.raises(ValueError):
        Verifier(None, 1.5, lambda v: None)  # type: ignore[arg-type]


def test_the_verifier_reuses_a_generations_prefix_exactly(tiny_path: Path) -> None:
    trusted = TrustedModel(str(tiny_path), backend="fast")
    ids = np.random.default_rng(5).integers(0, 200, 128)
    whole = trusted.boundary_rows(ids, 3)
    for first, end in [(0, 32), (32, 64), (96, 128), (64, 96), (64, 128)]:  # gaps, going back
        rows = trusted.rows_from(ids[:end], 3, first, "g")
        assert np.array_equal(rows, whole[first:end]), (first, end)
    other = ids.copy()
    other[10] += 1  # another generation's tokens under the same key: no reuse
    assert np.array_equal(
        trusted.rows_from(other[:64], 3, 32, "g"), trusted.boundary_rows(other[:64], 3)[32:]
    )


class _Model:
    """Stands in for the trusted model where ``check_claim`` is faked."""

    backend = "fast"

    def on(self, backend: str) -> "_Model":
        return self


def test_the_verifier_goes_on_when_a_verdict_cannot_be_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import asyncio

    from meshnet.tracker.trust import verifier
    from meshnet.tracker.trust.verifier import Verdict, Verifier

    monkeypatch.setattr(
        verifier, "check_claim", lambda model, c, exact: [Verdict(c, c.token_start == 0, "")]
    )
    kept: list[Verdict] = []

    def keep(v: Verdict) -> None:
        if not kept:
            kept.append(v)
            raise RuntimeError("the database is gone")
        kept.append(v)

    async def scenario() -> None:
        v = Verifier(_Model(), 1.0, keep)  # type: ignore[arg-type]
        for i in range(3):
            v.offer(_claim(32 * i))
        await asyncio.wait_for(v.drain(), 5)
        assert (v.stats.passed, v.stats.failed) == (1, 2)

    asyncio.run(scenario())
    assert [k.claim.token_start for k in kept] == [0, 32, 64]
