"""The KV stream over a plain TCP connection: the bulk path for node-to-node moves.

The same stream as ``transfer`` — header, chunks each with its digest, root
hash over the header's bytes and every chunk digest — laid out as raw bytes so
the payload crosses the socket straight from the exporter's buffer into the
importer's, without a protobuf message or a gRPC frame around each chunk::

    b"MKV1" | u32 header length | header | (u32 index | u32 length | digest | data)* | root

Both ends hash on a helper thread (BLAKE3 releases the GIL), the sender one
chunk ahead of the socket and the receiver right behind it. The receiver
applies the same checks as the gRPC reader — header limits before
allocating, chunk order and sizes, every hash, the root, one deadline — and
fails with the same ``KVImportFailed`` reasons.
"""

from __future__ import annotations

import socket
import struct
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from meshnet.errors import KVImportFailed
from meshnet.kv.transfer import CHUNK_BYTES, FORMAT_VERSION, HASH, digest, root_hash
from meshnet.protocol import meshnet_pb2 as pb

MAGIC = b"MKV1"
_HEAD = struct.Struct(">4sI")
_CHUNK = struct.Struct(">II32s")
_MAX_HEADER = 64 << 10
_ROOT = 32
_AHEAD = 2  # chunks read ahead of their hash check


def send_stream(
    sock: socket.socket,
    header: pb.KVHeader,
    payload: memoryview,
    chunk_bytes: int = CHUNK_BYTES,
) -> None:
    """Write one whole stream; ``header`` gets its sizes filled in."""
    header.version = FORMAT_VERSION
    header.hash = HASH
    header.chunk_bytes = chunk_bytes
    header.total_bytes = payload.nbytes
    head = header.SerializeToString(deterministic=True)
    sock.sendall(_HEAD.pack(MAGIC, len(head)) + head)
    starts = range(0, payload.nbytes, chunk_bytes)
    hashes: list[bytes] = []
    with ThreadPoolExecutor(1, thread_name_prefix="kv-hash") as pool:
        digests = [pool.submit(digest, payload[s : s + chunk_bytes]) for s in starts]
        for index, (start, hashed) in enumerate(zip(starts, digests, strict=True)):
            data = payload[start : start + chunk_bytes]
            hashes.append(hashed.result())
            sock.sendall(_CHUNK.pack(index, data.nbytes, hashes[-1]))
            sock.sendall(data)
    sock.sendall(root_hash(header, hashes))


def recv_stream(
    sock: socket.socket,
    check: Callable[[pb.KVHeader], float | None],
    deadline: float,
) -> tuple[pb.KVHeader, bytearray]:
    """Read and verify one whole stream; the payload only when everything checks out."""
    magic, size = _HEAD.unpack(_read(sock, _HEAD.size, deadline, "header"))
    if magic != MAGIC:
        raise KVImportFailed("not a KV stream", "version")
    if size > _MAX_HEADER:
        raise KVImportFailed(f"a header of {size} bytes", "size-limit")
    header = pb.KVHeader()
    try:
        header.ParseFromString(_read(sock, size, deadline, "header"))
    except Exception:
        raise KVImportFailed("the header does not parse", "invalid") from None
    deadline = check(header) or deadline  # sized to the stream, once its size is known
    # The payload grows as verified chunks arrive: a sender that stalls after its
    # header costs nothing; at most _AHEAD chunks wait for their hash beside it.
    payload = bytearray()
    n_chunks = -(-header.total_bytes // header.chunk_bytes)
    sent_digests: list[bytes] = []
    pending: deque[tuple[int, bytearray, Future[bytes]]] = deque()
    with ThreadPoolExecutor(1, thread_name_prefix="kv-verify") as pool:
        for index in range(n_chunks):
            got, length, sent = _CHUNK.unpack(_read(sock, _CHUNK.size, deadline, "chunk"))
            if got != index:
                raise KVImportFailed(f"expected chunk {index}, got {got}", "out-of-order")
            start = index * header.chunk_bytes
            want = min(header.chunk_bytes, header.total_bytes - start)
            if length != want:
                raise KVImportFailed(f"chunk {index} has {length} bytes, not {want}", "short-chunk")
            part = bytearray(length)
            _read_into(sock, memoryview(part), deadline)
            sent_digests.append(sent)
            pending.append((index, part, pool.submit(digest, part)))
            while len(pending) > _AHEAD:
                _take(payload, pending.popleft(), sent_digests)
        root = _read(sock, _ROOT, deadline, "trailer")
        while pending:
            _take(payload, pending.popleft(), sent_digests)
    if root != root_hash(header, sent_digests):
        raise KVImportFailed("the root hash does not match", "root-hash")
    return header, payload


def _take(
    payload: bytearray, chunk: tuple[int, bytearray, Future[bytes]], sent: list[bytes]
) -> None:
    """Append a chunk to the payload once its hash is the one the sender gave."""
    index, part, computed = chunk
    if computed.result() != sent[index]:
        raise KVImportFailed(f"chunk {index} does not match its hash", "chunk-hash")
    payload += part


def _read(sock: socket.socket, n: int, deadline: float, wanted: str) -> bytes:
    buf = bytearray(n)
    _read_into(sock, memoryview(buf), deadline, wanted)
    return bytes(buf)


def _read_into(
    sock: socket.socket, view: memoryview, deadline: float, wanted: str = "chunk"
) -> None:
    got = 0
    while got < view.nbytes:
        left = deadline - time.monotonic()
        if left <= 0:
            raise KVImportFailed(f"the transfer ran past its deadline in the {wanted}", "deadline")
        sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:])
        except TimeoutError:
            raise KVImportFailed(f"the transfer stalled in the {wanted}", "deadline") from None
        except OSError as e:
            raise KVImportFailed(f"the transfer broke in the {wanted}: {e}", "truncated") from None
        if n == 0:
            raise KVImportFailed(f"the stream ended in the {wanted}", "truncated")
        got += n
