"""The tracker's side of the nodes' commitments: checked off the wire, cut to what
the tracker committed, and encoded for the ledger.

A node commits a chunk (protocol/commitments.py) when it has computed its
positions, which may be before the tracker reads them (a ring runs ahead) or
for steps the tracker later cuts back (a turn's end, a failover's rewind). Only
a chunk whose every position is among those the tracker saw committed on that
link is kept; the rest was never the tracker's to hold against the node.

A chunk's commitment is a 16-byte hash (exact backends) or a 256-byte top-k
sketch (others, protocol/sketches.py); its length says which.

Ledger encoding (``LedgerRecord.commitments``), two forms told apart by the first
byte:

- *hashes* (every chunk a hash, as all records were before sketches): for each
  chunk in position order, ``token_start`` as u32 little-endian then the 16-byte
  digest: 20 bytes per 32 tokens. Its first byte is the low byte of a multiple of
  32, so never has one of its low 5 bits set;
- *tagged* (any chunk a sketch): ``TAGGED_MAGIC`` (4 bytes, the first 0xA7), then
  for each chunk ``token_start`` u32 little-endian, a kind byte (``KIND_HASH`` or
  ``KIND_SKETCH``) and the commitment of that kind's length: 261 bytes per 32
  tokens of sketches.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping

from meshnet.errors import MalformedBundle
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol.commitments import (
    CHUNK_TOKENS,
    DIGEST_BYTES,
    MAX_CHUNKS_PER_MESSAGE,
    SKETCH_BYTES,
)

_RECORD = struct.Struct("<I")
RECORD_BYTES = _RECORD.size + DIGEST_BYTES
MAX_POSITION = 2**32 - CHUNK_TOKENS  # a u32 in the ledger
TAGGED_MAGIC = b"\xa7MSK"  # version 1: K=2 sketches of protocol/sketches.py
KIND_HASH, KIND_SKETCH = 0, 1
_LENGTHS = {KIND_HASH: DIGEST_BYTES, KIND_SKETCH: SKETCH_BYTES}
_TAGGED = struct.Struct("<IB")


def checked_chunks(chunks: Iterable[pb.ChunkDigest]) -> dict[int, bytes]:
    """``chunks`` as start -> commitment (a hash or a sketch, all of one kind);
    ``MalformedBundle`` when one is not a chunk."""
    out: dict[int, bytes] = {}
    lengths: set[int] = set()
    for c in chunks:
        if len(out) >= MAX_CHUNKS_PER_MESSAGE:
            raise MalformedBundle(f"more than {MAX_CHUNKS_PER_MESSAGE} commitments in a message")
        if c.token_start % CHUNK_TOKENS or c.token_start > MAX_POSITION:
            raise MalformedBundle(f"a commitment starts at position {c.token_start}")
        if len(c.digest) not in (DIGEST_BYTES, SKETCH_BYTES):
            raise MalformedBundle(f"a commitment of {len(c.digest)} bytes")
        lengths.add(len(c.digest))
        if len(lengths) > 1:
            raise MalformedBundle("hashes and sketches in one message")
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
    """The ledger's bytes for a record's chunks (see the module's docstring); hashes
    only keep the hash form. ``MalformedBundle`` for a commitment of neither length."""
    chunks = sorted(commitments.items())
    if all(len(d) == DIGEST_BYTES for _, d in chunks):
        return b"".join(_RECORD.pack(s) + d for s, d in chunks)
    kinds = {length: kind for kind, length in _LENGTHS.items()}
    parts = [TAGGED_MAGIC]
    for start, d in chunks:
        if len(d) not in kinds:
            raise MalformedBundle(f"a commitment of {len(d)} bytes")
        parts.append(_TAGGED.pack(start, kinds[len(d)]) + d)
    return b"".join(parts)


def decode(data: bytes) -> dict[int, bytes]:
    """The chunks of a ledger record's ``commitments``; ``MalformedBundle`` when cut
    or of no known form."""
    if data[:1] and data[0] % CHUNK_TOKENS:
        return _decode_tagged(data)
    if len(data) % RECORD_BYTES:
        raise MalformedBundle(f"commitments of {len(data)} bytes are not whole records")
    out: dict[int, bytes] = {}
    for i in range(0, len(data), RECORD_BYTES):
        (start,) = _RECORD.unpack_from(data, i)
        out[start] = data[i + _RECORD.size : i + RECORD_BYTES]
    return out


def _decode_tagged(data: bytes) -> dict[int, bytes]:
    if not data.startswith(TAGGED_MAGIC):
        raise MalformedBundle("commitments of an unknown form")
    out: dict[int, bytes] = {}
    i = len(TAGGED_MAGIC)
    while i < len(data):
        if i + _TAGGED.size > len(data):
            raise MalformedBundle("commitments cut inside a chunk's header")
        start, kind = _TAGGED.unpack_from(data, i)
        length = _LENGTHS.get(kind)
        if length is None or start % CHUNK_TOKENS:
            raise MalformedBundle(f"a commitment of kind {kind} at position {start}")
        i += _TAGGED.size
        if i + length > len(data):
            raise MalformedBundle("commitments cut inside a chunk")
        out[start] = data[i : i + length]
        i += length
    return out
