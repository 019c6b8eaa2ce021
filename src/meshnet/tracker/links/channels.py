"""One gRPC channel per node address, shared by every generation the tracker drives,
and the keys every call on them is signed with."""

from __future__ import annotations

import grpc

from meshnet.auth.mesh_keys import MeshKeys, Metadata
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc
from meshnet.protocol.codec import MESSAGE_OPTIONS
from meshnet.protocol.keepalive import CLIENT_OPTIONS

_OPTIONS = [
    *MESSAGE_OPTIONS,
    *CLIENT_OPTIONS,  # a node that vanished is found out, its calls failed
    # Fail fast on a dead address instead of waiting for reconnect backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
_MAX_RETIRED = 64


class ChannelPool:
    """Lazily opened ``grpc.aio`` channels; call from the tracker's event loop only."""

    def __init__(self, keys: MeshKeys) -> None:
        self.keys = keys
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retired: list[grpc.aio.Channel] = []

    def stub(self, address: str) -> pb_grpc.NodeAsyncStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.aio.insecure_channel(address, options=_OPTIONS)
            self._channels[address] = channel
        return pb_grpc.NodeStub(channel)

    def signed(self, node_id: str, method: str) -> Metadata:
        """The metadata of the tracker's call of ``method`` on ``node_id``."""
        return self.keys.call(node_id, method)

    def retire(self, address: str) -> None:
        """Dial a node that was found dead afresh from now on.

        The old channel is not closed: closing it would cancel every other call on
        it at once, which their generations would read as their own failure. Calls
        to a dead node fail by themselves; the channel is closed with the pool.
        """
        channel = self._channels.pop(address, None)
        if channel is not None:
            self._retired.append(channel)
            del self._retired[:-_MAX_RETIRED]  # bounded: the oldest are long finished

    async def close(self) -> None:
        for channel in [*self._channels.values(), *self._retired]:
            await channel.close()
        self._channels.clear()
        self._retired.clear()
