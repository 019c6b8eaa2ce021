"""KV export/import streams: a header, hashed chunks, a root hash — verified before use.

A stream is ``header, chunk 0 … chunk n-1, trailer``. The header says what the
KV is (model fingerprint, layer range, session, epoch, positions, committed
steps, the token-prefix hash the tracker vouches for, dtype and shape) and how
it is cut (chunk and total sizes). Every chunk carries its digest; the trailer
carries the root hash: the hash of the header's bytes followed by every chunk
digest, so reordering, dropping or swapping anything is caught. The hash is
BLAKE3: a cryptographic hash about three times as fast as SHA-256 here, which
is most of what a KV move costs besides the copies.

The reader checks the header against the receiver's own expectations before
allocating anything (sizes are recomputed from the shape, never trusted),
reads under one deadline for the whole transfer, verifies each chunk as it
comes and the root at the end, and only then returns the payload. Any failure
is a ``KVImportFailed`` with a short machine-readable ``reason``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from blake3 import blake3

from meshnet.errors import KVImportFailed
from meshnet.protocol import meshnet_pb2 as pb

FORMAT_VERSION = 2  # 2: BLAKE3 digests (1 had SHA-256)
HASH = "blake3"
CHUNK_BYTES = 4 << 20  # what we write; readers accept up to MAX_CHUNK_BYTES
MAX_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class KVShape:
    """What the receiver's shard holds per position; a header must agree with it."""

    fingerprint: str
    layer_start: int
    layer_end: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # numpy dtype name, e.g. "float32"
    itemsize: int
    max_tokens: int  # the model's context length
    windows: tuple[int, ...] = ()  # per layer: its window (0: none); () for none at all

    def payload_bytes(self, tokens: int) -> int:
        """Bytes of ``tokens`` positions: a windowed layer holds only its last window."""
        windows = self.windows or (0,) * (self.layer_end - self.layer_start)
        kept = sum(min(tokens, w) if w else tokens for w in windows)
        return 2 * kept * self.n_kv_heads * self.head_dim * self.itemsize


def digest(data: bytes | bytearray | memoryview) -> bytes:
    """A chunk's digest."""
    return blake3(data).digest()


def root_hash(header: pb.KVHeader, chunk_hashes: Iterable[bytes]) -> bytes:
    h = blake3(header.SerializeToString(deterministic=True))
    for c in chunk_hashes:
        h.update(c)
    return h.digest()


def export_frames(
    header: pb.KVHeader, payload: bytes | memoryview, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[pb.KVFrame]:
    """The frames of one stream; ``header`` gets its sizes filled in."""
    header.version = FORMAT_VERSION
    header.hash = HASH
    header.chunk_bytes = chunk_bytes
    header.total_bytes = memoryview(payload).nbytes
    yield pb.KVFrame(header=header)
    hashes: list[bytes] = []
    view = memoryview(payload)
    for index, start in enumerate(range(0, header.total_bytes, chunk_bytes)):
        data = bytes(view[start : start + chunk_bytes])
        hashed = digest(data)
        hashes.append(hashed)
        frame = pb.KVFrame()  # set in place: a nested constructor would copy the data again
        frame.chunk.index = index
        frame.chunk.data = data
        frame.chunk.digest = hashed
        yield frame
    yield pb.KVFrame(trailer=pb.KVTrailer(root_hash=root_hash(header, hashes)))


def check_header(h: pb.KVHeader, shape: KVShape, expected_prefix_hash: str | None) -> None:
    """Refuse a header that does not describe KV this receiver can hold, before any allocation."""
    if h.version != FORMAT_VERSION:
        raise KVImportFailed(f"format version {h.version}, expected {FORMAT_VERSION}", "version")
    if h.hash != HASH:
        raise KVImportFailed(f"hash {h.hash!r}, expected {HASH}", "version")
    if h.fingerprint != shape.fingerprint:
        raise KVImportFailed(f"KV of model {h.fingerprint[:12]}, not this one", "wrong-model")
    if (h.layer_start, h.layer_end) != (shape.layer_start, shape.layer_end):
        got, want = (h.layer_start, h.layer_end), (shape.layer_start, shape.layer_end)
        raise KVImportFailed(f"KV of layers {got}, this node serves {want}", "wrong-layers")
    if (h.dtype, h.n_kv_heads, h.head_dim) != (shape.dtype, shape.n_kv_heads, shape.head_dim):
        raise KVImportFailed("KV dtype or shape differs from this shard's", "wrong-shape")
    if not 0 < h.tokens <= shape.max_tokens:
        raise KVImportFailed(f"{h.tokens} positions, limit {shape.max_tokens}", "size-limit")
    if h.steps > h.tokens:
        raise KVImportFailed(f"{h.steps} steps for {h.tokens} positions", "inconsistent")
    if h.total_bytes != shape.payload_bytes(h.tokens):
        raise KVImportFailed(
            f"header says {h.total_bytes} bytes, {h.tokens} positions take "
            f"{shape.payload_bytes(h.tokens)}",
            "size-mismatch",
        )
    if not 0 < h.chunk_bytes <= MAX_CHUNK_BYTES:
        raise KVImportFailed(f"chunk size {h.chunk_bytes}", "size-limit")
    if expected_prefix_hash is not None and h.token_prefix_hash != expected_prefix_hash:
        raise KVImportFailed("the KV was computed for other tokens", "token-prefix")


def read_stream(
    frames: Iterator[pb.KVFrame],
    check: Callable[[pb.KVHeader], float | None],
    deadline: float,
) -> tuple[pb.KVHeader, bytearray]:
    """Read and verify one whole stream; the payload only when everything checks out.
    ``check`` vets the header and may answer a new deadline for the rest.

    The payload grows as verified chunks arrive: a sender that stops after its
    header costs the receiver nothing.
    """
    header = _next(frames, deadline, "header").header
    deadline = check(header) or deadline  # sized to the stream, once its size is known
    payload = bytearray()
    hashes: list[bytes] = []
    n_chunks = -(-header.total_bytes // header.chunk_bytes)
    for index in range(n_chunks):
        frame = _next(frames, deadline, "chunk")
        if frame.WhichOneof("kind") != "chunk" or frame.chunk.index != index:
            raise KVImportFailed(f"expected chunk {index}", "out-of-order")
        start = index * header.chunk_bytes
        size = min(header.chunk_bytes, header.total_bytes - start)
        data = frame.chunk.data
        if len(data) != size:
            raise KVImportFailed(f"chunk {index} has {len(data)} bytes, not {size}", "short-chunk")
        hashed = digest(data)
        if hashed != frame.chunk.digest:
            raise KVImportFailed(f"chunk {index} does not match its hash", "chunk-hash")
        payload += data
        hashes.append(hashed)
    trailer = _next(frames, deadline, "trailer")
    if trailer.WhichOneof("kind") != "trailer":
        raise KVImportFailed("more chunks than the header says", "out-of-order")
    if trailer.trailer.root_hash != root_hash(header, hashes):
        raise KVImportFailed("the root hash does not match", "root-hash")
    return header, payload


def _next(frames: Iterator[pb.KVFrame], deadline: float, wanted: str) -> pb.KVFrame:
    if time.monotonic() > deadline:
        raise KVImportFailed(f"the transfer ran past its deadline before the {wanted}", "deadline")
    frame = next(frames, None)
    if frame is None:
        raise KVImportFailed(f"the stream ended before the {wanted}", "truncated")
    if wanted == "header" and frame.WhichOneof("kind") != "header":
        raise KVImportFailed("the stream does not start with a header", "out-of-order")
    return frame
