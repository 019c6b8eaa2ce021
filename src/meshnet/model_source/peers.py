"""Shard bytes between nodes, over the bulk TCP port (``node/kv_offers.py``).

A fetching node connects to a peer's bulk port and sends ``MAGIC`` (where a KV
fetch sends its 16-byte ticket), then one request: a 4-byte length and a JSON
object (``token``, ``fingerprint``, ``layers``, ``part``: the model's file, from 0;
``offset``, ``length``). The token is a peer token the tracker issued for this
caller to this peer (``pull``, scope ``shard:FINGERPRINT``), checked with the
peer's own key. The answer is one status byte (0: the bytes follow; 2: not
fetched yet, ask again: the peer is fetching them itself, ``live``; else refused)
and ``length`` bytes read from the peer's shard file. Nothing read is trusted: the
fetcher checks every tensor against the manifest, as from the hub.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshnet.errors import MeshnetError
from meshnet.layer_range import LayerRange

MAGIC = b"meshnet-shard-v1"  # 16 bytes: never a random KV ticket (2^-128)
MAX_REQUEST = 4096
MAX_LENGTH = 16 << 20  # one request's bytes (a fetcher asks for cfg.chunk_bytes, 8 MiB)
_OK, _REFUSED, _NOT_YET = 0, 1, 2
_TIMEOUT_S = 30.0
_LEN = struct.Struct("<I")


@dataclass(frozen=True)
class Peer:
    """A node holding a shard of the model, as the tracker tells it."""

    node_id: str
    address: str  # its bulk port, host:port
    layers: LayerRange
    token: str  # lets this node read that peer's shards of the model
    fetching: bool = False  # still fetching them itself (``live``)


class PeerRefused(MeshnetError):
    kind = "peer-refused"
    retryable = True


class PeerNotYet(PeerRefused):
    """The peer is fetching the bytes asked for itself and has not checked them yet."""

    kind = "peer-not-yet"


def scope(fingerprint: str) -> str:
    """The peer token scope that allows reading a model's shards."""
    return f"shard:{fingerprint}"


def read_from_peer(peer: Peer, fingerprint: str, part: int, offset: int, length: int) -> bytes:
    """``length`` bytes at ``offset`` of ``peer``'s shard file of ``fingerprint`` (its file
    ``part``); ``PeerRefused`` (or ``OSError``) when it cannot give them."""
    request = json.dumps(
        {
            "token": peer.token,
            "fingerprint": fingerprint,
            "layers": [peer.layers.start, peer.layers.end],
            "part": part,
            "offset": offset,
            "length": length,
        }
    ).encode()
    host, _, port = peer.address.rpartition(":")
    with socket.create_connection((host.strip("[]"), int(port)), timeout=_TIMEOUT_S) as conn:
        conn.sendall(MAGIC + _LEN.pack(len(request)) + request)
        status = _recv_exact(conn, 1)
        if status == bytes([_NOT_YET]):
            raise PeerNotYet(f"{peer.node_id} has not fetched bytes {offset}+{length} yet")
        if status != bytes([_OK]):
            raise PeerRefused(f"{peer.node_id} refused bytes {offset}+{length}")
        return _recv_exact(conn, length)


Authorize = Callable[[str, str], None]  # (token, fingerprint): raises unless allowed
# (fingerprint, layers, part, offset, length) -> the file holding them; PeerNotYet when
# they are being fetched
ShardPath = Callable[[str, LayerRange, int, int, int], Path]


def serve_request(conn: socket.socket, authorize: Authorize, path_of: ShardPath) -> None:
    """Answer one request whose ``MAGIC`` was read already (see the module)."""
    try:
        (n,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
        if n > MAX_REQUEST:
            raise ValueError("request too long")
        raw = json.loads(_recv_exact(conn, n))
        fingerprint, token = str(raw["fingerprint"]), str(raw["token"])
        layers = LayerRange(int(raw["layers"][0]), int(raw["layers"][1]))
        offset, length, part = int(raw["offset"]), int(raw["length"]), int(raw.get("part", 0))
        authorize(token, fingerprint)
        if not (offset >= 0 and 0 < length <= MAX_LENGTH):
            raise ValueError("range outside the shard")
        path = path_of(fingerprint, layers, part, offset, length)
        if offset + length > path.stat().st_size:
            raise ValueError("range outside the shard")
        with path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read(length)
        if len(data) != length:
            raise ValueError("the shard file is short")
    except PeerNotYet:
        conn.sendall(bytes([_NOT_YET]))
        return
    except (MeshnetError, ValueError, KeyError, TypeError, IndexError, OSError):
        conn.sendall(bytes([_REFUSED]))
        return
    conn.sendall(bytes([_OK]) + data)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = conn.recv(min(n - len(buf), 1 << 20))
        if not part:
            raise OSError(f"the peer closed after {len(buf)} of {n} bytes")
        buf += part
    return bytes(buf)
