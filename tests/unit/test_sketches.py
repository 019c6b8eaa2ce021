"""Top-k sketches: what a node on a backend that is not bit-exact commits, read back,
checked within the tolerance against the verifier's rows, and kept in the ledger."""

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from meshnet.backends.base import BatchEntry
from meshnet.backends.shard import load_shard
from meshnet.errors import MalformedBundle
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import open_gguf
from meshnet.model.spec import read_spec
from meshnet.node.engine import EngineConfig, NodeEngine
from meshnet.node.scheduler import StepWork
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol.commitments import CHUNK_TOKENS, SKETCH_BYTES, RowLog
from meshnet.protocol.sketches import (
    POSITION_BYTES,
    QUARTILE_RTOL,
    SKETCH_K,
    VALUE_RTOL,
    SketchTooWide,
    committed_values,
    parse,
    position_sketches,
    sketch_errors,
    sketch_mismatch,
)
from meshnet.tracker.links import commitments
from meshnet.tracker.trust.verifier import (
    SpanClaim,
    TrustedModel,
    Upstream,
    check_claim,
    check_span,
    compare_chunk,
)


def _rows(n: int, d: int = 16, seed: int = 0) -> np.ndarray:
    return (10 * np.random.default_rng(seed).standard_normal((n, d))).astype(np.float32)


def _sketch(rows: np.ndarray) -> bytes:
    return b"".join(position_sketches(rows))


def test_a_sketch_reads_back_as_the_top_channels_and_their_values() -> None:
    rows = _rows(CHUNK_TOKENS)
    sketch = _sketch(rows)
    assert len(sketch) == SKETCH_BYTES == CHUNK_TOKENS * SKETCH_K * 4
    channels, mantissas = parse(sketch, rows.shape[1])
    want = np.argsort(-np.abs(rows), axis=1)[:, :SKETCH_K]
    assert np.array_equal(channels, want)
    values = np.take_along_axis(rows, want, axis=1)
    rebuilt = committed_values(values, mantissas)
    assert np.all(np.abs(rebuilt - values) <= 2.0**-17 * np.abs(values))
    assert sketch_mismatch(sketch, rows) == ""


def test_a_value_across_a_power_of_two_reads_back() -> None:
    """The exponent is the verifier's: a value just over 2 committed, just under
    2 recomputed, is rebuilt with the neighbouring exponent, not off by half."""
    rows = np.zeros((1, 4), np.float32)
    rows[0, :2] = [2.0 + 2e-6, -3.0]
    mine = rows.copy()
    mine[0, 0] = np.float32(2.0 - 2e-6)
    assert sketch_errors(_sketch(rows), mine).max() < 2e-5  # not 0.5


@pytest.mark.parametrize("length", [0, SKETCH_BYTES - 1, SKETCH_BYTES + 1, 16 + 1])
def test_a_sketch_of_a_wrong_length_is_refused(length: int) -> None:
    chunk = pb.ChunkDigest(token_start=0, digest=b"\x01" * length)
    with pytest.raises(MalformedBundle):
        commitments.checked_chunks([chunk])
    assert sketch_mismatch(b"\x01" * length, _rows(CHUNK_TOKENS)) != ""


def test_hashes_and_sketches_in_one_message_are_refused() -> None:
    chunks = [pb.ChunkDigest(digest=bytes(16)), pb.ChunkDigest(token_start=32, digest=bytes(256))]
    with pytest.raises(MalformedBundle):
        commitments.checked_chunks(chunks)
    assert commitments.checked_chunks(chunks[1:]) == {32: bytes(256)}


def test_a_sketch_naming_a_channel_out_of_the_row_or_twice_fails() -> None:
    rows = _rows(CHUNK_TOKENS, d=16)
    entries = bytearray(_sketch(rows))
    beyond = bytearray(entries)
    beyond[0:2] = (16).to_bytes(2, "little")
    assert "beyond" in sketch_mismatch(bytes(beyond), rows)
    twice = bytearray(entries)
    twice[4:6] = twice[0:2]
    assert "twice" in sketch_mismatch(bytes(twice), rows)


def test_rows_too_wide_for_a_channel_index_are_refused() -> None:
    with pytest.raises(SketchTooWide):
        position_sketches(np.zeros((1, 65536), np.float32))
    assert len(position_sketches(np.ones((1, 65535), np.float32))[0]) == POSITION_BYTES


def test_the_tolerance_lets_near_ties_swap_and_rounding_pass_but_not_more() -> None:
    rows = _rows(CHUNK_TOKENS)
    sketch = _sketch(rows)
    close = rows * np.float32(1 + QUARTILE_RTOL / 10)  # a backend's rounding: passes
    assert sketch_mismatch(sketch, close) == ""
    outlier = rows.copy()
    top = int(np.argmax(np.abs(outlier[5])))
    outlier[5, top] *= np.float32(1 + VALUE_RTOL / 4)  # one value a little off: passes
    assert sketch_mismatch(sketch, outlier) == ""
    outlier[5, top] = rows[5, top] * np.float32(1 + 4 * VALUE_RTOL)  # one far off: fails
    assert "position 5" in sketch_mismatch(sketch, outlier)
    drift = rows * np.float32(1 + 3 * QUARTILE_RTOL)  # every value a little off: fails
    assert "a quarter" in sketch_mismatch(sketch, drift)
    few = rows.copy()
    few[:4] *= np.float32(1 + 3 * QUARTILE_RTOL)  # an eighth of the values
    assert sketch_mismatch(sketch, few) == ""  # rare outliers are an honest backend's
    tie = np.zeros((CHUNK_TOKENS, 8), np.float32)
    tie[:, :3] = [5.0, 4.0, 4.000004]  # channel 2 beats channel 1 by a hair
    swapped = tie.copy()
    swapped[:, 1:3] = [4.000004, 4.0]  # the verifier sees them the other way round
    assert sketch_mismatch(_sketch(tie), swapped) == ""
    swapped[:, 2] = 3.0  # not a near-tie: channel 2 is not in the verifier's top 2
    assert sketch_mismatch(_sketch(tie), swapped) != ""


def test_a_sketch_row_log_commits_whole_chunks_whatever_the_steps() -> None:
    rows = _rows(100)
    log = RowLog(exact=False)
    got: dict[int, bytes] = {}
    position = 0
    for n in [40, 1, 1, 20, 3, 35]:
        got.update(log.add(position, rows[position : position + n]))
        position += n
    assert got == {s: _sketch(rows[s : s + CHUNK_TOKENS]) for s in (0, 32, 64)}
    assert all(len(d) == POSITION_BYTES for d in log.digests)  # 8 bytes kept per position


def test_ledger_encoding_keeps_hash_rows_and_tags_sketches() -> None:
    hashes = {0: bytes(range(16)), 32: b"b" * 16}
    old = b"".join(s.to_bytes(4, "little") + d for s, d in sorted(hashes.items()))
    assert commitments.encode(hashes) == old  # rows written before sketches read the same
    assert commitments.decode(old) == hashes
    sketches = {0: b"\x05" * SKETCH_BYTES, 4096: b"\x07" * SKETCH_BYTES}
    data = commitments.encode(sketches)
    assert data.startswith(commitments.TAGGED_MAGIC)
    assert len(data) == 4 + 2 * (5 + SKETCH_BYTES)
    assert commitments.decode(data) == sketches
    mixed = {0: bytes(16), 32: b"\x09" * SKETCH_BYTES}
    assert commitments.decode(commitments.encode(mixed)) == mixed
    for cut in [data[:-1], data[:6], data[:1] + b"XYZ" + data[4:]]:
        with pytest.raises(MalformedBundle):
            commitments.decode(cut)
    unknown = bytearray(data)
    unknown[8] = 7  # the first chunk's kind byte
    with pytest.raises(MalformedBundle):
        commitments.decode(bytes(unknown))
    with pytest.raises(MalformedBundle):
        commitments.encode({0: b"x" * 17})


def test_no_hash_record_reads_as_tagged() -> None:
    """A hash record's first byte is the low byte of a multiple of 32; the tagged
    form's first byte has low bits set: no record is read as the other form."""
    assert commitments.TAGGED_MAGIC[0] % CHUNK_TOKENS
    for start in range(0, 2**16, CHUNK_TOKENS):
        data = commitments.encode({start: bytes(16)})
        assert commitments.decode(data) == {start: bytes(16)}


# Honest numpy against the verifier's fast, and cheats, on the tiny model.


def _numpy_claims(path: Path, ids: np.ndarray) -> list[tuple[LayerRange, int, bytes]]:
    """The chunks two numpy nodes (layers 0:2 and 2:4) commit for a prompt then
    one-row decode steps."""
    engines = [NodeEngine(EngineConfig(backend="numpy")) for _ in range(2)]
    spans = [LayerRange(0, 2), LayerRange(2, 4)]
    for e, layers in zip(engines, spans, strict=True):
        e.start()
        e.tiers.load(str(path), layers).result(30)
        e.sessions.open("s", 1).result(5)
    claims: list[tuple[LayerRange, int, bytes]] = []
    try:
        steps = [ids[:45], *[ids[i : i + 1] for i in range(45, len(ids))]]
        for n, x in enumerate(steps):
            h = x
            for e, layers in zip(engines, spans, strict=True):
                w = StepWork("s", 1, h, None, step=n)
                h = e.submit(w).result(10)
                claims += [(layers, s, d) for s, d in w.chunks]
    finally:
        for e in engines:
            e.stop()
    return claims


def _cheat_rows(path: Path, ids: np.ndarray, end: int, cheat: str) -> np.ndarray:
    """Rows after layers [0, end) on numpy with one layer skipped or the embedding
    perturbed (+1e-3 in one channel, as tests/e2e/dishonest_node.py does)."""
    f = open_gguf(str(path))
    shard = load_shard(f, read_spec(f), LayerRange(0, end - (cheat == "skip")), "numpy")
    hidden = shard.backend.embed(ids)
    if cheat == "weights":
        hidden[:, 0] += np.float32(1e-3)
    return shard.backend.run_layers(hidden, [BatchEntry(shard.backend.new_kv(), len(ids))])


def test_honest_numpy_nodes_pass_within_the_tolerance_and_cheats_fail(tiny_path: Path) -> None:
    ids = np.random.default_rng(3).integers(0, 200, 70)
    trusted = TrustedModel(str(tiny_path), backend="fast")
    claims = _numpy_claims(tiny_path, ids)
    assert sorted((c[0].end, c[1]) for c in claims) == [(2, 0), (2, 32), (4, 0), (4, 32)]
    for layers, start, sketch in claims:
        assert len(sketch) == SKETCH_BYTES
        tokens = tuple(int(t) for t in ids[: start + CHUNK_TOKENS])
        claim = SpanClaim("n", "g", layers, start, sketch, tokens)
        [verdict] = check_claim(trusted, claim, exact=False)
        assert verdict.passed, verdict.detail
        wrong = check_span(trusted, claim)  # a sketch where a hash is due
        assert not wrong.passed and "wrong kind" in wrong.detail
    hashed = SpanClaim("n", "g", LayerRange(0, 2), 0, bytes(16), tuple(int(t) for t in ids[:32]))
    wrong = check_span(trusted, hashed, exact=False)  # a hash where a sketch is due
    assert not wrong.passed and "wrong kind" in wrong.detail
    for end in (2, 4):
        want = trusted.boundary_rows(ids[:64], end)
        for cheat in ("skip", "weights"):
            rows = _cheat_rows(tiny_path, ids[:64], end, cheat)
            for start in (0, 32):
                sketch = _sketch(rows[start : start + CHUNK_TOKENS])
                assert compare_chunk(sketch, want[start : start + CHUNK_TOKENS], False), (
                    end,
                    cheat,
                    start,
                )


def test_a_numpy_hop_after_a_cheating_one_is_not_blamed(tiny_path: Path) -> None:
    ids = np.random.default_rng(4).integers(0, 200, 64)
    trusted = TrustedModel(str(tiny_path), backend="fast")
    claims = {(c[0].end, c[1]): c[2] for c in _numpy_claims(tiny_path, ids)}
    tokens = tuple(int(t) for t in ids[:64])
    cheated = _sketch(_cheat_rows(tiny_path, ids[:64], 2, "weights")[32:64])
    early = Upstream("early", LayerRange(0, 2), ((0, claims[(2, 0)]), (32, cheated)))
    late = SpanClaim("late", "g", LayerRange(2, 4), 32, _sketch(_rows(32)), tokens, (early,))
    [verdict] = check_claim(trusted, late, exact=False)
    assert not verdict.passed and verdict.claim.node_id == "early"
    assert verdict.claim.token_start == 32
    honest = dataclasses.replace(early, chunks=((0, claims[(2, 0)]), (32, claims[(2, 32)])))
    [verdict] = check_claim(trusted, dataclasses.replace(late, upstream=(honest,)), exact=False)
    assert not verdict.passed and verdict.claim.node_id == "late"


def test_a_one_ulp_change_is_within_the_tolerance() -> None:
    """What a tolerance cannot catch (docs/verification.md): one ulp is far inside it."""
    rows = _rows(CHUNK_TOKENS)
    bent = rows.copy()
    bent[:, :] = np.nextafter(bent, np.float32(np.inf))
    assert sketch_mismatch(_sketch(bent), rows) == ""
