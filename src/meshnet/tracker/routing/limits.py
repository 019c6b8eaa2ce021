"""The route driver's limits: time per step and per generation, failovers, and its modes."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DriverLimits:
    step_timeout_s: float = 30.0  # one step through one shard
    row_timeout_s: float = 0.05  # and this much more for each row of the step (a long prefill)
    open_timeout_s: float = 10.0
    generation_timeout_s: float = 600.0  # whole generation, also the streams' gRPC deadline
    max_recoveries: int = 8  # failovers one generation may take
    # A failed span nothing serves now (its only node restarting, a heal loading) is
    # waited for this long, looked for again every route_poll_s, before the generation
    # fails: a mesh under churn answers late rather than not at all.
    route_wait_s: float = 15.0
    route_poll_s: float = 0.25
    fence_timeout_s: float = 60.0  # how long a failed node is sent its fence
    relay: bool = True  # hops send activations to each other; False: all through the driver
    autorun: bool = True  # a route's hops run their decode steps ahead by themselves
    prefix_cache: bool = True  # a fresh generation starts on its hops' cached prompt prefix
