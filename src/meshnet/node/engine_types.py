"""What a node's engine is configured with and what it answers (node/engine.py), and
what its parts read of what it serves (``Serving``).

``EngineConfig`` sits below the engine so that what reads or changes it (the
tiers of live configuration, node/tiers.py; the node's start) need not import
the engine itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from meshnet.backends.shard import DEFAULT_BACKEND, Shard
from meshnet.kv.prefix_cache import PrefixStats
from meshnet.layer_range import LayerRange


@dataclass(frozen=True)
class EngineConfig:
    kv_budget_bytes: int = 0  # KV all sessions may hold; 0 means unlimited
    max_batch_tokens: int = 512  # rows in one forward
    prefill_chunk: int = 128  # prompt rows one session adds to one forward
    max_queued_steps: int = 256  # submitted but unfinished steps; more are refused
    max_streams: int = 64  # Forward streams held at once; more are refused with overloaded
    backend: str = DEFAULT_BACKEND
    park_dir: str | None = None  # where parked KV goes; None: a fresh temp directory
    ctx: int = 0  # positions a sequence may reach (``--ctx``); 0: the model's trained context
    drain_timeout_s: float = 60.0  # a T2/T3 change not applied by then is withdrawn
    # Bytes of prompt-prefix KV kept for reuse (kv/prefix_cache.py), within the KV
    # budget (what sessions hold comes first); 0 turns the prefix cache off.
    prefix_cache_bytes: int = 256 * 2**20


@dataclass(frozen=True)
class OpenedSlot:
    """A session's state right after an open: what a resuming driver checks."""

    kv_tokens: int  # positions of KV held
    steps: int  # steps committed
    unparked: bool = False  # read back from local disk by this open


@dataclass(frozen=True)
class ParkedSlot:
    """What a park did: the positions now on disk and the hot bytes it freed (0 when
    the session was parked already)."""

    tokens: int
    freed_bytes: int


@dataclass(frozen=True)
class ExportedKV:
    """A copy of one session's KV on this shard, taken between iterations."""

    epoch: int
    steps: int
    tokens: int
    payload: memoryview  # bytes, as SequenceKV.export_bytes lays them out


@dataclass(frozen=True)
class EngineStats:
    loaded: bool
    layers: LayerRange | None
    fingerprint: str
    sessions: int
    parked: int  # sessions whose KV is parked on disk
    kv_bytes: int
    kv_peak_bytes: int
    kv_budget_bytes: int
    queue_depth: int  # steps submitted and not finished
    steps: int  # steps finished since start
    last_batch: int  # sessions in the last forward
    max_batch: int  # most sessions in one forward since start
    tokens_per_s: float  # rows per second over recent forwards
    max_streams: int  # Forward streams it holds at once
    relayed: int = 0  # steps whose input came straight from the previous hop
    context: int = 0  # positions a sequence may reach here (0: empty)
    head_parts: int = 0  # head multiplies the ring's first hop shared in time
    head_parts_late: int = 0  # those it was asked for and this node did itself
    prefix: PrefixStats | None = None  # the prefix cache's state (None: never read)


class Serving(Protocol):
    """What the engine's parts read of what it serves: its shard and its configuration,
    both changed only by a tier (node/engine_tiers.py ``Tiers``), on the loop."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def shard(self) -> Shard | None: ...

    @property
    def draining(self) -> bool:
        """A tier-2 or tier-3 change waits for the loop to drain: only half-run prompts
        go on."""
        ...

    @property
    def swapping(self) -> bool:
        """The waiting change is a shard swap: opens and imports are refused."""
        ...
