"""The node's gRPC servicer, driven in-process with a fake call context."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from meshnet.layer_range import LayerRange
from meshnet.model.gguf_file import sha256_file
from meshnet.node.engine import NodeEngine
from meshnet.node.service import NodeIdentity, NodeService
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb


class FakeContext:
    """What the servicer reads of a gRPC context: the time left on the call."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining

    def time_remaining(self) -> float | None:
        return self.remaining


@pytest.fixture
def service(tiny_path: Path) -> Iterator[NodeService]:
    engine = NodeEngine()
    engine.start()
    engine.load(str(tiny_path), LayerRange(0, 4)).result(30)
    yield NodeService(NodeIdentity("n1", str(tiny_path)), engine)
    engine.stop()


def _open(tiny_path: Path, **changes: object) -> pb.ForwardRequest:
    fields = dict(
        session_id="s", epoch=1, fingerprint=sha256_file(tiny_path), layer_start=0, layer_end=4
    )
    fields.update(changes)
    return pb.ForwardRequest(open=pb.Open(**fields))  # type: ignore[arg-type]


def _step(n: int, array: np.ndarray) -> pb.ForwardRequest:
    return pb.ForwardRequest(step=pb.Step(step=n, input=codec.encode(array)))


def _kinds(replies: list[pb.ForwardResponse]) -> list[str]:
    return [r.WhichOneof("kind") or "" for r in replies]


# gRPC reports a call without a deadline as an enormous time remaining.
@pytest.mark.parametrize("remaining", [None, 1e300, 30.0])
def test_steps_run_whatever_deadline_the_call_has(
    service: NodeService, tiny_path: Path, remaining: float | None
) -> None:
    requests = [_open(tiny_path), _step(0, np.asarray([5, 6, 7], np.int64))]
    replies = list(service.Forward(iter(requests), FakeContext(remaining)))  # type: ignore[arg-type]
    assert _kinds(replies) == ["opened", "result"]


def test_malformed_bundle_fails_the_step_and_spares_the_session(
    service: NodeService, tiny_path: Path
) -> None:
    bad = pb.ForwardRequest(
        step=pb.Step(step=1, input=pb.Tensor(dtype="f32", shape=[1, 64], data=b"\0" * 256))
    )
    requests = [
        _open(tiny_path),
        _step(0, np.asarray([5, 6], np.int64)),
        bad,
        _step(1, np.asarray([10**6], np.int64)),
        _step(1, np.asarray([7], np.int64)),
    ]
    replies = list(service.Forward(iter(requests), FakeContext(None)))  # type: ignore[arg-type]
    assert _kinds(replies) == ["opened", "result", "failure", "failure", "result"]
    assert replies[2].failure.kind == "malformed-bundle"
    assert replies[3].failure.kind == "malformed-bundle"
    assert service.engine.stats().sessions == 0  # released when the stream ended


@pytest.mark.parametrize(
    "changes", [dict(fingerprint="0" * 64), dict(layer_start=1), dict(session_id="")]
)
def test_open_for_the_wrong_shard_is_refused(
    service: NodeService, tiny_path: Path, changes: dict[str, object]
) -> None:
    replies = list(service.Forward(iter([_open(tiny_path, **changes)]), FakeContext(None)))  # type: ignore[arg-type]
    assert _kinds(replies) == ["failure"]
    assert replies[0].failure.kind in {"shard-mismatch", "malformed-bundle"}
