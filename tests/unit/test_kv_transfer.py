"""KV export/import streams through the node's servicer: verified, or nothing is kept."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from kv_nodes import PREFIX, Context, exported_frames, node_service, put_frames, run_steps

from meshnet.auth.signing import PREFIX_KEY
from meshnet.node.engine import NodeEngine
from meshnet.node.service import NodeService
from meshnet.protocol import meshnet_pb2 as pb


@pytest.fixture
def nodes(tiny_path: Path) -> Iterator[tuple[NodeService, NodeService]]:
    a, b = node_service(tiny_path), node_service(tiny_path)
    yield a, b
    a.engine.stop()
    b.engine.stop()


def _session(engine: NodeEngine) -> None:
    engine.sessions.open("s", 1).result(5)
    run_steps(engine, "s", [[5, 6, 7, 8, 9], [10], [11], [12]])


def test_imported_kv_continues_bit_identically(nodes: tuple[NodeService, NodeService]) -> None:
    a, b = nodes
    _session(a.engine)
    frames = exported_frames(a)
    assert len(frames) > 3  # several chunks
    reply = put_frames(b, frames)
    assert reply.imported, reply.failure
    assert reply.tokens == 8
    assert np.array_equal(run_steps(a.engine, "s", [[13]], 4), run_steps(b.engine, "s", [[13]], 4))


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
    frames = exported_frames(a)
    spoil, reason = CORRUPTIONS[name]
    spoil(frames)
    reply = put_frames(b, frames)
    assert not reply.imported
    assert (reply.failure.kind, reply.reason) == ("kv-import-failed", reason)
    assert b.engine.stats().sessions == 0  # quarantined: KV, steps, queued work gone
    assert b.engine.stats().kv_bytes == 0
    # The node goes on serving: a fresh session works, and a good import too.
    b.engine.sessions.open("t", 1).result(5)
    run_steps(b.engine, "t", [[1, 2, 3]])
    assert put_frames(b, exported_frames(a)).imported


def test_a_stalled_stream_is_cut_off_by_one_deadline(
    nodes: tuple[NodeService, NodeService],
) -> None:
    a, b = nodes
    _session(a.engine)
    frames = exported_frames(a)
    context = Context(remaining=0.3, metadata=((PREFIX_KEY, PREFIX),))

    def trickle() -> Iterator[pb.KVFrame]:
        yield frames[0]
        yield frames[1]
        context.cancelled.wait(10)  # the peer stalls until the call is cut
        raise RuntimeError("call cancelled")

    reply = b.StatePut(trickle(), context)  # type: ignore[arg-type]
    assert (reply.imported, reply.reason) == (False, "deadline")
    assert b.engine.stats().sessions == 0
