"""A hop of every layer runs decode steps by itself (``Step.autorun_until``): the tokens
are those the tracker would have got driving each step, also sampled and penalised;
a run the hop cannot make is refused. (The hops of a ring: tests/e2e/test_autorun.py.)"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshnet.model.gguf_file import sha256_file
from meshnet.node.service import NodeService
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb

PROMPT = [5, 6, 7, 8]
SAMPLING = pb.Sampling(temperature=0.8, top_p=0.95, repetition_penalty=1.3, seed=1234)


class Context:
    def __init__(self) -> None:
        self.callbacks: list[Callable[[], object]] = []

    def time_remaining(self) -> float | None:
        return None

    def add_callback(self, callback: Callable[[], object]) -> bool:
        self.callbacks.append(callback)
        return True

    def is_active(self) -> bool:
        return True


def _open(tiny_path: Path, session: str, sampling: pb.Sampling | None) -> pb.ForwardRequest:
    return pb.ForwardRequest(
        open=pb.Open(
            session_id=session,
            epoch=1,
            fingerprint=sha256_file(tiny_path),
            layer_start=0,
            layer_end=4,
            sampling=sampling,
        )
    )


def _step(n: int, ids: list[int], history: list[int], **fields: Any) -> pb.ForwardRequest:
    return pb.ForwardRequest(
        step=pb.Step(
            step=n,
            input=codec.encode(np.asarray(ids, np.int64)),
            draws=n,  # one uniform drawn per token before this step (temperature > 0)
            history=history,
            **fields,
        )
    )


def _tokens(replies: list[pb.ForwardResponse]) -> list[int]:
    assert all(r.WhichOneof("kind") == "result" for r in replies[1:]), replies
    return [r.result.sampled.token for r in replies[1:]]


def _driven(service: NodeService, tiny_path: Path, steps: int) -> list[int]:
    """The tokens of ``steps`` steps, each sent by the 'tracker' after the last one came."""
    tokens: list[int] = []

    def requests() -> Iterator[pb.ForwardRequest]:
        yield _open(tiny_path, "driven", SAMPLING)
        yield _step(0, PROMPT, PROMPT)
        for n in range(1, steps):  # pulled after step n - 1's reply: its token is there
            yield _step(n, [tokens[-1]], [*PROMPT, *tokens])

    replies = []
    for reply in service.Forward(requests(), Context()):  # type: ignore[arg-type]
        replies.append(reply)
        if reply.WhichOneof("kind") == "result":
            tokens.append(reply.result.sampled.token)
    return _tokens(replies)


def test_an_autorun_samples_the_tokens_driven_steps_would(
    service: NodeService, tiny_path: Path
) -> None:
    want = _driven(service, tiny_path, 9)
    first = want[0]
    requests = [
        _open(tiny_path, "auto", SAMPLING),
        _step(0, PROMPT, PROMPT),
        _step(1, [first], [*PROMPT, first], autorun_until=4),
        pb.ForwardRequest(extend=pb.Extend(until=9)),
    ]
    replies = list(service.Forward(iter(requests), Context()))  # type: ignore[arg-type]
    assert [r.result.step for r in replies[1:]] == list(range(9))
    assert _tokens(replies) == want


def test_an_extend_that_comes_as_the_run_ends_continues_it(
    service: NodeService, tiny_path: Path
) -> None:
    want = _driven(service, tiny_path, 7)
    gate: list[int] = []

    def requests() -> Iterator[pb.ForwardRequest]:
        yield _open(tiny_path, "late", SAMPLING)
        yield _step(0, PROMPT, PROMPT)
        yield _step(1, [want[0]], [*PROMPT, want[0]], autorun_until=3)
        while len(gate) < 4:  # the run's last step (2) has answered
            time.sleep(0.001)
        yield pb.ForwardRequest(extend=pb.Extend(until=7))

    replies = []
    for reply in service.Forward(requests(), Context()):  # type: ignore[arg-type]
        replies.append(reply)
        gate.append(1)
    assert _tokens(replies) == want


@pytest.mark.parametrize(
    ("sampling", "next_address", "fields", "why"),
    [
        (None, "", {}, "needs the next hop's address"),
        (None, "127.0.0.1:9", {}, "forwards its output"),
        (SAMPLING, "", {"relayed": True, "rows": 1}, "nothing is relayed to it"),
    ],
    ids=["no-next-hop", "not-forwarding", "relayed-to-a-whole-hop"],
)
def test_a_run_the_hop_cannot_make_is_refused(
    service: NodeService,
    tiny_path: Path,
    sampling: pb.Sampling | None,
    next_address: str,
    fields: dict[str, Any],
    why: str,
) -> None:
    """A hop of every layer that samples feeds itself; any other hop runs ahead only as
    a ring's: with a next hop to hand its output to, forwarding it."""
    opened = _open(tiny_path, "bad", sampling)
    opened.open.next_address = next_address
    requests = [opened, _step(0, PROMPT, []), _step(1, [9], [], autorun_until=5, **fields)]
    replies = list(service.Forward(iter(requests), Context()))  # type: ignore[arg-type]
    assert [r.WhichOneof("kind") for r in replies] == ["opened", "result", "failure"]
    assert replies[-1].failure.kind == "malformed-bundle"
    assert why in replies[-1].failure.message
