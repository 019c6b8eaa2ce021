"""Node to node: a hop sends its output straight to the next hop of the route.

The sender makes one ``Relay`` call per step on a channel kept per next-hop
address. The receiver files the input in its ``Mailbox`` until the driver's
step for it (marked ``relayed``) takes it; inputs can arrive before or after
that step. The mailbox is bounded in entries and bytes, and inputs nobody
took expire, so a peer cannot make a node hold memory it did not ask for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np

from meshnet.errors import (
    Cancelled,
    DeadlineExceeded,
    MeshnetError,
    Overloaded,
    StreamReset,
)
from meshnet.protocol import meshnet_pb2 as pb
from meshnet.protocol import meshnet_pb2_grpc as pb_grpc
from meshnet.protocol.codec import MESSAGE_OPTIONS

RelayKey = tuple[str, int, int]  # (session id, epoch, step)

_POLL_S = 0.05  # how often a waiting step checks that its call is still wanted


@dataclass
class _Letter:
    x: np.ndarray
    arrived: float  # time.monotonic()


class Mailbox:
    """Inputs relayed by previous hops, by (session, epoch, step); thread-safe."""

    def __init__(self, max_entries: int, max_bytes: int, ttl_s: float = 60.0) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._letters: dict[RelayKey, _Letter] = {}
        self._bytes = 0
        self._cond = threading.Condition()
        self.delivered = 0  # inputs taken by their steps

    def put(self, key: RelayKey, x: np.ndarray) -> None:
        """File an input; ``Overloaded`` when the mailbox is full."""
        with self._cond:
            self._expire(time.monotonic())
            old = self._letters.pop(key, None)
            if old is not None:  # sent again (a retried relay): the newest counts
                self._bytes -= old.x.nbytes
            if len(self._letters) >= self.max_entries or self._bytes + x.nbytes > self.max_bytes:
                raise Overloaded(f"relay mailbox full ({len(self._letters)} inputs waiting)")
            self._letters[key] = _Letter(x, time.monotonic())
            self._bytes += x.nbytes
            self._cond.notify_all()

    def take(
        self, key: RelayKey, timeout_s: float | None, wanted: Callable[[], bool]
    ) -> np.ndarray:
        """The input for ``key``, waiting for it up to ``timeout_s`` while ``wanted()``."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while True:
                letter = self._letters.pop(key, None)
                if letter is not None:
                    self._bytes -= letter.x.nbytes
                    self.delivered += 1
                    return letter.x
                if not wanted():
                    raise Cancelled(f"step {key[2]} of {key[0]} is no longer wanted")
                left = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
                if left <= 0:
                    raise DeadlineExceeded(
                        f"the previous hop sent no input for step {key[2]} of session {key[0]}"
                    )
                self._cond.wait(left)

    def drop(self, session_id: str, epoch: int) -> None:
        """Forget the inputs of a session's epoch (its stream ended)."""
        with self._cond:
            for key in [k for k in self._letters if k[:2] == (session_id, epoch)]:
                self._bytes -= self._letters.pop(key).x.nbytes

    def _expire(self, now: float) -> None:
        for key in [k for k, v in self._letters.items() if now - v.arrived > self.ttl_s]:
            self._bytes -= self._letters.pop(key).x.nbytes


class RelaySender:
    """Sends outputs to next hops, one channel per address; thread-safe."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def send(self, address: str, frame: pb.RelayFrame, timeout_s: float) -> None:
        """Deliver one step's output; a typed failure (of the next hop) when it cannot."""
        try:
            self._stub(address).Relay(frame, timeout=timeout_s)
        except grpc.RpcError as e:
            raise _relay_failure(e, address) from None

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()

    def _stub(self, address: str) -> pb_grpc.NodeStub:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = grpc.insecure_channel(address, options=MESSAGE_OPTIONS)
                self._channels[address] = channel
            return pb_grpc.NodeStub(channel)


def _relay_failure(e: grpc.RpcError, address: str) -> MeshnetError:
    code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.UNKNOWN
    detail = e.details() if isinstance(e, grpc.Call) else str(e)
    message = f"relay to {address} failed: {code.name} {detail or ''}".strip()
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Overloaded(message)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(message)
    return StreamReset(message)
