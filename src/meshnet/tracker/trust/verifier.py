"""The verifier: re-runs a sample of nodes' committed spans on trusted capacity.

Trusted capacity is the tracker's own engine: shards ``[0, end)`` of the
served model on the node's backend, loaded on first use per boundary ``end``;
where trusted nodes fit a claim, they check it first (``Verifier.elsewhere``:
trusted_capacity.py). Because the kernels are bit-exact whatever the batch,
chunking or split (docs/kernels.md), a check is exact: the rows of a chunk's
positions at the node's end boundary, re-computed from the session's token ids
``[0, chunk_end)`` (the prefix is needed for attention), must hash to the
node's commitment (protocol/commitments.py).

Each completed chunk is checked with probability ``rate``, off the request
path: a bounded queue and one worker whose compute runs in a thread. A full
queue skips the chunk (counted), so verification never slows a generation
down beyond the CPU it takes. Every verdict goes to ``on_verdict`` (the
tracker records it and quarantines a node that failed one).

The re-run starts from the token ids, so a node whose inputs came from a
cheating hop before it differs too, through no fault of its own. A claim that
differs is therefore blamed on its node only when every hop before it on the
route committed, for every position up to the chunk's end, exactly what the
verifier computes at that hop's boundary; the first hop that did not is the
one blamed, and when a hop before it committed too little to tell, there is
no verdict (``inconclusive``).

A node on a backend that is not bit-exact (``numpy``) commits top-k sketches
(protocol/sketches.py) instead of hashes; its claims are re-run on
``SKETCH_BACKEND`` (``fast``: float32 activations, as the reference's) and compared
with the sketch's tolerance, hops before it too (a route's hops share one backend:
routes.py). A commitment of the other kind fails.
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from meshnet.backends.base import BatchEntry
from meshnet.backends.shard import DEFAULT_BACKEND, Shard, load_shard
from meshnet.kv.cache import SequenceKV
from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import open_gguf
from meshnet.model.spec import read_spec
from meshnet.protocol.commitments import (
    CHUNK_TOKENS,
    DIGEST_BYTES,
    EXACT_BACKENDS,
    SKETCH_BYTES,
    chunk_digest,
    chunk_digests_of,
    row_digests,
)
from meshnet.protocol.sketches import sketch_mismatch
from meshnet.tracker.trust.sampled_check import Sampled, check_sampled

log = logging.getLogger(__name__)

# EXACT_BACKENDS (protocol/commitments.py): a node on one of them is checked on the same
# backend here, by hash; on another, on SKETCH_BACKEND, by sketch: float32 activations,
# as the numpy reference computes (q8's 8-bit activations would move rows past the
# sketch's tolerance).
SKETCH_BACKEND = "fast"
_MAX_SHARDS = 4  # boundaries whose shard [0, end) is held at once
_MAX_PREFIXES = 8  # generations' checked prefixes (their KV) held at once


@dataclass
class _Prefix:
    """The KV of ``tokens`` through a shard ``[0, end)``: a generation's checked prefix."""

    tokens: tuple[int, ...]
    kv: SequenceKV

    @property
    def length(self) -> int:
        return len(self.tokens)


class TrustedModel:
    """The served model on the tracker, for computing rows at any layer boundary.

    Thread-safe: one computation at a time (the verifier's worker, a calibration)."""

    def __init__(self, model_path: str, backend: str = DEFAULT_BACKEND) -> None:
        """``backend``: the one loaded first; by default the one nodes run by default."""
        self.model_path = model_path
        self.backend = backend
        self._file = open_gguf(model_path)
        self.spec = read_spec(self._file)
        self._shards: OrderedDict[int, Shard] = OrderedDict()
        self._prefixes: OrderedDict[tuple[str, int], _Prefix] = OrderedDict()  # (key, end)
        self._lock = threading.Lock()
        self._others: dict[str, TrustedModel] = {}  # the same model on other backends
        self._others_lock = threading.Lock()  # not _lock: that one is held while computing

    def on(self, backend: str) -> TrustedModel:
        """The same model computed on ``backend``: a node is checked against the
        numerics it claims to run (``q8`` nodes are exact against a ``q8`` engine, not a
        ``fast`` one); a backend whose bits vary with batching cannot be checked exactly,
        and its sketches are compared on ``SKETCH_BACKEND``. Made on first use; the
        process holds each backend's weights."""
        if backend not in EXACT_BACKENDS:
            backend = SKETCH_BACKEND
        if backend == self.backend:
            return self
        with self._others_lock:
            other = self._others.get(backend)
            if other is None:
                other = self._others[backend] = TrustedModel(self.model_path, backend)
            return other

    def boundary_rows(self, tokens: np.ndarray, end: int) -> np.ndarray:
        """Rows [T, d] after layer ``end - 1`` for ``tokens`` [T] fed from position 0
        (the embedding's rows when ``end`` is 0): what a node whose range ends at
        ``end`` commits to, before any final norm or head."""
        ids = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            if end == 0:
                return self._shard(1).backend.embed(ids)
            shard = self._shard(end)
            hidden = shard.backend.embed(ids)
            return shard.backend.run_layers(hidden, [BatchEntry(shard.backend.new_kv(), len(ids))])

    def rows_from(self, tokens: np.ndarray, end: int, first: int, key: str) -> np.ndarray:
        """Rows [T - first, d] after layer ``end - 1`` for positions ``first``.. of
        ``tokens`` fed from position 0; the KV of an earlier call for the same ``key``
        (a generation) whose tokens are a prefix of these is reused, so a session's
        chunks checked in order cost their own tokens, not the whole prefix again.
        (Bit-exact either way: the kernels do not depend on how positions are chunked.)"""
        ids = np.asarray(tokens, dtype=np.int64)
        with self._lock:
            shard = self._shard(end)
            held = self._prefixes.pop((key, end), None)
            done = 0 if held is None else held.length
            if held is None or done > first or held.tokens != tuple(ids[:done].tolist()):
                held, done = _Prefix((), shard.backend.new_kv()), 0
            new = ids[done:]
            hidden = shard.backend.run_layers(
                shard.backend.embed(new), [BatchEntry(held.kv, len(new))]
            )
            self._prefixes[(key, end)] = _Prefix(tuple(ids.tolist()), held.kv)
            while len(self._prefixes) > _MAX_PREFIXES:
                self._prefixes.popitem(last=False)
            return hidden[first - done :]

    def logits_of(self, row: np.ndarray) -> np.ndarray:
        """The head's logits [vocab] of one last-layer row [d] (what a last hop samples)."""
        return self.logits(row.reshape(1, -1))[0]

    def logits(self, rows: np.ndarray) -> np.ndarray:
        """The head's logits [T, vocab] of last-layer rows [T, d] (the same bits as one
        row at a time: the kernels do not depend on the batch)."""
        with self._lock:
            return self._shard(self.spec.n_layers).backend.head(rows)

    def _shard(self, end: int) -> Shard:
        shard = self._shards.get(end)
        if shard is None:
            shard = load_shard(self._file, self.spec, LayerRange(0, end), self.backend)
            self._shards[end] = shard
            while len(self._shards) > _MAX_SHARDS:
                self._shards.popitem(last=False)
        self._shards.move_to_end(end)
        return shard


@dataclass(frozen=True)
class Upstream:
    """A hop before the claim's node on its route, and what it committed: whether the
    node's inputs were honest, when its own check fails."""

    node_id: str
    layers: LayerRange
    chunks: tuple[tuple[int, bytes], ...]  # (start, digest) of chunks before the claim's end


@dataclass(frozen=True)
class SpanClaim:
    """A node's commitment to one chunk of a generation, and the tokens it came from."""

    node_id: str
    generation_id: str
    layers: LayerRange
    token_start: int
    digest: bytes
    tokens: tuple[int, ...]  # the session's ids fed at positions [0, token_end)
    upstream: tuple[Upstream, ...] = ()  # the route's hops before it, in order
    sampled: Sampled | None = None  # on the last hop: what it picked from these positions
    # (start, digest) of the rows it says it received, chunks up to its end (not on a first
    # range): whether the hop before it sent what it committed to.
    inputs: tuple[tuple[int, bytes], ...] = ()

    @property
    def token_end(self) -> int:
        return self.token_start + CHUNK_TOKENS


@dataclass(frozen=True)
class Verdict:
    claim: SpanClaim
    passed: bool
    detail: str


@dataclass
class VerifierStats:
    offered: int = 0  # chunks committed and seen by the verifier
    sampled: int = 0  # of those, drawn for a check
    skipped: int = 0  # drawn, but the queue was full
    passed: int = 0
    failed: int = 0
    inconclusive: int = 0  # differed, but its inputs could not be vouched for


def check_claim(model: TrustedModel, claim: SpanClaim, exact: bool = True) -> list[Verdict]:
    """Re-run ``claim``'s span on ``model`` and compare with its commitment: its verdict,
    or when it differs and its inputs came from hops before it, the verdict on the first
    of those that committed other bytes (its rows were computed from theirs); no verdict
    when the hops before it did not commit all they sent it (inconclusive). ``exact``:
    the route's nodes commit hashes (else sketches, compared with a tolerance)."""
    verdict = check_span(model, claim, exact)
    if verdict.passed or claim.layers.start == 0:
        return [verdict]
    for up in claim.upstream:
        have = dict(up.chunks)
        rows = model.boundary_rows(np.asarray(claim.tokens, np.int64), up.layers.end)
        for start in range(0, rows.shape[0] - CHUNK_TOKENS + 1, CHUNK_TOKENS):
            if start not in have:
                return []  # its inputs cannot be vouched for: no verdict either way
            tokens = claim.tokens[: start + CHUNK_TOKENS]
            culprit = SpanClaim(
                up.node_id, claim.generation_id, up.layers, start, have[start], tokens
            )
            why = compare_chunk(culprit.digest, rows[start : start + CHUNK_TOKENS], exact)
            if why:
                return [mismatch(culprit, why)]
    chained = [u.layers for u in claim.upstream]
    if not chained or chained[0].start != 0 or chained[-1].end != claim.layers.start:
        return []
    if not exact:  # the rows a hop received are no bits to compare with a sketch
        return [verdict]
    return _sent_or_computed(claim, verdict, rows)


def _sent_or_computed(claim: SpanClaim, verdict: Verdict, sent: np.ndarray) -> list[Verdict]:
    """The verdicts on a claim that differs though every hop before it committed exactly
    the verifier's rows (``sent``: those at its start). It computed other rows from the
    right inputs, or the hop before it sent other rows than it committed to: when the
    node's own input digests say so, one of the two lies and both fail; a node that did
    not commit its inputs cannot say so."""
    received = dict(claim.inputs)
    sender = claim.upstream[-1]
    for start, want in sorted(chunk_digests_of(sent, 0).items()):
        if start not in received or received[start] == want:
            continue
        committed = dict(sender.chunks)[start]
        tokens = claim.tokens[: start + CHUNK_TOKENS]
        what = f"positions [{start}, {start + CHUNK_TOKENS})"
        detail = (
            f"node {claim.node_id} says it received other rows from node {sender.node_id} "
            f"at {what} than {sender.node_id} committed to (one of them lies)"
        )
        culprit = SpanClaim(
            sender.node_id, claim.generation_id, sender.layers, start, committed, tokens
        )
        return [Verdict(claim, False, detail), Verdict(culprit, False, detail)]
    return [verdict]


def check_span(model: TrustedModel, claim: SpanClaim, exact: bool = True) -> Verdict:
    """The check of ``claim``'s own chunk, whatever its inputs were: exact for a hash,
    within the tolerance for a sketch (``exact`` False); and on the last hop of the ids
    it sampled from the chunk's rows (sampled_check.py)."""
    tokens = np.asarray(claim.tokens, np.int64)
    if len(tokens) < claim.token_end or claim.token_start < 0:
        return Verdict(claim, False, "the claim's tokens do not cover its chunk")
    rows = model.rows_from(tokens, claim.layers.end, claim.token_start, claim.generation_id)
    chunk = rows[:CHUNK_TOKENS]
    why = compare_chunk(claim.digest, chunk, exact)
    if why:
        return mismatch(claim, why)
    if claim.sampled is not None and claim.sampled.tokens:
        logits = model.logits(chunk)
        why = check_sampled(logits, claim.token_start, claim.tokens, claim.sampled, exact)
        if why:
            return Verdict(claim, False, f"layers {claim.layers} sampled other ids: {why}")
    return Verdict(claim, True, "exact" if exact else "within tolerance")


def compare_chunk(commitment: bytes, rows: np.ndarray, exact: bool) -> str:
    """Why ``commitment`` is not one of the chunk whose rows [32, d] the verifier
    computed; "" when it is. ``exact``: a hash, equal to the rows' bit for bit;
    else a sketch, within its tolerance (protocol/sketches.py)."""
    if len(commitment) != (DIGEST_BYTES if exact else SKETCH_BYTES):
        kind = "a hash" if exact else "a sketch"
        return f"commitment of the wrong kind ({len(commitment)} bytes, expected {kind})"
    if not exact:
        return sketch_mismatch(commitment, rows)
    want = chunk_digest(row_digests(rows))
    return "" if want == commitment else f"committed {commitment.hex()}, verifier {want.hex()}"


def mismatch(claim: SpanClaim, why: str) -> Verdict:
    """A failed verdict on ``claim``, its layers and positions saying where."""
    what = f"layers {claim.layers} positions [{claim.token_start}, {claim.token_end})"
    return Verdict(claim, False, f"{what}: {why}")


class Verifier:
    """Samples claims at ``rate`` and checks them in the background; call ``offer`` from
    the event loop (the first claim drawn starts the worker task there)."""

    def __init__(
        self,
        model: TrustedModel,
        rate: float,
        on_verdict: Callable[[Verdict], None],
        queue_size: int = 64,
        seed: int | None = None,
        backend_of: Callable[[str], str] | None = None,
    ) -> None:
        """``backend_of(node_id)``: the backend a node computes on (default: ``model``'s);
        a claim is checked on it (a route's hops share one: routes.py). It is asked when
        the claim is offered: a check runs later, from the queue, by when the node may
        have left and the registry forgotten its backend."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"verify rate must be in [0, 1], not {rate}")
        self.model = model
        self.backend_of = backend_of or (lambda node_id: model.backend)
        self.rate = rate
        self.on_verdict = on_verdict
        self.stats = VerifierStats()
        self._queue: asyncio.Queue[tuple[SpanClaim, str]] = asyncio.Queue(queue_size)
        self._random = random.Random(seed)
        self._worker: asyncio.Task[None] | None = None  # started by the first claim drawn
        # Checks a claim elsewhere first (trusted nodes: tracker/trust/trusted_capacity.py), given
        # its node's backend; None from it, or no hook, and the tracker's engine checks it.
        self.elsewhere: Callable[[SpanClaim, str], Awaitable[list[Verdict] | None]] | None = None

    def offer(self, claim: SpanClaim) -> bool:
        """Draw ``claim`` for a check with probability ``rate``; True when queued."""
        self.stats.offered += 1
        if not self.draw():
            return False
        self.stats.sampled += 1
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self.run())
        try:
            backend = self.backend_of(claim.node_id)
        except Exception:  # the registry unreadable (a database gone): not the generation's fault
            log.exception("no backend for %s: its claim goes unchecked", claim.node_id)
            self.stats.skipped += 1
            return False
        try:
            self._queue.put_nowait((claim, backend))
        except asyncio.QueueFull:
            self.stats.skipped += 1
            return False
        return True

    def draw(self) -> bool:
        """Whether the next claim is checked: true with probability ``rate``."""
        return self.rate > 0.0 and self._random.random() < self.rate

    async def run(self) -> None:
        """Check queued claims one at a time, for ever."""
        while True:
            claim, backend = await self._queue.get()
            try:
                exact = backend in EXACT_BACKENDS
                verdicts = None
                if self.elsewhere is not None and exact:  # a sketch is no bits to compare
                    verdicts = await self.elsewhere(claim, backend)
                if verdicts is None:
                    model = self.model.on(backend)
                    verdicts = await asyncio.to_thread(check_claim, model, claim, exact)
            except Exception:  # a bug in the check is not the node's fault: no verdict
                log.exception("checking %s of %s failed", claim.layers, claim.node_id)
            else:
                self.stats.inconclusive += not verdicts
                for verdict in verdicts:
                    self._report(verdict)
            finally:
                self._queue.task_done()

    def _report(self, verdict: Verdict) -> None:
        """Count a verdict and hand it on; a failure to record it (a database gone) is
        logged and the worker goes on."""
        if verdict.passed:
            self.stats.passed += 1
        else:
            self.stats.failed += 1
        try:
            self.on_verdict(verdict)
        except Exception:
            log.exception(
                "the verdict on %s of %s was not kept", verdict.claim.layers, verdict.claim.node_id
            )

    async def drain(self) -> None:
        """Wait until every queued claim is checked (tests, benchmarks)."""
        await self._queue.join()
