"""The chunks a generation's hops committed, made claims for the verifier once they
can be checked.

A hop's chunk is ready when the driver has committed all its positions (a hop may
commit positions it ran ahead, which a rewind then cuts). On a hop after the first
it also waits for every hop before it that ran the chunk in this epoch to send its
own commitment of it: the verifier vouches for a hop's inputs by what the hops
before it committed, and with a commitment missing it has no verdict on a hop
whose rows differ (verifier.check_claim). Those commitments can come after the
hop's own: in a ring each hop sends them on a stream of its own, read beside the
last hop's tokens (ring.py), and a forwarding hop's answer to a step is read
while the next one runs. A chunk claimed at once was then checked without them,
and a hop that committed honest rows but sent the next hop others went unblamed.

What is held back when the links are about to go (the generation's end, a
failover, a cancel) is claimed as it is (``final``): a hop that never sends its
commitments cannot keep the work after it from the verifier.

Nor can it keep its own: a hop commits every chunk it ran in its epoch (KV it was
given, a parked or imported prefix, is before its epoch's first position), so a
chunk whose positions the driver committed and whose commitment never came by the
generation's end was ``withheld``: work the verifier could not check, of a node
that could then compute anything unseen. The tracker takes it as a failed check.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from meshnet.protocol.commitments import CHUNK_TOKENS
from meshnet.tracker.links.commitments import committed
from meshnet.tracker.links.hop_link import HopLink
from meshnet.tracker.routing.generation import Generation
from meshnet.tracker.trust.sampled_check import Sampled
from meshnet.tracker.trust.verifier import SpanClaim, Upstream

_POLL_S = 0.005  # how often the wait at a generation's end looks for late commitments


def ready_claims(
    gen: Generation, fed: Sequence[int], final: bool = False
) -> tuple[list[SpanClaim], int]:
    """The claims of every chunk of ``gen``'s links now ready (each taken off the link's
    unclaimed ones), and how many chunks whose positions are committed wait for a hop
    before them; ``final``: none waits. ``fed``: every id fed so far, then the one
    just sampled."""
    claims: list[SpanClaim] = []
    waiting = 0
    for i, link in enumerate(gen.links):
        before = gen.links[:i]
        for start in sorted(link.unclaimed):  # a few: those completed since the last call
            if start + CHUNK_TOKENS > min(link.positions, len(fed)):
                continue  # not all its positions committed yet
            if not final and any(_owes(u, start) for u in before):
                waiting += 1
                continue
            link.unclaimed.discard(start)
            claims.append(_claim(gen, link, before, start, fed))
    return claims, waiting


async def claim_rest(
    gen: Generation, fed: Sequence[int], offer: Callable[[SpanClaim], None], grace_s: float
) -> list[SpanClaim]:
    """At a generation's end, with its links still read: give the hops up to ``grace_s``
    to send the commitments still to come, offer every chunk committed, and answer the
    chunks withheld (each as a claim with no digest)."""
    deadline = time.monotonic() + grace_s
    while True:
        final = time.monotonic() >= deadline
        claims, waiting = ready_claims(gen, fed, final)
        for claim in claims:
            offer(claim)
        missing = _first_withheld(gen, fed)
        if final or not (waiting or missing):
            return _withheld_claims(gen, fed, missing)
        await asyncio.sleep(_POLL_S)


def withheld(gen: Generation, fed: Sequence[int]) -> list[SpanClaim]:
    """For each hop that ran a chunk in this epoch whose positions the driver committed
    and whose commitment has not come, a claim with no digest of the first such chunk
    (one is enough to fail it)."""
    return _withheld_claims(gen, fed, _first_withheld(gen, fed))


def _withheld_claims(gen: Generation, fed: Sequence[int], first: dict[int, int]) -> list[SpanClaim]:
    return [
        _claim(gen, gen.links[i], gen.links[:i], start, fed, digest=b"")
        for i, start in first.items()
    ]


def _first_withheld(gen: Generation, fed: Sequence[int]) -> dict[int, int]:
    """Link index -> the start of its first chunk withheld (see ``withheld``)."""
    out: dict[int, int] = {}
    for i, link in enumerate(gen.links):
        last = min(link.positions, len(fed)) - CHUNK_TOKENS
        start = next((s for s in range(0, last + 1, CHUNK_TOKENS) if _owes(link, s)), None)
        if start is not None:
            out[i] = start
    return out


def _owes(link: HopLink, start: int) -> bool:
    """Whether ``link``'s hop ran the chunk at ``start`` in this epoch (it held none of
    it when the epoch began) and its commitment of it has not come yet."""
    return link.first_position <= start and start not in link.commitments


def _claim(
    gen: Generation,
    link: HopLink,
    before: Sequence[HopLink],
    start: int,
    fed: Sequence[int],
    digest: bytes | None = None,
) -> SpanClaim:
    """The claim of ``link``'s chunk at ``start``: its commitment, or ``digest``."""
    end = start + CHUNK_TOKENS
    upstream = tuple(
        Upstream(u.node_id, u.hop.layers, tuple(committed(u.commitments, end).items()))
        for u in before
    )
    return SpanClaim(
        link.node_id,
        gen.id,
        link.hop.layers,
        start,
        link.commitments[start] if digest is None else digest,
        tuple(fed[:end]),
        upstream,
        _sampled(gen, link.node_id, start, fed) if link.samples else None,
        tuple(committed(link.inputs, end).items()),
    )


def _sampled(gen: Generation, node_id: str, start: int, fed: Sequence[int]) -> Sampled:
    """The ids ``node_id``, a last hop, picked from the positions of the chunk at
    ``start`` (each id is fed one position after the one it was picked from)."""
    picked = tuple(
        (q, fed[q])
        for q in range(start + 1, min(start + CHUNK_TOKENS + 1, len(fed)))
        if gen.sampled_by.get(q) == node_id
    )
    return Sampled(gen.params, gen.first_sampled, picked)
