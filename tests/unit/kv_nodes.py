"""Node services of the tiny model and the KV export/import calls between them, as the
tracker makes them (signed, the prefix vouched for): for the unit tests of KV transfer."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from meshnet.auth.grpc_auth import NodeGate
from meshnet.auth.keys import new_secret
from meshnet.auth.mesh_keys import MeshKeys, Metadata
from meshnet.auth.signing import PREFIX_KEY
from meshnet.backends.shard import DEFAULT_BACKEND
from meshnet.kv.transfer import export_frames
from meshnet.layer_range import LayerRange
from meshnet.node.engine import NodeEngine
from meshnet.node.engine_types import EngineConfig
from meshnet.node.model_dirs import ModelDirs
from meshnet.node.scheduler import StepWork
from meshnet.node.service import NodeIdentity, NodeService
from meshnet.protocol import meshnet_pb2 as pb

KEYS = MeshKeys(new_secret())  # the tracker's side: signs its calls to the nodes
PREFIX = "prefix-of-s"  # the token prefix hash the tracker vouches for session "s"


class Context:
    """The part of a gRPC server context the KV calls use, with the call's metadata."""

    def __init__(self, remaining: float | None = None, metadata: Metadata = ()) -> None:
        self.remaining = remaining
        self.metadata = metadata
        self.cancelled = threading.Event()

    def time_remaining(self) -> float | None:
        return self.remaining

    def invocation_metadata(self) -> Metadata:
        return self.metadata

    def cancel(self) -> None:
        self.cancelled.set()

    def abort(self, code: object, details: str) -> None:
        raise RuntimeError(details)


def node_service(tiny_path: Path, backend: str = DEFAULT_BACKEND, name: str = "n") -> NodeService:
    """A started node engine holding the tiny model's layers 0-4 on ``backend``, served
    under the node id ``name`` (its caller stops the engine)."""
    engine = NodeEngine(EngineConfig(backend=backend))
    engine.start()
    engine.tiers.load(str(tiny_path), LayerRange(0, 4)).result(30)
    identity = NodeIdentity(name, str(tiny_path), ModelDirs.of([tiny_path.parent]))
    return NodeService(identity, engine, NodeGate(KEYS.node_key(name)))


def run_steps(engine: NodeEngine, sid: str, steps: list[list[int]], first: int = 0) -> np.ndarray:
    """Session ``sid``'s steps from ``first`` on, one forward each; the last one's output."""
    out = np.empty(0)
    for i, ids in enumerate(steps):
        work = StepWork(sid, 1, np.asarray(ids, np.int64), None, step=first + i)
        out = engine.submit(work).result(10)
    return out


def exported_frames(service: NodeService, chunk_bytes: int = 1024) -> list[pb.KVFrame]:
    """Session "s"'s KV as ``service`` exports it to a signed StateGet, re-cut into
    frames of ``chunk_bytes``."""
    get = pb.StateGetRequest(session_id="s", token_prefix_hash=PREFIX)
    signed = Context(metadata=KEYS.call(service.identity.node_id, "StateGet"))
    got = list(service.StateGet(get, signed))  # type: ignore[arg-type]
    header = got[0].header
    payload = b"".join(f.chunk.data for f in got[1:-1])
    return list(export_frames(header, payload, chunk_bytes))


def put_frames(service: NodeService, frames: list[pb.KVFrame]) -> pb.StatePutResponse:
    """``frames`` put into ``service`` as session "s"'s KV, its prefix vouched for."""
    vouched = Context(metadata=((PREFIX_KEY, PREFIX),))
    return service.StatePut(iter(frames), vouched)  # type: ignore[arg-type]
