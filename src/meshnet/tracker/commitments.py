"""The tracker's side of the nodes' commitments: checked off the wire, cut to what
the tracker committed, and encoded for the ledger.

A node commits a chunk (protocol/commitments.py) when it has computed its
positions, which may be before the tracker reads them (a ring runs ahead) or
for steps the tracker later cuts back (a turn's end, a failover's rewind). Only
a chunk whose every position is among those the tracker saw committed on that
link is kept; the rest was never the tracker's to hold against the node.

Ledger encoding (``LedgerRecord.commitments``): for each chunk in position
order, ``token_start`` as u32 little-endian then the 16-byte digest: 20 bytes
per 32 tokens.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from meshnet.errors import MalformedBundle
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol.commitments import CHUNK_TOKENS, DIGEST_BYTES, MAX_CHUNKS_PER_MESSAGE

_RECORD = struct.Struct("<I")
RECORD_BYTES = _RECORD.size + DIGEST_BYTES
MAX_POSITION = 2**32 - CHUNK_TOKENS  # a u32 in the ledger


def checked_chunks(chunks: Iterable[pb.ChunkDigest]) -> dict[int, bytes]:
    """``chunks`` as start -> digest; ``MalformedBundle`` when one is not a chunk."""
    out: dict[int, bytes] = {}
    for c in chunks:
        if len(out) >= MAX_CHUNKS_PER_MESSAGE:
            raise MalformedBundle(f"more than {MAX_CHUNKS_PER_MESSAGE} commitments in a message")
        if c.token_start % CHUNK_TOKENS or c.token_start > MAX_POSITION:
            raise MalformedBundle(f"a commitment starts at position {c.token_start}")
        if len(c.digest) != DIGEST_BYTES:
            raise MalformedBundle(f"a commitment of {len(c.digest)} bytes")
        out[int(c.token_start)] = bytes(c.digest)
    return out


def checked_inputs(chunks: Iterable[pb.ChunkDigest]) -> dict[int, bytes]:
    """The input digests among ``chunks`` (start -> digest; a chunk without one is left
    out); ``MalformedBundle`` when one is not a digest. Call after ``checked_chunks``."""
    out: dict[int, bytes] = {}
    for c in chunks:
        if c.input_digest and len(c.input_digest) != DIGEST_BYTES:
            raise MalformedBundle(f"an input commitment of {len(c.input_digest)} bytes")
        if c.input_digest:
            out[int(c.token_start)] = bytes(c.input_digest)
    return out


def committed(commitments: Mapping[int, bytes], positions: int) -> dict[int, bytes]:
    """The chunks wholly within the first ``positions`` (what the tracker committed)."""
    return {s: d for s, d in sorted(commitments.items()) if s + CHUNK_TOKENS <= positions}


def encode(commitments: Mapping[int, bytes]) -> bytes:
    """The ledger's bytes for a record's chunks (see the module's docstring)."""
    return b"".join(_RECORD.pack(s) + d for s, d in sorted(commitments.items()))


def decode(data: bytes) -> dict[int, bytes]:
    """The chunks of a ledger record's ``commitments``; ``MalformedBundle`` when cut."""
    if len(data) % RECORD_BYTES:
        raise MalformedBundle(f"commitments of {len(data)} bytes are not whole records")
    out: dict[int, bytes] = {}
    for i in range(0, len(data), RECORD_BYTES):
        (start,) = _RECORD.unpack_from(data, i)
        out[start] = data[i + _RECORD.size : i + RECORD_BYTES]
    return out
