"""Head assist (node/head_assist.py) against a fake peer: the logits are bit-identical
to one multiply whether the peer's part comes in time, late, refused or never; a late
or refusing peer is not asked for a while; the share grows while the peer's part is
there first and shrinks when this node waits for it; a peer whose parts save less
than the head's time alone is not asked for a while, one whose parts save it is."""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from meshnet.backends import quant
from meshnet.errors import MeshnetError, ShardMismatch
from meshnet.node import head_assist as ha
from meshnet.node.relay_wire import Ask

ROWS, COLS = 200, 256
SHA = "cd" * 32


def _head() -> quant.QuantMatrix:
    data = np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)
    return quant.from_blocks(gguf.quants.quantize(data, QT.Q8_0), QT.Q8_0, (ROWS, COLS), q8=True)


HEAD = _head()
NORMED = np.random.default_rng(1).standard_normal((1, COLS)).astype(np.float32)
WHOLE = quant.matmul(NORMED, HEAD)
MULTIPLY = quant.matmul  # the peer's, never slowed by ``timed_rows``
ROW_S = 1e-5  # with ``timed_rows``: seconds a row of this node's multiplies takes


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1e-4  # every look at the clock is a tenth of a millisecond on
        return self.now


class Peer:
    """A first hop's head link: answers from the head's rows, or as told."""

    address = "peer:1"

    def __init__(self) -> None:
        self.asks: list[Ask] = []
        self.fail: Exception | None = None  # raised by ``part``
        self.early = True  # the part was there when this node's was done
        self.closed = 0
        self.clock: Clock | None = None  # moved on by ``wait_s`` as a part is awaited
        self.wait_s = 0.0

    def ask(self, x: np.ndarray, stop: int, fingerprint: str, backend: str) -> Ask:
        ask = Ask(len(self.asks) + 1, x.shape[0], x.shape[1], stop, fingerprint, backend)
        self.asks.append(ask)
        return ask

    def part(self, ask: Ask, timeout_s: float) -> np.ndarray:
        if self.fail is not None:
            raise self.fail
        if self.clock is not None:
            self.clock.now += self.wait_s
        return MULTIPLY(NORMED, quant.row_range(HEAD, 0, ask.stop))

    def ready(self) -> bool:
        return self.early

    def close(self) -> None:
        self.closed += 1


def _assist(peer: Peer, clock: Clock) -> ha.HeadAssist:
    connect: Callable[[], Peer] = lambda: peer  # noqa: E731
    return ha.HeadAssist(connect, SHA, "q8", clock=clock)  # type: ignore[arg-type]


def test_a_part_in_time_gives_the_logits_of_one_multiply() -> None:
    peer, clock = Peer(), Clock()
    assist = _assist(peer, clock)
    out = assist.logits(NORMED, HEAD)
    np.testing.assert_array_equal(out, WHOLE)
    assert len(peer.asks) == 1 and peer.asks[0].stop % 16 == 0 and peer.asks[0].stop > 0
    assert (peer.asks[0].fingerprint, peer.asks[0].backend) == (SHA, "q8")
    assert assist.asked == 1 and assist.late == 0


def test_the_share_grows_while_the_peer_is_first_and_shrinks_when_it_is_waited_for() -> None:
    peer, clock = Peer(), Clock()
    assist = _assist(peer, clock)
    assist.logits(NORMED, HEAD)  # a new link's first answer: not learnt from
    assert assist.share == pytest.approx(ha.FIRST_SHARE)
    for _ in range(3):
        np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    grown = assist.share
    assert grown == pytest.approx(ha.FIRST_SHARE + 3 * ha._STEP)
    peer.early = False
    np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    assert assist.share < grown


@pytest.mark.parametrize(
    "failure", [TimeoutError(), OSError("reset"), ShardMismatch("another model file")]
)
def test_a_part_that_does_not_come_is_done_here_with_the_same_logits(failure: Exception) -> None:
    peer, clock = Peer(), Clock()
    assist = _assist(peer, clock)
    peer.fail = failure
    np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    assert assist.asked == 0
    assert assist.late == (1 if isinstance(failure, TimeoutError) else 0)


def test_a_peer_late_several_times_running_is_not_asked_for_a_while() -> None:
    peer, clock = Peer(), Clock()
    assist = _assist(peer, clock)
    peer.fail = TimeoutError()
    for _ in range(ha.MAX_LATE):
        np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    assert assist.late == ha.MAX_LATE
    asked = len(peer.asks)
    np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    assert len(peer.asks) == asked  # paused: multiplied here alone
    clock.now += ha.LATE_PAUSE_S
    peer.fail = None
    np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    assert len(peer.asks) == asked + 1 and assist.asked == 1


def test_a_refusing_peer_is_not_asked_until_its_long_pause_ends() -> None:
    peer, clock = Peer(), Clock()
    assist = _assist(peer, clock)
    peer.fail = ShardMismatch("this node holds no quantized head")
    assist.logits(NORMED, HEAD)
    clock.now += ha.LATE_PAUSE_S
    assist.logits(NORMED, HEAD)
    assert len(peer.asks) == 1
    clock.now += ha.REFUSED_PAUSE_S
    peer.fail = None
    assist.logits(NORMED, HEAD)
    assert len(peer.asks) == 2


def test_a_peer_that_cannot_be_reached_is_paused_and_the_logits_made_here() -> None:
    clock = Clock()

    def unreachable() -> Peer:
        raise OSError("connection refused")

    assist = ha.HeadAssist(unreachable, SHA, "q8", clock=clock)  # type: ignore[arg-type]
    np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    refused = ha.HeadAssist(_raise(ShardMismatch("no head parts")), SHA, "q8", clock=clock)
    np.testing.assert_array_equal(refused.logits(NORMED, HEAD), WHOLE)


@pytest.fixture
def timed_rows(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """A clock that this node's multiplies move on by ``ROW_S`` a row, as compute would."""
    clock = Clock()

    def matmul(x: np.ndarray, w: quant.QuantMatrix) -> np.ndarray:
        clock.now += w.rows * ROW_S
        return MULTIPLY(x, w)

    monkeypatch.setattr(ha.quant, "matmul", matmul)
    return clock


def test_a_peer_whose_parts_save_time_is_still_asked_after_the_head_is_timed_alone(
    timed_rows: Clock,
) -> None:
    peer = Peer()
    assist = _assist(peer, timed_rows)
    for _ in range(1 + ha.PROBE_EVERY):  # a new link's first answer is not timed
        np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    asked = len(peer.asks)
    for _ in range(ha.PROBE_RUNS):  # the head alone
        np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    assert len(peer.asks) == asked
    np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    assert len(peer.asks) == asked + 1 and assist.asked == asked + 1


def test_a_peer_whose_parts_save_nothing_is_not_asked_for_a_while(timed_rows: Clock) -> None:
    peer = Peer()
    peer.clock, peer.wait_s = timed_rows, ROWS * ROW_S  # as long as the head alone
    assist = _assist(peer, timed_rows)
    for _ in range(1 + ha.PROBE_EVERY + ha.PROBE_RUNS):
        np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    asked = len(peer.asks)
    assert asked == 1 + ha.PROBE_EVERY and assist.late == 0
    np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    assert len(peer.asks) == asked  # paused: multiplied here alone
    timed_rows.now += ha.NO_GAIN_PAUSE_S
    np.testing.assert_array_equal(assist.logits(NORMED, HEAD), WHOLE)
    assert len(peer.asks) == asked + 1


def test_several_rows_are_multiplied_here() -> None:
    peer, clock = Peer(), Clock()
    rows = np.random.default_rng(2).standard_normal((3, COLS)).astype(np.float32)
    out = _assist(peer, clock).logits(rows, HEAD)
    np.testing.assert_array_equal(out, quant.matmul(rows, HEAD))
    assert peer.asks == []


def _raise(e: MeshnetError) -> Callable[[], Peer]:
    def connect() -> Peer:
        raise e

    return connect
