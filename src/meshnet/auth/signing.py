"""Signed calls and tracker-issued tokens, all HMAC-SHA256 under a node's key.

- **Tracker to node** (gRPC metadata ``x-meshnet-auth: t1.<ms>.<mac>``): the
  tracker signs the method and the time with the node's key; the node checks
  it with its own key.
- **Node to node** (``p1.<expiry>.<caller>.<kind>.<scope>.<mac>``): a peer
  token the tracker issues for one callee: who may call (``caller``), for what
  (``relay`` activations, or ``pull`` one session's KV named by ``scope``),
  until when. The callee checks it with its own key; the caller cannot forge
  or widen it.
- **Node to tracker** (HTTP ``Authorization: Meshnet-Node <id>.<ms>.<mac>``):
  the node signs the method, path, time and the body's SHA-256 with its key.

A signature older or newer than ``MAX_SKEW_S`` is refused. These authenticate
calls; they do not hide them: links that cross untrusted networks need a
tunnel or TLS as well (docs/security.md).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import dataclass
from typing import Literal

from meshnet.auth.keys import same
from meshnet.errors import PermissionDenied, Unauthenticated

METADATA_KEY = "x-meshnet-auth"
PREFIX_KEY = "x-meshnet-prefix"  # StatePut: the token prefix hash the tracker vouches for
HTTP_SCHEME = "Meshnet-Node"
MAX_SKEW_S = 120.0
MAX_TOKEN_CHARS = 1024
PeerKind = Literal["relay", "pull"]
_PEER_KINDS = ("relay", "pull")


def _mac(key: str, *fields: str) -> str:
    return hmac.new(bytes.fromhex(key), "\n".join(fields).encode(), "sha256").hexdigest()


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _unb64(text: str) -> str:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
    except (ValueError, UnicodeDecodeError):
        raise Unauthenticated("a malformed credential") from None


def _fresh(ms_text: str, now: float) -> None:
    try:
        stamp = int(ms_text) / 1000
    except ValueError:
        raise Unauthenticated("a malformed credential") from None
    if abs(now - stamp) > MAX_SKEW_S:
        raise Unauthenticated("the signature is stale (or the clocks disagree)")


def _ms(now: float) -> str:
    return str(int(now * 1000))


@dataclass(frozen=True)
class Caller:
    """Who a verified gRPC call came from."""

    kind: Literal["tracker", "peer"]
    node_id: str = ""  # the calling node (peers)
    peer_kind: str = ""  # what the tracker let that peer do
    scope: str = ""  # the session a pull token names


def sign_tracker_call(key: str, method: str, now: float | None = None) -> str:
    stamp = _ms(time.time() if now is None else now)
    return f"t1.{stamp}.{_mac(key, 'tracker', method, stamp)}"


def peer_token(
    callee_key: str, caller: str, kind: PeerKind, scope: str = "", ttl_s: float = 3600.0
) -> str:
    """A token letting ``caller`` make ``kind`` calls (for ``scope``) to the key's node."""
    expiry = str(int(time.time() + ttl_s))
    mac = _mac(callee_key, "peer", kind, caller, scope, expiry)
    return f"p1.{expiry}.{_b64(caller)}.{kind}.{_b64(scope)}.{mac}"


def verify_call(key: str, method: str, credential: str | None, now: float | None = None) -> Caller:
    """The caller of a gRPC call to the node holding ``key``; raises ``Unauthenticated``."""
    if not credential:
        raise Unauthenticated("this call needs the mesh's credential")
    if len(credential) > MAX_TOKEN_CHARS:
        raise Unauthenticated("a malformed credential")
    now = time.time() if now is None else now
    parts = credential.split(".")
    if parts[0] == "t1" and len(parts) == 3:
        _, stamp, mac = parts
        _fresh(stamp, now)
        if not same(mac, _mac(key, "tracker", method, stamp)):
            raise Unauthenticated("the call's signature does not check out")
        return Caller("tracker")
    if parts[0] == "p1" and len(parts) == 6:
        _, expiry, caller_b64, kind, scope_b64, mac = parts
        caller, scope = _unb64(caller_b64), _unb64(scope_b64)
        if kind not in _PEER_KINDS or not same(mac, _mac(key, "peer", kind, caller, scope, expiry)):
            raise Unauthenticated("the peer token does not check out")
        try:
            expired = int(expiry) < now
        except ValueError:
            raise Unauthenticated("a malformed credential") from None
        if expired:
            raise Unauthenticated("the peer token has expired")
        return Caller("peer", caller, kind, scope)
    raise Unauthenticated("a malformed credential")


def require_peer(caller: Caller, kind: PeerKind, scope: str | None = None) -> None:
    """Let the tracker through; let a peer through only for what its token names."""
    if caller.kind == "tracker":
        return
    if caller.peer_kind != kind or (scope is not None and caller.scope != scope):
        raise PermissionDenied(f"this peer token does not allow {kind} here")


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def sign_request(
    node_id: str, key: str, method: str, path: str, body: bytes, now: float | None = None
) -> str:
    """The ``Authorization`` header value of a node's request to the tracker."""
    stamp = _ms(time.time() if now is None else now)
    mac = _mac(key, "node", method.upper(), path, stamp, body_digest(body))
    return f"{HTTP_SCHEME} {_b64(node_id)}.{stamp}.{mac}"


def request_signer(header: str) -> str:
    """The node id a request's ``Authorization`` header claims (not yet verified)."""
    scheme, _, value = header.partition(" ")
    parts = value.split(".")
    if scheme != HTTP_SCHEME or len(parts) != 3 or len(header) > MAX_TOKEN_CHARS:
        raise Unauthenticated(f"node calls need 'Authorization: {HTTP_SCHEME} ...'")
    return _unb64(parts[0])


def verify_request(
    key: str, header: str, method: str, path: str, body: bytes, now: float | None = None
) -> None:
    """Check a node's request signature with that node's key."""
    _, _, value = header.partition(" ")
    _, stamp, mac = value.split(".")
    _fresh(stamp, time.time() if now is None else now)
    if not same(mac, _mac(key, "node", method.upper(), path, stamp, body_digest(body))):
        raise Unauthenticated("the request's signature does not check out")


def manifest_mac(key: str, node_id: str, digest: str) -> str:
    """The tracker's signature of a model manifest (``model_source.manifest``: its
    ``digest``) for node ``node_id``, under that node's key: the node checks it with
    its own key, so a manifest from anywhere else is refused."""
    return _mac(key, "manifest", node_id, digest)


def verify_manifest(key: str, node_id: str, digest: str, mac: str) -> None:
    """``Unauthenticated`` unless ``mac`` is the tracker's ``manifest_mac`` of ``digest``."""
    if not same(mac, manifest_mac(key, node_id, digest)):
        raise Unauthenticated("the model manifest's signature does not check out")
