"""What the tracker keeps of a hop's commitments: checked, bounded, claimed once."""

from typing import Any

import pytest

from meshnet.errors import MalformedBundle
from meshnet.layer_range import LayerRange
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol.commitments import CHUNK_TOKENS, MAX_CHUNKS_PER_MESSAGE
from meshnet.tracker.links.hop_link import HopLink
from meshnet.tracker.nodes.routes import Hop


def _link() -> HopLink:
    hop = Hop("n", "127.0.0.1:1", LayerRange(0, 2))
    no_call: Any = None  # _note never touches the stream
    return HopLink(hop, no_call, 1, no_call)


def _chunks(first: int, n: int) -> list[pb.ChunkDigest]:
    starts = range(first * CHUNK_TOKENS, (first + n) * CHUNK_TOKENS, CHUNK_TOKENS)
    return [pb.ChunkDigest(token_start=s, digest=bytes(16)) for s in starts]


def test_a_node_cannot_make_the_tracker_keep_more_chunks_than_a_context_holds() -> None:
    link = _link()
    link._note(_chunks(0, MAX_CHUNKS_PER_MESSAGE - 1))
    link._note(_chunks(0, 10))  # the same chunks again (a rewind recomputed them): kept
    assert len(link.commitments) == MAX_CHUNKS_PER_MESSAGE - 1
    with pytest.raises(MalformedBundle, match="node n: more than 4096 chunks"):
        link._note(_chunks(MAX_CHUNKS_PER_MESSAGE, 2))  # one message each time: still bounded
    assert len(link.commitments) == MAX_CHUNKS_PER_MESSAGE - 1  # nothing of it kept


def test_noted_chunks_wait_to_be_claimed() -> None:
    link = _link()
    link._note(_chunks(0, 3))
    assert link.unclaimed == {0, 32, 64}
