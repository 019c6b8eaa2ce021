"""A route's hops run a generation's decode steps by themselves.

Driven step by step, each token costs a round trip to the tracker: a request
written, read and answered on every hop, the engines idle meanwhile. Instead
the tracker starts a run (``Step.autorun_until``) and only reads tokens,
extending the run ahead of what it read (``Extend``) until the generation ends.

- A node that holds the whole model and samples feeds each sampled token
  straight back as its next step's input.
- On a route of several hops the steps go round a ring: the first hop is fed
  each next token by the last (relayed, like the activations between hops),
  each hop starts a step the moment its input is relayed to it, and only the
  last answers the tracker, with the token; the others answer only a failure.
  The first hop alone keeps to the run's end; the others follow their inputs.

What a hop runs past the end is cut back when the session is next opened
(rewind), like any step the tracker did not see committed; the sampling
contract holds because each step carries the generator's position and history
exactly as the tracker would have sent them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import numpy as np

from meshnet.model.sampling import SamplingParams
from meshnet.protocol import codec
from meshnet.protocol import meshnet_pb2 as pb


class Inbox:
    """A stream's requests read on a thread of their own, so a running autorun can see
    an ``Extend`` without waiting for one. ``listener``, when set, is told each
    extension's end as it comes (the request is queued too)."""

    def __init__(self, requests: Iterator[pb.ForwardRequest]) -> None:
        self._queue: queue.Queue[pb.ForwardRequest | None] = queue.Queue()
        self._requests = requests
        self._ended = False  # the end was taken: every later get is None at once
        self.listener: Callable[[int], None] | None = None
        threading.Thread(target=self._read, name="forward-inbox", daemon=True).start()

    def _read(self) -> None:
        try:
            for request in self._requests:
                listener = self.listener
                if listener is not None and request.WhichOneof("kind") == "extend":
                    listener(request.extend.until)
                self._queue.put(request)
        except Exception:  # the call ended under us (cancelled, reset): the stream is over
            pass
        finally:
            self._queue.put(None)

    def get(self) -> pb.ForwardRequest | None:
        """The next request, waiting for it; None once the stream has ended."""
        if self._ended:
            return None
        return self._took(self._queue.get())

    def waiting(self) -> list[pb.ForwardRequest | None]:
        """The requests that came meanwhile, without waiting (None: the stream ended)."""
        out: list[pb.ForwardRequest | None] = []
        while not self._ended:
            try:
                out.append(self._took(self._queue.get_nowait()))
            except queue.Empty:
                break
        return out

    def _took(self, request: pb.ForwardRequest | None) -> pb.ForwardRequest | None:
        self._ended = request is None
        return request


def next_step(
    step: pb.Step, until: int, sampled: int | None, sampling: SamplingParams | None
) -> pb.Step:
    """The step after ``step``, as the tracker would send it.

    A hop that sampled ``sampled`` moves the generator's position and history
    on. A hop of every layer is fed its own token in the message; every other
    hop of a ring gets its input relayed by the hop before (the first hop: the
    token, from the last).
    """
    after = pb.Step(
        step=step.step + 1, timeout_ms=step.timeout_ms, forward=step.forward, autorun_until=until
    )
    if sampled is not None and sampling is not None:
        after.draws = step.draws + (0 if sampling.greedy else 1)
        if sampling.sees_history:
            after.history.extend([*step.history, sampled])
            after.generated_from = step.generated_from
    if sampled is not None and not step.relayed:
        after.input.CopyFrom(codec.encode(np.asarray([sampled], dtype=np.int64)))
    else:
        after.relayed = True
        after.rows = 1
    return after


Posted = tuple[pb.Step, "pb.ForwardResponse | None"]


Defer = Callable[[Callable[[], None]], None]


class Run:
    """One autorun's state, shared by the stream's handler and the engine thread.

    Each step is launched from the engine thread the moment the step before it
    is answered, so every running autorun is in the engine's next batch; the
    handler only sends the answers. ``None`` posted for a step: the run
    reached its end there (the step it would go on with).

    ``defer`` is how a post reaches the handler: the engine's ``after_batch``, so
    that a batch's handlers are woken only once the engine has answered and
    launched every step of it (see ``NodeEngine.after_batch``).
    """

    def __init__(self, until: int, defer: Defer) -> None:
        self.until = until
        self._stopped = False
        self._lock = threading.Lock()
        self._posts: queue.Queue[Posted] = queue.Queue()
        self._defer = defer

    def post(self, step: pb.Step, reply: pb.ForwardResponse | None) -> None:
        """Hand the handler ``reply`` to ``step`` (posts keep their order)."""
        self._defer(lambda: self._posts.put((step, reply)))

    def next_post(self, timeout_s: float) -> Posted | None:
        """The next answer (or the end), waiting at most ``timeout_s``."""
        try:
            return self._posts.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def proceeds(self, step: int) -> bool:
        """Whether ``step`` is still to be run."""
        with self._lock:
            return not self._stopped and step < self.until

    def extend(self, until: int) -> None:
        with self._lock:
            self.until = max(self.until, until)

    def stop(self) -> None:
        """The stream is over: launch nothing more."""
        with self._lock:
            self._stopped = True
