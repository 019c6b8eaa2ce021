"""Secrets and what is derived from them.

The tracker holds the **mesh secret**. Each node holds only its own **node key**,
``HMAC(mesh secret, node id)``: the tracker can derive any node's key, a node
cannot derive another's, so a node id is bound to its credential and nothing but
the tracker can speak for the mesh. A tenant's **prefix scope** (what the nodes'
prefix caches key its prompts under, kv/prefix_cache.py) is derived the same way,
under another label: nodes learn no tenant id from it and cannot make one up.
User-facing secrets (API keys, the admin token) are random and kept only as
SHA-256 digests; every comparison of a secret is constant-time.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

from meshnet.errors import MeshnetError

MESH_SECRET_FILE = "mesh.secret"
_SECRET_BYTES = 32
_NODE_KEY_LABEL = b"meshnet node key v1\0"
_SCOPE_LABEL = b"meshnet prefix scope v1\0"
SCOPE_BYTES = 16  # a scope's length: enough that no two tenants' ever meet


class CredentialError(MeshnetError):
    """A secret file or key is missing, unreadable or malformed."""

    kind = "credential-invalid"
    http_status = 500


def new_secret() -> str:
    """A fresh random secret, hex."""
    return secrets.token_hex(_SECRET_BYTES)


def node_key(mesh_secret: str, node_id: str) -> str:
    """The credential of node ``node_id`` (hex), derived from the mesh secret."""
    mac = hmac.new(bytes.fromhex(mesh_secret), _NODE_KEY_LABEL + node_id.encode(), "sha256")
    return mac.hexdigest()


def prefix_scope(mesh_secret: str, tenant: str, salt: str = "") -> bytes:
    """The prefix-cache scope of ``tenant``'s requests that send ``salt`` (a request's
    ``cache_salt``; empty: none), derived from the mesh secret."""
    name = tenant.encode()
    message = _SCOPE_LABEL + len(name).to_bytes(4, "little") + name + salt.encode()
    return hmac.new(bytes.fromhex(mesh_secret), message, "sha256").digest()[:SCOPE_BYTES]


def digest(secret: str) -> str:
    """What is stored of a user-facing secret."""
    return hashlib.sha256(secret.encode()).hexdigest()


def same(a: str, b: str) -> bool:
    """Constant-time equality of two secrets or digests."""
    return hmac.compare_digest(a.encode(), b.encode())


def check_hex_secret(text: str, what: str) -> str:
    """``text`` stripped, if it is a hex secret of the right length."""
    value = text.strip()
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raw = b""
    if len(raw) != _SECRET_BYTES:
        raise CredentialError(f"{what} must be {_SECRET_BYTES * 2} hex digits")
    return value


def write_private(path: Path, text: str) -> bool:
    """Create ``path`` readable by its owner only, holding ``text``; False if it exists.

    Created exclusively, so two processes starting at once agree on one secret.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return True


def read_secret_file(path: Path, what: str) -> str:
    try:
        return check_hex_secret(path.read_text(), what)
    except OSError as e:
        raise CredentialError(f"cannot read {what} at {path}: {e.strerror}") from None


def ensure_mesh_secret(data_dir: Path) -> str:
    """The mesh secret under ``data_dir``, made on first use."""
    path = data_dir / MESH_SECRET_FILE
    write_private(path, new_secret() + "\n")
    return read_secret_file(path, "the mesh secret")
