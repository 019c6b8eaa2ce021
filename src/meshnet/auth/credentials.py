"""Where credentials come from: the node's key, and the user-facing ``credentials.json``.

``DATA_DIR/credentials.json`` (``{"api_key": ..., "admin_token": ...}``, owner
read-only) is made on a tracker's first start, with the mesh secret beside it;
the tracker registers their digests (the default tenant's key, the admin
token) at every start, so the file is what an operator hands to a client.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from meshnet.auth.keys import (
    CredentialError,
    check_hex_secret,
    node_key,
    read_secret_file,
    write_private,
)

CREDENTIALS_FILE = "credentials.json"
NODE_KEY_ENV = "MESHNET_NODE_KEY"
MESH_SECRET_ENV = "MESHNET_MESH_SECRET"
API_KEY_PREFIX = "mk"
ADMIN_TOKEN_PREFIX = "ma"


def node_credential(
    node_id: str, key_file: str | None, secret_file: str | None, env: Mapping[str, str]
) -> str:
    """A node's key: from its key file or ``$MESHNET_NODE_KEY``, else derived from the
    mesh secret (file or ``$MESHNET_MESH_SECRET``)."""
    if key_file:
        return read_secret_file(Path(key_file), "the node key")
    if env.get(NODE_KEY_ENV):
        return check_hex_secret(env[NODE_KEY_ENV], NODE_KEY_ENV)
    if secret_file:
        return node_key(read_secret_file(Path(secret_file), "the mesh secret"), node_id)
    if env.get(MESH_SECRET_ENV):
        return node_key(check_hex_secret(env[MESH_SECRET_ENV], MESH_SECRET_ENV), node_id)
    raise CredentialError(
        f"a node needs its credential: --node-key-file, ${NODE_KEY_ENV}, --mesh-secret-file "
        f"or ${MESH_SECRET_ENV} (`meshnet credentials node-key NODE_ID` prints one)"
    )


def new_api_key() -> tuple[str, str]:
    """A fresh API key and its id (the part that is looked up)."""
    key_id = secrets.token_hex(6)
    return f"{API_KEY_PREFIX}_{key_id}_{secrets.token_hex(32)}", key_id


def api_key_id(key: str) -> str | None:
    """The id of a well-formed API key; None for anything else."""
    parts = key.split("_")
    if len(parts) != 3 or parts[0] != API_KEY_PREFIX or len(parts[1]) != 12:
        return None
    return parts[1]


def new_admin_token() -> str:
    return f"{ADMIN_TOKEN_PREFIX}_{secrets.token_hex(32)}"


@dataclass(frozen=True)
class UserCredentials:
    api_key: str
    admin_token: str


def ensure_user_credentials(data_dir: Path) -> UserCredentials:
    """The credentials file under ``data_dir``, made on first use."""
    path = data_dir / CREDENTIALS_FILE
    key, _ = new_api_key()
    fresh = {"api_key": key, "admin_token": new_admin_token()}
    write_private(path, json.dumps(fresh, indent=2) + "\n")
    return read_user_credentials(path)


def read_user_credentials(path: Path) -> UserCredentials:
    try:
        data = json.loads(path.read_text())
        creds = UserCredentials(str(data["api_key"]), str(data["admin_token"]))
    except OSError as e:
        raise CredentialError(f"cannot read {path}: {e.strerror}") from None
    except (ValueError, KeyError, TypeError):
        raise CredentialError(f"{path} is not a credentials file") from None
    if api_key_id(creds.api_key) is None or not creds.admin_token.startswith(ADMIN_TOKEN_PREFIX):
        raise CredentialError(f"{path} holds a malformed key or token")
    return creds
