"""The node's gate: every gRPC call is checked before its handler runs.

A call without a credential the node's key accepts is refused
(``UNAUTHENTICATED``), and so is a peer token used for a method it does not
cover (``PERMISSION_DENIED``), before a handler or a stream's thread is taken.
What a token's scope allows (which session a ``pull`` token names) is checked
by the handler that knows the request, with ``caller()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import grpc

from meshnet.auth.mesh_keys import SERVICE
from meshnet.auth.signing import METADATA_KEY, Caller, verify_call
from meshnet.errors import MeshnetError, PermissionDenied, Unauthenticated

# What a peer token of each kind may call; every other method is the tracker's alone.
PEER_METHODS: Mapping[str, str] = {
    SERVICE + "RelayStream": "relay",
    SERVICE + "StateOffer": "pull",
    SERVICE + "StateGet": "pull",
}


def credential_of(metadata: Any) -> str | None:
    for key, value in metadata or ():
        if key == METADATA_KEY:
            return str(value)
    return None


class NodeGate(grpc.ServerInterceptor):
    """Lets through only calls signed by the tracker or carrying a peer token for them."""

    def __init__(self, key: str) -> None:
        self._key = key

    def caller(self, method: str, context: grpc.ServicerContext) -> Caller:
        """The verified caller of a call the gate let in (for scope checks)."""
        return verify_call(self._key, method, credential_of(context.invocation_metadata()))

    def check(self, method: str, metadata: Any) -> Caller:
        caller = verify_call(self._key, method, credential_of(metadata))
        if caller.kind == "peer" and PEER_METHODS.get(method) != caller.peer_kind:
            raise PermissionDenied(f"a {caller.peer_kind} token cannot call {method}")
        return caller

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler[Any, Any] | None],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any] | None:
        handler = continuation(details)
        if handler is None:
            return None
        try:
            self.check(details.method, details.invocation_metadata)
        except MeshnetError as e:
            return _refusal(handler, e)
        return handler


def _refusal(
    handler: grpc.RpcMethodHandler[Any, Any], e: MeshnetError
) -> grpc.RpcMethodHandler[Any, Any]:
    code = (
        grpc.StatusCode.PERMISSION_DENIED
        if isinstance(e, PermissionDenied)
        else grpc.StatusCode.UNAUTHENTICATED
    )
    assert isinstance(e, PermissionDenied | Unauthenticated)

    def refuse(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, e.message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)
