"""What a node commits to: digests of the hidden rows at its range's end boundary.

The exact backends (``q8``, the default, and ``fast``) are bit-exact whatever the
batch, chunking or split (docs/kernels.md), so a commitment can be a plain hash:
re-running the same tokens through the same layers on the same backend on trusted
hardware gives the same bytes.

- A *row digest* is SHA-256 of one position's float32 row [d] (little-endian),
  the output of the range's last layer (on the last hop: before the final norm
  and head, the boundary a split there would send).
- A *chunk* is ``CHUNK_TOKENS`` consecutive positions starting at a multiple of
  it; its digest is SHA-256 over its rows' digests in position order, cut to
  ``DIGEST_BYTES``. Hashing row digests, not rows, lets a node keep 32 bytes per
  position instead of the rows, and cut back (a rewind) by dropping digests.

On the wire a chunk is ``(token_start, digest)``: 16 + 8 bytes per 32 tokens,
0.75 bytes per token (TOPLOC: ~8). Nodes and the tracker's verifier share this
module: only the same function on both sides makes an exact check.

A node on a backend that is not bit-exact (``EXACT_BACKENDS``) commits instead,
per chunk, the top-k sketch of its rows (protocol/sketches.py): its positions'
sketches in order, ``SKETCH_BYTES`` in the same ``digest`` field, checked with
a tolerance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from meshnet.protocol.sketches import POSITION_BYTES, position_sketches

CHUNK_TOKENS = 32  # positions per committed chunk
DIGEST_BYTES = 16  # of a chunk's SHA-256
SKETCH_BYTES = CHUNK_TOKENS * POSITION_BYTES  # of a chunk's top-k sketch (256)
# Backends whose rows are the same bits alone, batched, chunked and split
# (docs/kernels.md): their nodes commit hashes, checked exactly on the same backend;
# any other commits sketches, checked with a tolerance on the verifier's backend.
EXACT_BACKENDS = frozenset({"fast", "q8", "q8-kv16"})
MAX_CHUNKS_PER_MESSAGE = 4096  # a message naming more is malformed (a context of 128k)


def row_digests(rows: np.ndarray) -> list[bytes]:
    """One SHA-256 per row of hidden states ``rows`` [T, d] (cast to little-endian f32)."""
    x = np.ascontiguousarray(rows, dtype="<f4")
    return [hashlib.sha256(x[i].tobytes()).digest() for i in range(x.shape[0])]


def chunk_digest(digests: Sequence[bytes]) -> bytes:
    """The commitment to one chunk: SHA-256 over its rows' digests, cut to 16 bytes."""
    h = hashlib.sha256()
    for d in digests:
        h.update(d)
    return h.digest()[:DIGEST_BYTES]


def chunk_digests_of(rows: np.ndarray, first_position: int) -> dict[int, bytes]:
    """Every whole chunk among ``rows`` (positions ``first_position``, ...): start -> digest.

    What the verifier computes from the rows it re-ran; a chunk only partly in
    ``rows`` is left out."""
    digests = row_digests(rows)
    out: dict[int, bytes] = {}
    start = -(-first_position // CHUNK_TOKENS) * CHUNK_TOKENS  # the first whole chunk
    while start + CHUNK_TOKENS <= first_position + len(digests):
        lo = start - first_position
        out[start] = chunk_digest(digests[lo : lo + CHUNK_TOKENS])
        start += CHUNK_TOKENS
    return out


def commits_exactly(backend: str) -> bool:
    """Whether a node on ``backend`` commits hashes (else top-k sketches)."""
    return backend in EXACT_BACKENDS


class RowLog:
    """A session's row digests on one node, to commit chunks as they complete.

    ``base`` is the position of the first digest held: KV imported from elsewhere
    (a snapshot, a migration) was not computed here, so its positions are not
    committed, nor is a chunk that begins before ``base``. ``exact``: keep each
    position's SHA-256 (32 bytes) and commit chunk hashes; else keep its top-k sketch
    (8 bytes) and commit the chunk's sketches joined.
    """

    def __init__(self, base: int = 0, exact: bool = True) -> None:
        self.base = base
        self.exact = exact
        self.digests: list[bytes] = []

    @property
    def end(self) -> int:
        return self.base + len(self.digests)

    def add(self, position: int, rows: np.ndarray) -> list[tuple[int, bytes]]:
        """Log the rows computed for positions ``position``, ...; the chunks they complete.

        A position other than the log's end (KV that came from elsewhere, or was cut
        back past the log) starts the log afresh there."""
        if position != self.end:
            self.base, self.digests = position, []
        completed: list[tuple[int, bytes]] = []
        for d in row_digests(rows) if self.exact else position_sketches(rows):
            self.digests.append(d)
            end = self.end
            start = end - CHUNK_TOKENS
            if end % CHUNK_TOKENS == 0 and start >= self.base:
                lo = start - self.base
                last = self.digests[lo:]
                completed.append((start, chunk_digest(last) if self.exact else b"".join(last)))
        return completed

    def truncate(self, positions: int) -> None:
        """The KV was cut back to ``positions``: forget the rows past it."""
        if positions < self.base:
            self.base, self.digests = positions, []
        else:
            del self.digests[positions - self.base :]
