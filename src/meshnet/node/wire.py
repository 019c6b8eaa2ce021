"""What the node's gRPC handlers share: limits, a failure's wire form, a call's time left."""

from __future__ import annotations

import grpc

from meshnet.errors import MeshnetError
from meshnet.protocol import meshnet_pb2 as pb

CONTROL_TIMEOUT_S = 30.0  # a control call's work on the engine's loop
MAX_SESSION_ID = 128
_NO_DEADLINE_S = 7 * 24 * 3600.0


def fail(e: MeshnetError) -> pb.Failure:
    return pb.Failure(kind=e.kind, message=e.message, retryable=e.retryable)


def remaining_s(timeout_ms: int, context: grpc.ServicerContext) -> float | None:
    """Seconds left for a step: its own budget or the call's deadline, whichever is sooner.

    gRPC reports a call without a deadline as an astronomically large remaining
    time; anything past ``_NO_DEADLINE_S`` counts as no deadline at all.
    """
    limits = [timeout_ms / 1000.0] if timeout_ms else []
    left = context.time_remaining()
    if left is not None and left < _NO_DEADLINE_S:
        limits.append(max(left, 0.0))
    return min(limits) if limits else None
