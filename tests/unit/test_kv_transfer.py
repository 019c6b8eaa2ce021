"""KV export/import streams through the node's servicer: verified, or nothing is kept."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

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


def _service(tiny_path: Path, backend: str = DEFAULT_BACKEND, name: str = "n") -> NodeService:
    engine = NodeEngine(EngineConfig(backend=backend))
    engine.start()
    engine.tiers.load(str(tiny_path), LayerRange(0, 4)).result(30)
    identity = NodeIdentity(name, str(tiny_path), ModelDirs.of([tiny_path.parent]))
    return NodeService(identity, engine, NodeGate(KEYS.node_key(name)))


@pytest.fixture
def nodes(tiny_path: Path) -> Iterator[tuple[NodeService, NodeService]]:
    a, b = _service(tiny_path), _service(tiny_path)
    yield a, b
    a.engine.stop()
    b.engine.stop()


def _run(engine: NodeEngine, sid: str, steps: list[list[int]], first: int = 0) -> np.ndarray:
    out = np.empty(0)
    for i, ids in enumerate(steps):
        work = StepWork(sid, 1, np.asarray(ids, np.int64), None, step=first + i)
        out = engine.submit(work).result(10)
    return out


def _session(engine: NodeEngine) -> None:
    engine.sessions.open("s", 1).result(5)
    _run(engine, "s", [[5, 6, 7, 8, 9], [10], [11], [12]])


def _frames(service: NodeService, chunk_bytes: int = 1024) -> list[pb.KVFrame]:
    get = pb.StateGetRequest(session_id="s", token_prefix_hash=PREFIX)
    signed = Context(metadata=KEYS.call(service.identity.node_id, "StateGet"))
    got = list(service.StateGet(get, signed))  # type: ignore[arg-type]
    header = got[0].header
    payload = b"".join(f.chunk.data for f in got[1:-1])
    return list(export_frames(header, payload, chunk_bytes))


def _put(service: NodeService, frames: list[pb.KVFrame]) -> pb.StatePutResponse:
    vouched = Context(metadata=((PREFIX_KEY, PREFIX),))
    return service.StatePut(iter(frames), vouched)  # type: ignore[arg-type]


def test_imported_kv_continues_bit_identically(nodes: tuple[NodeService, NodeService]) -> None:
    a, b = nodes
    _session(a.engine)
    frames = _frames(a)
    assert len(frames) > 3  # several chunks
    reply = _put(b, frames)
    assert reply.imported, reply.failure
    assert reply.tokens == 8
    assert np.array_equal(_run(a.engine, "s", [[13]], 4), _run(b.engine, "s", [[13]], 4))


def _flip(frames: list[pb.KVFrame]) -> None:
    data = bytearray(frames[2].chunk.data)
    data[7] ^= 0x10
    frames[2].chunk.data = bytes(data)


def _set(field: str, value: object) -> Callable[[list[pb.KVFrame]], None]:
    return lambda frames: setattr(frames[0].header, field, value)


CORRUPTIONS: dict[str, tuple[Callable[[list[pb.KVFrame]], object], str]] = {
    "bit flip": (_flip, "chunk-hash"),
    "truncated": (lambda f: f.pop(3), "out-of-order"),
    "cut off": (lambda f: f.__delitem__(slice(3, None)), "truncated"),
    "wrong version": (_set("version", 99), "version"),
    "inflated length": (_set("total_bytes", 10**12), "size-mismatch"),
    "more positions": (_set("tokens", 10**9), "size-limit"),
    "wrong model": (_set("fingerprint", "0" * 64), "wrong-model"),
    "wrong layers": (_set("layer_end", 3), "wrong-layers"),
    "root hash": (lambda f: setattr(f[-1].trailer, "root_hash", b"\0" * 32), "root-hash"),
}


@pytest.mark.parametrize("name", CORRUPTIONS)
def test_a_bad_stream_is_refused_and_leaves_the_slot_empty(
    nodes: tuple[NodeService, NodeService], name: str
) -> None:
    a, b = nodes
    _session(a.engine)
    _session(b.engine)  # b held KV for "s": a failed import must not leave it half-replaced
    frames = _frames(a)
    spoil, reason = CORRUPTIONS[name]
    spoil(frames)
    reply = _put(b, frames)
    assert not reply.imported
    assert (reply.failure.kind, reply.reason) == ("kv-import-failed", reason)
    assert b.engine.stats().sessions == 0  # quarantined: KV, steps, queued work gone
    assert b.engine.stats().kv_bytes == 0
    # The node goes on serving: a fresh session works, and a good import too.
    b.engine.sessions.open("t", 1).result(5)
    _run(b.engine, "t", [[1, 2, 3]])
    assert _put(b, _frames(a)).imported


def test_a_stalled_stream_is_cut_off_by_one_deadline(
    nodes: tuple[NodeService, NodeService],
) -> None:
    a, b = nodes
    _session(a.engine)
    frames = _frames(a)
    context = Context(remaining=0.3, metadata=((PREFIX_KEY, PREFIX),))

    def trickle() -> Iterator[pb.KVFrame]:
        yield frames[0]
        yield frames[1]
        context.cancelled.wait(10)  # the peer stalls until the call is cut
        raise RuntimeError("call cancelled")

    reply = b.StatePut(trickle(), context)  # type: ignore[arg-type]
    assert (reply.imported, reply.reason) == (False, "deadline")
    assert b.engine.stats().sessions == 0
