"""Trusted nodes (``meshnet tracker --trusted-node ID``) and their use as verification capacity.

Trust is configuration, never state: the ids are given when the tracker starts,
a node's id is authenticated (its key derives from the mesh secret and the id,
auth/mesh_keys.py), and nothing a node sends makes it trusted. A trusted node
is up without a calibration, its chunks are never sampled for a check (its work
is what checks are made against), and its ledger work is billable at once
(``completed``, never ``unverified``; ledger.py).

It is also capacity for the verifier: a claim on layers ``[s, end)`` of a
backend is re-run on a chain of up trusted nodes of that backend whose ranges
chain from layer 0 and whose last ends at ``end`` exactly (a node commits only
at its range's end). The chain runs the token ids ``[0, chunk_end)`` on a
throwaway session (a fresh uuid on every hop, as a calibration does), hop by hop
through the tracker: the first hop takes the ids, each later one the rows the
one before answered. The last hop's commitment for the chunk is the check, and
for a last hop's claim the ids it picked (``SpanClaim.sampled``) too: the chain's
last hop is then fed the chunk's positions one step each, each step answering
the logits of its row, and the sampler must pick the same ids from them
(sampled_check.py), as on the tracker's engine:

- equal (and the same picks): the claim passed (its detail names the chain);
- equal rows, other picks: the claim failed;
- different, on a claim of a first range: the claim failed;
- different, on a claim whose inputs came from hops before it: no verdict here;
  the tracker's engine checks it again, where the upstream blame lives
  (verifier.check_claim);
- no chain fits, or the chain did not answer (not reached, a timeout, a
  malformed answer): no verdict here either, and the check falls back to the
  tracker's engine. A trusted node's failure is never held against the node
  being checked; the trusted node rests for ``REST_S`` so that the next checks
  do not each wait for it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from meshnet.errors import MalformedBundle, MeshnetError
from meshnet.mesh_reports import check_node_id
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.tracker.links.channels import ChannelPool
from meshnet.tracker.links.commitments import checked_chunks
from meshnet.tracker.nodes.registry import NodeRecord
from meshnet.tracker.nodes.routes import Hop, Route
from meshnet.tracker.trust.sampled_check import check_sampled
from meshnet.tracker.trust.throwaway import run_steps
from meshnet.tracker.trust.verifier import SpanClaim, Verdict

log = logging.getLogger(__name__)

MAX_TRUSTED = 256  # ids one tracker may be told to trust
REST_S = 10.0  # a trusted node that did not answer a check is not asked again this long
_TIMEOUT_S = 15.0  # one hop of a check: open and answer ...
_ROW_TIMEOUT_S = 0.02  # ... and this much more per position it computes


@dataclass(frozen=True)
class ChainAnswer:
    """What a chain of trusted nodes computed for some tokens."""

    digests: dict[int, bytes]  # its last hop's commitments: chunk start -> digest
    logits: np.ndarray | None = None  # [T - logits_from, vocab], when asked for


# Runs ``tokens`` [T] through a chain; with ``logits_from`` (an int) the last hop's logits
# of every position from it on too. ``MeshnetError`` (naming the node where known) when a
# hop did not answer.
RunChain = Callable[[Route, np.ndarray, int | None], Awaitable[ChainAnswer]]


def trusted_ids(values: Iterable[str]) -> frozenset[str]:
    """The node ids of ``--trusted-node`` flags, checked; ``ValueError`` saying which is
    not a node id (as nodes name themselves) or that there are too many."""
    ids: set[str] = set()
    for value in values:
        ids.add(check_node_id(value))
    if len(ids) > MAX_TRUSTED:
        raise ValueError(f"at most {MAX_TRUSTED} trusted nodes, not {len(ids)}")
    return frozenset(ids)


def trusted_chain(
    nodes: Sequence[NodeRecord],
    trusted: frozenset[str],
    fingerprint: str,
    backend: str,
    end: int,
    resting: frozenset[str] = frozenset(),
) -> Route | None:
    """The fewest up trusted nodes of ``fingerprint`` on ``backend`` whose layer ranges
    chain from 0 to ``end`` exactly, or None when none do. ``resting``: trusted nodes
    not to use now. Among chains of as many hops the one of the smallest node ids
    (in hop order) is taken, so a check's route does not depend on registry order."""
    usable = sorted(
        (
            n
            for n in nodes
            if n.node_id in trusted
            and n.node_id not in resting
            and n.routable
            and n.fingerprint == fingerprint
            and n.backend == backend
        ),
        key=lambda n: n.node_id,
    )
    reached: dict[int, Route] = {0: ()}  # boundary -> the first chain found to it
    frontier = [0]
    while frontier and end not in reached:  # breadth first: fewest hops
        following = []
        for boundary in frontier:
            for n in usable:
                assert n.layers is not None  # routable
                if n.layers.start != boundary or n.layers.end > end or n.layers.end in reached:
                    continue
                reached[n.layers.end] = (*reached[boundary], Hop(n.node_id, n.address, n.layers))
                following.append(n.layers.end)
        frontier = following
    chain = reached.get(end)
    return chain if chain else None


@dataclass
class TrustedStats:
    ran: int = 0  # checks a trusted chain answered
    unfit: int = 0  # no chain of up trusted nodes fits the claim's span: the engine's
    unanswered: int = 0  # the chain did not answer: the engine's
    upstream: int = 0  # differed on a claim with hops before it: the engine blames


class TrustedCapacity:
    """Checks claims on chains of trusted nodes; call ``check`` from the event loop."""

    def __init__(
        self,
        trusted: frozenset[str],
        fingerprint: str,
        nodes: Callable[[], Sequence[NodeRecord]],
        run: RunChain,
    ) -> None:
        self.trusted = trusted
        self.fingerprint = fingerprint
        self.nodes = nodes  # the registry's records now
        self.run = run
        self.stats = TrustedStats()
        self.checks: Counter[str] = Counter()  # per trusted node: checks it took part in
        self._resting: dict[str, float] = {}  # node id -> monotonic time it may be asked again

    async def check(self, claim: SpanClaim, backend: str) -> list[Verdict] | None:
        """The verdict of a trusted chain on ``claim`` (its node computes on ``backend``);
        None when the tracker's engine is to check it (see the module docstring)."""
        now = time.monotonic()
        self._resting = {k: t for k, t in self._resting.items() if t > now}
        chain = trusted_chain(
            self.nodes(),
            self.trusted,
            self.fingerprint,
            backend,
            claim.layers.end,
            frozenset(self._resting),
        )
        if chain is None:
            self.stats.unfit += 1
            return None
        names = " > ".join(h.node_id for h in chain)
        picks = claim.sampled if claim.sampled is not None and claim.sampled.tokens else None
        logits_from = claim.token_start if picks is not None else None
        try:
            answer = await self.run(chain, np.asarray(claim.tokens, np.int64), logits_from)
        except MeshnetError as e:
            self._unanswered(chain, e.node_id, f"did not answer: {e}")
            return None
        want = answer.digests.get(claim.token_start)
        if want is None:
            self._unanswered(chain, chain[-1].node_id, "did not commit the chunk")
            return None
        self.stats.ran += 1
        self.checks.update(h.node_id for h in chain)
        if want != claim.digest:
            return self._differs(claim, names, want)
        if picks is not None and answer.logits is not None:
            why = check_sampled(answer.logits, claim.token_start, claim.tokens, picks)
            if why:  # its rows were honest, so its inputs were: the picks are its own
                detail = f"layers {claim.layers} sampled other ids: {why} (trusted {names})"
                return [Verdict(claim, False, detail)]
        return [Verdict(claim, True, f"exact on trusted {names}")]

    def _differs(self, claim: SpanClaim, names: str, want: bytes) -> list[Verdict] | None:
        """A claim whose chunk the chain computed otherwise: failed on a first range; after
        other hops, left to the engine (was it this node, or a hop before it?)."""
        if claim.layers.start > 0:
            self.stats.upstream += 1
            return None
        what = f"layers {claim.layers} positions [{claim.token_start}, {claim.token_end})"
        detail = f"{what}: committed {claim.digest.hex()}, trusted {names} {want.hex()}"
        return [Verdict(claim, False, detail)]

    def _unanswered(self, chain: Route, node_id: str, why: str) -> None:
        """A chain that did not answer: its node (or, not knowing which, every one of its
        nodes) rests, and the engine checks the claim."""
        self.stats.unanswered += 1
        names = [h.node_id for h in chain]
        culprits = [node_id] if node_id in names else names
        log.warning("trusted check on %s %s; the tracker's engine checks it", culprits, why)
        until = time.monotonic() + REST_S
        self._resting.update((c, until) for c in culprits)


async def run_chain(
    channels: ChannelPool,
    fingerprint: str,
    shape: tuple[int, int],
    chain: Route,
    tokens: np.ndarray,
    logits_from: int | None = None,
) -> ChainAnswer:
    """Feed ``tokens`` [T] through ``chain`` hop by hop, each hop a throwaway session
    (released when its stream ends) of one step, or with ``logits_from`` the last hop one
    step up to that position and one step per position after it, each answering its
    row's logits. ``shape``: the model's (hidden size, vocabulary size)."""
    width, vocab = shape
    x = tokens
    for hop in chain[:-1]:
        [result] = await _run_hop(channels, fingerprint, hop, [x])
        x = codec.decode(result.output, codec.TensorLimits("f32", 2, len(tokens), width))
        if x.shape[0] != len(tokens):
            raise MalformedBundle(f"{len(x)} rows for {len(tokens)} tokens", hop.node_id)
    last = chain[-1]
    if logits_from is None or not 0 <= logits_from < len(tokens):
        [result] = await _run_hop(channels, fingerprint, last, [x])
        return ChainAnswer(checked_chunks(result.commitments))
    steps = [x[: logits_from + 1], *(x[p : p + 1] for p in range(logits_from + 1, len(x)))]
    results = await _run_hop(channels, fingerprint, last, steps)
    digests: dict[int, bytes] = {}
    for result in results:
        digests.update(checked_chunks(result.commitments))
    one = codec.TensorLimits("f32", 2, 1, vocab)
    logits = np.concatenate([codec.decode(r.output, one) for r in results])
    return ChainAnswer(digests, logits)


async def _run_hop(
    channels: ChannelPool, fingerprint: str, hop: Hop, steps: Sequence[np.ndarray]
) -> list[pb.StepResult]:
    """Run ``steps`` on ``hop`` as one throwaway session, given time by their rows."""
    timeout_s = _TIMEOUT_S + _ROW_TIMEOUT_S * sum(len(x) for x in steps)
    return await run_steps(channels, fingerprint, hop, steps, timeout_s)
