"""When a hop's committed chunk goes to the verifier: not before the hops ahead of it
sent theirs of it (their streams are read apart from its own), and at the end as is;
and which chunks a hop ran and never committed (withheld)."""

import asyncio
from typing import Any

from meshnet.layer_range import LayerRange
from meshnet.model.sampling import SamplingParams
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol.commitments import CHUNK_TOKENS
from meshnet.tracker.links.hop_link import HopLink
from meshnet.tracker.nodes.routes import Hop
from meshnet.tracker.routing.generation import Generation
from meshnet.tracker.routing.span_claims import claim_rest, ready_claims, withheld
from meshnet.tracker.trust.verifier import SpanClaim

FED = list(range(2 * CHUNK_TOKENS + 1))  # two chunks' positions fed, and one id sampled


def _link(node_id: str, layers: LayerRange, positions: int, first_position: int = 0) -> HopLink:
    no_call: Any = None  # nothing here touches the stream
    link = HopLink(Hop(node_id, "127.0.0.1:1", layers), no_call, 1, no_call)
    link.positions, link.first_position = positions, first_position
    return link


def _commit(link: HopLink, *starts: int) -> None:
    """``link``'s node sends its commitments of the chunks at ``starts`` (inputs too)."""
    link._note(
        [
            pb.ChunkDigest(token_start=s, digest=bytes([s % 251]) * 16, input_digest=bytes(16))
            for s in starts
        ]
    )


def _ring(first_position: int = 0) -> Generation:
    """A generation on a 0:2 -> 2:4 route whose driver committed two chunks' positions."""
    gen = Generation("g", (), 0.0, SamplingParams())
    positions = len(FED) - 1
    gen.links = [
        _link("first", LayerRange(0, 2), positions, first_position),
        _link("last", LayerRange(2, 4), positions, first_position),
    ]
    return gen


def _claimed(claims: list[SpanClaim]) -> list[tuple[str, int]]:
    return [(c.node_id, c.token_start) for c in claims]


def test_a_last_hops_chunk_waits_for_the_first_hops_commitment_of_it() -> None:
    """The last hop's answer came first (a ring reads the first hop's commitments on its
    own stream): claimed then, its check would find nothing to vouch for its inputs."""
    gen = _ring()
    first, last = gen.links
    _commit(first, 0)
    _commit(last, 0, CHUNK_TOKENS)
    claims, waiting = ready_claims(gen, FED)
    assert _claimed(claims) == [("first", 0), ("last", 0)]
    assert waiting == 1
    _commit(first, CHUNK_TOKENS)  # its reader got there
    claims, waiting = ready_claims(gen, FED)
    assert _claimed(claims) == [("first", CHUNK_TOKENS), ("last", CHUNK_TOKENS)]
    assert waiting == 0
    (late,) = [c for c in claims if c.node_id == "last"]
    assert late.upstream[0].chunks == ((0, first.commitments[0]), (32, first.commitments[32]))
    assert late.inputs == ((0, bytes(16)), (32, bytes(16)))  # what it says it was sent
    assert ready_claims(gen, FED) == ([], 0)  # each chunk is claimed once


def test_a_chunk_whose_positions_are_not_all_committed_is_not_claimed_nor_waiting() -> None:
    gen = _ring()
    for link in gen.links:
        _commit(link, 0, CHUNK_TOKENS)
        link.positions = CHUNK_TOKENS + 5  # the node ran ahead of the driver
    claims, waiting = ready_claims(gen, FED)
    assert _claimed(claims) == [("first", 0), ("last", 0)] and waiting == 0


def test_a_hop_that_began_its_epoch_past_the_chunk_owes_no_commitment_of_it() -> None:
    """A resumed turn: the hop before computed the chunk in an earlier epoch, whose
    link holds its commitment; this epoch's will never send it."""
    gen = _ring(first_position=CHUNK_TOKENS)
    _commit(gen.links[1], 0)
    claims, waiting = ready_claims(gen, FED)
    assert _claimed(claims) == [("last", 0)] and waiting == 0


def test_final_claims_what_waits_as_it_is() -> None:
    """Before the links go (a failover, a cancel), a hop that never sent its commitment
    does not keep the chunks after it from the verifier."""
    gen = _ring()
    _commit(gen.links[1], 0)
    assert ready_claims(gen, FED) == ([], 1)
    claims, waiting = ready_claims(gen, FED, final=True)
    assert _claimed(claims) == [("last", 0)] and waiting == 0
    assert claims[0].upstream[0].chunks == ()  # what the verifier then has: no verdict


def test_the_generations_end_waits_for_a_commitment_on_its_way() -> None:
    gen = _ring()
    first, last = gen.links
    _commit(first, 0)
    _commit(last, 0, CHUNK_TOKENS)
    offered: list[SpanClaim] = []

    async def end() -> list[SpanClaim]:
        asyncio.get_running_loop().call_later(0.05, _commit, first, CHUNK_TOKENS)
        return await claim_rest(gen, FED, offered.append, grace_s=5.0)

    assert asyncio.run(end()) == []  # nothing withheld
    assert sorted(_claimed(offered)) == [("first", 0), ("first", 32), ("last", 0), ("last", 32)]
    (late,) = [c for c in offered if c.token_start == 32 and c.node_id == "last"]
    assert dict(late.upstream[0].chunks)[32] == first.commitments[32]


def test_the_generations_end_waits_no_longer_than_its_grace() -> None:
    gen = _ring()
    _commit(gen.links[1], 0, CHUNK_TOKENS)  # the first hop never sends its commitments
    offered: list[SpanClaim] = []
    missing = asyncio.run(claim_rest(gen, FED, offered.append, grace_s=0.05))
    assert _claimed(offered) == [("last", 0), ("last", 32)]
    assert _claimed(missing) == [("first", 0)]  # its first chunk withheld fails it
    assert missing[0].digest == b""


def test_withheld_chunks_are_those_a_hop_ran_in_its_epoch_and_never_committed() -> None:
    """Not a chunk the driver has not committed yet, nor one begun before the hop's
    epoch (KV it was given: a resumed turn's, an import's, which it commits no part of)."""
    gen = _ring()
    first, last = gen.links
    _commit(last, 0)
    _commit(first, CHUNK_TOKENS)
    assert _claimed(withheld(gen, FED)) == [("first", 0), ("last", CHUNK_TOKENS)]
    _commit(last, CHUNK_TOKENS)
    (claim,) = withheld(gen, FED)
    assert claim.layers == LayerRange(0, 2) and claim.tokens == tuple(FED[:CHUNK_TOKENS])
    assert withheld(gen, FED[: CHUNK_TOKENS - 1]) == []  # its positions not all committed
    first.first_position = 5  # the chunk at 0 began before this epoch
    assert withheld(gen, FED) == []
