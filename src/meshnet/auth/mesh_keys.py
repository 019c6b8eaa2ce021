"""The tracker's side of the mesh secret: signing its calls and issuing peer tokens."""

from __future__ import annotations

from functools import lru_cache

from meshnet.auth.keys import node_key, prefix_scope
from meshnet.auth.signing import METADATA_KEY, PeerKind, peer_token, sign_tracker_call
from meshnet.protocol import meshnet_pb2 as pb

SERVICE = f"/{pb.DESCRIPTOR.services_by_name['Node'].full_name}/"  # a method's full name
Metadata = tuple[tuple[str, str], ...]


class MeshKeys:
    """Derives node keys from the mesh secret; what the tracker signs its gRPC calls with."""

    def __init__(self, mesh_secret: str) -> None:
        self._key = lru_cache(maxsize=4096)(lambda node_id: node_key(mesh_secret, node_id))
        self._scope = lru_cache(maxsize=4096)(
            lambda tenant, salt: prefix_scope(mesh_secret, tenant, salt)
        )

    def node_key(self, node_id: str) -> str:
        return str(self._key(node_id))

    def prefix_scope(self, tenant: str, salt: str = "") -> bytes:
        """What the nodes' prefix caches key ``tenant``'s prompts under (with a request's
        ``salt``, a narrower scope of its own): opaque to them."""
        return bytes(self._scope(tenant, salt))

    def call(self, node_id: str, method: str) -> Metadata:
        """Metadata for the tracker's call of ``method`` (e.g. "Forward") on ``node_id``."""
        return ((METADATA_KEY, sign_tracker_call(self.node_key(node_id), SERVICE + method)),)

    def peer(self, callee: str, caller: str, kind: PeerKind, scope: str = "") -> str:
        """A token for ``caller`` to make ``kind`` calls to ``callee``."""
        return peer_token(self.node_key(callee), caller, kind, scope)
