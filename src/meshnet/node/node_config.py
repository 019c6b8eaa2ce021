"""What a node process is told at start (``meshnet node``'s flags, typed).

Below the node's main and its preflight checks, which both read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshnet.kv.pace import TransferPace
from meshnet.layer_range import LayerRange
from meshnet.model_source.config import SourceConfig
from meshnet.node.engine_types import EngineConfig
from meshnet.node.relay_socket import RelayTimeouts


@dataclass(frozen=True)
class NodeConfig:
    """Everything a node process is told at start."""

    tracker_url: str  # e.g. http://127.0.0.1:8000
    listen: str  # host:port for gRPC; port 0 picks a free one
    model_path: str | None  # None: the bundled model
    layers: LayerRange | None  # None: start empty and wait for a Configure
    node_id: str  # stable name on the mesh
    node_key: str  # its credential (meshnet.auth.keys.node_key)
    advertise_host: str | None  # host the tracker should dial, when not the listen host
    advertise_port: int | None = None  # port the tracker should dial, when not the bound one
    heartbeat_s: float = 1.0
    control_workers: int = 24  # server threads beside Forward streams: 8 relay streams, control
    # Kernel threads (one pool per process); None: every core this process may run
    # on (``available_cores``). ``meshnet up`` gives each of its nodes a share.
    threads: int | None = None
    engine: EngineConfig = field(default_factory=EngineConfig)
    # The memory the whole process may take (--memory-mb); 0: what the host has. What
    # is left of it is offered to placement for more layers (node/memory_offer.py).
    memory_cap_bytes: int = 0
    model_dirs: tuple[str, ...] = ()  # Configure loads only from these (and the start model's)
    # Port of the node's /metrics (HTTP, on the listen host, the tracker's signature
    # only; docs/operating-metrics.md). 0: any free one; None: no metrics server.
    metrics_port: int | None = 0
    # TCP port on the listen host where previous hops relay a ring's inputs
    # (node/relay_socket.py), offered to them in the answers of their relay streams.
    # 0: any free one (none when ``advertise_port`` is set); None: none (they keep to
    # gRPC).
    relay_port: int | None = 0
    # As a ring's last hop, share a tied head's multiply with the ring's first hop,
    # trusting its answers (node/head_assist.py): for nodes of one operator.
    head_assist: bool = False
    # Where models given by reference (hf:ORG/REPO:QUANT, URLs) are fetched to; None:
    # the default cache (MESHNET_CACHE), named by the node's id at the source.
    source: SourceConfig | None = None
    # How long a KV import may take: a base plus its bytes over a minimum rate.
    kv_pace: TransferPace = field(default_factory=TransferPace)
    # How long a relay-port peer may hold its connection without progress, and how
    # gRPC and the relay port probe a peer that may have vanished (protocol/keepalive.py).
    relay_timeouts: RelayTimeouts = field(default_factory=RelayTimeouts)
