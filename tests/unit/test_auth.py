"""The mesh's credentials: node keys, signed calls, peer tokens, node requests."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from meshnet.auth.credentials import (
    ensure_user_credentials,
    node_credential,
    read_user_credentials,
)
from meshnet.auth.keys import (
    SCOPE_BYTES,
    CredentialError,
    ensure_mesh_secret,
    new_secret,
    node_key,
)
from meshnet.auth.mesh_keys import SERVICE, MeshKeys
from meshnet.auth.signing import (
    MAX_SKEW_S,
    peer_token,
    require_peer,
    sign_request,
    sign_tracker_call,
    verify_call,
    verify_request,
)
from meshnet.errors import PermissionDenied, Unauthenticated

SECRET = new_secret()
FORWARD = SERVICE + "Forward"


def test_each_node_has_its_own_key_and_only_the_secret_derives_it() -> None:
    assert node_key(SECRET, "a") != node_key(SECRET, "b")
    assert node_key(SECRET, "a") == node_key(SECRET, "a")
    assert node_key(new_secret(), "a") != node_key(SECRET, "a")


def test_a_prefix_scope_is_the_tenants_own_and_names_no_one() -> None:
    keys = MeshKeys(SECRET)
    alice = keys.prefix_scope("alice")
    assert len(alice) == SCOPE_BYTES and b"alice" not in alice
    assert keys.prefix_scope("alice") == alice  # every request of one tenant shares it
    assert keys.prefix_scope("bob") != alice
    assert keys.prefix_scope("alice", "s1") not in (alice, keys.prefix_scope("alice", "s2"))
    # a tenant's salt cannot reach another tenant's scope ("a" + "lice" is not "alice")
    assert keys.prefix_scope("a", "lice") != alice
    assert MeshKeys(new_secret()).prefix_scope("alice") != alice  # only the secret derives it


def test_a_tracker_call_checks_out_only_with_the_nodes_key_and_method() -> None:
    keys = MeshKeys(SECRET)
    ((_, credential),) = keys.call("a", "Forward")
    assert verify_call(node_key(SECRET, "a"), FORWARD, credential).kind == "tracker"
    with pytest.raises(Unauthenticated):  # signed for another node
        verify_call(node_key(SECRET, "b"), FORWARD, credential)
    with pytest.raises(Unauthenticated):  # replayed on another method
        verify_call(node_key(SECRET, "a"), SERVICE + "Release", credential)
    with pytest.raises(Unauthenticated):
        verify_call(node_key(SECRET, "a"), FORWARD, None)
    with pytest.raises(Unauthenticated):
        verify_call(node_key(SECRET, "a"), FORWARD, "t1.x.y")


def test_a_stale_signature_is_refused() -> None:
    key = node_key(SECRET, "a")
    old = sign_tracker_call(key, FORWARD, now=1_000_000.0)
    assert verify_call(key, FORWARD, old, now=1_000_000.0 + MAX_SKEW_S - 1).kind == "tracker"
    with pytest.raises(Unauthenticated, match="stale"):
        verify_call(key, FORWARD, old, now=1_000_000.0 + MAX_SKEW_S + 1)


def test_a_peer_token_allows_only_its_kind_scope_and_time() -> None:
    callee = node_key(SECRET, "b")
    token = peer_token(callee, "a", "pull", "sess-1")
    caller = verify_call(callee, SERVICE + "StateOffer", token)
    assert (caller.kind, caller.node_id, caller.peer_kind, caller.scope) == (
        "peer",
        "a",
        "pull",
        "sess-1",
    )
    require_peer(caller, "pull", "sess-1")
    with pytest.raises(PermissionDenied):
        require_peer(caller, "pull", "sess-2")
    with pytest.raises(PermissionDenied):
        require_peer(caller, "relay")
    with pytest.raises(Unauthenticated):  # a token for another callee
        verify_call(node_key(SECRET, "c"), SERVICE + "StateOffer", token)
    expired = peer_token(callee, "a", "relay", ttl_s=-1)
    with pytest.raises(Unauthenticated, match="expired"):
        verify_call(callee, SERVICE + "RelayStream", expired)
    widened = token.replace(".pull.", ".relay.")
    with pytest.raises(Unauthenticated):
        verify_call(callee, SERVICE + "RelayStream", widened)


def test_a_node_request_is_bound_to_its_body_and_path() -> None:
    key = node_key(SECRET, "a")
    header = sign_request("a", key, "POST", "/mesh/nodes", b'{"x": 1}')
    verify_request(key, header, "POST", "/mesh/nodes", b'{"x": 1}')
    with pytest.raises(Unauthenticated):
        verify_request(key, header, "POST", "/mesh/nodes", b'{"x": 2}')
    with pytest.raises(Unauthenticated):
        verify_request(key, header, "POST", "/mesh/nodes/a/heartbeat", b'{"x": 1}')
    with pytest.raises(Unauthenticated):
        verify_request(node_key(SECRET, "b"), header, "POST", "/mesh/nodes", b'{"x": 1}')


def test_credentials_are_made_once_and_readable_by_their_owner_only(tmp_path: Path) -> None:
    first = ensure_user_credentials(tmp_path)
    assert ensure_user_credentials(tmp_path) == first
    assert read_user_credentials(tmp_path / "credentials.json") == first
    secret = ensure_mesh_secret(tmp_path)
    assert ensure_mesh_secret(tmp_path) == secret
    for name in ("credentials.json", "mesh.secret"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    (tmp_path / "bad.json").write_text('{"api_key": "x"}')
    with pytest.raises(CredentialError):
        read_user_credentials(tmp_path / "bad.json")


def test_a_node_takes_its_key_from_a_file_the_environment_or_the_secret(tmp_path: Path) -> None:
    key = node_key(SECRET, "n")
    (tmp_path / "key").write_text(key + "\n")
    (tmp_path / "secret").write_text(SECRET)
    assert node_credential("n", str(tmp_path / "key"), None, {}) == key
    assert node_credential("n", None, None, {"MESHNET_NODE_KEY": key}) == key
    assert node_credential("n", None, str(tmp_path / "secret"), {}) == key
    assert node_credential("n", None, None, {"MESHNET_MESH_SECRET": SECRET}) == key
    with pytest.raises(CredentialError, match="needs its credential"):
        node_credential("n", None, None, {})
    with pytest.raises(CredentialError):
        node_credential("n", None, None, {"MESHNET_NODE_KEY": "not hex"})
