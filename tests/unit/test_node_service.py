"""The node's gRPC servicer, driven in-process with a fake call context."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from meshnet.kv.prefix_cache import BLOCK_TOKENS, MAX_SCOPE_BYTES
from meshnet.model.gguf_file import sha256_file
from meshnet.node.service import NodeService
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb


class FakeContext:
    """What the servicer uses of a gRPC context: the time left, the end-of-call callbacks."""

    def __init__(self, remaining: float | None) -> None:
        self.remaining = remaining
        self.callbacks: list[Callable[[], object]] = []

    def time_remaining(self) -> float | None:
        return self.remaining

    def add_callback(self, callback: Callable[[], object]) -> bool:
        self.callbacks.append(callback)
        return True

    def end(self) -> None:
        """What gRPC does when the call terminates: run the callbacks."""
        for callback in self.callbacks:
            callback()


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


def _logits(reply: pb.ForwardResponse) -> np.ndarray:
    return np.frombuffer(reply.result.output.data, np.float32)


def test_a_duplicate_step_returns_the_recorded_result_without_touching_kv(
    service: NodeService, tiny_path: Path
) -> None:
    prompt = np.asarray([5, 6, 7], np.int64)
    requests = [
        _open(tiny_path),
        _step(0, prompt),
        _step(0, prompt),  # delivered twice
        _step(1, np.asarray([9], np.int64)),
        _step(1, np.asarray([9], np.int64)),
        _step(0, prompt),  # too old: its result is no longer kept
        _step(5, np.asarray([9], np.int64)),  # steps 2-4 never happened here
    ]
    context = FakeContext(None)
    replies = list(service.Forward(iter(requests), context))  # type: ignore[arg-type]
    assert _kinds(replies) == [
        "opened",
        "result",
        "result",
        "result",
        "result",
        "failure",
        "failure",
    ]
    assert np.array_equal(_logits(replies[1]), _logits(replies[2]))
    assert np.array_equal(_logits(replies[3]), _logits(replies[4]))
    assert replies[5].failure.kind == "malformed-bundle"
    assert replies[6].failure.kind == "cache-miss"

    # The KV holds 4 positions, not 5 or 8: a fresh session given each input once agrees.
    once = [_open(tiny_path, session_id="t"), _step(0, prompt), _step(1, np.asarray([9], np.int64))]
    alone = list(service.Forward(iter(once), FakeContext(None)))  # type: ignore[arg-type]
    assert np.array_equal(_logits(alone[2]), _logits(replies[3]))


def test_resume_moves_the_kv_to_a_new_epoch_and_fences_the_old_one(
    service: NodeService, tiny_path: Path
) -> None:
    first = FakeContext(None)
    old = iter([_open(tiny_path, epoch=1), _step(0, np.asarray([5, 6, 7], np.int64))])
    replies = service.Forward(old, first)  # type: ignore[arg-type]
    assert _kinds([next(replies), next(replies)]) == ["opened", "result"]

    resumed = list(
        service.Forward(
            iter([_open(tiny_path, epoch=2, resume=True), _step(1, np.asarray([9], np.int64))]),
            FakeContext(None),  # type: ignore[arg-type]
        )
    )
    assert _kinds(resumed) == ["opened", "result"]
    assert (resumed[0].opened.kv_tokens, resumed[0].opened.steps) == (3, 1)

    # The old epoch is fenced: its stream ending frees nothing, a late open is stale.
    first.end()
    late = list(service.Forward(iter([_open(tiny_path, epoch=1)]), FakeContext(None)))  # type: ignore[arg-type]
    assert late[0].failure.kind == "stale-epoch"


def test_the_end_of_the_call_frees_the_sessions_kv(service: NodeService, tiny_path: Path) -> None:
    context = FakeContext(None)
    replies = service.Forward(
        iter([_open(tiny_path), _step(0, np.asarray([5, 6, 7], np.int64))]),
        context,  # type: ignore[arg-type]
    )
    next(replies), next(replies)
    assert service.engine.stats().sessions == 1
    context.end()  # the driver cancelled the call; the handler has not woken yet
    service.engine.sessions.open("other", 1).result(5)  # the loop has applied the release by now
    assert service.engine.stats().sessions == 1
    replies.close()


def _prompt(n: int) -> np.ndarray:
    return (np.arange(n, dtype=np.int64) * 31) % 90 + 10


def _scoped_open(tiny_path: Path, sid: str, prompt: np.ndarray, scope: bytes) -> pb.ForwardRequest:
    return _open(
        tiny_path,
        session_id=sid,
        prefix_ids=prompt.tolist(),
        prefix_reuse=len(prompt) - 1,
        prefix_scope=scope,
    )


def test_a_prompt_is_reused_only_under_the_scope_it_was_cached_in(
    service: NodeService, tiny_path: Path
) -> None:
    prompt = _prompt(2 * BLOCK_TOKENS + 5)
    first = [_scoped_open(tiny_path, "a", prompt, b"alice"), _step(0, prompt)]
    replies = list(service.Forward(iter(first), FakeContext(None)))  # type: ignore[arg-type]
    assert _kinds(replies) == ["opened", "result"]
    held: dict[bytes, tuple[int, int]] = {}
    for sid, scope in (("b", b"bob"), ("u", b""), ("c", b"alice")):
        opened = list(
            service.Forward(iter([_scoped_open(tiny_path, sid, prompt, scope)]), FakeContext(None))
        )  # type: ignore[arg-type]
        held[scope] = (opened[0].opened.kv_tokens, opened[0].opened.steps)
    # identical ids: another tenant's scope (or none) finds nothing, the same one its blocks
    assert held == {b"bob": (0, 0), b"": (0, 0), b"alice": (2 * BLOCK_TOKENS, 1)}


@pytest.mark.parametrize(
    "changes",
    [
        dict(prefix_ids=[5, 6, 7], prefix_scope=bytes(MAX_SCOPE_BYTES + 1)),
        dict(prefix_scope=b"a scope with no prompt"),
    ],
)
def test_a_hostile_prefix_scope_is_refused_and_opens_nothing(
    service: NodeService, tiny_path: Path, changes: dict[str, object]
) -> None:
    replies = list(service.Forward(iter([_open(tiny_path, **changes)]), FakeContext(None)))  # type: ignore[arg-type]
    assert _kinds(replies) == ["failure"]
    assert replies[0].failure.kind == "malformed-bundle"
    assert service.engine.stats().sessions == 0
